"""Host synchronisations per decode tick on the torch device path, counted on the CPU
(specs/async.md §16.2).

A plain decode step is the device's `decode_batch` (the forward) and the read of its tokens
(`argmax_batch`). Everything the step needs from the host goes over in one packed non-blocking copy
(transfers.send_ints) and the tokens come back in one read, so a GPU would wait once per step.

A speculative tick is the proposal, whose drafts stay on the device (late drafts, specs/async.md
§16.3), and the verify, whose rows, agreements and inputs come back in one packed read: one read, no
blocking copy, no boolean mask and no data-dependent shape, for the checkpoint MTP module, a DFlash
drafter and n-gram drafts (the scheduler's own). With late drafts off (expert parallelism) the
proposal reads its drafts too: two. Counted with tests/support/host_syncs.py (what it counts is in
its docstring).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from support.host_syncs import SyncCounter  # noqa: E402

from fxsched.runtime.generate import generate  # noqa: E402
from fxsched.runtime.torch_model import HybridEngine  # noqa: E402
from fxsched.runtime.torch_model.default_model import default_model_dir  # noqa: E402

MAX_SYNCS_PER_DECODE_STEP = 2
MAX_READS_PER_SPECULATIVE_TICK = 1  # the verify's packed read (specs/async.md §16.2)
READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")


def test_counter_sees_each_kind_of_synchronisation():
    x = torch.arange(6)
    with SyncCounter() as c:
        x.sum().item()
        x.tolist()
        x[x > 2]
        torch.nonzero(x)
        torch.tensor([1, 2], device="cpu")
        x.to("cpu")
        x.to("cpu", non_blocking=True)
        bool(x[0])
    assert c.counts == {"item": 1, "tolist": 1, "bool_index": 1, "nonzero": 1, "blocking_copy": 2, "__bool__": 1}


def _worst_decode_step(engine, batch):
    """The sync counts of the worst plain decode step of a 12-token greedy run of `batch` prompts."""
    windows = []
    prompts = [[5 + i, 17, 42, 7 + i] for i in range(batch)]
    counter = SyncCounter()

    def wrap(device):
        decode, argmax = device.decode_batch, device.argmax_batch

        def decode_batch(*a, **k):
            counter.window()
            return decode(*a, **k)

        def argmax_batch(*a, **k):
            out = argmax(*a, **k)
            windows.append(counter.window())
            return out
        device.decode_batch, device.argmax_batch = decode_batch, argmax_batch
        return device

    with counter:
        result = generate(engine, prompts, 12, eos_ids=(), wrap_device=wrap)
    assert all(len(out) == 12 for out in result.outputs)
    assert len(windows) >= 10  # every decode step after the first token was counted
    return max(windows, key=lambda w: sum(w.values()))


@pytest.mark.parametrize("batch", [1, 3])
def test_plain_decode_step_synchronises_at_most_twice(batch):
    engine = HybridEngine.from_pretrained(default_model_dir(), max_slots=4)
    worst = _worst_decode_step(engine, batch)
    assert sum(worst.values()) <= MAX_SYNCS_PER_DECODE_STEP, dict(worst)


@pytest.fixture(scope="module")
def tiny_moe_checkpoint(tmp_path_factory):
    pytest.importorskip("transformers", reason="the tiny MoE checkpoint is built with transformers")
    from support.hf_tiny import build
    return build("Qwen3NextForCausalLM", tmp_path_factory.mktemp("moe") / "next", seed=0).path


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch", [1, 3])
def test_moe_decode_step_synchronises_at_most_twice(tiny_moe_checkpoint, batch, dtype):
    """A Qwen3-Next-style model (GDN and attention layers, sparse MoE with a shared expert, 8 experts,
    top-2): the routed sum groups tokens by expert on the device (the old per-expert loop read the
    experts back: one sync per active expert per layer). bf16 takes the per-assignment CPU kernel,
    fp32 the grouped GEMMs."""
    engine = HybridEngine.from_pretrained(tiny_moe_checkpoint, max_seq_len=64, max_slots=4, block_size=4,
                                          dtype=dtype)
    assert any(name.endswith(".moe.router") for name in engine.model.w)
    worst = _worst_decode_step(engine, batch)
    assert sum(worst.values()) <= MAX_SYNCS_PER_DECODE_STEP, dict(worst)


def _ticks(engine, prompts, spec, **kwargs):
    """The sync counts of each tick of a greedy run: a window closes when a forward's tokens have
    been read (a verify's rows, or a decode's argmax), so it holds everything the tick did since the
    previous one's answer (the proposal, the capacity and block queries, the forward, its read).
    Returns every window but the first (the prefill's) and how many verifies closed one."""
    counter, windows, verifies = SyncCounter(), [], []

    def wrap(device):
        def closing(name):
            call = getattr(device, name)

            def run(*a, **k):
                out = call(*a, **k)
                windows.append(counter.window())
                verifies.append("verify" in name)
                return out
            return run
        for name in ("argmax_batch", "argmax_on_device", "serial_verify", "decode_verify_batched"):
            setattr(device, name, closing(name))
        return device

    with counter:
        result = generate(engine, prompts, 24, spec=spec, eos_ids=(), wrap_device=wrap, **kwargs)
    assert all(len(out) == 24 for out in result.outputs)
    return windows[1:], sum(verifies[1:])


def _assert_ticks(windows, verifies, reads=MAX_READS_PER_SPECULATIVE_TICK):
    assert verifies >= 3, "too few speculative ticks to count"
    for w in windows:
        others = {kind: n for kind, n in w.items() if kind not in READS}
        assert sum(n for kind, n in w.items() if kind in READS) <= reads and not others, dict(w)


@pytest.mark.parametrize("late", [True, False])
@pytest.mark.parametrize("batch", [1, 3])
def test_mtp_checkpoint_module_tick_reads_once_and_never_blocks(batch, late):
    """The default model's drafter is a checkpoint MTP module (one decoder layer with its own K/V):
    its ragged catch-up writes padding rows to a spare cache row instead of selecting live rows
    with a boolean mask, and its span comes from the host's lengths, not the device. Without late
    drafts the proposal reads its drafts back: two reads a tick."""
    engine = HybridEngine.from_pretrained(default_model_dir(), max_slots=4)
    assert engine.cfg.mtp_layers == 1
    prompts = [[5 + i, 17, 42, 7 + i, 5 + i, 17] for i in range(batch)]
    windows, verifies = _ticks(engine, prompts, "mtp", late_drafts=late)
    _assert_ticks(windows, verifies, reads=1 if late else 2)
    if not late:
        assert any(sum(w.values()) == 2 for w in windows)


def test_ngram_tick_reads_once():
    """n-gram drafts are the scheduler's (one running sequence); the default model falls into a
    loop, so the prompt lookup keeps proposing."""
    engine = HybridEngine.from_pretrained(default_model_dir(), max_slots=4)
    _assert_ticks(*_ticks(engine, [[5, 17, 42, 7] * 4], "ngram"))


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("batch", [1, 3])
def test_dflash_tick_reads_once_and_never_blocks(tmp_path_factory, batch):
    """A checkpoint DFlash drafter: serial verifies while a batch starts (one sequence per query,
    specs/speculation.md), then batched ones; every window reads once."""
    pytest.importorskip("transformers", reason="the tiny Qwen3 target is built with transformers")
    from support.hf_tiny import build
    from support.hf_tiny_dflash import write_tiny_dflash_for
    root = tmp_path_factory.mktemp("dflash")
    target = build("Qwen3ForCausalLM", root / "target", seed=3).path
    draft = write_tiny_dflash_for(root / "draft", target, seed=1, target_layer_ids=(1, 2), block_size=4,
                                  mask_token_id=150)
    engine = HybridEngine.from_pretrained(target, max_seq_len=64, max_slots=4, block_size=4, draft_model=draft)
    prompts = [[5 + i, 17, 42, 7 + i, 5 + i, 17] for i in range(batch)]
    _assert_ticks(*_ticks(engine, prompts, "dflash"))
