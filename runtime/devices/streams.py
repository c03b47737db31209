"""Streams and events of the torch runtime, named by small integers as the scheduler names them.

Stream 0 is the device's default (decode) stream; ``create_stream`` hands out 1, 2, ...;
``create_event`` hands out 2, 3, ... (event ids start at 2, as on the recording device).

On CUDA the objects are real ``torch.cuda.Stream`` / ``torch.cuda.Event``: recording, waiting and
synchronizing do what the CUDA calls do, and ``synchronize`` (the scheduler's Quiesce) blocks the
host until the stream's work is done. On any other device the shim classes below keep the same
interface; CPU torch ops complete before they return, so there is never outstanding work and a
wait returns at once (the shim still checks that ids exist and that an event was recorded before
it is waited on, so misuse is caught on CPU too).

Invariant: every id the scheduler holds names exactly one stream or event of this set; an unknown
id raises ``StreamError``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Protocol, Union, cast

import torch


class StreamError(RuntimeError):
    """An unknown stream or event id, or an event waited on before it was ever recorded."""


class CpuEvent:
    """Shim of ``torch.cuda.Event`` for synchronous devices."""

    def __init__(self) -> None:
        self.recorded = False

    def record(self, stream: Optional["CpuStream"] = None) -> None:
        self.recorded = True

    def wait(self, stream: Optional["CpuStream"] = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class CpuStream:
    """Shim of ``torch.cuda.Stream`` for synchronous devices: all work is already complete."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.waited: list[CpuEvent] = []

    def wait_event(self, event: CpuEvent) -> None:
        self.waited.append(event)
        del self.waited[:-16]  # keep a short history for debugging only

    def wait_stream(self, stream: "CpuStream") -> None:
        pass

    def record_event(self, event: Optional[CpuEvent] = None) -> CpuEvent:
        event = event or CpuEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class AnyStream(Protocol):
    """What a set uses of a stream: ``torch.cuda.Stream`` on CUDA, ``CpuStream`` elsewhere (a set
    never mixes the two, so an event or stream passed in is always of the same kind)."""

    def wait_event(self, event: Any) -> None: ...
    def wait_stream(self, stream: Any) -> None: ...
    def synchronize(self) -> None: ...


class AnyEvent(Protocol):
    """What a set uses of an event: ``torch.cuda.Event`` on CUDA, ``CpuEvent`` elsewhere."""

    def record(self, stream: Any = None) -> None: ...


class StreamSet:
    """The streams and events of one device, by id."""

    def __init__(self, device: Union[str, torch.device]) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            self._streams: dict[int, AnyStream] = {0: torch.cuda.default_stream(self.device)}
        else:
            self._streams = {0: CpuStream(0)}
        self._events: dict[int, AnyEvent] = {}
        self._recorded: set[int] = set()
        self._next_stream = 1
        self._next_event = 2

    # --- creation ------------------------------------------------------------------------------

    def create_stream(self) -> int:
        sid = self._next_stream
        self._next_stream += 1
        self._streams[sid] = torch.cuda.Stream(self.device) if self.cuda else CpuStream(sid)
        return sid

    def create_event(self) -> int:
        eid = self._next_event
        self._next_event += 1
        self._events[eid] = torch.cuda.Event() if self.cuda else CpuEvent()
        return eid

    # --- lookup --------------------------------------------------------------------------------

    def stream(self, sid: int) -> AnyStream:
        try:
            return self._streams[sid]
        except KeyError:
            raise StreamError(f"unknown stream {sid} (known: {sorted(self._streams)})") from None

    def event(self, eid: int) -> AnyEvent:
        try:
            return self._events[eid]
        except KeyError:
            raise StreamError(f"unknown event {eid} (known: {sorted(self._events)})") from None

    @property
    def secondary(self) -> list[int]:
        """Ids of every stream but the default one."""
        return sorted(s for s in self._streams if s != 0)

    # --- operations ----------------------------------------------------------------------------

    def record_event(self, eid: int, sid: int) -> None:
        """The event completes when the stream's work queued so far is done."""
        event, stream = self.event(eid), self.stream(sid)
        event.record(stream)
        self._recorded.add(eid)

    def stream_wait_event(self, sid: int, eid: int) -> None:
        """Work queued on the stream from now on waits for the event."""
        stream, event = self.stream(sid), self.event(eid)
        if eid not in self._recorded:
            raise StreamError(f"stream {sid} waits on event {eid}, which was never recorded")
        stream.wait_event(event)

    def synchronize(self, sid: int) -> None:
        """Block the host until the stream's queued work is done (the scheduler's Quiesce)."""
        self.stream(sid).synchronize()

    def sync_secondary(self) -> None:
        """Order the default stream's next work after every secondary stream's queued work (the
        scheduler's wait before a verify). A device-side wait, not the host's: the host reads only
        what the default stream produced, which now comes after the secondary streams' work, so
        blocking the host here would add a synchronisation to every speculative tick for nothing
        (specs/async.md §16.2)."""
        default = self._streams[0]
        for sid in self.secondary:
            default.wait_stream(self._streams[sid])

    def synchronize_all(self) -> None:
        for sid in sorted(self._streams):
            self._streams[sid].synchronize()
        if self.cuda:
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def use(self, sid: int) -> Iterator[None]:
        """Run the body's kernels on stream ``sid``, ordered after the default stream's work and
        before anything the default stream does next (safe for tensors shared between them)."""
        stream = self.stream(sid)
        if not self.cuda or sid == 0:
            yield
            return
        default = self._streams[0]
        stream.wait_stream(default)
        with torch.cuda.stream(cast(torch.cuda.Stream, stream)):  # a CUDA set holds CUDA streams
            yield
        default.wait_stream(stream)
