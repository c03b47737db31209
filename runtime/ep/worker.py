"""The EP worker: ranks >= 1 take the leader's stream, mirror every slot, and either (given a
model replica, for a model without experts) run the same forwards, or (given an expert server,
for a sharded MoE model) hold their share of the experts and compute it in every MoE layer call.

``EpWorker.handle`` takes one message at a time: the parser makes commands, the mirror applies
them and hands the slot operations to the replica. Control messages: TICK compares the mirror's
digest with the leader's (and the replica's tokens with the mirror); SYNC posts ``ok`` or the
first error; the shutdown word posts the final report (``report()``, JSON) and stops. After an
error the worker keeps taking messages (the leader must never block on it) but applies no more.
An EXPERTS message (the data plane, runtime/ep/experts.py) is no command: it is not counted, and
the expert server takes part in the layer call's collectives even after an error (with zeros).

``run_worker`` is the process entry (the ``torch.multiprocessing`` target, see run.py).
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from typing import Any, Callable, Optional, Protocol

import attrs
import structlog

from fxsched.runtime.ep.mirror import EpMirror, MirrorError, Snapshot, SlotOp
from fxsched.runtime.ep.protocol import CommandParser, Kind, Message, ProtocolError, Shutdown, Sync, Tick

log = structlog.get_logger("fxsched.ep")

EXIT_LINK_LOST = 3  # the leader went away or stopped sending for longer than the idle timeout


class Replica(Protocol):
    """A model copy driven by slot operations."""

    def run(self, ops: list[SlotOp]) -> None: ...
    def check(self, snapshot: Snapshot) -> None: ...
    def stats(self) -> dict: ...


class Experts(Protocol):
    """A worker's expert shard serving the leader's MoE layer calls (experts.ExpertServer)."""

    def serve(self, message: Message) -> Optional[str]: ...
    def stats(self) -> dict: ...


class EpWorker:
    def __init__(self, rank: int, post: Callable[[str, bytes], None], replica: Optional[Replica] = None,
                 experts: Optional[Experts] = None):
        self.rank = rank
        self.post = post
        self.replica = replica
        self.experts = experts
        self.parser = CommandParser()
        self.mirror = EpMirror()
        self.ticks: list[tuple[int, Snapshot]] = []
        self.error: Optional[str] = None
        self.messages = 0
        self.stopped = False

    def handle(self, message: Message) -> bool:
        """Take one message; False once the shutdown word has come."""
        if message.kind == Kind.EXPERTS:
            if self.experts is None:  # cannot take part in the collectives that follow
                raise ProtocolError(f"rank {self.rank}: an expert call, but this worker holds no experts")
            error = self.experts.serve(message)
            if error is not None:
                self._fail(error)
            return True
        self.messages += 1
        if message.number != self.messages and self.error is None:
            self._fail(f"message {message.number} arrived as number {self.messages}")
        try:
            command = self.parser.feed(message)
        except ProtocolError as err:
            self._fail(str(err))
            return True
        match command:
            case None:
                pass
            case Sync(number=n):
                self.post(f"sync/{n}", b"ok" if self.error is None else self.error.encode())
            case Tick():
                self._tick(command)
            case Shutdown():
                self.post("final", json.dumps(self.report()).encode())
                self.stopped = True
                return False
            case _ if self.error is None:
                try:
                    ops = self.mirror.apply(command)
                    if self.replica is not None:
                        self.replica.run(ops)
                except (MirrorError, ProtocolError) as err:
                    self._fail(str(err))
                except Exception as err:  # noqa: BLE001 — a replica fault is reported, never fatal here
                    self._fail(f"replica: {type(err).__name__}: {err}")
        return True

    def _tick(self, tick: Tick) -> None:
        snapshot = self.mirror.snapshot()
        self.ticks.append((tick.tick, snapshot))
        if self.error is not None:
            return
        if self.mirror.digest() != tick.digest:
            self._fail(f"mirror differs from the leader's at tick {tick.tick}")
            return
        if self.replica is not None:
            try:
                self.replica.check(snapshot)
            except Exception as err:  # noqa: BLE001
                self._fail(f"replica at tick {tick.tick}: {err}")

    def _fail(self, message: str) -> None:
        if self.error is None:
            self.error = message
            log.error("ep_worker_error", rank=self.rank, message=message)

    def report(self) -> dict:
        """What the worker saw: per-tick snapshots, counts, the first error."""
        return {
            "rank": self.rank,
            "messages": self.messages,
            "ticks": [[tick, [[slot, list(toks)] for slot, toks in snap]] for tick, snap in self.ticks],
            "final": [[slot, list(toks)] for slot, toks in self.mirror.snapshot()],
            "replica": self.replica.stats() if self.replica is not None else None,
            "experts": self.experts.stats() if self.experts is not None else None,
            "error": self.error,
        }


def snapshot_from_json(raw) -> Snapshot:
    return tuple((slot, tuple(toks)) for slot, toks in raw)


# --- the worker process ---------------------------------------------------------------------------


@attrs.frozen
class WorkerOptions:
    """How a worker process runs. ``replica`` builds its model copy, ``experts(rank, world)`` its
    expert server (both picklable; neither: mirror only)."""

    backend: str = "gloo"
    startup_timeout_s: float = 60.0
    idle_timeout_s: float = 600.0
    replica: Optional[Callable[[], Replica]] = None
    experts: Optional[Callable[[int, int], Any]] = None


DEFAULT_OPTIONS = WorkerOptions()  # frozen, so one instance serves every default


def comm_device(backend: str, rank: int) -> str:
    """Where the message tensors live: CPU for gloo, the rank's GPU for NCCL."""
    if backend != "nccl":
        return "cpu"
    import torch

    index = rank % max(torch.cuda.device_count(), 1)
    torch.cuda.set_device(index)
    return f"cuda:{index}"


