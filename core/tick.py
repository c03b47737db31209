"""Rules of the loop: start-up, inbox, admission check, snapshot, rotation, idle check, end of tick
and shutdown (specs/scheduler.md §5.3–5.8, §5.19, §5.21). The lanes live in ``prefill`` and
``decode``; this module hands work to them only by pushing records of ``core/phases.py``."""

from __future__ import annotations

from fxsched.core import admission
from fxsched.core.ahead import ahead_past_deadline, any_ahead, needs_settled
from fxsched.core.agenda import ask, push, update
from fxsched.core.events import AdapterIds, EventCreated, FreeBlocks, InputReady, LoraApplied, StreamCreated
from fxsched.core.faults import SHUTDOWN_ABORT, fail_request
from fxsched.core.phases import (
    Admit,
    AwaitAdapterIds,
    AwaitEvent,
    AwaitInput,
    AwaitPublishBlocks,
    AwaitRotation,
    AwaitStream,
    ContinuePrefills,
    DecodeLane,
    EmptyBatchExit,
    EmptyBatchSkip,
    EndOfTick,
    IdleCheck,
    Publish,
    RequeueResume,
    ResolveAhead,
    RetireResolved,
    Rotate,
    Shutdown,
    StartRequests,
    StartUp,
    SwapIn,
    SwapOutRoom,
    TickStart,
)
from fxsched.core.records import replace, with_fields
from fxsched.core.request import Request
from fxsched.core.retire import compact, compaction_moves, finish_and_release
from fxsched.core.sequence import Guard
from fxsched.core.state import SchedulerState, in_flight, kept_facts, queue_idle, quiescent
from fxsched.effects import device_calls as dc
from fxsched.effects import lifecycle as lc
from fxsched.effects.base import Effect
from fxsched.effects.client import DoneOut, ErrorOut, FinishReason, ResponseOut, RotationAck

# --- start-up ---------------------------------------------------------------------------------


def start_up(state: SchedulerState, task: StartUp, out: list[Effect]) -> SchedulerState:
    out.append(dc.BindGpuToThread())
    return ask(state, out, dc.CreateStream(), AwaitStream())


def stream_created(state: SchedulerState, waiting: AwaitStream, event: StreamCreated,
                   out: list[Effect]) -> SchedulerState:
    state = replace(state, prefill_stream=event.stream)
    return ask(state, out, dc.CreateEvent(), AwaitEvent())


def event_created(state: SchedulerState, waiting: AwaitEvent, event: EventCreated,
                  out: list[Effect]) -> SchedulerState:
    return push(replace(state, prefill_event=event.event), TickStart())


# --- inbox ------------------------------------------------------------------------------------


def drain_inbox(state: SchedulerState) -> SchedulerState:
    """Take everything already in the inbox without waiting."""
    if not (state.inbox or state.inbox_rotations or state.inbox_closed):
        return state
    return replace(
        state,
        pending=state.pending + state.inbox,
        rotations=state.rotations + state.inbox_rotations,
        closed=state.closed or state.inbox_closed,
        inbox=(),
        inbox_rotations=(),
        inbox_closed=False,
    )


def drop_cancelled_waiting(state: SchedulerState, out: list[Effect]) -> SchedulerState:
    """A request cancelled while it still waits for admission ends here, never admitted: no slot,
    no prefill. A stream gets its final frame ``Done(stop, n=0)``, a blocking client an empty
    ``Response(stop)``; a request admission would refuse whatever the device holds (its prompt
    past the context or the pool) gets that refusal's ``Error`` instead (specs/scheduler.md §5.4
    step 1)."""
    if not state.cancels or not state.pending:
        return state
    gone = {r.id for r in state.pending if r.id in state.cancels}
    if not gone:
        return state
    for r in state.pending:
        if r.id in gone:
            problem = admission.impossible(state.model, state.config, r)
            if problem is not None:
                out.append(ErrorOut(r.id, problem, r.streaming))
            else:
                out.append(DoneOut(r.id, FinishReason.STOP, 0, 0, 0, 0, None) if r.streaming
                           else ResponseOut(r.id, (), FinishReason.STOP))
    return replace(state, pending=tuple(r for r in state.pending if r.id not in gone), cancels=state.cancels - gone)


