"""Faulty EP workers for the tests: worker process entries whose message loop exits or stalls
after a number of messages (``EpCluster(..., entries={rank: faulty(ExitAfter(20))})``)."""

from __future__ import annotations

import functools
import multiprocessing
import os
import time
from typing import Callable

import attrs
import pytest
import structlog
import torch.distributed as dist

from fxsched.runtime.ep.worker import EpWorker, run_worker
from fxsched.runtime.ep.protocol import Message

log = structlog.get_logger("fxsched.ep")

EXIT_INJECTED = 17  # the exit code of a worker that ExitAfter stopped


def _serve_then(messages: int, fault: Callable[[EpWorker], None]) -> Callable:
    """A message loop that serves ``messages`` messages, then runs ``fault`` on the next one."""

    def serve(worker: EpWorker, receive: Callable[[], Message]) -> None:
        while True:
            message = receive()
            if worker.messages >= messages:
                fault(worker)
            if not worker.handle(message):
                return

    return serve


@attrs.frozen
class ExitAfter:
    """Serve ``messages`` messages, then exit the process at once (a worker that dies mid-run)."""

    messages: int

    def __call__(self, worker: EpWorker, receive: Callable[[], Message]) -> None:
        def die(w: EpWorker) -> None:
            log.warning("ep_worker_injected_exit", rank=w.rank, after=w.messages)
            os._exit(EXIT_INJECTED)

        _serve_then(self.messages, die)(worker, receive)


@attrs.frozen
class StallAfter:
    """Serve ``messages`` messages, then take no more and never answer (a hung worker)."""

    messages: int

    def __call__(self, worker: EpWorker, receive: Callable[[], Message]) -> None:
        def hang(w: EpWorker) -> None:
            log.warning("ep_worker_injected_stall", rank=w.rank, after=w.messages)
            while True:
                time.sleep(3600)

        _serve_then(self.messages, hang)(worker, receive)


def faulty(serve) -> Callable:
    """A worker process entry that runs ``serve`` as its message loop (picklable for spawn)."""
    return functools.partial(run_worker, serve=serve)


@pytest.fixture(autouse=True)
def no_process_left():
    """After each test of a module that imports this fixture: no worker process is left (any found
    is killed, then the test fails) and no process group is still initialised."""
    yield
    left = multiprocessing.active_children()
    for p in left:
        p.kill()
        p.join(5)
    if dist.is_initialized():
        dist.destroy_process_group()
    assert left == [], f"processes left behind: {left}"
