"""Logging setup: structlog events on stderr, key=value lines or JSON (``--log-format json``), quiet
unless asked (``-v``)."""

from __future__ import annotations

import logging
import sys
from typing import Any, Optional, TextIO, cast

import structlog


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is at the time of writing (it may be replaced later)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


LOG_FORMATS = ("text", "json")
_format = "text"


def configure_logging(verbose: bool = False, fmt: Optional[str] = None, level: Optional[int] = None) -> None:
    """Send structlog events to stderr: INFO and up with ``verbose``, else WARNING and up (``level``
    sets another). ``fmt``: ``text`` (key=value lines) or ``json`` (one JSON object per line,
    structlog's JSONRenderer); None keeps the format of the last call (text at first)."""
    global _format
    if fmt is not None:
        if fmt not in LOG_FORMATS:
            raise ValueError(f"log format {fmt!r}: choose from {', '.join(LOG_FORMATS)}")
        _format = fmt
    if level is None:
        level = logging.INFO if verbose else logging.WARNING
    renderer: Any = (structlog.processors.JSONRenderer() if _format == "json"
                     else structlog.dev.ConsoleRenderer(colors=False))
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        # structlog only writes and flushes its file, which is all _CurrentStderr offers
        logger_factory=structlog.PrintLoggerFactory(file=cast(TextIO, _CurrentStderr())),
        cache_logger_on_first_use=False,
    )


def ensure_configured() -> None:
    """Library default: quiet, on stderr, unless the application configured structlog itself."""
    if not structlog.is_configured():
        configure_logging(False)