def tick_start(state: SchedulerState, task: TickStart, out: list[Effect]) -> SchedulerState:
    state = drop_cancelled_waiting(drain_inbox(state), out)
    if any_ahead(state) and needs_settled(state):  # the tokens on the device are read first (§16.6)
        return push(state, ResolveAhead(), RetireResolved(), TickStart())
    if not in_flight(state) and not state.swapped and not state.preempted and queue_idle(state):
        return ask(push(state, TickStart()), out, dc.WaitForInput(), AwaitInput())
    new: tuple[Request, ...] = ()
    if state.pending and not admission.policy_declines(state):
        cap = state.config.max_batch_size - len(state.rows) - len(state.prefilling)
        new = admission.select_requests(state.config, state.pending, cap)
    tasks: tuple[object, ...] = _TICK_TASKS
    if new:
        tasks = (Admit(),) + tasks
    return update(state, out, {"new_requests": new, "mixed_step_ran": False, "agenda": tasks + state.agenda,
                               "pending": admission.without(state.pending, new) if new else state.pending})


# the agenda of a tick (after ``Admit`` when there are new requests); tasks are stateless records
_TICK_TASKS: tuple[object, ...] = (Publish(), Rotate(), IdleCheck(), SwapOutRoom(), StartRequests(), ContinuePrefills(),
                                   EmptyBatchExit(), DecodeLane(), EndOfTick())


def input_ready(state: SchedulerState, waiting: AwaitInput, event: InputReady, out: list[Effect]) -> SchedulerState:
    return state  # TickStart is already back on the agenda and drains again


# --- admission check --------------------------------------------------------------------------


def _cohort_slot(state: SchedulerState) -> int:
    if state.rows:
        return state.rows[0].request.adapter_slot
    if state.prefilling:
        return state.prefilling[0].request.adapter_slot
    return state.new_requests[0].adapter_slot


def admit(state: SchedulerState, task: Admit, out: list[Effect]) -> SchedulerState:
    slots = (_cohort_slot(state),) + tuple(r.adapter_slot for r in state.new_requests)
    return ask(state, out, dc.AdapterIdFor(slots), AwaitAdapterIds(state.new_requests))


def adapter_ids(state: SchedulerState, waiting: AwaitAdapterIds, event: AdapterIds,
                out: list[Effect]) -> SchedulerState:
    cohort_id, ids = event.ids[0], event.ids[1:]
    new, ids = admission.refuse_impossible(state, waiting.new, ids, out)
    if new and not (state.rows or state.prefilling):
        cohort_id = ids[0]  # the cohort is the first new request that can be served
    same: tuple[Request, ...] = new
    other: tuple[Request, ...] = ()
    if not state.config.mixed_adapters:
        same, other = admission.cohort_split(cohort_id, new, ids)
    admitted, deferred = admission.reserve_kv(state.model, state.config, admission.committed_blocks(state), same)
    back = tuple(sorted(deferred + other, key=lambda r: waiting.new.index(r)))
    return replace(state, new_requests=admitted, pending=back + state.pending)


# --- snapshot publish, rotation, idle check ----------------------------------------------------


# records without fields, built once (they are frozen values: one instance is as good as another)
_COUNT_FREE = dc.NumFreeBlocks()
_AWAIT_PUBLISH = AwaitPublishBlocks()
_OCCUPANCY = dc.SsmSnapshotOccupancy()


def publish(state: SchedulerState, task: Publish, out: list[Effect]) -> SchedulerState:
    return ask(state, out, _COUNT_FREE, _AWAIT_PUBLISH)


def published(state: SchedulerState, waiting: AwaitPublishBlocks, event: FreeBlocks,
              out: list[Effect]) -> SchedulerState:
    out.append(_OCCUPANCY)
    out.append(_OCCUPANCY)
    return with_fields(state, {"tick": state.tick + 1})


def no_rotation_due(state: SchedulerState) -> bool:
    """Rotate has nothing to do: no rotation asked for, or not quiescent yet."""
    return not state.rotations or not quiescent(state)


def rotate(state: SchedulerState, task: Rotate, out: list[Effect]) -> SchedulerState:
    if no_rotation_due(state):
        return state
    name = state.rotations[0]
    state = replace(state, rotations=state.rotations[1:])
    return ask(push(state, Rotate()), out, lc.LoraRotate(name), AwaitRotation(name))


def rotated(state: SchedulerState, waiting: AwaitRotation, event: LoraApplied, out: list[Effect]) -> SchedulerState:
    out.append(RotationAck(waiting.name, event.error))
    return state


def not_idle(state: SchedulerState) -> bool:
    """The idle check has nothing to do: requests were admitted this tick, or some are in flight."""
    return bool(state.new_requests) or in_flight(state)


def idle_check(state: SchedulerState, task: IdleCheck, out: list[Effect]) -> SchedulerState:
    if not_idle(state):
        return state
    state = drain_inbox(state)
    # a request drained here is still owed an answer: the loop ends only with nothing pending
    if state.closed and not state.pending and not state.swapped and not state.preempted:
        return replace(state, agenda=(Shutdown(),))
    return state


def batch_not_empty(state: SchedulerState) -> bool:
    """The empty-batch exit (and its skip) has nothing to do: some sequence is active."""
    return bool(state.rows)


