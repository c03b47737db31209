"""Links between the EP leader (rank 0) and its workers: the message broadcast and the ack path.

Two implementations of one pair of interfaces:

* ``TorchLeaderLink`` / ``TorchWorkerLink``: messages go out with ``dist.broadcast`` from rank 0
  on an EP process group (gloo on CPU, NCCL on GPU; the header is a fixed-size int64 tensor, a
  long payload a second one of announced length). Acks and reports come back through the
  rendezvous ``TCPStore``: a worker *posts* ``ep/<key>/<rank>``; the leader waits for every
  rank's key with a deadline, watching the worker processes when it can.
* ``LoopbackLink``: in-process workers called directly (tests of the protocol, no processes).

A broadcast that fails, or an ack that does not come before the deadline, raises ``LinkError``
naming the worker(s) concerned; the leader never waits longer than its timeout. A worker whose
process has ended is reported as dead with its exit code (``EP worker 1 died (its process exited
with code 3)``), not as a timeout: the leader saw it end and did not wait.
"""

from __future__ import annotations

import functools
import time
from typing import Callable, Optional, Protocol

import structlog

from fxsched.runtime.ep.protocol import HEADER_LEN, Message, decode_header, encode

log = structlog.get_logger("fxsched.ep")

POLL_S = 0.01  # the longest pause between two looks at the store while waiting for an answer
# A collective that fails because a peer's sockets closed may report before that process can be
# reaped: the leader looks this long for an ended worker before calling the failure a timeout.
DEATH_GRACE_S = 0.5


class LinkError(RuntimeError):
    """Worker ``ranks`` did not take a message or did not answer in time; ``detail`` says how.
    ``died``: their processes ended (``detail`` gives the exit codes), so nobody waited for them."""

    def __init__(self, ranks: tuple[int, ...], timeout_s: float, detail: str = "", died: bool = False):
        self.ranks = ranks
        self.timeout_s = timeout_s
        self.detail = detail
        self.died = died
        who = f"EP worker {ranks[0]}" if len(ranks) == 1 else "EP workers " + ", ".join(map(str, ranks))
        text = f"{who} died" if died else f"{who} did not answer within {timeout_s:g}s"
        super().__init__(f"{text} ({detail})" if detail else text)


class LeaderLink(Protocol):
    world_size: int

    def send(self, message: Message) -> None: ...
    def collect(self, key: str, timeout_s: float) -> dict[int, bytes]: ...


class WorkerLink(Protocol):
    rank: int

    def receive(self) -> Message: ...
    def post(self, key: str, value: bytes) -> None: ...


def _store_key(key: str, rank: int) -> str:
    return f"ep/{key}/{rank}"


def ready_key(rank: int) -> str:
    return _store_key("ready", rank)


def await_key(store, name: str, deadline: float, exitcode: Callable[[], Optional[int]]) -> bool:
    """Poll ``store`` for ``name`` until ``deadline`` (monotonic) or the process ``exitcode`` names
    ends; True when the key is there. (``store.check`` polls quietly; a timed-out ``store.wait``
    logs a warning each time.)"""
    pause = 50e-6
    while True:
        if store.check([name]):
            return True
        if exitcode() is not None or time.monotonic() >= deadline:
            return store.check([name])
        time.sleep(pause)
        pause = min(pause * 2, POLL_S)


# --- torch.distributed ---------------------------------------------------------------------------


