"""Replay files of the model checker (``fxsched replay``): a violation's episode and event log
written as JSON, and the deterministic re-run that reaches it again.

A file is checked before it runs: valid UTF-8 JSON, an object of format ``fxsched-replay-1`` with
an ``episode`` object (the fields of ``Episode`` and its ``SimRequest`` list, each of its type,
integers within ``MAX_INT`` in size, numbers finite), a list of ``events`` (strings) and the
recorded ``invariant``. Anything else raises ``ReplayError`` (a ``ValueError``) naming the file
and the field; so does an episode the walk cannot even set up. A run whose events differ from
the recorded ones says how (``ReplayOutcome.departure``): a file shorter than the run was cut
short, a run that departs from the file or ends before it means the code (or the file) changed.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from typing import Any, Optional

import attrs

from fxsched.runtime.check.invariants import Violation
from fxsched.runtime.files import read_text
from fxsched.runtime.check.episode import Episode, SimRequest
from fxsched.runtime.check.walk import WalkReport, run_episode

FORMAT = "fxsched-replay-1"
MAX_INT = 100_000  # the walk draws far smaller values; a bigger size would only make the re-run hang


class ReplayError(ValueError):
    """A replay file that cannot be replayed; the message names the file and what is wrong."""


def write_replay(report: WalkReport, path) -> None:
    """Write the violation of ``report`` (which must have one) as a replay file."""
    if report.violation is None:
        raise ValueError(f"seed {report.seed}: the walk broke no invariant; there is nothing to replay")
    data = {"format": FORMAT, "seed": report.seed, **report.violation}
    with open(path, "w") as fh:
        json.dump(data, fh, indent=1)


@attrs.frozen
class ReplayOutcome:
    """A re-run of a replay file: the violation it reached (None: it ran clean), the file's data,
    and the index of the first event that differs from the file's log (None: identical)."""

    violation: Optional[Violation]
    data: dict
    diverged: Optional[int]
    recorded: int  # events in the file
    replayed: int  # events of the re-run

    def departure(self) -> Optional[str]:
        """How the re-run's events differ from the file's, in words; None when they do not."""
        if self.diverged is None:
            return None
        if self.diverged == self.recorded < self.replayed:
            return (f"the file records {self.recorded} events and the run has {self.replayed}: the file is "
                    f"truncated (shorter than the run)")
        if self.diverged == self.replayed < self.recorded:
            return (f"the run ends after {self.replayed} of the file's {self.recorded} events (the code or the file "
                    f"changed since it was written)")
        return (f"the run departs from the recorded events at event {self.diverged} (the code or the file changed "
                f"since it was written)")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _fits(value: Any, kind: str) -> bool:
    """Whether a JSON value has the type an attrs field names (as its annotation string)."""
    if kind.startswith("Optional[") and kind.endswith("]"):
        return value is None or _fits(value, kind[len("Optional["):-1])
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool) and abs(value) <= MAX_INT
    if kind == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if kind == "str":
        return isinstance(value, str)
    if kind == "tuple[int, ...]":
        return isinstance(value, list) and len(value) <= MAX_INT and all(_fits(v, "int") for v in value)
    return True  # a type this check does not know: the record's own construction judges it


def _describe(kind: str) -> str:
    """A field's annotation in words, for an error message."""
    if kind.startswith("Optional[") and kind.endswith("]"):
        return f"{_describe(kind[len('Optional['):-1])} or null"
    words = {"bool": "a boolean", "int": f"an integer from {-MAX_INT} to {MAX_INT}", "float": "a finite number",
             "str": "a string", "tuple[int, ...]": f"a list of integers from {-MAX_INT} to {MAX_INT}"}
    return words.get(kind, kind)


def _check_record(cls, raw: Any, where: str) -> None:
    if not isinstance(raw, dict):
        raise ReplayError(f"{where}: expected an object, got {_show(raw)}")
    fields = attrs.fields_dict(cls)
    unknown = sorted(set(raw) - set(fields) - {"planted"})
    if unknown:
        raise ReplayError(f"{where}: unknown field {_show(unknown[0])}")
    for name, field in fields.items():
        if name not in raw:
            if field.default is attrs.NOTHING:
                raise ReplayError(f"{where}: missing field '{name}'")
            continue
        kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "")
        if not _fits(raw[name], kind):
            raise ReplayError(f"{where}: field '{name}' expects {_describe(kind)}, got {_show(raw[name])}")


def _check_episode(raw: Any, where: str) -> None:
    _check_record(Episode, raw, where)
    requests = raw["requests"]
    if not isinstance(requests, list) or len(requests) > 10_000:
        raise ReplayError(f"{where}: field 'requests' expects a list of request objects, got {_show(requests)}")
    for index, request in enumerate(requests):
        _check_record(SimRequest, request, f"{where} request #{index + 1}")


def load_replay(path) -> dict:
    """The checked contents of a replay file (see the module docstring); ReplayError otherwise."""
    text = read_text(path, "replay file", ReplayError)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ReplayError(f"{path}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno}); "
                          f"the file may be truncated") from None
    except (ValueError, RecursionError) as err:  # a number too long to read, nesting too deep
        raise ReplayError(f"{path}: not a readable JSON file ({type(err).__name__}: {err})") from None
    if not isinstance(data, dict):
        raise ReplayError(f"{path}: not an fxsched replay file (expected a JSON object, got {type(data).__name__})")
    if data.get("format") != FORMAT:
        raise ReplayError(f"{path}: not an fxsched replay file (format {_show(data.get('format'))}, "
                          f"expected {FORMAT!r})")
    if not isinstance(data.get("invariant"), str):
        raise ReplayError(f"{path}: field 'invariant' expects a string, got {_show(data.get('invariant'))}")
    events = data.get("events")
    if not isinstance(events, list) or not all(isinstance(e, str) for e in events):
        raise ReplayError(f"{path}: field 'events' expects a list of strings, got {_show(events)}")
    _check_episode(data.get("episode"), f"{path}: episode")
    return data


def replay_run(path) -> ReplayOutcome:
    """Load and re-run a replay file's episode (``ReplayOutcome``); ReplayError for a bad file."""
    data = load_replay(path)
    try:
        episode = Episode.from_json(data["episode"])
        result = run_episode(episode, Counter(), keep_log=True)
    except Exception as err:  # noqa: BLE001 — values the walk cannot set up (run_episode reports the rest)
        raise ReplayError(f"{path}: the episode cannot be run ({type(err).__name__}: {err})") from None
    recorded, replayed = data["events"], list(result.events)
    diverged = None
    if replayed != recorded:
        # the logs may have different lengths: the first difference within the shorter one, else its end
        diverged = next((i for i, (a, b) in enumerate(zip(replayed, recorded, strict=False)) if a != b),
                        min(len(replayed), len(recorded)))
    return ReplayOutcome(result.violation, data, diverged, len(recorded), len(replayed))


def replay(path) -> tuple[Optional[Violation], dict, Optional[int]]:
    """Re-run a replay file's episode: (the violation it reaches or None, the file's data, the index
    of the first event that differs from the recorded log, or None when the runs are identical —
    they differ only when the code or the file changed since it was written)."""
    outcome = replay_run(path)
    return outcome.violation, outcome.data, outcome.diverged
