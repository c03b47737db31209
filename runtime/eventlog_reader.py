"""Event logs, read back (specs/event-log.md §9.1–9.3): ``read_log`` checks the header and reads
the steps as they are iterated; ``is_event_log`` tells a log by its first bytes.

Bad files raise ``EventLogError`` (a ``ValueError``) naming the file, the line and the problem.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Iterator, Optional

from fxsched.core import events as ev
from fxsched.core.config import ModelInfo, SchedulerConfig
from fxsched.runtime.eventlog_codec import (DEFINE, EFFECTS, END, FORMAT, MAGIC, VERSION, Decoder, EventLogError,
                                            _Bad, _settings_from, _show)
from fxsched.runtime.files import open_binary


def is_event_log(path: str | Path) -> bool:
    """Whether the file at ``path`` begins as an event log does (False when it cannot be read)."""
    try:
        with open(path, "rb") as fh:
            return fh.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


@dataclass
class LogStep:
    """One recorded step: the event (index among the events, 0-based; its line) and the effects
    record that followed it (None when the log ends first)."""

    index: int
    line: int
    event: ev.Event
    effects: Optional[list[Any]] = None
    effects_line: int = 0


@dataclass
class EventLog:
    """A read log: the header's settings and meta, and its steps as they are read."""

    path: Path
    config: SchedulerConfig
    model: ModelInfo
    meta: dict
    decoder: Decoder
    steps: Iterator[LogStep]
    cut_short: Optional[str] = None  # why the log ends early (set once ``steps`` is exhausted)
    lines: int = 0


MAX_LINE_BYTES = 64 * 1024 * 1024  # the longest line read (a bound on memory, far above any real record)


def _lines(path: Path, fh: IO[bytes]) -> Iterator[tuple[int, Any, bool]]:
    """(line number, parsed record, complete) for each line; an unterminated last line is given as
    (number, None, False)."""
    number = 0
    while True:
        raw = fh.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        number += 1
        if len(raw) > MAX_LINE_BYTES:
            raise EventLogError(f"{path}: line {number}: longer than {MAX_LINE_BYTES >> 20} MiB, more than any "
                                f"event log line")
        if not raw.endswith(b"\n"):
            yield number, None, False
            return
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise EventLogError(f"{path}: line {number}: not UTF-8 text ({err.reason} at byte {err.start})") from None
        try:
            value = json.loads(text)
        except ValueError as err:  # JSONDecodeError, or a number too long to read
            raise EventLogError(f"{path}: line {number}: not valid JSON ({getattr(err, 'msg', err)})") from None
        except RecursionError:
            raise EventLogError(f"{path}: line {number}: nested too deeply") from None
        yield number, value, True


def read_log(path: str | Path) -> EventLog:
    """Open an event log and read its header; its steps are read as ``EventLog.steps`` is iterated
    (``EventLogError`` for a malformed line, raised when that line is reached)."""
    path = Path(path)
    fh = open_binary(path, "event log", EventLogError)
    try:
        lines = _lines(path, fh)
        first = next(lines, None)
        if first is None or not first[2]:
            raise EventLogError(f"{path}: line 1: the header is missing or cut short")
        head = first[1]
        if not isinstance(head, dict) or head.get("format") != FORMAT:
            raise EventLogError(f"{path}: line 1: not an fxsched event log (expected a header with format {FORMAT!r})")
        if head.get("version") != VERSION:
            raise EventLogError(f"{path}: line 1: event log version {_show(head.get('version'))} "
                                f"(this fxsched reads version {VERSION})")
        unknown = sorted(set(head) - {"format", "version", "config", "model", "meta"})
        if unknown:
            raise EventLogError(f"{path}: line 1: unknown header field {unknown[0]!r}")
        decoder = Decoder()
        meta = head.get("meta", {})
        if not isinstance(meta, dict):
            raise EventLogError(f"{path}: line 1: header field 'meta' expects an object, got {_show(meta)}")
        try:
            config = _settings_from(SchedulerConfig, head.get("config"), decoder, "config")
            model = _settings_from(ModelInfo, head.get("model"), decoder, "model")
        except _Bad as err:
            raise EventLogError(f"{path}: line 1: {err}") from None
    except BaseException:
        fh.close()
        raise
    log = EventLog(path, config, model, meta, decoder, iter(()))
    log.steps = _steps(log, lines, fh)
    return log


def _steps(log: EventLog, lines: Iterator[tuple[int, Any, bool]], fh: IO[bytes]) -> Iterator[LogStep]:
    path, decoder = log.path, log.decoder
    current: Optional[LogStep] = None
    index = 0
    ended = False
    try:
        for number, record, complete in lines:
            log.lines = number
            if not complete:
                log.cut_short = f"line {number} is incomplete (the run was cut short mid-record)"
                break
            if ended:
                raise EventLogError(f"{path}: line {number}: a record after the end record")
            try:
                if not isinstance(record, list) or not record or not isinstance(record[0], str):
                    raise _Bad(f"expected a record [tag, ...], got {_show(record)}")
                kind = record[0]
                if kind == DEFINE:
                    decoder.define(record)
                elif kind == EFFECTS:
                    if current is None or current.effects is not None:
                        raise _Bad("an effects record without its event")
                    current.effects, current.effects_line = record[1:], number
                    yield current
                elif kind == END:
                    if len(record) != 2 or record[1] != index:
                        raise _Bad(f"the end record {_show(record)} does not count the {index} events of the log")
                    if current is not None and current.effects is None:
                        yield current
                    current, ended = None, True
                else:
                    if current is not None and current.effects is None:
                        raise _Bad(f"an event where the effects of the event on line {current.line} belong")
                    definition = decoder.definition(kind)
                    if not issubclass(definition.cls, ev.Event):
                        raise _Bad(f"tag {kind!r} names {definition.cls.__name__}, not an event")
                    current = LogStep(index, number, decoder.build(kind, record[1:]))
                    index += 1
            except _Bad as err:
                raise EventLogError(f"{path}: line {number}: {err}") from None
        else:
            if not ended and log.lines >= 1:
                log.cut_short = "the log has no end record (the run was cut short, or is still running)"
        if current is not None and current.effects is None and not ended:
            yield current
    finally:
        fh.close()