def empty_batch_exit(state: SchedulerState, task: EmptyBatchExit, out: list[Effect]) -> SchedulerState:
    """After lane 2: with nothing active, try to bring back swapped and preempted sequences first.

    (Trying only the requeue resume here would leave a swapped sequence waiting forever once
    nothing else runs, since swap-in lives in the end of tick; found by the model checker,
    specs/scheduler.md §5.14.)
    """
    if batch_not_empty(state):
        return state
    if state.config.spill_pool:
        return push(state, SwapIn(), RequeueResume(), EmptyBatchSkip())
    return push(state, RequeueResume(), EmptyBatchSkip())


def empty_batch_skip(state: SchedulerState, task: EmptyBatchSkip, out: list[Effect]) -> SchedulerState:
    """Still nothing active: skip lane 3 and the end of tick."""
    if batch_not_empty(state):
        return state
    return replace(state, agenda=(TickStart(),))


# --- end of tick ------------------------------------------------------------------------------


def expire_deadlines(state: SchedulerState) -> SchedulerState:
    """Every active sequence whose deadline has passed gets guard ``request_timeout`` and finishes."""
    now = state.now_ms
    facts = kept_facts(state)
    if facts is not None and (facts.next_deadline is None or facts.next_deadline > now):
        return state  # no unfinished row is past its deadline
    expired = set()
    for s in state.rows:  # requests and the finished flags: exact in the records (state.settled)
        deadline = s.request.deadline_ms
        if deadline is not None and not s.finished and deadline <= now:
            expired.add(s.seq_id)
    if not expired:
        return state
    return replace(state, active=tuple(replace(s, guard=Guard.REQUEST_TIMEOUT, finished=True)
                                       if s.seq_id in expired else s for s in state.active))


def retire_finished(state: SchedulerState, out: list[Effect], then: tuple[object, ...] = ()) -> SchedulerState:
    """Finish and release every finished sequence in active order; compact the survivors; push
    the tasks ``then``."""
    pinned = tuple(e.slot for e in state.prefilling)
    facts = kept_facts(state)
    if facts.any_finished if facts is not None else any(s.finished for s in state.rows):  # (exact in the records)
        survivors = []
        config = state.config
        for s in state.active:
            if not s.finished:
                survivors.append(s)
            else:
                finish_and_release(s, config, out)
        active = tuple(survivors)
    elif compaction_moves(facts.slots if facts is not None else [s.slot for s in state.rows], pinned):
        active = state.active
    else:  # nothing retires or moves: the records (and any hot columns over them) stay
        return update(state, out, {"agenda": then + state.agenda})
    return update(state, out, {"rows": compact(active, out, pinned), "settled": None, "agenda": then + state.agenda})


def retire_resolved(state: SchedulerState, task: RetireResolved, out: list[Effect]) -> SchedulerState:
    """After the tokens on the device were read at a tick's start: the sequences they finished
    retire before admission counts the seats (as the last end of tick would have retired them)."""
    return retire_finished(state, out)


def end_of_tick(state: SchedulerState, task: EndOfTick, out: list[Effect]) -> SchedulerState:
    if ahead_past_deadline(state):  # its token is read first, to time it out with the token taken (§16.6)
        return push(state, ResolveAhead(), EndOfTick())
    state = expire_deadlines(state)
    then = _AFTER_TICK_SPILL if state.config.spill_pool else _AFTER_TICK
    return retire_finished(state, out, then)


_AFTER_TICK: tuple[object, ...] = (RequeueResume(), TickStart())
_AFTER_TICK_SPILL: tuple[object, ...] = (SwapIn(), RequeueResume(), TickStart())


# --- shutdown ---------------------------------------------------------------------------------


def shutdown(state: SchedulerState, task: Shutdown, out: list[Effect]) -> SchedulerState:
    for s in state.active:
        finish_and_release(s, state.config, out)
    for entry in state.prefilling:
        fail_request(entry.request, entry.seq_id, entry.slot, SHUTDOWN_ABORT, out)
    for held in state.swapped:
        fail_request(held.sequence.request, held.sequence.seq_id, None, SHUTDOWN_ABORT, out)
    for entry_p in state.preempted:
        fail_request(entry_p.sequence.request, entry_p.sequence.seq_id, None, SHUTDOWN_ABORT, out)
    for request in state.pending + state.inbox:
        out.append(ErrorOut(request.id, SHUTDOWN_ABORT, request.streaming))
    out.extend([lc.EpShutdown(), lc.Quiesce(0), lc.Quiesce(state.prefill_stream), lc.Teardown()])
    return replace(state, active=(), prefilling=(), swapped=(), preempted=(), pending=(), inbox=(), agenda=(),
                   stopped=True)

