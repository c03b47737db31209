"""Replay files of the model checker (``fxsched replay``): a violation's episode and event log
written as JSON, and the deterministic re-run that reaches it again."""

from __future__ import annotations

import json
from collections import Counter
from typing import Optional

from fxsched.runtime.check.invariants import Violation
from fxsched.runtime.check.walk import Episode, WalkReport, run_episode

FORMAT = "fxsched-replay-1"


def write_replay(report: WalkReport, path) -> None:
    """Write the violation of ``report`` (which must have one) as a replay file."""
    if report.violation is None:
        raise ValueError(f"seed {report.seed}: the walk broke no invariant; there is nothing to replay")
    data = {"format": FORMAT, "seed": report.seed, **report.violation}
    with open(path, "w") as fh:
        json.dump(data, fh, indent=1)


def replay(path) -> tuple[Optional[Violation], dict, Optional[int]]:
    """Re-run a replay file's episode: (the violation it reaches or None, the file's data, the index
    of the first event that differs from the recorded log, or None when the runs are identical —
    they differ only when the code changed since the file was written)."""
    with open(path) as fh:
        data = json.load(fh)
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: not an fxsched replay file (format {data.get('format')!r})")
    episode = Episode.from_json(data["episode"])
    result = run_episode(episode, Counter(), keep_log=True)
    recorded, replayed = data["events"], list(result.events)
    diverged = None
    if replayed != recorded:
        # the logs may have different lengths: the first difference within the shorter one, else its end
        diverged = next((i for i, (a, b) in enumerate(zip(replayed, recorded, strict=False)) if a != b),
                        min(len(replayed), len(recorded)))
    return result.violation, data, diverged
