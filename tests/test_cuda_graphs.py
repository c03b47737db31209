"""Static forwards and their CUDA graphs (runtime/torch_model/graphs.py, specs/async.md §16.4).

On the CPU the static form runs eagerly over its fixed-shape inputs, with nothing captured. That
is what a CUDA graph records and replays, so these tests check everything a graph relies on:
  * copying a batch into a bucket's inputs, including padding rows;
  * padding writes that land in the scratch block only;
  * logits, and the states a commit reads, equal to the eager forward;
  * greedy tokens equal through generate.
Decodes take the static form only where the GDN decode is not in place (CUDA), so the tests turn
the in-place CPU kernel off. The capture and replay themselves run only where CUDA exists.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from fxsched.runtime.generate import generate  # noqa: E402
from fxsched.runtime.torch_model import HybridEngine  # noqa: E402
from fxsched.runtime.torch_model import decode_path as decode_path_module  # noqa: E402
from fxsched.runtime.torch_model.default_model import default_model_dir  # noqa: E402
from fxsched.runtime.torch_model.graphs import buckets  # noqa: E402

PROMPTS = ([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [3, 4, 5], [9, 8, 7, 6, 5, 4, 3, 2])


@pytest.fixture
def no_in_place_decode(monkeypatch):
    monkeypatch.setattr(decode_path_module, "gdn_decode_in_place", lambda device: False)


def _engine(static: bool) -> HybridEngine:
    engine = HybridEngine.from_pretrained(default_model_dir(), max_slots=6)
    for slot, prompt in enumerate(PROMPTS + ([1, 2, 3, 4, 5, 6],)):  # slot 3 is seated but never in a batch
        engine.alloc(slot)
        engine.prefill(slot, prompt)
    if static:
        assert engine.use_graphs(capture=False) is not None
    return engine


def test_buckets_cover_every_batch_size_up_to_the_slots():
    assert buckets(1) == (1,) and buckets(6) == (1, 2, 4, 6) and buckets(20) == (1, 2, 4, 8, 16, 20)
    for slots in (1, 3, 8, 9, 33):
        sizes = buckets(slots)
        assert all(any(b >= n for b in sizes) for n in range(1, slots + 1)) and max(sizes) == slots


@pytest.mark.usefixtures("no_in_place_decode", "one_torch_thread")
def test_static_decodes_and_verifies_equal_the_eager_forward_and_write_no_other_block():
    static, eager = _engine(True), _engine(False)
    slots = [0, 1, 2]  # three sequences: bucket 4, one padding row
    bystander = {i: static.kv.k[i][static.block_table(3)].clone() for i in range(len(static.kv.k))}
    tokens = [30, 31, 32]
    for _ in range(3):
        got, want = static.decode_batch(slots, tokens), eager.decode_batch(slots, tokens)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        tokens = [int(t) for t in want.argmax(-1)]
    drafts = [[tokens[i], 40 + i, 50 + i] for i in range(3)]  # uniform K = 3 verify
    got_rows = static.verify_batched(slots, drafts)
    want_rows = eager.verify_batched(slots, drafts)
    for g, w in zip(got_rows, want_rows, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert eager.graphs is None and static.graphs is not None
    assert static.graphs.stats.static == 4 and static.graphs.stats.eager == 0
    static.gdn_fold_accepted(slots, [1, 2, 3])  # the states a commit reads came out of the static form
    eager.gdn_fold_accepted(slots, [1, 2, 3])
    assert static.decode_batch(slots, [1, 2, 3]).argmax(-1).tolist() == eager.decode_batch(slots, [1, 2, 3]).argmax(
        -1).tolist()
    for i, before in bystander.items():  # the padding row wrote to the scratch block, never a seated one
        assert torch.equal(static.kv.k[i][static.block_table(3)], before)


@pytest.mark.usefixtures("no_in_place_decode", "one_torch_thread")
def test_a_ragged_verify_and_a_prefill_run_eagerly():
    static = _engine(True)
    assert static.graphs is not None
    static.verify_batched([0, 1], [[1, 2, 3], [4]])
    static.alloc(4)
    static.prefill(4, [7, 7, 7, 7])
    assert static.graphs.stats.static == 0 and static.graphs.stats.eager == 2


@pytest.mark.usefixtures("no_in_place_decode", "one_torch_thread")
@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_generate_gives_the_same_tokens_through_static_forwards(spec):
    prompts = [[5 + i, 17, 42, 7 + i, 5 + i, 17] for i in range(3)]
    outputs = []
    for static in (True, False):
        engine = HybridEngine.from_pretrained(default_model_dir(), max_slots=4)
        if static:
            engine.use_graphs(capture=False)
        outputs.append(generate(engine, prompts, 16, spec=spec, eos_ids=()).outputs)
        if static:
            # every plain decode; with MTP the bootstrap decodes and the uniform verifies (D-Cut's
            # ragged ones run eagerly)
            assert engine.graphs is not None and engine.graphs.stats.static > (10 if spec == "none" else 0)
    assert outputs[0] == outputs[1]


# --- CUDA ------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_captured_graphs_replay_the_eager_forward_without_a_host_sync():
    graphed = HybridEngine.from_pretrained(default_model_dir(), device="cuda", max_slots=6, cuda_graphs=True)
    eager = HybridEngine.from_pretrained(default_model_dir(), device="cuda", max_slots=6, cuda_graphs=False)
    assert graphed.graphs is not None and graphed.graphs.captured and eager.graphs is None
    for engine in (graphed, eager):
        for slot, prompt in enumerate(PROMPTS):
            engine.alloc(slot)
            engine.prefill(slot, prompt)
    slots, tokens = [0, 1, 2], [30, 31, 32]
    for _ in range(4):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # a host sync inside the replayed forward raises
        try:
            got = graphed.decode_batch(slots, tokens)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        want = eager.decode_batch(slots, tokens)
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
        tokens = want.argmax(-1).tolist()
    assert graphed.graphs.stats.static >= 4