class TorchLeaderLink:
    """Rank 0's end. ``timeout_s`` is the group's collective timeout (a broadcast to a worker that
    does not receive fails after it); ``exitcode(rank)`` (optional) reports an ended worker process."""

    def __init__(self, group, store, world_size: int, timeout_s: float, comm_device: str = "cpu",
                 exitcode: Optional[Callable[[int], Optional[int]]] = None):
        self.group = group
        self.timeout_s = timeout_s
        self.store = store
        self.world_size = world_size
        self.comm_device = comm_device
        self.exitcode = exitcode or (lambda rank: None)

    def send(self, message: Message) -> None:
        import torch
        import torch.distributed as dist

        header, tail = encode(message)
        try:
            dist.broadcast(torch.tensor(header, dtype=torch.int64, device=self.comm_device), src=0, group=self.group)
            if tail is not None:
                dist.broadcast(torch.tensor(tail, dtype=torch.int64, device=self.comm_device), src=0, group=self.group)
        except RuntimeError as err:
            raise self.failure(err) from err

    def failure(self, err: Exception) -> LinkError:
        """A collective on the group that raised ``err``, as a LinkError: the workers whose
        processes ended (looking up to ``DEATH_GRACE_S`` for one that is still being reaped, unless
        the collective timed out), else every worker as not answering within the timeout."""
        timed_out = "timed out" in str(err).lower() or "timeout" in str(err).lower()
        deadline = time.monotonic() + (0.0 if timed_out else DEATH_GRACE_S)
        while not self._ended() and time.monotonic() < deadline:
            time.sleep(POLL_S)
        gone = bool(self._ended())
        return LinkError(self._suspects(), self.timeout_s, self._why(err) if gone or not timed_out else "", died=gone)

    def _ended(self) -> list[int]:
        return [r for r in range(1, self.world_size) if self.exitcode(r) is not None]

    def collect(self, key: str, timeout_s: float) -> dict[int, bytes]:
        """Every worker's value under ``key`` (consumed), or LinkError at the deadline."""
        deadline = time.monotonic() + timeout_s
        answers = {}
        for rank in range(1, self.world_size):
            name = _store_key(key, rank)
            if not await_key(self.store, name, deadline, functools.partial(self.exitcode, rank)):
                code = self.exitcode(rank)
                detail = f"its process exited with code {code}" if code is not None else ""
                raise LinkError((rank,), timeout_s, detail, died=code is not None)
            answers[rank] = self.store.get(name)
            self.store.delete_key(name)
        return answers

    def _suspects(self) -> tuple[int, ...]:
        gone = tuple(r for r in range(1, self.world_size) if self.exitcode(r) is not None)
        return gone or tuple(range(1, self.world_size))

    def _why(self, err: Exception) -> str:
        ended = [(r, c) for r, c in ((r, self.exitcode(r)) for r in range(1, self.world_size)) if c is not None]
        if len(ended) == 1:
            return f"its process exited with code {ended[0][1]}"
        if ended:
            return "; ".join(f"worker {r} exited with code {c}" for r, c in ended)
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        return first[:200]


class TorchWorkerLink:
    """A worker's end: blocking receive of the next message, posts to the store."""

    def __init__(self, group, store, rank: int, comm_device: str = "cpu"):
        self.group = group
        self.store = store
        self.rank = rank
        self.comm_device = comm_device

    def receive(self) -> Message:
        import torch
        import torch.distributed as dist

        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.comm_device)
        dist.broadcast(header, src=0, group=self.group)
        message, tail = decode_header(header.tolist())
        if not tail:
            return message
        data = torch.empty(tail, dtype=torch.int64, device=self.comm_device)
        dist.broadcast(data, src=0, group=self.group)
        return Message(message.kind, message.a, message.b, data.tolist(), message.number)

    def post(self, key: str, value: bytes) -> None:
        self.store.set(_store_key(key, self.rank), value)


# --- in-process ---------------------------------------------------------------------------------


class LoopbackLink:
    """Delivers each message to in-process workers at once; their posts wait in a dict."""

    def __init__(self, make_workers: Callable[["LoopbackLink"], list]):
        self.posts: dict[str, bytes] = {}
        self.workers = make_workers(self)
        self.world_size = len(self.workers) + 1

    def poster(self, rank: int) -> Callable[[str, bytes], None]:
        def post(key: str, value: bytes) -> None:
            self.posts[_store_key(key, rank)] = value

        return post

    def send(self, message: Message) -> None:
        for worker in self.workers:
            worker.handle(message)

    def collect(self, key: str, timeout_s: float) -> dict[int, bytes]:
        answers = {}
        for rank in range(1, self.world_size):
            name = _store_key(key, rank)
            if name not in self.posts:
                raise LinkError((rank,), timeout_s, "no answer posted")
            answers[rank] = self.posts.pop(name)
        return answers
