"""One episode of the checker's walk with every client output it produced."""

from __future__ import annotations

from collections import Counter


def episode_outputs(episode, monkeypatch):
    """The client outputs of ``episode`` in order, its violation (None: clean) and its coverage."""
    from fxsched.runtime.check import walk
    seen: list = []
    coverage: Counter = Counter()
    with monkeypatch.context() as patch:
        output = walk.WalkObserver.output

        def record(self, out):
            seen.append(out)
            return output(self, out)
        patch.setattr(walk.WalkObserver, "output", record)
        result = walk.run_episode(episode, coverage)
    return seen, result.violation, coverage