Serve = Callable[[EpWorker, Callable[[], Message]], None]


def serve(worker: EpWorker, receive: Callable[[], Message]) -> None:
    """Take messages until the shutdown word."""
    while worker.handle(receive()):
        pass


def run_worker(rank: int, world_size: int, host: str, port: int, options: WorkerOptions = DEFAULT_OPTIONS,
               serve: Serve = serve) -> None:
    """Process entry of worker ``rank``: join the group through the leader's store, build the
    replica or load the expert shard (posting ``ep/weights/<rank>``: the shard's report, or the
    loading error), ``serve`` the stream, leave. Exits 0 after the shutdown word,
    ``EXIT_LINK_LOST`` when the leader is gone. Ctrl-C is the leader's to handle (it tears the
    workers down): SIGINT is ignored here."""
    import signal

    import torch.distributed as dist

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from fxsched.runtime.ep.link import TorchWorkerLink, ready_key
    from fxsched.runtime.logs import ensure_configured

    ensure_configured()
    startup = timedelta(seconds=options.startup_timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=False, timeout=startup)
    store.set(ready_key(rank), "1")
    dist.init_process_group(options.backend, store=dist.PrefixStore("ep/pg", store), rank=rank,
                            world_size=world_size, timeout=startup)
    code = 0
    try:
        group = dist.new_group(backend=options.backend, timeout=timedelta(seconds=options.idle_timeout_s))
        replica = options.replica() if options.replica is not None else None
        device = comm_device(options.backend, rank)
        link = TorchWorkerLink(group, store, rank, device)
        experts = _load_experts(options, rank, world_size, link.post)
        if experts is not None:
            experts.attach(group, device)
        worker = EpWorker(rank, link.post, replica, experts)
        try:
            serve(worker, link.receive)
        except RuntimeError as err:
            log.info("ep_worker_link_lost", rank=rank, error=str(err).splitlines()[0] if str(err) else "")
            code = EXIT_LINK_LOST
    finally:
        dist.destroy_process_group()
    if code:
        sys.exit(code)


def _load_experts(options: WorkerOptions, rank: int, world_size: int, post: Callable[[str, bytes], None]):
    """The worker's expert server (None without ``options.experts``); its weights report, or the
    error that stopped the loading, is posted for the leader either way."""
    if options.experts is None:
        return None
    try:
        experts = options.experts(rank, world_size)
    except Exception as err:  # noqa: BLE001 -- the leader names it and stops the cluster
        message = " ".join(f"{type(err).__name__}: {err}".split())
        log.error("ep_worker_experts_failed", rank=rank, error=message)
        post("weights", json.dumps({"rank": rank, "error": message}).encode())
        return None
    post("weights", json.dumps(experts.weights_report()).encode())
    return experts
