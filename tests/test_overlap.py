"""The device lane (specs/async.md §16.5): the device's effects carried out on their own thread
while the host steps the scheduler and serves its clients.

The lane itself (order, errors, the hidden-time clock against sleeps that release the GIL); the
torch device's tokens with the lane and without, in every proposer mode, greedy and sampled; a
query answered ahead that the device then answers otherwise; a late proposal that fails, whose
failure is the fault of the verify that consumes its drafts; the command line's refusals.
"""

from __future__ import annotations

import time

import pytest

from fxsched.runtime.devices.lane import DeviceLane


# --- the lane -------------------------------------------------------------------------------------


def test_the_lane_runs_work_in_the_order_launched_and_reraises_at_the_wait():
    lane = DeviceLane()
    seen: list[int] = []
    slow = lane.launch(lambda: (time.sleep(0.05), seen.append(1)))
    fast = lane.launch(seen.append, 2)

    def fail() -> None:
        raise ValueError("broken forward")
    failed = lane.launch(fail)
    assert lane.wait(fast) is None and seen == [1, 2]  # the second waited for the first
    assert slow.done()
    with pytest.raises(ValueError, match="broken forward"):
        lane.wait(failed)
    lane.launch(fail)
    lane.fence()  # a fence waits and keeps errors with their futures
    lane.close()


def test_the_lane_counts_host_time_that_ran_beside_its_work():
    """Work of 0.3 s launched, the host busy 0.1 s (a sleep releases the GIL, as a torch operator
    does), then waiting: about 0.1 s of host time hidden, about 0.2 s waited, 0.3 s busy."""
    lane = DeviceLane()
    job = lane.launch(time.sleep, 0.3)
    time.sleep(0.1)
    lane.wait(job)
    lane.close()
    assert 0.08 <= lane.hidden_s <= 0.2
    assert 0.1 <= lane.waited_s <= 0.3
    assert lane.busy_s >= 0.29
    assert lane.hidden_s + lane.waited_s == pytest.approx(lane.busy_s, abs=0.02)


# --- the scheduler on the simulated device, behind the host ------------------------------------------


def test_a_device_behind_the_host_changes_no_client_output(monkeypatch):
    """Episodes of the checker's walk with late answers, run with the device's work on a deferred
    lane (proposals answered ahead, client outputs before the device's part of their batch) and
    without: the same outputs, no invariant broken, and proposals were answered ahead."""
    import random

    import attrs

    from support.walk_episode import episode_outputs

    from fxsched.runtime.check.walk import random_episode
    rng = random.Random(11)
    compared = ahead = 0
    while compared < 40:
        episode = random_episode(rng)
        if not episode.mode.startswith(("mtp", "dflash")) or episode.fault_phase:
            continue
        episode = attrs.evolve(episode, late_drafts=True)
        behind, behind_violation, coverage = episode_outputs(attrs.evolve(episode, lane=True), monkeypatch)
        level, level_violation, _ = episode_outputs(attrs.evolve(episode, lane=False), monkeypatch)
        assert behind_violation is None and level_violation is None, (behind_violation, level_violation)
        assert behind == level, episode
        ahead += coverage["feature:answered_ahead"]
        compared += 1
    assert ahead > 0


# --- the torch device ------------------------------------------------------------------------------


def _default_engine():
    from fxsched.runtime.torch_model import HybridEngine
    from fxsched.runtime.torch_model.default_model import default_model_dir
    return HybridEngine.from_pretrained(default_model_dir(), max_slots=4)


PROMPTS = [[5 + i, 17, 42, 7 + i, 5 + i, 17, 42, 7 + i] for i in range(3)]


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize(("spec", "temperature"), [
    ("none", 0.0), ("mtp", 0.0), ("mtp", 0.8), ("ngram", 0.0), ("dflash", 0.0), ("dflash", 0.8)])
def test_the_lane_changes_no_token(spec, temperature, request):
    """Greedy and seeded sampled runs give the same tokens with the lane and without; with it, the
    summary has the host's time and the part hidden, and the proposals were answered ahead."""
    from fxsched.runtime.generate import SamplingOptions, generate

    engine = request.getfixturevalue("tiny_dflash_engine") if spec == "dflash" else _default_engine()
    sampling = SamplingOptions(temperature=temperature, seed=11)
    runs = {on: generate(engine, PROMPTS, 16, spec=spec, eos_ids=(), sampling=sampling, overlap=on)
            for on in (True, False)}
    assert runs[True].outputs == runs[False].outputs
    assert all(len(out) == 16 for out in runs[True].outputs)
    on, off = runs[True].summary, runs[False].summary
    assert on.verifies == off.verifies and on.target_forwards == off.target_forwards
    assert off.host_s is None and off.hidden_s is None
    assert on.host_s is not None and on.hidden_s is not None and 0 <= on.hidden_s <= on.host_s <= on.seconds


@pytest.mark.usefixtures("one_torch_thread")
def test_an_answer_ahead_the_device_contradicts_ends_the_run(monkeypatch):
    """The host went on with the answer the device gave ahead; a lane answer that differs is a
    broken protocol, not something to paper over."""
    import attrs

    from fxsched.runtime.generate import generate
    from fxsched.runtime.interpreter import Interpreter, RunError

    promise = Interpreter._answer_ahead

    def one_too_many(self, query):
        ahead = promise(self, query)
        return None if ahead is None else attrs.evolve(ahead, drafts=ahead.drafts + (ahead.drafts[0],))
    monkeypatch.setattr(Interpreter, "_answer_ahead", one_too_many)
    with pytest.raises(RunError, match="answered ahead"):
        generate(_default_engine(), PROMPTS[:1], 8, spec="mtp", eos_ids=(), overlap=True)


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("overlap", [True, False])
def test_a_late_proposal_that_fails_is_the_fault_of_its_verify(overlap, monkeypatch):
    """The proposal already answered LATE_DRAFT placeholders when its forward fails: the verify
    that consumes them fails those sequences with the proposal's error, the others go on."""
    from fxsched.runtime.generate import generate
    from fxsched.runtime.torch_model.errors import OutOfBlocksError

    engine = _default_engine()
    drafts = engine.mtp_drafts
    calls = {"n": 0}

    def third_fails(slots, tokens, n):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OutOfBlocksError("MTP module cache full")
        return drafts(slots, tokens, n)
    monkeypatch.setattr(engine, "mtp_drafts", third_fails)
    result = generate(engine, PROMPTS[:1], 12, spec="mtp", eos_ids=(), overlap=overlap)
    (only,) = result.results
    assert only.error is not None
    assert "late proposal of sequence" in only.error and "MTP module cache full" in only.error


def test_overlap_under_expert_parallelism_is_refused_in_one_line(capsys):
    from fxsched.runtime.cli.app import main

    assert main(["generate", "--prompt-ids", "1 2 3", "--overlap", "--ep-ranks", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--overlap" in err[0] and "expert parallelism" in err[0]


def test_bench_generate_refuses_an_unknown_overlap(capsys):
    from fxsched.runtime.cli.app import main

    assert main(["bench", "generate", "--overlap", "sometimes"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--overlap sometimes" in err[0]
