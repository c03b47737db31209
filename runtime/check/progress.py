"""The checker's rules of time and progress: deadlines met on time, no idle wait and no shutdown
while work waits, and block tables that never shrink (specs/checker.md §11.2).

They are written from the rule book, not from ``core/``: what ``Progress`` reads is the state the
scheduler publishes after each step (its active, prefilling, swapped, preempted and pending work,
the agenda and the waiting record), the effects of each batch and the client frames. The
``Monitor`` (runtime/check/invariants.py) owns one and calls it from its hooks; each check costs
nothing in an episode that gives it nothing to look at (no deadline, no idle wait, no shutdown).
"""

from __future__ import annotations

from typing import Any, Optional

from fxsched.core.phases import AwaitAdapterIds, AwaitPublishBlocks, EndOfTick
from fxsched.core.state import SchedulerState
from fxsched.runtime.check.violation import Violation


_BEFORE_PUBLISH = (AwaitAdapterIds, AwaitPublishBlocks)
"""The waiting records of a tick's first queries (specs/scheduler.md §5.4-§5.6): a state parked
there holds the next tick's agenda, before its publish counts it and its clock reading comes."""


def work_waiting(state: SchedulerState) -> list[str]:
    """What the scheduler still owes work to (specs/scheduler.md §5.4 step 2, §5.8): active,
    prefilling, swapped, preempted, being restored, admitted this tick, pending or undrained."""
    owed = []
    for name in ("active", "prefilling", "swapped", "preempted", "restoring", "new_requests", "pending", "inbox"):
        if getattr(state, name):
            owed.append(name)
    return owed


def no_idle_with_work(state: SchedulerState) -> None:
    """no idle wait (specs/scheduler.md §5.4 step 2): the loop blocks on its inbox only when nothing
    is active, prefilling, swapped, preempted, admitted or pending: a sequence that waits for room
    must never wait on a client that may never write again."""
    owed = [name for name in work_waiting(state) if name != "inbox"]
    if owed:
        raise Violation("no_idle_with_work", f"the loop waits for input while work waits: {', '.join(owed)}")


def no_shutdown_with_work(state: SchedulerState) -> None:
    """no early shutdown (specs/scheduler.md §5.8, §5.21): with the inbox closed the loop ends only
    once nothing is in flight, swapped, preempted or pending (``state``: the state the shutdown
    step was given)."""
    owed = [name for name in work_waiting(state) if name != "inbox"]
    if owed:
        raise Violation("no_shutdown_with_work", f"the loop shut down with work still owed: {', '.join(owed)}")


class Progress:
    """Deadlines on time (specs/scheduler.md §5.19 step 1) and block tables that only grow.

    Deadlines: every unfinished active sequence whose deadline is at or before the tick's clock is
    finished with guard ``request_timeout`` at that tick's end, whichever other deadlines the batch
    holds (the earliest of several is never masked by a later one). The checker notes, at every
    step of a tick before its end-of-tick runs, each active unfinished sequence past its deadline;
    when the next tick's clock reading comes, each noted request must have had its final frame. A
    sequence swapped in or resumed after the deadline stage is noted only in the next tick (the
    states of a tick published before its clock reading comes are skipped), and a request preempted or spilled in
    the tick is let go (it is not active at the tick's end).

    Block tables: the blocks the scheduler records for a live sequence never fall (specs/scheduler.md
    §5.2: ``blocks`` mirrors the device table, which never shrinks until freed), a rejected verify
    that crossed a block boundary included."""

    def __init__(self) -> None:
        self.deadlines: dict[int, float] = {}  # request id -> deadline, for requests that have one
        self.earliest = float("inf")  # the earliest deadline of an unfinished request
        self.overdue: dict[int, float] = {}  # request id -> clock of the tick it must end in
        self.blocks: dict[int, int] = {}  # seq id -> the most blocks seen for it
        self.tick = -1  # the tick (``state.tick``, counted at its publish) of the last clock reading

    def add_request(self, request: Any) -> None:
        deadline = getattr(request, "deadline_ms", None)
        if deadline is not None:
            self.deadlines[request.id] = deadline
            self.earliest = min(self.earliest, deadline)

    def finished(self, rid: int) -> None:
        if rid in self.deadlines:
            del self.deadlines[rid]
            self.earliest = min(self.deadlines.values(), default=float("inf"))
        self.overdue.pop(rid, None)

    def let_go(self, rid: int) -> None:
        """A request preempted or spilled: not active at its tick's end."""
        self.overdue.pop(rid, None)

    def on_state(self, state: SchedulerState, now_ms: float) -> None:
        if now_ms < self.earliest or state.tick != self.tick or isinstance(state.waiting, _BEFORE_PUBLISH):
            return  # nothing is due yet, or the next tick began and its clock reading has not come
        if not any(type(task) is EndOfTick for task in state.agenda):
            return  # the tick's end ran; what is active now came back after its deadline stage
        deadlines = self.deadlines
        for seq in state.active:
            rid = seq.request.id
            due = deadlines.get(rid)
            if due is not None and due <= now_ms and not seq.finished and rid not in self.overdue:
                self.overdue[rid] = now_ms

    def on_clock(self, final: dict, tick: int) -> None:
        """A new tick's clock reading (``tick``: the tick it reads for, published already): every
        request noted overdue in the tick that ended has its final frame. (A second reading within
        the same tick, which a host may send, only moves the clock.)"""
        if tick == self.tick:
            return
        self.tick = tick
        if not self.overdue:
            return
        late = sorted(rid for rid in self.overdue if rid not in final)
        if late:
            rid = late[0]
            raise Violation("timeout_on_time", f"request {rid} (deadline {self.deadlines.get(rid)} ms) was active and "
                                               f"unfinished past its deadline in the tick at {self.overdue[rid]} ms, "
                                               f"but that tick ended without finishing it")
        self.overdue.clear()

    def blocks_grow(self, seq_id: int, blocks: int) -> None:
        seen = self.blocks.get(seq_id, 0)
        if blocks < seen:
            raise Violation("blocks_never_shrink", f"sequence {seq_id} holds {blocks} blocks after {seen}")
        self.blocks[seq_id] = blocks

    def released(self, seq_id: int) -> None:
        self.blocks.pop(seq_id, None)


def check_blocks(progress: Progress, rows: tuple, settled: Optional[Any]) -> None:
    """Every active sequence's recorded block count against the most it held before (``rows``:
    the state's records, ``settled``: its hot columns, whose blocks are newer when they stand over
    these very records)."""
    grow = progress.blocks_grow
    if settled is not None and settled.base is rows:
        for seq, blocks in zip(rows, settled.blocks, strict=True):
            grow(seq.seq_id, blocks)
    else:
        for seq in rows:
            grow(seq.seq_id, seq.blocks)
