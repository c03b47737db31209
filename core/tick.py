"""The loop: start-up, inbox, admission check, snapshot, rotation, idle check, end of tick and
shutdown (scheduler.md §5.3–5.8, §5.19, §5.21). The lanes live in ``prefill`` and ``decode``."""

from __future__ import annotations

import attrs

from fxsched.core.records import replace

from fxsched.core import admission
from fxsched.core.events import (
    AdapterIds,
    EventCreated,
    FreeBlocks,
    InputReady,
    LoraApplied,
    StreamCreated,
)
from fxsched.core.machine import answer_rule, ask, push, task_rule
from fxsched.core.planted import planted
from fxsched.core.retire import REQUEST_TIMEOUT, compact, finish_and_release, finish_frame
from fxsched.core.state import SchedulerState
from fxsched.effects import device_calls as dc
from fxsched.effects import lifecycle as lc
from fxsched.effects.client import ErrorOut, RotationAck


# --- tasks ------------------------------------------------------------------------------------


@attrs.frozen
class StartUp:
    pass


@attrs.frozen
class TickStart:
    pass


@attrs.frozen
class Admit:
    pass


@attrs.frozen
class Publish:
    pass


@attrs.frozen
class Rotate:
    pass


@attrs.frozen
class IdleCheck:
    pass


@attrs.frozen
class EmptyBatchExit:
    pass


@attrs.frozen
class EndOfTick:
    pass


@attrs.frozen
class Shutdown:
    pass


# --- waiting records --------------------------------------------------------------------------


@attrs.frozen
class AwaitStream:
    pass


@attrs.frozen
class AwaitEvent:
    pass


@attrs.frozen
class AwaitInput:
    """Blocked on the inbox: nothing in flight and nothing pending."""


@attrs.frozen
class AwaitAdapterIds:
    new: tuple


@attrs.frozen
class AwaitPublishBlocks:
    pass


@attrs.frozen
class AwaitRotation:
    name: str


# --- start-up ---------------------------------------------------------------------------------


@task_rule(StartUp)
def _start_up(state: SchedulerState, task, out: list) -> SchedulerState:
    out.append(dc.BindGpuToThread())
    return ask(state, out, dc.CreateStream(), AwaitStream())


@answer_rule(AwaitStream, StreamCreated)
def _stream_created(state, waiting, event: StreamCreated, out):
    state = replace(state, prefill_stream=event.stream)
    return ask(state, out, dc.CreateEvent(), AwaitEvent())


@answer_rule(AwaitEvent, EventCreated)
def _event_created(state, waiting, event: EventCreated, out):
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


def queue_idle(state: SchedulerState) -> bool:
    return not state.pending and not state.rotations and not state.closed


def in_flight(state: SchedulerState) -> bool:
    return bool(state.active or state.prefilling)


def policy_declines(state: SchedulerState) -> bool:
    """The admission policy's word on prefilling now (FIFO is always willing)."""
    config = state.config
    if config.policy != "slai":
        return False
    return admission.slai_declines(state.now_ms, state.last_decode_ms, config.slai_deadline_ms, bool(state.active))


from fxsched.core.prefill import ContinuePrefills, StartRequests  # noqa: E402
from fxsched.core.decode import DecodeLane  # noqa: E402
from fxsched.core.lifecycle import RequeueResume, SwapIn, SwapOutRoom  # noqa: E402
from fxsched.core import flow as _flow  # noqa: E402,F401  (registers the forward continuation)


@task_rule(TickStart)
def _tick_start(state: SchedulerState, task, out: list) -> SchedulerState:
    state = drain_inbox(state)
    if not in_flight(state) and not state.swapped and not state.preempted and queue_idle(state):
        return ask(push(state, TickStart()), out, dc.WaitForInput(), AwaitInput())
    new = ()
    if state.pending and not policy_declines(state):
        cap = state.config.max_batch_size - len(state.active) - len(state.prefilling)
        new = admission.select_requests(state.config, state.pending, cap)
    state = replace(state, new_requests=new, pending=admission.without(state.pending, new),
                         mixed_step_ran=False)
    tasks = (Publish(), Rotate(), IdleCheck(), SwapOutRoom(), StartRequests(), ContinuePrefills(),
             EmptyBatchExit(), DecodeLane(), EndOfTick())
    if new:
        tasks = (Admit(),) + tasks
    return push(state, *tasks)


