"""The mutation suite (tests/mutants.py) stays honest: every mutant still matches core/ exactly
once and is still Python, the suite keeps its spread over core/'s modules, and (marker
``mutants``, not in the default run) the runner really kills a mutant and passes clean code.

The kill rates themselves come from ``python tests/run_mutants.py`` (minutes, not seconds)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import pytest

from mutants import BY_ID, MUTANTS
from planted_bugs import PLANTED_BUGS
from support.mutation import ROOT, mutant, mutated_sources, occurrences

import run_mutants

# every module of core/ with rules or logic a bug can hide in (core/machine.py's layers 3 and 4)
RULE_MODULES = ("tick", "flow", "prefill", "decode", "spec_step", "kverify", "dflash", "mtp_batch", "ngram",
                "self_spec", "lifecycle")
HELPER_MODULES = ("admission", "chunking", "verdict", "watchdog", "emit", "retire", "faults", "memory",
                  "verifying", "rows")


def test_the_suite_is_large_and_spread_over_every_module():
    assert len(MUTANTS) >= 40
    assert len(BY_ID) == len(MUTANTS), "two mutants share an id"
    per_module = Counter(m.module for m in MUTANTS)
    for module in RULE_MODULES + HELPER_MODULES:
        assert per_module[module] >= 2, f"core/{module}.py has {per_module[module]} mutants"
    for m in MUTANTS:
        assert m.description and m.id.startswith(m.module), m.id
        assert (ROOT / m.file).exists(), m.file


@pytest.mark.parametrize("mutant_id", [m.id for m in MUTANTS])
def test_every_mutant_still_matches_core_once_and_compiles(mutant_id):
    """A change of core/ that breaks a mutant's snippet fails here, not as a mutant testing nothing."""
    m = BY_ID[mutant_id]
    for edit in m.edits:
        assert edit.file.startswith("core/") and edit.old != edit.new
        assert occurrences(edit) == 1, f"{m.id}: {edit.file} holds the original {occurrences(edit)} times"
    for f, text in mutated_sources(m.edits).items():
        assert text != (ROOT / f).read_text()
        compile(text, f, "exec")


def test_no_mutant_repeats_a_planted_bug():
    planted = {(e.file, e.old, e.new) for bug in PLANTED_BUGS for e in bug.edits}
    for m in MUTANTS:
        assert not {(e.file, e.old, e.new) for e in m.edits} & planted, m.id


def test_the_runner_refuses_a_mutant_that_no_longer_matches():
    stale = dataclasses.replace(BY_ID["tick_arrivals_jump_queue"], old="no such text\n")
    problems = run_mutants.check_snippets((stale,))
    assert len(problems) == 1 and "0 times" in problems[0]
    assert run_mutants.check_snippets(MUTANTS) == []


@pytest.mark.mutants
def test_the_runner_kills_a_mutant_and_passes_clean_code(tmp_path):
    """Through the runner's own functions: a clean copy survives the checker, a mutant does not."""
    args = run_mutants.parse_args(["--steps", "5000", "--seeds", "1,2", "--checker-only"])
    with mutant(()) as clean:
        assert run_mutants.run_checker(clean, args.seeds, args.steps, args.checker_timeout) is None
    result = run_mutants.measure(BY_ID["verifying_full_accept_wrong_bonus"].edits, args)
    assert result["checker"] is not None and result["checker"]["kind"] == "violation", result
    assert not result["tested"]


@pytest.mark.mutants
def test_the_runner_end_to_end_on_two_mutants(tmp_path, capsys):
    """The command line: baseline, one mutant the checker kills, one it cannot see, the JSON file."""
    out = tmp_path / "r.json"
    rc = run_mutants.main(["verifying_full_accept_wrong_bonus", "rows_host_pick_fixed_seed", "--steps", "3000",
                           "--checker-only", "--jobs", "2", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "baseline: the unmutated copy passes" in text and "checker alone:     1/2 = 50.0 %" in text
    assert "rows_host_pick_fixed_seed:" in text.split("survivors of the checker:")[1]
    assert Path(out).exists()
