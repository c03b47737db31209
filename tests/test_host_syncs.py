"""Host synchronisations per tick on the torch device path, counted on the CPU (specs/async.md §16.2).

A plain decode step is the device's `decode_batch` (the forward) and the read of its tokens
(`argmax_batch`, or `sample_rows` for sampled rows). Everything the step needs from the host goes
over in one packed non-blocking copy (transfers.send_ints / send_values: a pick's filters, uniforms
and rows included) and the tokens come back in one read (with any logprob records), so a GPU would
wait once per step.

A speculative tick is the proposal, whose drafts stay on the device (late drafts, specs/async.md
§16.3), and the verify, whose rows, agreements and inputs come back in one packed read: one read, no
blocking copy, no boolean mask and no data-dependent shape, for the checkpoint MTP module, a DFlash
drafter and n-gram drafts (the scheduler's own). With late drafts off (expert parallelism) the
proposal reads its drafts too: two; a rejection-sampled verify reads its sampled rows too: two. The
scheduler's sync_secondary before a verify is counted apart. The last section runs the CUDA code
paths on the CPU. Counted with tests/support/host_syncs.py (what it counts is in its docstring).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any, NamedTuple

import attrs
import pytest

torch = pytest.importorskip("torch")

from support.host_syncs import SyncCounter  # noqa: E402

from fxsched.runtime import generate as generate_module  # noqa: E402
from fxsched.runtime.devices.streams import StreamSet  # noqa: E402
from fxsched.runtime.generate import SamplingOptions, generate  # noqa: E402
from fxsched.runtime.torch_model import HybridEngine  # noqa: E402
from fxsched.runtime.torch_model import decode_path as decode_path_module  # noqa: E402
from fxsched.runtime.torch_model.default_model import default_model_dir  # noqa: E402
from fxsched.runtime.torch_model.kernel_paths import (  # noqa: E402
    attention_kernels_apply,
    gdn_fold_kernel_applies,
    gdn_recurrence_kernel_applies,
)

MAX_SYNCS_PER_DECODE_STEP = 2
MAX_READS_PER_SPECULATIVE_TICK = 1  # the verify's packed read (specs/async.md §16.2)
# The scheduler's sync_secondary before a verify (and one per bootstrap, specs/speculation.md): the
# default stream waits for the secondary streams on the device, the host never (specs/async.md §16.2).
SECONDARY = "sync_secondary"
MAX_SECONDARY_WAITS = 0
READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")


def test_counter_sees_each_kind_of_synchronisation():
    x = torch.arange(6)
    streams = StreamSet("cpu")
    event = streams.create_event()
    streams.record_event(event, 0)
    with SyncCounter() as c:
        x.sum().item()
        x.tolist()
        x[x > 2]
        torch.nonzero(x)
        torch.tensor([1, 2], device="cpu")
        x.to("cpu")
        x.to("cpu", non_blocking=True)  # queued: not counted
        bool(x[0])
        x[[0, 2]]  # a list index: copied to the device first
        x[[0, 2]] = 7
        x.view(2, 3)[:, (0, 1)]
        x.view(2, 3)[1, 2]  # a tuple of ints is basic indexing: not counted
        host = torch.tensor([3, 4])  # made on the host, without a device: not yet a copy
        x[host]  # a host tensor as an index: copied first
        x[:2].copy_(host)  # a host tensor copied in: the host waits
        x[:2] = host[:2]  # the same, by assignment (a view of the host tensor)
        x[:2].copy_(host, non_blocking=True)  # queued: not counted
        sent = host.to("cpu", non_blocking=True)  # the device's copy now: using it copies nothing
        x[sent]
        x[:2].copy_(sent)
        streams.synchronize(0)  # the CPU stand-ins of a CUDA stream's and event's host waits
        streams.event(event).synchronize()
        streams.stream_wait_event(0, event)  # a stream waiting: the host does not
        with contextlib.suppress(AssertionError, RuntimeError):  # no CUDA here: counted, then it raises
            torch.cuda.synchronize()
    assert c.counts == {"item": 1, "tolist": 1, "bool_index": 1, "nonzero": 1, "blocking_copy": 4, "__bool__": 1,
                        "list_index": 4, "synchronize": 3}


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


class Run(NamedTuple):
    windows: list  # the sync counts of each tick but the first (the prefill's)
    verifies: int  # how many of those ticks a verify closed
    device: Any  # the run's TorchDevice
    first: Counter  # the first tick's counts (the boot and the prompts' prefill)


GREEDY_ANSWERS = ("argmax_batch", "argmax_on_device", "serial_verify", "decode_verify_batched", "sample_rows")
SAMPLED_ANSWERS = ("argmax_batch", "argmax_on_device", "sample_rows", "sample_verify")  # a verify, then its picks


def _run(engine, prompts, max_tokens, spec="none", picks=None, answers=GREEDY_ANSWERS, **kwargs) -> Run:
    """The sync counts of each tick of a run: a window closes when a forward's tokens have been read
    (``answers``: a verify's rows, a decode's argmax or its sampled rows), so it holds everything the
    tick did since the previous one's answer (the proposal, the capacity and block queries, the
    forward, its read). The waits of the scheduler's ``sync_secondary`` are counted apart
    (SECONDARY). ``picks`` (picks, eos ids) -> (picks, eos ids) rewrites what each ``sample_rows``
    is asked."""
    counter, windows, verifies, devices = SyncCounter(), [], [], []

    def wrap(device):
        devices.append(device)

        def closing(name):
            call = getattr(device, name)

            def run(*a, **k):
                if name == "sample_rows" and picks is not None:
                    a = (*a[:2], *picks(a[2], a[3]))
                out = call(*a, **k)
                windows.append(counter.window())
                verifies.append("verify" in name)
                return out
            return run
        for name in answers:
            setattr(device, name, closing(name))
        sync_secondary = device.sync_secondary

        def secondary(*a, **k):
            before = counter.counts["synchronize"]
            out = sync_secondary(*a, **k)
            waits = counter.counts.pop("synchronize", 0) - before
            counter.counts.update({"synchronize": before, SECONDARY: waits})
            counter.counts = +counter.counts  # no kind counted 0
            return out
        device.sync_secondary = secondary
        return device

    with counter:
        result = generate(engine, prompts, max_tokens, spec=spec, eos_ids=(), wrap_device=wrap, **kwargs)
    assert all(len(out) == max_tokens for out in result.outputs)
    return Run(windows[1:], sum(verifies[1:]), devices[0], windows[0])


def _ticks(engine, prompts, spec, **kwargs):
    run = _run(engine, prompts, 24, spec, **kwargs)
    return run.windows, run.verifies


def _assert_ticks(windows, verifies, reads=MAX_READS_PER_SPECULATIVE_TICK, min_verifies=3):
    """Every window reads at most ``reads`` times and makes no other synchronisation but the
    scheduler's ``sync_secondary`` (at most MAX_SECONDARY_WAITS)."""
    assert verifies >= min_verifies, "too few speculative ticks to count"
    for w in windows:
        others = {kind: n for kind, n in w.items() if kind not in READS + (SECONDARY,)}
        assert sum(n for kind, n in w.items() if kind in READS) <= reads and not others, dict(w)
        assert w[SECONDARY] <= MAX_SECONDARY_WAITS, dict(w)


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