@answer_rule(AwaitInput, InputReady)
def _input_ready(state, waiting, event, out):
    return state  # TickStart is already back on the agenda and drains again


# --- admission check --------------------------------------------------------------------------


def _cohort_slot(state: SchedulerState) -> int:
    if state.active:
        return state.active[0].request.adapter_slot
    if state.prefilling:
        return state.prefilling[0].request.adapter_slot
    return state.new_requests[0].adapter_slot


@task_rule(Admit)
def _admit(state: SchedulerState, task, out: list) -> SchedulerState:
    slots = (_cohort_slot(state),) + tuple(r.adapter_slot for r in state.new_requests)
    return ask(state, out, dc.AdapterIdFor(slots), AwaitAdapterIds(state.new_requests))


def refuse_impossible(state: SchedulerState, new: tuple, ids: tuple, out: list):
    """Fail at once the requests no device state could ever serve; keep the others (and their ids)."""
    keep, keep_ids = [], []
    for request, adapter_id in zip(new, ids):
        problem = admission.impossible(state.model, state.config, request, adapter_id)
        if problem is None:
            keep.append(request)
            keep_ids.append(adapter_id)
        else:
            out.append(ErrorOut(request.id, problem, request.streaming))
    return tuple(keep), tuple(keep_ids)


def committed_blocks(state: SchedulerState) -> int:
    """KV blocks committed to everything in flight (scheduler.md §5.5)."""
    model, config = state.model, state.config
    total = 0
    for s in state.active:
        total += admission.commitment(model, config, s.seq_len + 1, s.remaining)
    for p in state.prefilling:
        total += admission.commitment(model, config, p.request.prompt_len, p.request.max_tokens)
    for w in state.swapped:
        total += admission.commitment(model, config, w.sequence.seq_len + 1, w.sequence.remaining)
    for p in state.preempted:
        total += admission.commitment(model, config, len(p.tokens) + 1, p.sequence.remaining)
    return total


@answer_rule(AwaitAdapterIds, AdapterIds)
def _adapter_ids(state, waiting: AwaitAdapterIds, event: AdapterIds, out):
    cohort_id, ids = event.ids[0], event.ids[1:]
    new, ids = refuse_impossible(state, waiting.new, ids, out)
    if new and not (state.active or state.prefilling):
        cohort_id = ids[0]  # the cohort is the first new request that can be served
    same, other = admission.cohort_split(cohort_id, new, ids)
    admitted, deferred = admission.reserve_kv(state.model, state.config, committed_blocks(state), same)
    back = tuple(sorted(deferred + other, key=lambda r: waiting.new.index(r)))
    return replace(state, new_requests=admitted, pending=back + state.pending)


# --- snapshot publish, rotation, idle check ----------------------------------------------------


@task_rule(Publish)
def _publish(state: SchedulerState, task, out: list) -> SchedulerState:
    return ask(state, out, dc.NumFreeBlocks(), AwaitPublishBlocks())


@answer_rule(AwaitPublishBlocks, FreeBlocks)
def _published(state, waiting, event, out):
    out.append(dc.SsmSnapshotOccupancy())
    out.append(dc.SsmSnapshotOccupancy())
    return replace(state, tick=state.tick + 1)


def quiescent(state: SchedulerState) -> bool:
    """Nothing active, prefilling, newly admitted, swapped or preempted."""
    return not (state.active or state.prefilling or state.new_requests or state.swapped or state.preempted)


@task_rule(Rotate)
def _rotate(state: SchedulerState, task, out: list) -> SchedulerState:
    if not state.rotations or not quiescent(state):
        return state
    name = state.rotations[0]
    state = replace(state, rotations=state.rotations[1:])
    return ask(push(state, Rotate()), out, lc.LoraRotate(name), AwaitRotation(name))


@answer_rule(AwaitRotation, LoraApplied)
def _rotated(state, waiting: AwaitRotation, event: LoraApplied, out):
    out.append(RotationAck(waiting.name, event.error))
    return state


