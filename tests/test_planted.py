"""The model checker can fail: every planted bug (a source mutation of core/, tests/planted_bugs.py)
is caught by the random walk within its budget, by exactly the invariant named for it; the
unmutated code passes the same walk; a mutant's failure is written to a replay file that
reproduces it, through the library and through the ``fxsched check`` / ``fxsched replay`` commands.

Every mutant runs in a subprocess on a mutated copy of the package; each subprocess first checks
that it imported the mutated core (``GUARD`` of tests/support/mutation.py)."""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

import pytest

from planted_bugs import BUDGET, BY_NAME, PLANTED_BUGS
from support.mutation import GUARD, ROOT, apply_edits, cli_in, mutant, occurrences, run_python, walk_mutant

NAMES = [bug.name for bug in PLANTED_BUGS]

# what the walk reports when the run breaks down rather than an invariant: never a catch
NOT_AN_INVARIANT = {"device_refused", "step_raises", "batch_ends_in_one_query", "step_limit"}


def invariant_names() -> set[str]:
    """Every ``Violation`` name the checker's modules raise."""
    from fxsched.runtime.check import invariants

    text = "".join(path.read_text() for path in sorted(Path(invariants.__file__).parent.glob("*.py")))
    return set(re.findall(r'Violation\(\s*"(\w+)"', text))


def test_the_nine_planted_bugs_are_listed():
    assert sorted(NAMES) == sorted([
        "leak_on_cancel", "accepted_prefix_off_by_one", "commit_before_fold", "wrong_compaction_target",
        "double_release", "acc_counts_bonus", "token_after_eos", "slot_leak_on_preemption", "no_rewind_on_reject",
    ])
    for bug in PLANTED_BUGS:
        assert bug.description and bug.edits
        assert bug.invariant in invariant_names(), f"{bug.name}: no invariant named {bug.invariant}"
        assert bug.invariant not in NOT_AN_INVARIANT


@pytest.mark.parametrize("name", NAMES)
def test_every_original_text_occurs_exactly_once(name):
    """A refactor of core/ that breaks a mutant is noticed here, not as a silent pass."""
    bug = BY_NAME[name]
    for edit in bug.edits:
        assert edit.file.startswith("core/") and edit.old != edit.new
        assert occurrences(edit) == 1, f"{name}: {edit.file} holds the original {occurrences(edit)} times: {edit.old!r}"
    files = {edit.file for edit in bug.edits}
    mutated = apply_edits({f: (ROOT / f).read_text() for f in files}, bug.edits)
    for f, text in mutated.items():
        compile(text, f, "exec")  # the mutant is still Python


@pytest.mark.parametrize("name", NAMES)
def test_planted_bug_is_caught_by_its_invariant(name):
    bug = BY_NAME[name]
    report = walk_mutant(bug.edits, bug.seed, BUDGET)
    violation = report["violation"]
    assert violation is not None, f"{name} went unnoticed for {report['steps']} steps (seed {bug.seed})"
    assert violation["invariant"] == bug.invariant, (
        f"{name} was caught by {violation['invariant']} ({violation['message']}), not by {bug.invariant}")


def test_the_unmutated_code_passes_the_same_walks():
    """The same walks on an unmutated copy (same runner, same subprocess) break nothing, so a catch
    above is the mutation's doing."""
    for seed in sorted({bug.seed for bug in PLANTED_BUGS}):
        report = walk_mutant((), seed, BUDGET)
        assert report["violation"] is None, report["violation"]
        assert report["steps"] >= BUDGET


