"""The random walk on several processes (``walk(..., jobs=N)``, ``fxsched check --jobs N``): the
report is the one a single process gives, the violation included, and a worker that fails or dies
ends the walk with an error that says so instead of a hang."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest

from fxsched.runtime.check import invariants, walk as walk_module
from fxsched.runtime.check.invariants import Violation
from fxsched.runtime.check.walk import walk
from fxsched.runtime.cli.app import main

pytestmark = pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(),
                                reason="the walk runs episodes in forked processes only where the platform forks")


def test_two_processes_report_what_one_does():
    one = walk(7, steps=4000, jobs=1)
    two = walk(7, steps=4000, jobs=2)
    assert (one.jobs, two.jobs) == (1, 2)
    assert one.violation is None and two.violation is None
    assert (two.steps, two.episodes) == (one.steps, one.episodes)
    assert two.coverage == one.coverage
    assert two.cpu_seconds > 0


@pytest.mark.parametrize("jobs", [1, 2])
def test_episodes_run_with_the_objects_from_before_the_walk_frozen(monkeypatch, jobs):
    """No collection during the walk traverses the objects from before it (in a forked worker they
    share pages with the parent, which a collection's writes would copy); the collector gets them
    back when the walk ends, failed or not, and a caller's own freeze is left alone."""
    real = walk_module.run_indexed
    assert gc.get_freeze_count() == 0

    def frozen_while_running(seed, index):
        if gc.get_freeze_count() == 0:
            raise AssertionError("the objects from before the walk are not frozen")
        if index == 30:
            raise KeyError("made up")
        return real(seed, index)

    monkeypatch.setattr(walk_module, "run_indexed", frozen_while_running)
    report = walk(7, steps=1000, jobs=jobs)
    assert report.violation is None and report.episodes < 30
    assert gc.get_freeze_count() == 0
    with pytest.raises((RuntimeError, KeyError), match=r"made up"):
        walk(7, steps=20_000, jobs=jobs)
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        walk(7, steps=1000, jobs=jobs)
        assert gc.get_freeze_count() > 0  # (frozen objects that died meanwhile are no longer counted)
    finally:
        gc.unfreeze()


def test_a_time_budget_takes_whole_episodes_in_order():
    report = walk(3, seconds=0.3, jobs=2)
    again = walk(3, steps=report.steps, jobs=1)  # the same episodes, counted up to the same step total
    assert report.violation is None and report.episodes >= 1
    assert (again.steps, again.episodes, again.coverage) == (report.steps, report.episodes, report.coverage)


def _fails_on_long_episodes(monkeypatch):
    """Make ``slots_unique`` fail at tick 30 of an episode on a pool of more than 8 blocks: the first
    such episode of seed 7 is not among its first two, so the other process has run ahead by then."""
    real = invariants.slots_unique

    def fails_late(state, device):
        real(state, device)
        if device.tick >= 30 and device.total_blocks > 8:
            raise Violation("slots_unique", f"made to fail at tick {device.tick}")

    monkeypatch.setattr(invariants, "slots_unique", fails_late)


def test_the_violation_found_is_the_first_in_episode_order(monkeypatch):
    _fails_on_long_episodes(monkeypatch)
    one = walk(7, steps=20_000, jobs=1)
    two = walk(7, steps=20_000, jobs=2)
    assert one.violation is not None and one.violation["episode_index"] > 1
    assert two.violation == one.violation  # invariant, message, step, episode, its event log
    assert (two.steps, two.episodes, two.coverage) == (one.steps, one.episodes, one.coverage)


def test_the_command_reports_processes_and_the_same_coverage(capsys):
    assert main(["check", "--seed", "2", "--steps", "3000", "--jobs", "1", "--no-progress"]) == 0
    one = capsys.readouterr().out.splitlines()
    assert main(["check", "--seed", "2", "--steps", "3000", "--jobs", "2", "--no-progress"]) == 0
    two = capsys.readouterr().out.splitlines()
    assert " on 1 process, " in one[0] and " on 2 processes, " in two[0] and "per CPU second" in two[0]
    assert one[1:] == two[1:]


def test_a_worker_that_raises_names_the_episode(monkeypatch):
    real = walk_module.run_indexed

    def raises_at_3(seed, index):
        if index == 3:
            raise KeyError("made up")
        return real(seed, index)

    monkeypatch.setattr(walk_module, "run_indexed", raises_at_3)
    with pytest.raises(RuntimeError, match=r"a checker worker failed: episode 3: KeyError: 'made up'"):
        walk(7, steps=20_000, jobs=2)


def test_a_worker_that_dies_ends_the_walk(monkeypatch):
    real = walk_module.run_indexed

    def dies_at_3(seed, index):
        if index == 3:
            os._exit(7)
        return real(seed, index)

    monkeypatch.setattr(walk_module, "run_indexed", dies_at_3)
    with pytest.raises(RuntimeError, match=r"a checker worker died \(exit code 7\) before episode"):
        walk(7, steps=20_000, jobs=2)


def test_the_command_says_a_worker_failure_in_one_line(monkeypatch, capsys):
    def raises(seed, index):
        raise KeyError("made up")

    monkeypatch.setattr(walk_module, "run_indexed", raises)
    assert main(["check", "--seed", "7", "--steps", "100", "--jobs", "2", "--no-progress"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == ["fxsched check: seed 7: a checker worker failed: episode 0: "
                                              "KeyError: 'made up'"]


def test_ctrl_c_stops_the_workers_with_one_line():
    """SIGINT to the whole process group (as a terminal sends it): the parent says so in one line
    and exits 130, the workers print nothing and are gone."""
    proc = subprocess.Popen([sys.executable, "-m", "fxsched.runtime.cli", "check", "--seed", "7", "--time", "60",
                             "--jobs", "2", "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        time.sleep(3)  # past the start: the workers are running episodes
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert err.splitlines() == ["fxsched check: interrupted"], err
    time.sleep(0.2)
    with pytest.raises(ProcessLookupError):  # nobody is left in the group: the workers were reaped
        os.killpg(proc.pid, 0)