@task_rule(IdleCheck)
def _idle_check(state: SchedulerState, task, out: list) -> SchedulerState:
    if state.new_requests or in_flight(state):
        return state
    state = drain_inbox(state)
    # a request drained here is still owed an answer: the loop ends only with nothing pending
    if state.closed and not state.pending and not state.swapped and not state.preempted:
        return replace(state, agenda=(Shutdown(),))
    return state


@attrs.frozen
class EmptyBatchSkip:
    pass


@task_rule(EmptyBatchExit)
def _empty_batch_exit(state: SchedulerState, task, out: list) -> SchedulerState:
    """After lane 2: with nothing active, try to bring back swapped and preempted sequences first.

    (scheduler.md §5.14 tries only the requeue resume; a swapped sequence would then wait forever
    once nothing else runs, since swap-in lives in the end of tick. Found by the model checker.)
    """
    if state.active:
        return state
    if state.config.spill_pool:
        return push(state, SwapIn(), RequeueResume(), EmptyBatchSkip())
    return push(state, RequeueResume(), EmptyBatchSkip())


@task_rule(EmptyBatchSkip)
def _empty_batch_skip(state: SchedulerState, task, out: list) -> SchedulerState:
    """Still nothing active: skip lane 3 and the end of tick."""
    if state.active:
        return state
    return replace(state, agenda=(TickStart(),))


# --- end of tick ------------------------------------------------------------------------------


def expire_deadlines(state: SchedulerState) -> SchedulerState:
    """Every active sequence whose deadline has passed gets guard ``request_timeout`` and finishes."""
    now = state.now_ms
    changed = {}
    for s in state.active:
        deadline = s.request.deadline_ms
        if deadline is not None and not s.finished and deadline <= now:
            changed[s.seq_id] = replace(s, guard=REQUEST_TIMEOUT, finished=True)
    if not changed:
        return state
    return replace(state, active=tuple(changed.get(s.seq_id, s) for s in state.active))


def retire_finished(state: SchedulerState, out: list) -> SchedulerState:
    """Finish and release every finished sequence in active order; compact the survivors."""
    survivors = []
    config = state.config
    for s in state.active:
        if not s.finished:
            survivors.append(s)
        elif planted(config, "leak_on_cancel") and s.cancel_requested:
            out.append(finish_frame(s, config))
        else:
            finish_and_release(s, config, out)
            if planted(config, "double_release"):
                out.append(lc.ReleaseSeq(s.seq_id, s.slot, cache=True, reason="finish_sequence"))
    pinned = tuple(e.slot for e in state.prefilling)
    return replace(state, active=compact(tuple(survivors), out, planted(config, "wrong_compaction_target"), pinned))


@task_rule(EndOfTick)
def _end_of_tick(state: SchedulerState, task, out: list) -> SchedulerState:
    state = expire_deadlines(state)
    state = retire_finished(state, out)
    if state.config.spill_pool:
        return push(state, SwapIn(), RequeueResume(), TickStart())
    return push(state, RequeueResume(), TickStart())


# --- shutdown ---------------------------------------------------------------------------------


SHUTDOWN_ABORT = "aborted: the scheduler shut down"


@task_rule(Shutdown)
def _shutdown(state: SchedulerState, task, out: list) -> SchedulerState:
    from fxsched.core.faults import fail_request

    for s in state.active:
        finish_and_release(s, state.config, out)
    for entry in state.prefilling:
        fail_request(entry.request, entry.seq_id, entry.slot, SHUTDOWN_ABORT, out)
    for held in state.swapped:
        fail_request(held.sequence.request, held.sequence.seq_id, None, SHUTDOWN_ABORT, out)
    for entry in state.preempted:
        fail_request(entry.sequence.request, entry.sequence.seq_id, None, SHUTDOWN_ABORT, out)
    for request in state.pending + state.inbox:
        out.append(ErrorOut(request.id, SHUTDOWN_ABORT, request.streaming))
    out.extend([lc.EpShutdown(), lc.Quiesce(0), lc.Quiesce(state.prefill_stream), lc.Teardown()])
    return replace(state, active=(), prefilling=(), swapped=(), preempted=(), pending=(), inbox=(), agenda=(),
                   stopped=True)
