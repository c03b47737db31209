"""Static forwards recorded and replayed the way a CUDA graph would replay them, on the CPU
(runtime/torch_model/graphs.py, specs/async.md §16.4).

Each engine records every static forward at start-up, over the padding inputs, as a CUDA engine
captures its graphs, but with `support.graph_replay.TraceReplayRecorder`: a trace with real tensors
in which anything that is not a declared input (static buffers, KV cache, GDN states) is frozen at
its capture value, and every host value too. Its replays must then equal an eager twin's forward
at new positions, over new block tables (the sequences cross KV blocks), from new GDN states
(every step moves them), for batches that fill a bucket and batches padded into one: decodes, and
uniform verify rows of an MTP-sized (K = 3) and a DFlash (its block) verify, with the DFlash
drafter's captured layers. The dense, hybrid (Qwen3.5, MTP layer) and MoE (Qwen3-Next) families.

A forward that keeps a table from an earlier call (the rotary tables once were cached by their
positions tensor, which the warm-ups had already filled) replays the capture's values and fails
here; so does one that takes a value on the host.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="the tiny checkpoints are built with transformers")

from support.graph_replay import TraceReplayRecorder  # noqa: E402
from support.hf_tiny import build  # noqa: E402
from support.hf_tiny_dflash import write_tiny_dflash_for  # noqa: E402

from fxsched.runtime.torch_model import HybridEngine  # noqa: E402
from fxsched.runtime.torch_model import decode_path as decode_path_module  # noqa: E402

TOL = 1e-4
PROMPTS = ([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [3, 4, 5], [9, 8, 7, 6, 5, 4, 3], [21, 22, 23, 24, 25])
FAMILIES = {"dense": "Qwen3ForCausalLM", "hybrid": "Qwen3_5ForCausalLM", "moe": "Qwen3NextForCausalLM"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("replay")
    dirs = {name: build(arch, root / name, seed=5).path for name, arch in FAMILIES.items()}
    dirs["dflash"] = write_tiny_dflash_for(root / "dflash", dirs["dense"], seed=2, target_layer_ids=(1, 2),
                                           block_size=4, mask_token_id=150)
    return dirs


@pytest.fixture
def cuda_decode_path(monkeypatch):
    """The GDN decode of a CUDA engine (no in-place CPU kernel), so decodes take the static form."""
    monkeypatch.setattr(decode_path_module, "gdn_decode_in_place", lambda device: False)


def _pair(checkpoints, family: str) -> tuple[HybridEngine, HybridEngine, TraceReplayRecorder]:
    """A recorded engine and its eager twin, the same prompts prefilled in both (slot i: PROMPTS[i])."""
    draft = checkpoints["dflash"] if family == "dense" else None
    recorder = TraceReplayRecorder()
    engines = []
    for recorded in (True, False):
        engine = HybridEngine.from_pretrained(checkpoints[family], max_seq_len=64, max_slots=4, block_size=4,
                                              draft_model=draft)
        if recorded:  # recorded before any sequence is seated, over the padding inputs, as on CUDA
            assert engine.use_graphs(capture=True, recorder=recorder) is not None
        for slot, prompt in enumerate(PROMPTS):
            engine.alloc(slot)
            engine.prefill(slot, prompt)
        engines.append(engine)
    graphs = engines[0].graphs
    assert graphs is not None and recorder.recorded == len(graphs.forwards)
    return engines[0], engines[1], recorder


def _decode(recorded, eager, slots, tokens, steps):
    for _ in range(steps):
        got, want = recorded.decode_batch(slots, tokens), eager.decode_batch(slots, tokens)
        torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)
        tokens = [int(t) for t in want.argmax(-1)]
    return tokens


def _verify(recorded, eager, slots, drafts, accepted):
    got_rows, want_rows = recorded.verify_batched(slots, drafts), eager.verify_batched(slots, drafts)
    for got, want in zip(got_rows, want_rows, strict=True):
        torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)
    for engine in (recorded, eager):  # the states the commit folds came out of the replay
        engine.gdn_fold_accepted(slots, accepted)


@pytest.mark.usefixtures("cuda_decode_path", "one_torch_thread")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_replayed_forwards_equal_the_eager_forward(checkpoints, family):
    recorded, eager, recorder = _pair(checkpoints, family)
    slots = [0, 1, 2]  # bucket 4: one padding entry
    tokens = _decode(recorded, eager, slots, [30, 31, 32], steps=5)  # every sequence crosses a block
    k = 3  # an MTP-sized verify: 4 rows
    _verify(recorded, eager, slots, [[tokens[i], 40 + i, 50 + i][:k] + [60 + i] for i in range(3)], [1, 4, 2])
    tokens = _decode(recorded, eager, [0, 1, 2, 3], [33, 34, 35, 36], steps=2)  # a full bucket
    tokens = _decode(recorded, eager, [3], [tokens[3]], steps=2)  # bucket 1, another slot
    if family == "dense":  # the DFlash drafter's block (4 rows), its target layers captured
        assert recorded.capture_layers == (1, 2)
        _verify(recorded, eager, [1, 3], [[7, 8, 9, 10], [11, 12, 13, 14]], [2, 4])
        _decode(recorded, eager, [1, 3], [20, 21], steps=1)
    assert recorder.replays == recorded.graphs.stats.static and recorder.replays >= 10
    assert recorded.graphs.stats.eager == len(PROMPTS)  # the prefills


@pytest.mark.usefixtures("cuda_decode_path", "one_torch_thread")
def test_replays_stay_finite_over_a_garbage_state_pool(checkpoints):
    """The GDN state pool is allocated, not zeroed: garbage there (NaN here, as uninitialised memory
    may hold) must not reach a real row through the padding entries' scratch-block K/V."""
    recorder = TraceReplayRecorder()
    pair = []
    for recorded in (True, False):
        engine = HybridEngine.from_pretrained(checkpoints["hybrid"], max_seq_len=64, max_slots=4, block_size=4)
        for state in (*engine.gdn.recurrent, *engine.gdn.conv):
            state.fill_(float("nan"))
        if recorded:
            assert engine.use_graphs(capture=True, recorder=recorder) is not None
        for slot, prompt in enumerate(PROMPTS[:3]):
            engine.alloc(slot)
            engine.prefill(slot, prompt)
        pair.append(engine)
    got, want = pair[0].decode_batch([0, 1, 2], [30, 31, 32]), pair[1].decode_batch([0, 1, 2], [30, 31, 32])
    assert bool(torch.isfinite(got).all()) and bool(torch.isfinite(want).all())
    torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)
