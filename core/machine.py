"""The engine: ``step(state, event) -> (state, effects)``.

Theory of operation. A tick is a list of tasks on ``state.agenda`` (drain, admit, publish, rotate,
idle check, the three lanes, end of tick). ``advance`` runs tasks front first. A task either
finishes at once (emitting fire-and-forget effects, perhaps pushing more tasks) or ends with a
*query*: it appends the query effect and parks a ``waiting`` record that carries what the rule
needs to go on. The batch of effects returned by ``step`` therefore ends with exactly one query
(or with ``Teardown``). The query's answer is the next event; the rule the table names for the
waiting record's type takes it, and the engine advances again.

Input events (arrivals, cancels, clock, closure, rotation requests) may come in any phase; they
only record themselves in the state and produce no effects.

Layers (each imports only those above it; a test keeps it so):

1. values: ``records`` (fast copies), ``kv`` (block arithmetic), ``token_log``, ``request``,
   ``config``, ``events``;
2. state: ``sequence``, ``state``, ``phases`` (every task and waiting record: the namespace of
   ``loop_phases``, ``flow_phases``, ``prefill_phases``, ``decode_phases``, ``spec_phases`` and
   ``memory_phases``, one module per lane);
3. pure helpers: ``agenda`` (ask, push, lookups), ``rows``, ``admission``, ``chunking``,
   ``verdict``, ``watchdog``, ``emit`` (token sinks), ``retire``, ``faults``, ``memory``,
   ``verifying`` (what the speculative paths share), ``late`` (late drafts filled into a verify's
   waiting record), ``ahead`` (decodes answered ahead: what they feed, their tokens resolved),
   ``ahead_columns`` (the same for a steady batch, over the hot columns);
4. rule modules, which never import each other: ``tick`` (loop, inbox, admission check, snapshot,
   rotation, idle, end of tick, shutdown), ``flow`` (forward continuations), ``prefill`` (lanes 1
   and 2), ``decode`` (lane 3 dispatch, plain decode), ``spec_step`` (MTP / DFlash step),
   ``kverify`` (serial verifies), ``dflash``, ``mtp_batch`` (batched MTP verify), ``ngram``,
   ``self_spec``, ``lifecycle`` (swap-out, swap-in, requeue resume);
5. ``table``: the literal transition table;
6. ``machine``: ``step``.

The rules themselves are written up in specs/scheduler.md and specs/speculation.md.
"""

from __future__ import annotations

from typing import Any

from fxsched.core.agenda import Batch, PhaseError, push, put_seqs
from fxsched.core.events import (Arrival, Boot, Cancel, Clock, DeviceFault, Event, InboxClosed, RotationRequested,
                                 VerifyRows)
from fxsched.core.faults import Halt, RuleTakesFault, apply_fault
from fxsched.core.late import resolved
from fxsched.core.phases import StartUp
from fxsched.core.records import replace, with_fields
from fxsched.core.state import SchedulerState
from fxsched.core.table import ANSWERS, IDLE, TASKS
from fxsched.effects.base import Effect

__all__ = ["PhaseError", "advance", "step"]

_new_batch = list.__new__  # ``Batch(state)`` without its ``__init__`` frame: the caller is set after


def _take_input(state: SchedulerState, event: Event) -> SchedulerState:
    """An input event recorded in the state (none of the fields it sets converts or validates, so
    the copies take final values: ``with_fields``)."""
    if isinstance(event, Clock):
        return with_fields(state, {"now_ms": event.now_ms})
    if isinstance(event, Arrival):
        return with_fields(state, {"inbox": state.inbox + (event.request,)})
    if isinstance(event, Cancel):
        active = [s for s in state.active if s.request_id == event.request_id]
        if active:
            return put_seqs(state, {s.seq_id: replace(s, cancel_requested=True) for s in active if s.has_cancel_flag})
        # not running yet: remembered until the request becomes active (then it moves to the flag)
        return with_fields(state, {"cancels": state.cancels | {event.request_id}})
    if isinstance(event, InboxClosed):
        return with_fields(state, {"inbox_closed": True})
    if isinstance(event, RotationRequested):
        return with_fields(state, {"inbox_rotations": state.inbox_rotations + (event.name,)})
    raise PhaseError(f"unknown input event {event!r}")


