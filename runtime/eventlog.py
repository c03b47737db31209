"""Event logs, recorded: every input the scheduler took and every device answer, written as the
run goes (``EventRecorder``, specs/event-log.md §9.1). The format and its codec are
``fxsched.runtime.eventlog_codec``; reading a log back is ``fxsched.runtime.eventlog_reader``, the
re-run of ``step`` over it without the model (§9.4) ``fxsched.runtime.eventlog_replay``.

Invariant: the recorder writes an event before ``step`` runs on it and flushes once the effects are
written: a killed process leaves every completed step, and an exception inside ``step`` (the
recorder closed as the run unwinds) also the event that caused it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any, Optional, Self, Sequence as Seq

from fxsched.core import events as ev
from fxsched.core.config import ModelInfo, SchedulerConfig
from fxsched.core.state import SchedulerState
from fxsched.runtime.eventlog_codec import _SEPARATORS, END, Encoder, EventLogError, _dumps, header
from fxsched.runtime.interpreter import Observer


class EventRecorder(Observer):
    """An ``Observer`` that writes the event log of a run to ``path`` (a new file, replacing any).

    ``before_step`` writes the event, ``stepped`` the effects record and flushes; ``close`` (also
    on leaving a ``with`` block; idempotent) writes the end record and closes the file. Called from
    the drive loop's thread only. A path that cannot be opened raises ``EventLogError``.
    """

    def __init__(self, path: str | Path, config: SchedulerConfig, model: ModelInfo, meta: Optional[dict] = None):
        self.path = Path(path)
        self.events = 0
        self.bytes = 0
        self._encoder = Encoder()
        try:
            self._fh: Optional[IO[str]] = open(self.path, "w", encoding="utf-8", newline="\n")
        except OSError as err:
            raise EventLogError(f"{path}: cannot write the event log ({err.strerror or err})") from None
        try:
            self._write(json.dumps(header(config, model, meta), separators=_SEPARATORS, ensure_ascii=False,
                                   default=str))
            self._flush()
        except BaseException:
            self.close()
            raise

    def _write(self, line: str) -> None:
        if self._fh is None:
            raise EventLogError(f"{self.path}: the event log is closed")
        self._fh.write(line + "\n")
        self.bytes += len(line.encode("utf-8")) + 1

    def _flush(self) -> None:
        if self._fh is not None:
            self._fh.flush()

    def _emit(self, record: list[Any]) -> None:
        for definition in self._encoder.pending:
            self._write(_dumps(definition))
        self._encoder.pending.clear()
        self._write(_dumps(record))

    def before_step(self, event: ev.Event) -> None:
        self._emit(self._encoder.record(event))
        self.events += 1

    def stepped(self, event: ev.Event, state: SchedulerState, effects: Seq) -> None:
        self._emit(self._encoder.effects(effects))
        self._flush()

    def close(self) -> None:
        """Write the end record and close the file; a second call does nothing."""
        fh, self._fh = self._fh, None
        if fh is None:
            return
        try:
            fh.write(_dumps([END, self.events]) + "\n")
        finally:
            fh.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

