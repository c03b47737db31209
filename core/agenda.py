"""Agenda operations every rule uses: end the batch with a query, push tasks, and look up or
replace active sequences. Pure functions of the state."""

from __future__ import annotations

from typing import Any, Iterable, Optional

from fxsched.core.phases import AwaitForward
from fxsched.core.records import with_fields
from fxsched.core.request import Request
from fxsched.core.sequence import Sequence
from fxsched.core.state import SchedulerState
from fxsched.effects.base import Effect


class PhaseError(Exception):
    """An event that does not fit the phase the engine is in. The state is left unchanged."""


def ask(state: SchedulerState, out: list[Effect], query: Effect, waiting: Any) -> SchedulerState:
    """End the batch with ``query`` and park ``waiting`` until its answer comes."""
    out.append(query)
    return with_fields(state, {"waiting": waiting})


def push(state: SchedulerState, *tasks: Any) -> SchedulerState:
    """Put ``tasks`` at the front of the agenda, in order."""
    return with_fields(state, {"agenda": tasks + state.agenda})


def forward(state: SchedulerState, out: list[Effect], query: Effect, seq_ids: Iterable[int], *then: Any,
            request: Optional[Request] = None, slot: Optional[int] = None) -> SchedulerState:
    """Run a forward and continue with the tasks ``then`` once it is done."""
    return ask(state, out, query, AwaitForward(tuple(seq_ids), tuple(then), request, slot))


def find_seq(state: SchedulerState, seq_id: int) -> Sequence:
    for seq in state.active:
        if seq.seq_id == seq_id:
            return seq
    raise KeyError(f"sequence {seq_id} is not active ({state.describe()})")


def has_seq(state: SchedulerState, seq_id: int) -> bool:
    """Whether ``seq_id`` is still active (a fault may have failed it since a task was planned)."""
    return any(s.seq_id == seq_id for s in state.active)


def by_id(state: SchedulerState) -> dict[int, Sequence]:
    """The active sequences by id (build once per rule, not per row)."""
    return {s.seq_id: s for s in state.active}


def put_seqs(state: SchedulerState, updated: dict[int, Sequence]) -> SchedulerState:
    """Replace active sequences by id, keeping the active order (one rebuild for many)."""
    if not updated:
        return state
    get = updated.get
    return with_fields(state, {"active": tuple([get(s.seq_id, s) for s in state.active])})


def put_seq(state: SchedulerState, seq: Sequence) -> SchedulerState:
    return put_seqs(state, {seq.seq_id: seq})
