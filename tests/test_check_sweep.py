"""``fxsched check --seeds``: a sweep of the walk over many seeds (specs/checker.md §11.1).

A short sweep of main is clean, one line per seed and a summary; a sweep with an invariant that
breaks goes on past each broken seed, names every one, writes each one's replay file and exits 1;
bad seed lists are refused in one line with exit 2.
"""

from __future__ import annotations

import pytest

from fxsched.runtime.check import invariants
from fxsched.runtime.check.violation import Violation
from fxsched.runtime.cli import main


def test_a_short_sweep_of_main_breaks_no_invariant(capsys):
    assert main(["check", "--seeds", "1-3", "--steps", "4000", "--jobs", "1", "--no-progress"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out[:3]] == ["seed 1", "seed 2", "seed 3"]
    assert all(line.endswith("no invariant broken") for line in out[:3])
    assert out[3].startswith("seeds 1-3: 3 walked") and out[3].endswith("0 with a violation")


def test_a_sweep_goes_on_past_a_broken_seed_and_names_each(capsys, monkeypatch, tmp_path):
    def broken(device) -> None:
        if device.used_blocks:
            raise Violation("blocks_balance", "planted: any block in use")

    monkeypatch.setattr(invariants, "blocks_balance", broken)
    monkeypatch.chdir(tmp_path)
    assert main(["check", "--seeds", "4,6", "--steps", "2000", "--jobs", "1", "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "seed 4: VIOLATION blocks_balance" in out and "seed 6: VIOLATION blocks_balance" in out
    assert "2 with a violation: 4, 6" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fxsched-replay-4.json", "fxsched-replay-6.json"]


@pytest.mark.parametrize("seeds, words", [("5-1", "runs backwards"), ("x", "'x' is not a seed"),
                                          ("1-", "is not a seed"), ("-3", "go from 0")])
def test_bad_seed_lists_are_refused_in_one_line(capsys, seeds, words):
    assert main(["check", "--seeds", seeds, "--steps", "10"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--seeds" in err[0] and words in err[0]