# Ownership. Every state a rule returns is a copy made during this step (``with_fields``,
# ``replace``) or the state the rule was given. So once ``step`` holds a state that is not the
# caller's, no one else can see it until ``step`` returns it: the engine's own two writes (the
# answered record cleared, a task popped off the agenda) are made in place on such a state
# instead of copying all of it. Rules may keep and return an older state, so they copy, but for
# their last write: ``ask`` and ``update`` write in place a state that is not the caller's (the
# step's ``Batch`` of effects knows the caller), and their result is what the rule returns.


def _unpark(state: SchedulerState, caller: SchedulerState) -> SchedulerState:
    """``state`` with no waiting record: in place unless it is the caller's state."""
    if state is caller:
        return with_fields(state, {"waiting": None})
    state.__dict__["waiting"] = None
    return state


def advance(state: SchedulerState, out: list[Effect]) -> SchedulerState:
    """Run tasks until one waits for an answer or the loop has stopped. A task whose ``IDLE``
    predicate holds is dropped unrun: its rule would change nothing (specs/scheduler.md §5.2).
    ``state`` must be this step's own (see Ownership above): the tasks are popped in place."""
    idle = IDLE
    while state.waiting is None and not state.stopped:
        agenda = state.agenda
        i = 0
        for task in agenda:
            nothing_to_do = idle.get(type(task))
            if nothing_to_do is None or not nothing_to_do(state):
                break
            i += 1
        else:
            raise PhaseError(f"the agenda ran dry without a query ({state.describe()})")
        state.__dict__["agenda"] = agenda[i + 1:]
        state = TASKS[type(task)](state, task, out)
    return state


_INPUTS = (Arrival, Cancel, Clock, InboxClosed, RotationRequested)


def step(state: SchedulerState, event: Event) -> tuple[SchedulerState, tuple[Effect, ...]]:
    """The scheduler: a pure, total function of (state, event).

    Returns the next state and the effects to carry out, in order. It never reads a clock, draws
    a random number, does I/O or mutates its arguments. An event that does not fit the current
    phase raises ``PhaseError`` naming the phase and the event.
    """
    waiting = state.waiting
    if waiting is not None:
        phase = ANSWERS[type(waiting)]
        if isinstance(event, phase.accepts):  # the answer the engine waits for (most events)
            if type(event) is VerifyRows and event.inputs:  # late drafts arrive (specs/async.md §16.3)
                waiting = resolved(waiting, event.inputs)
            return _answered(state, phase.rule, waiting, event)
    if isinstance(event, _INPUTS):
        if state.stopped:
            raise PhaseError(f"the loop has stopped; {type(event).__name__} cannot be taken")
        return _take_input(state, event), ()
    out = Batch(state)
    if isinstance(event, Boot):
        if state.tick != 0 or state.agenda or state.waiting is not None or state.stopped:
            raise PhaseError(f"Boot only starts a fresh scheduler ({state.describe()})")
        state = advance(push(state, StartUp()), out)
        return state, tuple(out)
    if waiting is None:
        raise PhaseError(f"{type(event).__name__} arrived but no query is outstanding ({state.describe()})")
    phase = ANSWERS[type(waiting)]  # (an answer the phase accepts was taken above: this one is not)
    if isinstance(event, DeviceFault) and not isinstance(phase.fault, RuleTakesFault):
        if isinstance(phase.fault, Halt):
            raise PhaseError(f"phase {type(waiting).__name__}: device fault {event.message!r}; the loop cannot "
                             f"go on: {phase.fault.reason} ({state.describe()})")
        failed = apply_fault(phase.fault, replace(state, waiting=None), waiting, event.message, out)
        if failed is not None:
            return advance(failed, out), tuple(out)
    names = ", ".join(t.__name__ for t in phase.accepts)
    raise PhaseError(
        f"phase {type(waiting).__name__} waits for {names}, got {type(event).__name__} ({state.describe()})"
    )


def _answered(state: SchedulerState, rule: Any, waiting: Any,
              event: Event) -> tuple[SchedulerState, tuple[Effect, ...]]:
    """``rule`` takes the answer ``event`` to ``waiting``, then the agenda runs.

    The rule sees the answered waiting record still parked: it ends with a query (which parks the
    next one) or it does not, and then the record is cleared here. One state copy fewer per answer."""
    out = _new_batch(Batch)
    out.caller = state
    after = rule(state, waiting, event, out)
    if not out or not out[-1].QUERY:
        after = _unpark(after, state)
    return advance(after, out), tuple(out)
