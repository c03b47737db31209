"""Async scheduling (specs/async.md §16.6): plain decodes answered ahead, their tokens kept on the
device, fed to the next decode from there and read one tick late.

* The model checker's episodes with the simulated device keeping decodes (now and then) give every
  client exactly the frames of the same episode scheduled synchronously, whenever nothing in the
  episode depends on timing (no cancel, deadline or injected fault); and they reach every part
  of the protocol (kept tokens resolved by the next decode or read alone, a row computed ahead for
  a sequence its EOS ended, a kept decode that fails afterwards).
* On the torch device the greedy and the sampled tokens are those of the synchronous run, requests
  ending at EOS at different steps included, and an async tick still reads back once.
"""

from __future__ import annotations

import random
from collections import Counter

import attrs
import pytest

from fxsched.effects.client import ErrorOut
from fxsched.runtime.check.walk import _by_request, random_episode, run_episode


def _timing_free(episode) -> bool:
    """No input whose effect depends on when the host learns a token, or on which call of the device
    it lands (faults counted by call)."""
    return not (episode.fault_phase or episode.decode_fault_at or episode.kv_exhaust_at or episode.rotation_tick) and all(
        r.cancel_at is None and r.deadline_ms is None and r.host_cancel_tick is None for r in episode.requests)


def test_walk_episodes_give_the_clients_what_the_synchronous_run_gives(monkeypatch):
    from fxsched.runtime.devices import sim_decodes

    monkeypatch.setattr(sim_decodes, "AHEAD_FAILURE_CHANCE", 0.0)  # a kept decode that fails is a fault: timing
    rng = random.Random(50)
    compared = 0
    coverage: Counter = Counter()
    while compared < 30:
        episode = random_episode(rng)
        if episode.mode != "plain" or not _timing_free(episode):
            continue
        ahead: list = []
        level: list = []
        ahead_result = run_episode(attrs.evolve(episode, async_scheduling=True), coverage, outputs=ahead)
        level_result = run_episode(attrs.evolve(episode, async_scheduling=False), Counter(), outputs=level)
        assert ahead_result.violation is None and level_result.violation is None, (ahead_result, level_result)
        if any(isinstance(out, ErrorOut) for out in ahead + level):
            continue  # a tight pool: the rows computed ahead take KV a little earlier (a fault is timing)
        assert _by_request(ahead) == _by_request(level), episode  # (frames of different requests may interleave)
        compared += 1
    assert coverage["feature:decode_ahead"] > 0 and coverage["feature:kept_resolved"] > 0


def test_walk_reaches_every_part_of_the_protocol_without_a_violation():
    rng = random.Random(7)
    coverage: Counter = Counter()
    episodes = 0
    while episodes < 120:
        episode = random_episode(rng)
        if episode.mode != "plain":
            continue
        result = run_episode(attrs.evolve(episode, async_scheduling=True), coverage)
        assert result.violation is None, (result.violation, episode)
        episodes += 1
    for feature in ("decode_ahead", "kept_resolved", "kept_read_alone", "computed_ahead_dropped", "ahead_failure"):
        assert coverage[f"feature:{feature}"] > 0, feature


# --- the torch device ------------------------------------------------------------------------------

torch = pytest.importorskip("torch")


def _engine():
    from fxsched.runtime.torch_model import HybridEngine
    from fxsched.runtime.torch_model.default_model import default_model_dir
    return HybridEngine.from_pretrained(default_model_dir(), max_slots=8)


PROMPTS = [[5 + i, 17, 42, 7 + i] * (1 + i % 3) for i in range(6)]


@pytest.fixture
def made(monkeypatch) -> list:
    """Every ``TorchDevice`` made while the test runs, in order (``generate`` makes its own)."""
    from fxsched.runtime.devices import torch as torch_device

    devices: list = []
    original = torch_device.TorchDevice.__init__

    def init(self, *a, **k):
        original(self, *a, **k)
        devices.append(self)
    monkeypatch.setattr(torch_device.TorchDevice, "__init__", init)
    return devices