# Twice the loop the default model falls into (its greedy continuation of README's prompt): it goes
# on repeating it, so the prompt lookup keeps finding drafts.
LOOP = ("I have been very much in love with you, and I am sure I should have been very much surprised. "
        "I have been very much in love with you, and I am sure I should have been")


def _repetitive_prompt() -> list[int]:
    from fxsched.runtime.text import load_tokenizer

    tok = load_tokenizer(default_model_dir())
    assert tok is not None
    return tok.encode(LOOP)


def test_ngram_tick_reads_once():
    """n-gram drafts are the scheduler's (one running sequence)."""
    engine = HybridEngine.from_pretrained(default_model_dir(), max_slots=4)
    _assert_ticks(*_ticks(engine, [_repetitive_prompt()], "ngram"))


@pytest.mark.usefixtures("one_torch_thread")
def test_sampled_speculative_tick_reads_twice():
    """A rejection-sampled verify (specs/speculation.md §6.16) reads the greedy verify's rows, then
    its sampled rows with every logprob record they emit in one more read: two reads a tick, no
    other synchronisation (the filters, uniforms and drafts go over with one copy)."""
    engine = HybridEngine.from_pretrained(default_model_dir(), max_slots=4)
    prompts = [[5 + i, 17, 42, 7 + i, 5 + i, 17] for i in range(2)]
    run = _run(engine, prompts, 12, "mtp", answers=SAMPLED_ANSWERS,
               sampling=SamplingOptions(temperature=0.8, top_k=20, min_p=0.02, seed=5, logprobs=2))
    _assert_ticks(run.windows, run.verifies, reads=2)
    assert run.device.last_verify and all(record.top for _, records in run.device.last_verify for record in records)


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


