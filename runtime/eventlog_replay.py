"""The replay of an event log (specs/event-log.md §9.4): ``replay_log`` re-runs ``step`` over the
recorded events without the model and compares each step's effects with the recorded ones.

Invariant: ``replay_log`` never touches a device: it rebuilds ``initial_state(config, model)`` from
the header and feeds the events to the pure ``step``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from fxsched.core import events as ev
from fxsched.core.state import SchedulerState, initial_state
from fxsched.effects.client import RotationAck
from fxsched.runtime.eventlog_codec import (Decoder, Encoder, _Bad, _dumps, _init_fields, _is_client, client_frames,
                                            digest)
from fxsched.runtime.eventlog_reader import read_log


@dataclass
class Departure:
    """The first step whose effects differ from the recorded ones."""

    index: int
    line: int
    event: ev.Event
    recorded: list[str]  # the recorded effects, each as its type (client outputs rendered in full)
    replayed: list[str]
    position: int  # the first differing effect (0-based)
    error: Optional[str] = None  # step raised instead of answering

    def report(self) -> list[str]:
        out = [f"replay: departs at event {self.index} (line {self.line}): {_brief(self.event)}"]
        if self.error is not None:
            out.append(f"  recorded: {len(self.recorded)} effects [{', '.join(self.recorded)}]")
            out.append(f"  re-run:   step raised {self.error}")
            return out
        out.append(f"  recorded: {len(self.recorded)} effects [{', '.join(_kinds(self.recorded))}]")
        out.append(f"  re-run:   {len(self.replayed)} effects [{', '.join(_kinds(self.replayed))}]")
        want = self.recorded[self.position] if self.position < len(self.recorded) else "(none)"
        got = self.replayed[self.position] if self.position < len(self.replayed) else "(none)"
        out.append(f"  first differing effect #{self.position + 1}: recorded {want}, re-run {got}")
        return out


def _brief(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _kinds(effects: list[str]) -> list[str]:
    return [e.split("(", 1)[0].split(" ", 1)[0] for e in effects]


@dataclass
class ReplayResult:
    """What ``replay_log`` found: the events re-run, the first departure (None: identical), why the
    log ended early (None: it was closed), and the client outputs of the re-run, as
    ``(event index, output)``."""

    path: Path
    events: int
    departure: Optional[Departure]
    cut_short: Optional[str]
    outputs: list[tuple[int, Any]] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    def summary(self) -> str:
        if self.departure is not None:
            return f"replay: departs at event {self.departure.index}"
        line = f"replay: {self.events} events, identical effects and client outputs"
        if self.cut_short is not None:
            line += f"; the log was cut short: {self.cut_short}"
        return line


def render_output(index: int, output: Any) -> str:
    """One client output as ``replay --outputs`` prints it."""
    if isinstance(output, RotationAck):
        return f"event {index}: rotation {output.name} {output.render()}"
    return f"event {index}: request {output.request_id} {output.render()}"


def _describe_recorded(entry: Any, decoder: Decoder) -> str:
    try:
        if isinstance(entry, str) and "." in entry:
            tag, hexdigest = entry.split(".", 1)
            return f"{decoder.definition(tag).cls.__name__} (digest {hexdigest})"
        if isinstance(entry, str):
            return f"{decoder.definition(entry).cls.__name__}()"
        return _brief(decoder._instance(entry))
    except _Bad:
        return _brief(entry)


def _describe_replayed(effect: Any) -> str:
    if _is_client(effect) or not _init_fields(type(effect)):
        return _brief(effect)
    return f"{_brief(effect)} (digest {digest(effect)})"


class _TagsOf(Encoder):
    """An encoder that uses the file's tags (a class the file never defined gets ``?Name``)."""

    def __init__(self, decoder: Decoder):
        super().__init__()
        self.decoder = decoder

    def tag(self, cls: type) -> str:
        tag = self.tags.get(cls)
        if tag is None:
            tag = next((t for t, d in self.decoder.defs.items() if d.cls is cls), "?" + cls.__name__)
            if not tag.startswith("?"):
                self.tags[cls] = tag
        return tag


def replay_log(path: str | Path, step: Optional[Callable[[SchedulerState, ev.Event], Any]] = None) -> ReplayResult:
    """Re-run ``step`` (default: the scheduler's) over the events of the log at ``path`` from
    ``initial_state`` of its header, comparing each step's effects record with the recorded one.
    Stops at the first departure. ``EventLogError`` for a malformed log."""
    if step is None:
        from fxsched.core import machine

        step = machine.step
    log = read_log(path)
    state = initial_state(log.config, log.model)
    encoder = _TagsOf(log.decoder)
    outputs: list[tuple[int, Any]] = []
    events = 0
    departure: Optional[Departure] = None
    for item in log.steps:
        recorded = item.effects
        try:
            state, effects = step(state, item.event)
        except Exception as err:  # noqa: BLE001 - a scheduler that fails here is what replay reports
            if recorded is None:  # the recorded run stopped at this event too
                events += 1
                break
            departure = Departure(item.index, item.line, item.event,
                                  [_describe_recorded(e, log.decoder) for e in recorded], [], 0,
                                  error=f"{type(err).__name__}: {err}")
            break
        events += 1
        outputs.extend((item.index, frame) for frame in client_frames(effects))
        if recorded is None:
            break
        mine = encoder.effects(effects)[1:]
        if _dumps(mine) != _dumps(recorded):
            position = next((i for i, (a, b) in enumerate(zip(mine, recorded, strict=False))
                             if _dumps(a) != _dumps(b)), min(len(mine), len(recorded)))
            departure = Departure(item.index, item.line, item.event,
                                  [_describe_recorded(e, log.decoder) for e in recorded],
                                  [_describe_replayed(e) for e in effects], position)
            break
    if departure is None:
        for _ in log.steps:  # read to the end: a malformed line later on is still an error
            pass
    return ReplayResult(log.path, events, departure, log.cut_short if departure is None else None, outputs,
                        log.meta)
