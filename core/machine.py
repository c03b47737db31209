"""The engine: ``step(state, event) -> (state, effects)`` and its rule registry.

Theory of operation. A tick is a list of tasks on ``state.agenda`` (drain, admit, publish,
rotate, idle check, the three lanes, end of tick). ``advance`` runs tasks front first. A task
either finishes at once (emitting fire-and-forget effects, perhaps pushing more tasks) or ends
with a *query*: it appends the query effect and parks a ``waiting`` record that carries what the
rule needs to go on. The batch of effects returned by ``step`` therefore ends with exactly one
query (or with ``Teardown``). The query's answer is the next event; the rule registered for the
waiting record's type takes it and the engine advances again.

Input events (arrivals, cancels, clock, closure, rotation requests) may come in any phase; they
only record themselves in the state and produce no effects.

Where the rules live: ``tick`` (loop, inbox, admission, snapshot, rotation, idle, end of tick,
shutdown), ``prefill`` (lanes 1 and 2), ``decode`` (lane 3 dispatch and plain decode),
``spec_step`` / ``dflash`` / ``verdict`` (speculative decoding), ``retire`` (finish and release,
compaction), ``emit`` (token sinks), ``admission`` (policies and KV reservation).
"""

from __future__ import annotations

from typing import Any, Callable

import attrs

from fxsched.core.records import replace, with_fields

from fxsched.core.events import (
    Arrival,
    Boot,
    Cancel,
    Clock,
    DeviceFault,
    Event,
    InboxClosed,
    RotationRequested,
)
from fxsched.core.sequence import Sequence
from fxsched.core.state import SchedulerState
from fxsched.effects.base import Effect

TaskRule = Callable[[SchedulerState, Any, list], SchedulerState]
AnswerRule = Callable[[SchedulerState, Any, Event, list], SchedulerState]

TASK_RULES: dict[type, TaskRule] = {}
ANSWER_RULES: dict[type, tuple[tuple[type, ...], AnswerRule]] = {}


class PhaseError(Exception):
    """An event that does not fit the phase the engine is in. The state is left unchanged."""


def task_rule(task_type: type) -> Callable[[TaskRule], TaskRule]:
    """Register the rule that runs a task of ``task_type``."""

    def register(fn: TaskRule) -> TaskRule:
        TASK_RULES[task_type] = fn
        return fn

    return register


def answer_rule(waiting_type: type, *event_types: type) -> Callable[[AnswerRule], AnswerRule]:
    """Register the rule that takes the answer a ``waiting_type`` record waits for."""

    def register(fn: AnswerRule) -> AnswerRule:
        ANSWER_RULES[waiting_type] = (event_types, fn)
        return fn

    return register


# --- helpers used by the rules ---------------------------------------------------------------


def ask(state: SchedulerState, out: list, query: Effect, waiting: Any) -> SchedulerState:
    """End the batch with ``query`` and park ``waiting`` until its answer comes."""
    out.append(query)
    return replace(state, waiting=waiting)


def push(state: SchedulerState, *tasks: Any) -> SchedulerState:
    """Put ``tasks`` at the front of the agenda, in order."""
    return replace(state, agenda=tasks + state.agenda)


def find_seq(state: SchedulerState, seq_id: int) -> Sequence:
    for seq in state.active:
        if seq.seq_id == seq_id:
            return seq
    raise KeyError(f"sequence {seq_id} is not active ({state.describe()})")


def has_seq(state: SchedulerState, seq_id: int) -> bool:
    """Whether ``seq_id`` is still active (a fault may have failed it since a task was planned)."""
    return any(s.seq_id == seq_id for s in state.active)


def put_seqs(state: SchedulerState, updated: dict[int, Sequence]) -> SchedulerState:
    """Replace active sequences by id, keeping the active order (one rebuild for many)."""
    if not updated:
        return state
    get = updated.get
    return with_fields(state, {"active": tuple([get(s.seq_id, s) for s in state.active])})


def put_seq(state: SchedulerState, seq: Sequence) -> SchedulerState:
    return put_seqs(state, {seq.seq_id: seq})


# --- the step function -----------------------------------------------------------------------


def _take_input(state: SchedulerState, event: Event) -> SchedulerState:
    if isinstance(event, Arrival):
        return replace(state, inbox=state.inbox + (event.request,))
    if isinstance(event, Cancel):
        active = [s for s in state.active if s.request_id == event.request_id]
        if active:
            return put_seqs(state, {s.seq_id: replace(s, cancel_requested=True) for s in active if s.has_cancel_flag})
        # not running yet: remembered until the request becomes active (then it moves to the flag)
        return replace(state, cancels=state.cancels | {event.request_id})
    if isinstance(event, Clock):
        return replace(state, now_ms=event.now_ms)
    if isinstance(event, InboxClosed):
        return replace(state, inbox_closed=True)
    if isinstance(event, RotationRequested):
        return replace(state, inbox_rotations=state.inbox_rotations + (event.name,))
    raise PhaseError(f"unknown input event {event!r}")


def advance(state: SchedulerState, out: list) -> SchedulerState:
    """Run tasks until one waits for an answer or the loop has stopped."""
    while state.waiting is None and not state.stopped:
        if not state.agenda:
            raise PhaseError(f"the agenda ran dry without a query ({state.describe()})")
        task = state.agenda[0]
        state = replace(state, agenda=state.agenda[1:])
        state = TASK_RULES[type(task)](state, task, out)
    return state


_INPUTS = (Arrival, Cancel, Clock, InboxClosed, RotationRequested)


def step(state: SchedulerState, event: Event) -> tuple[SchedulerState, tuple[Effect, ...]]:
    """The scheduler: a pure, total function of (state, event).

    Returns the next state and the effects to carry out, in order. It never reads a clock, draws
    a random number, does I/O or mutates its arguments. An event that does not fit the current
    phase raises ``PhaseError`` naming the phase and the event.
    """
    if isinstance(event, _INPUTS):
        if state.stopped:
            raise PhaseError(f"the loop has stopped; {type(event).__name__} cannot be taken")
        return _take_input(state, event), ()
    out: list = []
    if isinstance(event, Boot):
        if state.tick != 0 or state.agenda or state.waiting is not None or state.stopped:
            raise PhaseError(f"Boot only starts a fresh scheduler ({state.describe()})")
        from fxsched.core.tick import StartUp

        state = advance(push(state, StartUp()), out)
        return state, tuple(out)
    waiting = state.waiting
    if waiting is None:
        raise PhaseError(f"{type(event).__name__} arrived but no query is outstanding ({state.describe()})")
    accepted, rule = ANSWER_RULES[type(waiting)]
    if isinstance(event, DeviceFault) and not isinstance(event, accepted):
        from fxsched.core.faults import fail_in_flight

        failed = fail_in_flight(replace(state, waiting=None), waiting, event.message, out)
        if failed is not None:
            return advance(failed, out), tuple(out)
    if not isinstance(event, accepted):
        names = ", ".join(t.__name__ for t in accepted)
        raise PhaseError(
            f"phase {type(waiting).__name__} waits for {names}, got {type(event).__name__} ({state.describe()})"
        )
    state = rule(replace(state, waiting=None), waiting, event, out)
    state = advance(state, out)
    return state, tuple(out)
