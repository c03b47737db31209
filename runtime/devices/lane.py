"""The device lane: one thread that carries out device work in the order it is handed over, so
the host can step the scheduler and serve its clients while a forward runs (specs/async.md §16.5).

It is the CPU's stand-in for a CUDA stream: work is queued in order and runs in order; the host
waits only where it needs an answer. Torch releases the GIL inside its operators, so a forward on
the lane and Python on the host really run at once.

The lane keeps the clocks of the overlap figures: ``busy_s``, the time it spent on work;
``waited_s``, the time the host spent blocked on it; and ``hidden_s``, the host's working time that
ran while the lane worked: for each piece of work, the part of the host's interval from its launch
to the wait that took its result during which the work ran (work runs one piece at a time, so no
instant is counted twice).
"""

from __future__ import annotations

import contextlib
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from time import perf_counter
from typing import Any, Callable, ContextManager, Optional, Protocol


class Lane(Protocol):
    """What the interpreter needs of a lane (``DeviceLane``, ``DeferredLane``)."""

    def launch(self, work: Callable[..., Any], *args: Any) -> Any: ...  # a job to wait for

    def wait(self, future: Any) -> Any: ...

    def fence(self) -> None: ...

    def close(self) -> None: ...


class DeviceLane:
    """One worker thread; ``launch`` queues work, ``wait`` takes its result (re-raising what it
    raised), ``fence`` waits for everything queued. ``context`` (e.g. ``torch.no_grad``) is
    entered around each piece of work: thread-local modes do not cross threads by themselves."""

    def __init__(self, context: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
                 name: str = "fxsched-device") -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._context = context
        self._spans: dict[Future, list[float]] = {}  # work not yet waited for: launched, started, ended
        self.busy_s = 0.0
        self.waited_s = 0.0
        self.hidden_s = 0.0

    def launch(self, work: Callable[..., Any], *args: Any) -> Future:
        """Queue ``work(*args)`` after everything launched before it; its future."""
        span = [perf_counter(), 0.0, 0.0]  # launched, started, ended
        future = self._pool.submit(self._run, work, args, span)
        self._spans[future] = span
        return future

    def _run(self, work: Callable[..., Any], args: tuple[Any, ...], span: list[float]) -> Any:
        span[1] = perf_counter()
        try:
            with self._context():
                return work(*args)
        finally:
            span[2] = perf_counter()

    def wait(self, future: Future) -> Any:
        """The result of launched work (what it raised is raised here)."""
        start = perf_counter()
        try:
            return future.result()
        finally:
            self._account(future, start)

    def _account(self, future: Future, start: float) -> None:
        now = perf_counter()
        launched, began, ended = self._spans.pop(future, (start, start, start))
        self.waited_s += now - start
        self.busy_s += ended - began
        self.hidden_s += max(0.0, min(start, ended) - max(launched, began))

    def fence(self) -> None:
        """Wait until every piece of launched work has run (their errors stay with their futures)."""
        for future in list(self._spans):
            start = perf_counter()
            with contextlib.suppress(BaseException):
                future.result()
            self._account(future, start)

    def close(self) -> None:
        """Wait for queued work and stop the thread."""
        self._pool.shutdown(wait=True)


class _Job:
    """A piece of the deferred lane's work: its result or what it raised, once it has run (the
    lane and its host share one thread, so no lock: ``concurrent.futures.Future`` takes one per call)."""

    __slots__ = ("done", "result", "error")

    def __init__(self) -> None:
        self.done = False
        self.result: Any = None
        self.error: Optional[BaseException] = None


class DeferredLane:
    """The model checker's lane: work runs only when the host waits for it (or for later work), on
    the host's own thread, in the order launched. It is the slowest device the protocol allows:
    everything the host does between a launch and its wait happens before the work, and nothing
    depends on timing, so a seed replays the same run."""

    def __init__(self) -> None:
        self._queue: deque[tuple[_Job, Callable[..., Any], tuple[Any, ...]]] = deque()

    def launch(self, work: Callable[..., Any], *args: Any) -> _Job:
        job = _Job()
        self._queue.append((job, work, args))
        return job

    def _run_until(self, until: Optional[_Job]) -> None:
        queue = self._queue
        while queue and (until is None or not until.done):
            job, work, args = queue.popleft()
            try:
                job.result = work(*args)
            except BaseException as err:  # kept with its job, as a thread's would be with its future
                job.error = err
            job.done = True

    def wait(self, job: _Job) -> Any:
        if not job.done:
            self._run_until(job)
        if job.error is not None:
            raise job.error
        return job.result

    def fence(self) -> None:
        if self._queue:
            self._run_until(None)

    def close(self) -> None:
        self.fence()