def test_the_subprocess_imports_the_mutated_core():
    bug = BY_NAME["double_release"]
    probe = GUARD + (
        "import inspect, fxsched.core.tick, fxsched.runtime.check.walk, fxsched.runtime.interpreter\n"
        "print(json.dumps({'files': [fxsched.core.__file__, fxsched.core.tick.__file__,\n"
        "                            fxsched.runtime.check.walk.initial_state.__code__.co_filename,\n"
        "                            fxsched.runtime.interpreter.step.__code__.co_filename],\n"
        "                  'source': inspect.getsource(fxsched.core.tick.retire_finished)}))\n"
    )
    with mutant(bug.edits) as root:
        proc = run_python(root, ["-c", probe])
        assert proc.returncode == 0, proc.stderr
        seen = json.loads(proc.stdout)
        for path in seen["files"]:  # core, and the core the walk and the interpreter call, are the mutant's
            assert Path(path).resolve().is_relative_to(root.resolve()), path
        assert "out.append(lc.ReleaseSeq(" in seen["source"]  # the mutated text is what runs
        # the guard is real: told to expect core/ from another root, the subprocess refuses to go on
        with tempfile.TemporaryDirectory() as other:
            wrong = run_python(root, ["-c", GUARD], guard_root=Path(other))
        assert wrong.returncode != 0 and "MUTANT NOT IMPORTED" in wrong.stderr
    assert not root.exists(), "the mutant's temp dir was not removed"
    assert "lc.ReleaseSeq(" not in (ROOT / "core" / "tick.py").read_text()  # the real core is untouched


def test_a_mutants_replay_file_reproduces_the_same_violation(tmp_path):
    bug = BY_NAME["accepted_prefix_off_by_one"]
    path = tmp_path / "replay.json"
    script = GUARD + (
        "from fxsched.runtime.check.replay import replay, write_replay\n"
        "from fxsched.runtime.check.walk import walk\n"
        "report = walk(int(sys.argv[1]), steps=int(sys.argv[2]))\n"
        "write_replay(report, sys.argv[3])\n"
        "violation, data, diverged = replay(sys.argv[3])\n"
        "print(json.dumps({'walk': {k: report.violation[k] for k in ('invariant', 'message')},\n"
        "                  'replay': {'invariant': violation.invariant, 'message': violation.message},\n"
        "                  'diverged': diverged}))\n"
    )
    with mutant(bug.edits) as root:
        proc = run_python(root, ["-c", script, str(bug.seed), str(BUDGET), str(path)])
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["walk"]["invariant"] == bug.invariant
    assert out["replay"] == out["walk"] and out["diverged"] is None
    data = json.loads(path.read_text())
    assert data["seed"] == bug.seed and data["invariant"] == bug.invariant and data["events"]
    assert "planted" not in data["episode"]

    # on the unmutated code the same episode runs clean: the failure was the mutation's
    from fxsched.runtime.check.replay import replay

    violation, _, diverged = replay(path)
    assert violation is None and diverged is not None


def test_check_and_replay_commands_on_a_mutant(tmp_path):
    bug = BY_NAME["double_release"]
    path = tmp_path / "r.json"
    with mutant(bug.edits) as root:
        check = cli_in(root, ["check", "--seed", str(bug.seed), "--steps", str(BUDGET), "--replay-file", str(path),
                              "--no-progress"], cwd=tmp_path)
        assert check.returncode == 1, check.stdout + check.stderr
        assert f"VIOLATION {bug.invariant}" in check.stdout and "steps/s" in check.stdout
        assert path.exists()
        again = cli_in(root, ["replay", str(path)], cwd=tmp_path)
        assert again.returncode == 1, again.stdout + again.stderr
        assert f"VIOLATION {bug.invariant}" in again.stdout and "departs" not in again.stdout
        # the same command line on the unmutated copy finds nothing
        with mutant(()) as clean:
            ok = cli_in(clean, ["check", "--seed", str(bug.seed), "--steps", "2000", "--no-progress"], cwd=tmp_path)
            assert ok.returncode == 0 and "no invariant broken" in ok.stdout, ok.stdout + ok.stderr
            clean_replay = cli_in(clean, ["replay", str(path)], cwd=tmp_path)
            assert clean_replay.returncode == 0 and "ran clean" in clean_replay.stdout
    assert not os.path.exists(root)
