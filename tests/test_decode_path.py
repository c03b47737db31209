"""The engine's decode fast path (runtime/torch_model/decode_path.py) against the general path.

Two engines with the same weights and prompts; one decodes with ``decode_batch``, the other runs
the same rows through the general forward (``verify_batched``: one row per slot, the per-row GDN
states) and commits them with ``gdn_fold_accepted``. After every step the bookkeeping must be
equal (tokens, lengths, block tables, the boundary snapshots' positions, free blocks) and the
tensors close (logits, GDN states, snapshots, hidden history, captured rows): fp32 and bf16 (the
CPU row kernel's decode plan), with the GDN states updated in place (the CPU kernel) and folded
afterwards (as on CUDA), across block and snapshot boundaries.
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from fxsched.runtime.torch_model import decode_path as decode_path_module  # noqa: E402
from fxsched.runtime.torch_model.config import default_config  # noqa: E402
from fxsched.runtime.torch_model.engine import HybridEngine  # noqa: E402
from fxsched.runtime.torch_model.errors import OutOfBlocksError, SlotError  # noqa: E402
from fxsched.runtime.torch_model.weights import init_weights  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ([1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11], [5, 5, 5])


def _config(dtype: str):
    base = default_config()
    if dtype == "float32":
        return dataclasses.replace(base, block_size=4, gdn_snapshot_every=1, max_slots=4, max_seq_len=64,
                                   num_blocks=64)
    return dataclasses.replace(base, dtype="bfloat16", head_dim=32, block_size=4, gdn_snapshot_every=2,
                               max_slots=4, max_seq_len=64, num_blocks=64)


def _twins(dtype: str):
    cfg = _config(dtype)
    weights = init_weights(cfg, torch.device("cpu"))
    engines = [HybridEngine(cfg, {k: v.clone() for k, v in weights.items()}) for _ in range(2)]
    for engine in engines:
        for slot, prompt in enumerate(PROMPTS):
            engine.alloc(slot)
            engine.prefill(slot, prompt)
    return engines


def _general_decode(engine: HybridEngine, slots, tokens):
    logits = engine.verify_batched(slots, [[t] for t in tokens])
    engine.gdn_fold_accepted(slots, [1] * len(slots))
    return torch.stack([row[0] for row in logits])


def _assert_same(fast: HybridEngine, general: HybridEngine, slots, tol):
    assert fast.num_free_blocks() == general.num_free_blocks()
    for slot in slots:
        a, b = fast.slot_state(slot), general.slot_state(slot)
        assert (a.seq_len, a.tokens, a.block_table) == (b.seq_len, b.tokens, b.block_table)
        assert sorted(a.boundary_states) == sorted(b.boundary_states)
        for k in a.boundary_states:
            for (ra, ca), (rb, cb) in zip(a.boundary_states[k], b.boundary_states[k], strict=True):
                torch.testing.assert_close(ra.float(), rb.float(), **tol)
                torch.testing.assert_close(ca.float(), cb.float(), **tol)
        for (ra, ca), (rb, cb) in zip(fast.gdn_state(slot), general.gdn_state(slot), strict=True):
            torch.testing.assert_close(ra.float(), rb.float(), **tol)
            torch.testing.assert_close(ca.float(), cb.float(), **tol)
        torch.testing.assert_close(fast.hidden_rows(slot, 0, a.seq_len).float(),
                                   general.hidden_rows(slot, 0, b.seq_len).float(), **tol)
        torch.testing.assert_close(fast.captured_hidden(slot).float(), general.captured_hidden(slot).float(), **tol)


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "folded"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_decode_path_equals_the_general_path(dtype, in_place, monkeypatch):
    if not in_place:
        monkeypatch.setattr(decode_path_module, "gdn_decode_in_place", lambda device: False)
    fast, general = _twins(dtype)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == "float32" else dict(atol=3e-2, rtol=3e-2)
    slots = [2, 0, 1]  # not in slot order
    tokens = [3, 1, 4]
    for _ in range(9):  # every slot crosses at least two block boundaries
        want = _general_decode(general, slots, tokens)
        got = fast.decode_batch(slots, tokens)
        torch.testing.assert_close(got.float(), want.float(), **tol)
        _assert_same(fast, general, slots, tol)
        tokens = want.float().argmax(-1).tolist()
    assert any(fast.slot_state(s).boundary_states for s in slots)


def test_a_decode_refused_changes_nothing():
    engine = _twins("float32")[0]
    before = [(engine.slot_state(s).seq_len, list(engine.slot_state(s).block_table)) for s in range(3)]
    free = engine.num_free_blocks()
    with pytest.raises(ValueError, match="token ids"):
        engine.decode_batch([0, 1], [1, 64])
    with pytest.raises(SlotError, match="not allocated"):
        engine.decode_batch([0, 3], [1, 1])
    with pytest.raises(SlotError, match="duplicate"):
        engine.decode_batch([1, 1], [1, 1])
    engine.pool.allocate(engine.num_free_blocks())  # nothing left for slot 0's next block (7 -> 8 rows)
    engine.decode_batch([0], [1])  # position 7 still fits the second block
    with pytest.raises(OutOfBlocksError):
        engine.decode_batch([0, 1], [1, 1])
    after = [(engine.slot_state(s).seq_len, list(engine.slot_state(s).block_table)) for s in range(3)]
    assert after[1:] == before[1:] and after[0][0] == before[0][0] + 1
    assert free > 0 and engine.num_free_blocks() == 0