@pytest.mark.usefixtures("one_torch_thread")
def test_greedy_tokens_equal_the_synchronous_run_with_requests_ending_at_eos():
    from fxsched.runtime.generate import generate
    free = generate(_engine(), PROMPTS, 24, eos_ids=()).outputs
    eos = free[0][6]  # a token that ends request 1 at its 7th token and others wherever it comes
    runs = {}
    for asynchronous in (False, True):
        result = generate(_engine(), PROMPTS, 24, eos_ids=(eos,), async_scheduling=asynchronous)
        runs[asynchronous] = result.outputs
    assert runs[True] == runs[False]
    assert len(runs[True][0]) == 7 and runs[True][0][-1] == eos
    assert any(len(o) == 24 for o in runs[True])  # others run to their budget past the early ends


@pytest.mark.usefixtures("one_torch_thread")
def test_sampled_tokens_equal_the_synchronous_run():
    from fxsched.runtime.generate import SamplingOptions, generate
    sampling = SamplingOptions(temperature=0.8, top_p=0.9, top_k=20, seed=11)
    runs = {a: generate(_engine(), PROMPTS, 20, eos_ids=(), sampling=sampling, async_scheduling=a).outputs
            for a in (False, True)}
    assert runs[True] == runs[False]


@pytest.mark.usefixtures("one_torch_thread")
def test_the_device_keeps_decodes_and_an_async_tick_reads_back_once(made):
    from support.host_syncs import SyncCounter

    from fxsched.runtime.generate import generate

    counter, engine = SyncCounter(), _engine()
    with counter:
        result = generate(engine, PROMPTS[:3], 16, eos_ids=(), async_scheduling=True)
    device = made[0]
    ticks = result.summary.target_forwards
    assert device.stats.calls["keep_ahead"] >= ticks - 3 and device.stats.calls["read_ahead"] >= ticks - 3
    reads = sum(counter.counts[k] for k in ("tolist", "item", "cpu", "numpy", "__int__", "__bool__", "__float__"))
    assert reads <= ticks + 2, dict(counter.counts)  # one read per tick (the prefill's first token included)
    assert counter.counts["blocking_copy"] == 0, dict(counter.counts)


@pytest.mark.usefixtures("one_torch_thread")
def test_speculative_runs_pipeline_their_plain_ticks_and_keep_the_synchronous_tokens(made):
    """With n-gram speculation configured, a tick of several sequences decodes plainly: it is
    answered ahead, and the tick where one sequence is left reads the kept token before it
    speculates; the tokens are the synchronous run's (requests ending at EOS at different steps)."""
    from fxsched.runtime.generate import generate

    prompts = PROMPTS[:2]
    free = generate(_engine(), prompts, 32, "ngram", eos_ids=()).outputs
    # an EOS that ends request 2 early and never comes in request 1: request 1 then runs alone
    eos = next(t for t in free[1][2:12] if t not in free[0])
    runs = {a: generate(_engine(), prompts, 32, "ngram", eos_ids=(eos,), async_scheduling=a).outputs
            for a in (False, True)}
    assert runs[True] == runs[False] and len(runs[True][0]) == 32 and len(runs[True][1]) < 12
    device = made[-1]
    assert device.stats.calls["keep_ahead"] > 0 and device.stats.calls["read_ahead"] > 0
    assert device.stats.verifies > 0  # the last sequence standing speculated


