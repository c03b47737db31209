"""One log record per finished request (specs/serve.md §12.10).

``RequestRecord`` watches a request's choice events as the engine thread hands them to the
request's sink (runtime/serve/app.py ``_submit``): the time of the first token, each choice's final
event. When the last choice has its final event, the record is written once, from the event loop
(never on the engine thread), as the structlog event ``request_finished``:

``request_id`` (the response's ``id``), ``model``, ``prompt_tokens``, ``output_tokens`` (all
choices), ``cached_tokens`` (prefix-cache hits, as the usage reports them), ``ttft_s`` (submit to
the first token, any choice; null when none came), ``latency_s`` (submit to the last final event),
``finish_reason`` (of each choice, comma-separated when they differ), ``n`` (choices) and, with
MTP or DFlash speculation, ``accepted_tokens`` (drafted tokens the target accepted, all choices), which
the engine reports on a final event (``ChoiceEvent.accepted_tokens``; n-gram drafts never count into a
sequence's ``acc``, core/ngram.py, so under n-gram the field is absent). A failed choice adds ``error``.

The record is at INFO: shown with ``-v`` or ``--enable-log-requests``, never with
``--disable-log-requests``; ``--log-format json`` renders it as one JSON object per line.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

import structlog

log = structlog.get_logger("fxsched.serve.requests")


class RequestRecord:
    """The record of one request (see the module docstring); ``watch`` is called on the engine
    thread with each of its choice events."""

    def __init__(self, request_id: str, model: str, prompt_tokens: int, choices: int,
                 loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.loop = loop
        self.start = time.perf_counter()
        self.first: Optional[float] = None
        self.finals: list[Any] = [None] * choices
        self.left = choices

    def watch(self, event: Any) -> None:
        if event.tokens and self.first is None:
            self.first = time.perf_counter()
        if not event.final or self.finals[event.index] is not None:
            return
        self.finals[event.index] = event
        self.left -= 1
        if self.left == 0:
            end = time.perf_counter()
            try:
                self.loop.call_soon_threadsafe(self.emit, end)
            except RuntimeError:  # the loop is closed: the server has stopped
                pass

    def fields(self, end: float) -> dict[str, Any]:
        finals = [f for f in self.finals if f is not None]
        reasons = [str(f.finish_reason) for f in finals]
        out: dict[str, Any] = {
            "request_id": self.request_id,
            "model": self.model,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": sum(f.completion_tokens for f in finals),
            "cached_tokens": max((f.cached_tokens for f in finals), default=0),
            "ttft_s": round(self.first - self.start, 6) if self.first is not None else None,
            "latency_s": round(end - self.start, 6),
            "finish_reason": reasons[0] if len(set(reasons)) == 1 else ",".join(reasons),
            "n": len(self.finals),
        }
        accepted = [getattr(f, "accepted_tokens", None) for f in finals]
        if any(a is not None for a in accepted):
            out["accepted_tokens"] = sum(a or 0 for a in accepted)
        errors = [f.error for f in finals if f.error is not None]
        if errors:
            out["error"] = errors[0]
        return out

    def emit(self, end: float) -> None:
        log.info("request_finished", **self.fields(end))
