"""Read timeouts of ``fxsched serve``'s HTTP connections (specs/serve.md §12.11).

uvicorn closes a kept-alive connection that stays idle between requests (``timeout_keep_alive``),
but a request that has begun is read for as long as its client likes: a client that sends half a
header, or a body a byte a minute, holds its connection (and, many times over, the server's file
descriptors) for ever. ``ReadTimeoutProtocol`` is uvicorn's h11 protocol with nginx's two read
timeouts (``client_header_timeout``, ``client_body_timeout``) on top:

* a new connection must send a whole request head within ``read_timeout`` seconds of its opening,
  and a kept-alive one within ``read_timeout`` of the first byte of its next request;
* while a body is being read, each pause between two reads may last at most ``read_timeout``
  (the server's own pause, flow control while the app has not taken the bytes, does not count).

Past either, the connection is closed (a request whose head was read sees ``http.disconnect``,
which the front door takes as a client that went away). Between requests uvicorn's keep-alive
timeout applies; once a request has been read whole, nothing here limits its response (a long
stream is not a slow read). ``protocol_class(read_timeout)`` is the class to give uvicorn's
``Config(http=...)``.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

import h11
import structlog
from uvicorn.protocols.http.h11_impl import H11Protocol

log = structlog.get_logger("fxsched.serve.http")


class ReadTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with the read timeouts of the module docstring."""

    read_timeout: float = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_timer: Optional[asyncio.TimerHandle] = None

    def _arm(self) -> None:
        self._disarm()
        self._read_timer = self.loop.call_later(self.read_timeout, self._expired)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()  # the connection owes a request head

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and self._read_timer is None:
            self._arm()  # the first byte of a kept-alive connection's next request: its head is due
        elif self.conn.their_state is h11.SEND_BODY:
            self._arm()  # a body that moves: the pause starts again
        super().data_received(data)
        self._after_read()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # a pipelined request already begun in the buffer owes the rest of its head
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0] and self._read_timer is None:
            self._arm()

    def _after_read(self) -> None:
        state = self.conn.their_state
        if state is h11.SEND_BODY and self._read_timer is None:
            self._arm()
        elif state is not h11.IDLE and state is not h11.SEND_BODY:
            self._disarm()  # read whole (or the connection is over): the response is not a read

    def _expired(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        if self.flow.read_paused:  # the server is not reading: the client is not late
            self._arm()
            return
        phase = "body" if self.conn.their_state is h11.SEND_BODY else "head"
        client = "%s:%d" % self.client if self.client else "?"
        log.warning("request_read_timeout", client=client, phase=phase, timeout_s=self.read_timeout)
        self.transport.close()


def protocol_class(read_timeout: float) -> type[ReadTimeoutProtocol]:
    """``ReadTimeoutProtocol`` with ``read_timeout`` seconds."""
    return type("ReadTimeoutProtocol", (ReadTimeoutProtocol,), {"read_timeout": float(read_timeout)})