# --- the CUDA code paths, run on the CPU -----------------------------------------------------------
#
# A CUDA engine takes other paths than a CPU one: the Triton kernels (paged KV append and attention,
# the GDN recurrence and fold, row argmax, greedy acceptance), decodes and uniform verifies through
# static forwards (graphs.py), and a GDN decode that returns its states for the fold instead of
# writing them in place. The same code runs here with the kernels interpreted (tests/conftest.py
# sets TRITON_INTERPRET=1 before anything imports them), FXSCHED_KERNELS=triton (a CPU engine's
# opt-in, kernel_paths.py), the static forwards run uncaptured and the in-place decode off. A tick
# then reads at most once and makes no blocking copy, list index, boolean mask or data-dependent
# shape: greedy, sampled (every filter, a logprob record), MTP, DFlash, n-gram, mixed prefill and
# decode. The interpreter runs every kernel program in Python: two sequences, a few tokens each.

CUDA_MAX_SEQ_LEN = 64  # the static forwards' block tables are as wide as max_seq_len


def _kernels_not_interpreted() -> str:
    """Why the Triton kernels cannot run on CPU tensors here ("" when they can)."""
    from fxsched.kernels import gated_delta, gdn_fold, greedy_accept, paged_attention, paged_kv_append, row_argmax
    from fxsched.kernels._triton import kernel_is_interpreted

    kernels = (gated_delta._gated_delta_kernel, gdn_fold._gather_rows_to_slots_kernel,
               greedy_accept._greedy_accept_kernel, paged_attention._paged_attention_kernel,
               paged_kv_append._paged_kv_append_kernel, row_argmax._row_argmax_kernel)
    if all(kernel_is_interpreted(k) for k in kernels):
        return ""
    return ("the Triton kernels are not interpreted here (TRITON_INTERPRET=1 must be set before fxsched.kernels "
            "is imported, as tests/conftest.py does without CUDA; on CUDA see tests/gpu/check.sh)")


@pytest.fixture
def cuda_paths(monkeypatch, one_torch_thread):
    """The code paths of a CUDA engine, on the CPU (see above)."""
    reason = _kernels_not_interpreted()
    if reason:
        pytest.skip(reason)
    monkeypatch.setenv("FXSCHED_KERNELS", "triton")
    monkeypatch.setattr(decode_path_module, "gdn_decode_in_place", lambda device: False)
    probe = torch.zeros(1)
    assert attention_kernels_apply(probe) and gdn_recurrence_kernel_applies(probe) and gdn_fold_kernel_applies(probe)


def _static(engine):
    assert engine.use_graphs(capture=False) is not None
    return engine


def _default_engine():
    return _static(HybridEngine.from_pretrained(default_model_dir(), max_slots=4, max_seq_len=CUDA_MAX_SEQ_LEN))