@pytest.mark.usefixtures("one_torch_thread")
def test_mtp_runs_pipeline_the_ticks_past_the_speculative_width(made, monkeypatch):
    """MTP configured with a speculative width of 2: three sequences decode plainly, answered ahead;
    once one ends, the two left read their kept tokens and speculate (the MTP head catching up over
    the plain rows); the tokens are the synchronous run's."""
    import functools

    from fxsched.runtime import generate as generating

    monkeypatch.setattr(generating, "SchedulerConfig", functools.partial(generating.SchedulerConfig, mtp_width_limit=2))
    prompts = PROMPTS[:3]
    free = generating.generate(_engine(), prompts, 24, "mtp", eos_ids=()).outputs
    eos = next(t for t in free[2][2:12] if t not in free[0] and t not in free[1])  # ends request 3 alone
    runs = {a: generating.generate(_engine(), prompts, 24, "mtp", eos_ids=(eos,), async_scheduling=a).outputs
            for a in (False, True)}
    assert runs[True] == runs[False] and len(runs[True][2]) < 12
    device = made[-1]
    assert device.stats.calls["keep_ahead"] > 0 and device.stats.verifies > 0


def test_walk_speculative_episodes_pipeline_their_plain_ticks_without_a_violation():
    """Speculative episodes scheduled asynchronously (the walk draws one in three): their plain ticks
    are answered ahead, kept tokens are read before a speculative step, and each gives its clients
    the synchronous twin's tokens, finish reasons and logprobs (run_episode compares them)."""
    rng = random.Random(11)
    coverage: Counter = Counter()
    modes: Counter = Counter()
    while sum(modes.values()) < 60:
        episode = random_episode(rng)
        if episode.mode == "plain":
            continue
        result = run_episode(attrs.evolve(episode, async_scheduling=True), coverage)
        assert result.violation is None, (result.violation, episode)
        modes[episode.mode] += 1
    assert coverage["feature:decode_ahead"] > 0 and coverage["feature:kept_read_alone"] > 0, coverage


# --- a decode that fails at its launch (specs/async.md §16.6 rule 6) ----------------------------------


class _LaunchFails:
    """A device whose decode launch finds the KV cache full, and whose kept tokens are (or are not)
    lost: it records every read of kept tokens with the decode the read answers for."""

    def __init__(self, lost: bool) -> None:
        self.lost = lost
        self.reads: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def note_fx(self, line: str) -> None:
        pass

    def decode_batch(self, tokens, seqs, stream: int) -> None:
        from fxsched.runtime.devices.device import DeviceError
        raise DeviceError("out of KV blocks", kv_exhausted=True)

    def read_ahead(self, seqs, fed=()) -> list[int]:
        from fxsched.runtime.devices.device import DeviceError
        self.reads.append((tuple(seqs), tuple(fed)))
        if self.lost:
            raise DeviceError("the decode answered ahead of sequence 1 failed")
        return [7] * len(seqs)


@pytest.mark.parametrize("lost", [False, True])
def test_a_decode_failing_at_launch_answers_the_kept_tokens_or_their_loss(lost):
    """A launch that finds the KV cache full brings the kept tokens it resolves (the scheduler takes
    them, then preempts and retries); when they were lost with the decode that kept them, that loss
    is the answer instead: not a KV exhaustion a preemption would mend, and the device is told the
    decode it takes down with it (whose sequences the fault covers)."""
    from fxsched.core.events import LATE_TOKEN, DeviceFault
    from fxsched.effects import plans
    from fxsched.runtime.host import Host
    from fxsched.runtime.interpreter import Interpreter

    device = _LaunchFails(lost)
    plan = plans.Decode(tokens=(LATE_TOKEN, 5), seqs=(1, 2), seq_lens=(9, 4), picks=(), ahead=True, resolve=(1,))
    answer = Interpreter(device, Host(), (63,)).perform(plan)
    assert isinstance(answer, DeviceFault)
    assert device.reads == [((1,), (1, 2))]
    if lost:
        assert (answer.message, answer.kv_exhausted, answer.earlier) == (
            "the decode answered ahead of sequence 1 failed", False, ())
    else:
        assert (answer.message, answer.kv_exhausted, answer.earlier) == ("out of KV blocks", True, (7,))
