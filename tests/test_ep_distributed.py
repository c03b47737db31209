"""EP over real processes: torch.multiprocessing (forkserver, else spawn), gloo over loopback. Every
test leaves no process behind, also when it fails (the cluster reaps its workers; the fixture checks
and kills)."""

from __future__ import annotations

import argparse
import os
import signal
import time

import pytest

pytest.importorskip("torch.distributed")


from fxsched.runtime.cli.ep import add_ep_ranks_argument, generate_function, run_with_ep  # noqa: E402
from fxsched.runtime.ep.run import (  # noqa: E402
    EpCluster,
    EpRunError,
    execute_scenario_ep,
    run_on_cluster,
    run_scenario_ep,
)
from fxsched.runtime.ep.worker import snapshot_from_json  # noqa: E402
from fxsched.runtime.scenarios.runner import run_scenario  # noqa: E402
from fxsched.runtime.scenarios.loader import load_scenario, specs_dir  # noqa: E402
from support.ep_faults import EXIT_INJECTED, ExitAfter, StallAfter, faulty, no_process_left  # noqa: E402, F401

SHORT_S = 2.0  # the leader's timeout in the failure tests
MARGIN_S = 1.5  # detection and clean-up on top of it (a loaded 2-core machine)


@pytest.mark.parametrize("name", ["plain_decode", "dflash_batched"])
def test_two_ranks_give_the_single_rank_trace_and_the_same_mirror_at_every_tick(name):
    result = execute_scenario_ep(name, 2)
    want = run_scenario(load_scenario(name))
    assert result.trace == want
    ticks = [line for line in want.splitlines() if line.startswith("-- tick ")]
    assert [f"-- tick {t}" for t, _ in result.leader_ticks] == ticks
    assert result.worker_ticks(1) == result.leader_ticks
    report = result.worker_reports[1]
    assert report["error"] is None and report["final"] == []  # every slot released at the end
    assert result.exitcodes == {1: 0}  # the shutdown word stopped the worker cleanly


def test_three_ranks_mirror_alike():
    result = execute_scenario_ep("dflash_batched", 3)
    assert result.trace == run_scenario(load_scenario("dflash_batched"))
    assert result.worker_ticks(1) == result.leader_ticks == result.worker_ticks(2)
    assert result.exitcodes == {1: 0, 2: 0}


def _failing_run(serve=None, before=lambda cluster: None):
    """Run dflash_batched with worker 1 serving through ``serve`` (a fault of support.ep_faults);
    (the EpRunError, seconds from the start of the run, the cluster)."""
    with EpCluster(2, SHORT_S, entries={1: faulty(serve)} if serve is not None else None) as cluster:
        before(cluster)
        start = time.monotonic()
        with pytest.raises(EpRunError) as info:
            run_on_cluster("dflash_batched", cluster)
        elapsed = time.monotonic() - start
    return info.value, elapsed, cluster


def test_a_worker_that_dies_mid_run_fails_the_requests_in_flight_within_the_timeout():
    err, elapsed, cluster = _failing_run(ExitAfter(20))
    assert str(err) == f"EP worker 1 died (its process exited with code {EXIT_INJECTED})"
    assert elapsed < SHORT_S + MARGIN_S
    assert "out s1: T10 Error(EP worker 1 died (its process exited" in err.trace
    assert "out s2: T20 Error(EP worker 1 died (its process exited" in err.trace
    assert cluster.exitcodes() == {1: EXIT_INJECTED}


def test_a_killed_worker_is_reported_at_the_first_message():
    def kill(cluster):
        os.kill(cluster.processes[0].pid, signal.SIGKILL)
        cluster.processes[0].join(5)

    err, elapsed, cluster = _failing_run(before=kill)
    assert str(err).startswith("EP worker 1 died (its process exited with code -9)")
    assert elapsed < SHORT_S + MARGIN_S
    assert "out s1: Error(EP worker 1 died" in err.trace


def test_a_worker_that_stops_answering_is_given_up_after_the_timeout():
    err, elapsed, cluster = _failing_run(StallAfter(20))
    assert str(err) == f"EP worker 1 did not answer within {SHORT_S:g}s"
    assert SHORT_S <= elapsed < SHORT_S + MARGIN_S
    assert "Error(EP worker 1 did not answer within 2s)" in err.trace
    assert cluster.exitcodes()[1] is not None  # terminated, not left running


