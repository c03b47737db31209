"""Faulty EP workers for the tests: worker process entries whose message loop exits or stalls
after a number of messages (``EpCluster(..., entries={rank: faulty(ExitAfter(20))})``)."""

from __future__ import annotations

import functools
import os
import time
from typing import Callable

import attrs
import structlog

from fxsched.runtime.ep.worker import EpWorker, run_worker
from fxsched.runtime.ep.protocol import Message

log = structlog.get_logger("fxsched.ep")

EXIT_INJECTED = 17  # the exit code of a worker that ExitAfter stopped


@attrs.frozen
class ExitAfter:
    """Serve ``messages`` messages, then exit the process at once (a worker that dies mid-run)."""

    messages: int

    def __call__(self, worker: EpWorker, receive: Callable[[], Message]) -> None:
        while True:
            message = receive()
            if worker.messages >= self.messages:
                log.warning("ep_worker_injected_exit", rank=worker.rank, after=worker.messages)
                os._exit(EXIT_INJECTED)
            if not worker.handle(message):
                return


@attrs.frozen
class StallAfter:
    """Serve ``messages`` messages, then take no more and never answer (a hung worker)."""

    messages: int

    def __call__(self, worker: EpWorker, receive: Callable[[], Message]) -> None:
        while True:
            message = receive()
            if worker.messages >= self.messages:
                log.warning("ep_worker_injected_stall", rank=worker.rank, after=worker.messages)
                while True:
                    time.sleep(3600)
            if not worker.handle(message):
                return


def faulty(serve) -> Callable:
    """A worker process entry that runs ``serve`` as its message loop (picklable for spawn)."""
    return functools.partial(run_worker, serve=serve)
