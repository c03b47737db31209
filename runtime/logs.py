"""Logging setup: structlog key-value events on stderr, quiet unless asked (``-v``)."""

from __future__ import annotations

import logging
import sys
from typing import TextIO, cast

import structlog


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is at the time of writing (it may be replaced later)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(verbose: bool = False) -> None:
    """Send structlog events to stderr: INFO and up with ``verbose``, else WARNING and up."""
    level = logging.INFO if verbose else logging.WARNING
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.dev.ConsoleRenderer(colors=False),
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