def test_the_cli_helpers_run_a_scenario_with_ranks():
    parser = argparse.ArgumentParser()
    parser.add_argument("name")
    add_ep_ranks_argument(parser)
    args = parser.parse_args(["plain_decode", "--ep-ranks", "2", "--ep-timeout", "20"])
    assert (args.ep_ranks, args.ep_timeout) == (2, 20.0)
    assert run_with_ep(args) == (specs_dir() / "goldens" / "plain_decode.trace").read_text()
    assert run_scenario_ep("plain_decode", 1) == run_with_ep(args)
    with pytest.raises(SystemExit):
        parser.parse_args(["plain_decode", "--ep-ranks", "0"])


# --- the torch model: workers run the same forwards ------------------------------------------------


BATCH = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(10, 30))]
SINGLE = [[3, 4, 5, 6]]


@pytest.mark.parametrize("spec, prompts", [
    ("none", BATCH),  # batched decodes: ROWS announcements
    ("dflash", BATCH),  # batched verifies, truncations and compactions: PENDING_ROWS, SET_LEN, MOVE
    ("mtp", SINGLE),  # serial K-verifies: the words alone (verify words, accept counts)
    ("ngram", SINGLE),  # K = 2 verifies and decode words
])
def test_generate_with_two_ranks_matches_one_rank_and_the_worker_model_keeps_up(spec, prompts):
    pytest.importorskip("fxsched.runtime.devices.torch")
    from fxsched.runtime.ep.generate import generate_ep
    from fxsched.runtime.generate import generate
    from fxsched.runtime.torch_model import HybridEngine, default_config

    from support.oracle import OracleDrafter

    cfg = default_config()
    plain = generate(HybridEngine(cfg), prompts, 20, "none")
    drafter = OracleDrafter(prompts, plain.outputs, cfg.vocab_size, noise=0.3) if spec in ("mtp", "dflash") else None
    result = generate_ep(HybridEngine(cfg), prompts, 20, spec, drafter=drafter, ep_ranks=2)
    assert result.outputs == plain.outputs
    report = result.worker_reports[1]
    assert report["error"] is None
    assert [(t, snapshot_from_json(snap)) for t, snap in report["ticks"]] == result.leader_ticks
    replica = report["replica"]
    assert replica["forwards"] == result.summary.target_forwards  # the same forwards, batch for batch
    assert replica["disagreed"] == 0 and replica["agreed"] > 0  # whose logits pick the leader's tokens
    assert result.device.stats.verifies > 0 or spec == "none"


def test_generate_function_picks_the_ep_run_for_more_than_one_rank():
    pytest.importorskip("fxsched.runtime.devices.torch")
    from fxsched.runtime.generate import generate

    assert generate_function(argparse.Namespace(ep_ranks=1)) is generate
    bound = generate_function(argparse.Namespace(ep_ranks=3, ep_timeout=7.0, weights=None))
    assert bound.keywords == {"ep_ranks": 3, "weights": None, "timeout_s": 7.0}


@pytest.mark.parametrize("spec, prompts", [("dflash", BATCH)])  # batched and fused serial verifies
def test_sampled_speculation_with_two_ranks_matches_one_rank(spec, prompts):
    """Rejection-sampled verifies (specs/speculation.md §6.16) run on rank 0's logits: a seeded run
    gives the single-rank tokens and the workers keep up with the rows it kept."""
    pytest.importorskip("fxsched.runtime.devices.torch")
    from fxsched.runtime.ep.generate import generate_ep
    from fxsched.runtime.generate import SamplingOptions, generate
    from fxsched.runtime.torch_model import HybridEngine, default_config

    cfg = default_config()
    sampling = SamplingOptions(temperature=0.8, top_k=20, seed=5)
    one = generate(HybridEngine(cfg), prompts, 12, spec, sampling=sampling)
    result = generate_ep(HybridEngine(cfg), prompts, 12, spec, ep_ranks=2, sampling=sampling)
    assert result.outputs == one.outputs
    assert result.device.stats.calls["sample_verify"] > 0
    report = result.worker_reports[1]
    assert report["error"] is None
    assert [(t, snapshot_from_json(snap)) for t, snap in report["ticks"]] == result.leader_ticks
