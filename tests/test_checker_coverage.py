"""The random walk reaches every feature it is meant to exercise within the CI budget, and breaks
no invariant on the way: a feature whose count is zero (runtime/check/walk.py ``FEATURES``) means
the checker has stopped looking at it."""

from __future__ import annotations

from fxsched.runtime.check.walk import FEATURES, feature_counts, walk

BUDGET = 200_000  # steps: about 15 s on one core


def test_the_walk_reaches_every_feature_and_breaks_no_invariant():
    report = walk(1, steps=BUDGET)
    assert report.violation is None, report.violation
    counts = feature_counts(report.coverage)
    assert set(counts) == set(FEATURES)
    missing = sorted(name for name, count in counts.items() if count == 0)
    assert not missing, f"features never reached in {report.steps} steps: {missing}"