def _assert_one_read_per_tick(run: Run, at_least: int):
    """Every tick, the prefill's included: at most one read, no blocking copy, list index, mask,
    data-dependent shape or other wait (the scheduler's sync_secondary apart); and the forwards ran
    static."""
    assert len(run.windows) >= at_least, "too few ticks to count"
    for w in [run.first, *run.windows]:
        reads = sum(n for kind, n in w.items() if kind in READS)
        others = {kind: n for kind, n in w.items() if kind not in READS + (SECONDARY,)}
        assert reads <= 1 and not others and w[SECONDARY] <= MAX_SECONDARY_WAITS, dict(w)
    graphs = run.device.engine.graphs
    assert graphs is not None and graphs.stats.static > 0


@pytest.mark.usefixtures("cuda_paths")
def test_cuda_paths_greedy_decode_tick_reads_once():
    run = _run(_default_engine(), [[5, 17, 42, 7], [6, 17, 42, 8]], 4)
    _assert_one_read_per_tick(run, 3)
    assert all(sum(w.values()) == 1 for w in run.windows[-2:])  # the read is each tick's one sync


def _varied_picks(picks, eos_ids):
    """Row 0: temperature, top-k and min-p, with a logprob record; row 1: temperature and top-p;
    both with the model's EOS ids masked."""
    rows = (dict(temperature=0.8, top_k=5, min_p=0.05, top_logprobs=2), dict(temperature=1.3, top_p=0.9))
    return [attrs.evolve(p, mask_eos=True, **rows[r % 2]) for r, p in enumerate(picks)], (763, 765)


@pytest.mark.usefixtures("cuda_paths")
def test_cuda_paths_sampled_decode_tick_reads_once():
    """Each row's filters, uniform, EOS mask and the rows of each kind go over with one copy; the
    tokens and the logprob record come back in one read."""
    run = _run(_default_engine(), [[5, 17, 42, 7], [6, 17, 42, 8]], 4, picks=_varied_picks,
               sampling=SamplingOptions(temperature=1.0, seed=11))
    _assert_one_read_per_tick(run, 3)
    sample = run.device.last_sample
    assert run.device.stats.calls["sample_rows"] >= 3 and sample is not None
    assert sample.logprobs[0] is not None and len(sample.logprobs[0].top) == 2 and sample.logprobs[1] is None


@pytest.mark.usefixtures("cuda_paths")
def test_cuda_paths_mtp_tick_reads_once():
    run = _run(_default_engine(), [[5, 17, 42, 7, 5, 17], [6, 17, 42, 8, 6, 17]], 8, spec="mtp")
    _assert_one_read_per_tick(run, 3)
    _assert_ticks(run.windows, run.verifies, min_verifies=2)


@pytest.mark.usefixtures("cuda_paths")
def test_cuda_paths_ngram_tick_reads_once():
    run = _run(_default_engine(), [_repetitive_prompt()], 16, spec="ngram")
    _assert_one_read_per_tick(run, 3)
    _assert_ticks(run.windows, run.verifies, min_verifies=1)


@pytest.mark.usefixtures("cuda_paths")
def test_cuda_paths_dflash_tick_reads_once(tiny_dflash_engine):
    engine = _static(tiny_dflash_engine)
    try:
        run = _run(engine, [[5, 17, 42, 7, 5, 17], [6, 17, 42, 8, 6, 17]], 8, spec="dflash")
        _assert_one_read_per_tick(run, 3)
    finally:
        engine.graphs = None  # the module's engine, as the fixture made it
    _assert_ticks(run.windows, run.verifies, min_verifies=2)


@pytest.mark.usefixtures("cuda_paths")
def test_cuda_paths_mixed_prefill_and_decode_tick_reads_once(monkeypatch):
    """A 40-token prompt prefilled 16 tokens a step beside a decoding one: mixed forwards, whose GDN
    layers keep the block-boundary states by the batch's own indices (gdn_chunked.KeepPlan)."""
    monkeypatch.setattr(generate_module, "PREFILL_CHUNK", 16)
    run = _run(_default_engine(), [[5, 17, 42, 7], [3, 9] * 20], 4)
    _assert_one_read_per_tick(run, 3)
    assert run.device.stats.calls["mixed_forward"] >= 2
