"""Running with expert-parallel ranks: the cluster of worker processes, and scenario runs whose
recording device is wrapped in ``EpLeaderDevice``.

``EpCluster`` (a context manager) starts ``ep_ranks - 1`` workers with torch.multiprocessing,
rendezvous on a loopback ``TCPStore`` with a free port, and sets up the EP group (the default
process group for start-up, then an EP group whose collective timeout is the leader's
``timeout_s``). On exit it never leaves a process behind: workers that acknowledged the shutdown
are joined, the others terminated, then killed.

Start method: a forkserver where the platform has one (``_context``): it is started once per
leader process, imports torch and the model code (``PRELOAD``) without running anything, and forks
every worker of every later cluster from that state, so a worker starts in a fraction of a second
instead of importing torch afresh (1-2 s each); it ends with the leader process, or earlier when
the command that ran the clusters calls ``stop_launcher`` (the CLI does, before it returns).
Elsewhere, spawn.
Either way a worker is a fresh process that never shares the leader's threads or CUDA context.

Ctrl-C: the workers are born ignoring SIGINT (``_sigint_ignored`` around their start: the
forkserver, started inside it, and its children keep the ignored signal, as a spawned interpreter
does; ``run_worker`` ignores it again), so a terminal's Ctrl-C, which reaches the
whole process group, interrupts the leader alone. Leaving the cluster on a ``KeyboardInterrupt``
sends nothing more (a message may have been cut in half) and terminates the workers at once,
which end quietly.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Optional

import attrs
import structlog

from fxsched.runtime.ep import DEFAULT_TIMEOUT_S
from fxsched.runtime.ep.leader import EpLeaderDevice
from fxsched.runtime.ep.link import LinkError, LoopbackLink, TorchLeaderLink, await_key, ready_key
from fxsched.runtime.ep.mirror import Snapshot
from fxsched.runtime.ep.worker import (
    DEFAULT_OPTIONS,
    EpWorker,
    Replica,
    WorkerOptions,
    comm_device,
    run_worker,
    snapshot_from_json,
)
from fxsched.runtime.interpreter import RunError
from fxsched.runtime.devices.recording import RecordingDevice
from fxsched.runtime.scenarios.runner import RunResult, execute_scenario
from fxsched.runtime.scenarios.loader import Scenario, load_scenario

log = structlog.get_logger("fxsched.ep")

JOIN_S = 10.0  # how long a worker that acknowledged the shutdown may take to exit
TERM_S = 0.5  # how long a terminated worker may take to exit before it is killed (a stopped one never does)


class EpRunError(RunError):
    """The EP group failed during a run; ``trace`` is what the leader recorded (requests in
    flight end with the group's error); ``result`` what a ``generate`` run that still finished
    produced (each request's tokens so far, the failed ones with the group's error)."""

    def __init__(self, message: str, trace: Optional[str] = None, result: Any = None):
        super().__init__(message)
        self.trace = trace
        self.result = result


WorkerEntry = Callable[[int, int, str, int, WorkerOptions], None]


@contextlib.contextmanager
def _sigint_ignored():
    """SIGINT ignored while processes are started (they inherit it; see the module docstring)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


# Modules a forkserver imports once, so that each worker it forks starts without importing them.
PRELOAD = ("torch", "torch.distributed", "fxsched.runtime.ep.worker", "fxsched.runtime.ep.experts",
           "fxsched.runtime.ep.replica", "fxsched.runtime.torch_model")


def stop_launcher() -> None:
    """End this process's forkserver (the workers' launcher) and the resource tracker it started
    now, rather than when the process exits: a command calls it once its clusters are done, so no
    EP process outlives its return. A later cluster starts new ones."""
    from multiprocessing import forkserver, resource_tracker

    for server, running in ((getattr(forkserver, "_forkserver", None), "_forkserver_pid"),
                            (getattr(resource_tracker, "_resource_tracker", None), "_pid")):
        stop = getattr(server, "_stop", None)  # CPython's own way to stop them (its tests use it)
        if stop is None or getattr(server, running, None) is None:
            continue
        try:
            stop()
        except OSError as err:
            log.warning("ep_launcher_stop_failed", error=str(err))


def _context(mp: Any) -> Any:
    """The start method of the workers: a forkserver (it imports torch and the model code once per
    leader process and runs nothing, so it forks each worker without a CUDA context or a busy
    thread pool), else spawn."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


class EpCluster:
    """Rank 0 in this process, ranks 1.. in worker processes. Each worker process runs
    ``entries.get(rank, run_worker)(rank, world_size, host, port, options)``; an entry must be
    picklable (it is sent to the forkserver, or to a spawned process)."""

    def __init__(self, ep_ranks: int, timeout_s: float = DEFAULT_TIMEOUT_S,
                 options: WorkerOptions = DEFAULT_OPTIONS, entries: Optional[dict[int, WorkerEntry]] = None):
        if ep_ranks < 2:
            raise ValueError(f"--ep-ranks {ep_ranks}: an EP cluster needs at least 2 ranks")
        self.world_size = ep_ranks
        self.timeout_s = timeout_s
        self.options = options
        self.entries = entries or {}
        self.processes: list = []
        self.store: Any = None  # the rendezvous torch.distributed.TCPStore, once started
        self.link: Optional[TorchLeaderLink] = None
        self.leader: Optional[EpLeaderDevice] = None

    def __enter__(self) -> "EpCluster":
        try:
            self._start()
        except BaseException as err:
            self.close(abort=isinstance(err, KeyboardInterrupt))
            raise
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(abort=exc_type is not None and issubclass(exc_type, KeyboardInterrupt))

    def exitcode(self, rank: int) -> Optional[int]:
        return self.processes[rank - 1].exitcode

    def exitcodes(self) -> dict[int, Optional[int]]:
        return {rank: p.exitcode for rank, p in enumerate(self.processes, 1)}

    def _start(self) -> None:
        import torch.distributed as dist
        import torch.multiprocessing as mp

        if dist.is_initialized():
            raise RunError("EP: this process already has a default torch.distributed process group")
        startup = timedelta(seconds=self.options.startup_timeout_s)
        self.store = dist.TCPStore("127.0.0.1", 0, self.world_size, is_master=True, timeout=startup,
                                   wait_for_workers=False)
        ctx = _context(mp)
        for rank in range(1, self.world_size):
            entry = self.entries.get(rank, run_worker)
            p = ctx.Process(target=entry, args=(rank, self.world_size, "127.0.0.1", self.store.port, self.options),
                            name=f"fxsched-ep-worker-{rank}", daemon=True)
            with _sigint_ignored():
                p.start()
            self.processes.append(p)
        self._await_ready()
        dist.init_process_group(self.options.backend, store=dist.PrefixStore("ep/pg", self.store), rank=0,
                                world_size=self.world_size, timeout=startup)
        group = dist.new_group(backend=self.options.backend, timeout=timedelta(seconds=self.timeout_s))
        self.link = TorchLeaderLink(group, self.store, self.world_size, self.timeout_s,
                                    comm_device(self.options.backend, 0), self.exitcode)
        log.info("ep_cluster_up", ranks=self.world_size, port=self.store.port)

    def _await_ready(self) -> None:
        """Every worker reached the store (a worker that dies on the way is named at once)."""
        deadline = time.monotonic() + self.options.startup_timeout_s
        for rank in range(1, self.world_size):
            if not await_key(self.store, ready_key(rank), deadline, functools.partial(self.exitcode, rank)):
                code = self.exitcode(rank)
                if code is not None:
                    raise RunError(f"EP worker {rank} exited with code {code} while starting")
                raise RunError(f"EP worker {rank} did not start within {self.options.startup_timeout_s:g}s")

    def wrap(self, inner) -> EpLeaderDevice:
        """``inner`` as rank 0 of this cluster (which must be up: entered as a context manager)."""
        if self.link is None:
            raise RunError("EP: the cluster is not up (enter it with `with EpCluster(...)`)")
        self.leader = EpLeaderDevice(inner, self.link, self.timeout_s)
        return self.leader

    def close(self, abort: bool = False) -> None:
        """Stop the workers (shutdown word if the run did not send it), then reap every process.
        ``abort`` (Ctrl-C): send nothing, terminate the workers at once."""
        import torch.distributed as dist

        if self.leader is not None and not abort:
            try:
                self.leader.stop_workers()
            except Exception as err:  # noqa: BLE001 — closing must go on
                log.warning("ep_stop_workers_failed", error=str(err))
        clean = self.leader is not None and self.leader.shut_down and self.leader.failure is None
        deadline = time.monotonic() + (JOIN_S if clean else 0.0 if abort else 0.5)
        for p in self.processes:
            p.join(max(deadline - time.monotonic(), 0.01))
        for p in self.processes:
            if p.is_alive():
                # expected after Ctrl-C or a failed group (whose error the caller reports)
                (log.warning if clean else log.info)("ep_worker_terminated", name=p.name, pid=p.pid)
                p.terminate()
                p.join(TERM_S)
            if p.is_alive():
                p.kill()
                p.join(2.0)
        if dist.is_initialized():
            dist.destroy_process_group()
        self.store = None


# --- scenario runs ---------------------------------------------------------------------------------


def execute_with(scenario: Scenario, wrap: Callable[[RecordingDevice], object]) -> RunResult:
    """``runner.execute_scenario`` with the recording device wrapped."""
    return execute_scenario(scenario, wrap_device=wrap)


@attrs.frozen
class EpRunResult:
    """A finished EP run: the trace, the leader's mirror at every tick, the workers' reports."""

    trace: str
    leader_ticks: list
    worker_reports: dict
    exitcodes: dict = attrs.field(factory=dict)  # rank -> exit code, once the cluster is closed

    def worker_ticks(self, rank: int) -> list[tuple[int, Snapshot]]:
        return [(tick, snapshot_from_json(snap)) for tick, snap in self.worker_reports[rank]["ticks"]]


def _scenario(name_or_scenario) -> Scenario:
    return name_or_scenario if isinstance(name_or_scenario, Scenario) else load_scenario(name_or_scenario)


def run_on_cluster(name_or_scenario, cluster: EpCluster) -> EpRunResult:
    """Run a scenario with its recording device as rank 0 of ``cluster`` (which must be up)."""
    return _run_wrapped(_scenario(name_or_scenario), cluster.wrap)


def _run_wrapped(scenario: Scenario, make_leader: Callable[[RecordingDevice], EpLeaderDevice]) -> EpRunResult:
    """Run ``scenario`` with its recording device wrapped by ``make_leader``; an EP failure raises
    EpRunError with the leader's message (and the trace when the run itself finished)."""
    leaders: list[EpLeaderDevice] = []

    def wrap(device: RecordingDevice) -> EpLeaderDevice:
        leaders.append(make_leader(device))
        return leaders[-1]

    try:
        result = execute_with(scenario, wrap)
        leaders[0].stop_workers()  # a no-op after the scenario's own EpShutdown
    except RunError as err:
        failure = leaders[0].failure if leaders else None
        if failure is not None and not isinstance(err, EpRunError):
            raise EpRunError(str(err) if failure in str(err) else f"{err} (EP: {failure})") from err
        raise
    leader = leaders[0]
    trace = result.trace()
    if leader.failure is not None:
        raise EpRunError(leader.failure, trace)
    return EpRunResult(trace, list(leader.tick_snapshots), dict(leader.worker_reports))


def execute_scenario_ep(name_or_scenario, ep_ranks: int, timeout_s: float = DEFAULT_TIMEOUT_S,
                        options: WorkerOptions = DEFAULT_OPTIONS) -> EpRunResult:
    """Run a scenario with rank 0 here and ``ep_ranks - 1`` worker processes. Raises EpRunError
    (a RunError) if the group fails; never waits longer than ``timeout_s`` on a worker."""
    scenario = _scenario(name_or_scenario)
    if ep_ranks == 1:
        from fxsched.runtime.scenarios.runner import execute_scenario

        return EpRunResult(execute_scenario(scenario).trace(), [], {})
    with EpCluster(ep_ranks, timeout_s, options) as cluster:
        result = _run_wrapped(scenario, cluster.wrap)
    return attrs.evolve(result, exitcodes=cluster.exitcodes())


def run_scenario_ep(name_or_scenario, ep_ranks: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
    """The trace of a scenario run with ``ep_ranks`` EP ranks (equal to the single-rank trace)."""
    return execute_scenario_ep(name_or_scenario, ep_ranks, timeout_s).trace


def execute_scenario_loopback(name_or_scenario, workers: int = 1, replica: Optional[Callable[[], Replica]] = None,
                              timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[EpRunResult, list[EpWorker]]:
    """The same run with in-process workers (no torch.distributed): tests of the protocol."""
    link = LoopbackLink(lambda lk: [EpWorker(r, lk.poster(r), replica() if replica else None)
                                    for r in range(1, workers + 1)])
    result = _run_wrapped(_scenario(name_or_scenario), lambda device: EpLeaderDevice(device, link, timeout_s))
    return result, link.workers


__all__ = ["EpCluster", "EpRunError", "EpRunResult", "LinkError", "execute_scenario_ep", "execute_scenario_loopback",
           "execute_with", "run_on_cluster", "run_scenario_ep"]
