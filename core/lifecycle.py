"""Rules of memory pressure: admission-time swap-out, swap-in and requeue resume
(specs/scheduler.md §5.9, §5.18, §5.19). Victims, preemption and the spill itself are pure helpers
in ``core/memory.py``.

Invariant kept: a preempted or swapped sequence returns to active only when its blocks fit; its
client notices nothing but time.
"""

from __future__ import annotations

from fxsched.core.agenda import ask, forward, push
from fxsched.core.events import BlocksReclaimed, DeviceFault, FreeBlocks, SlotAllocated, StateRestored
from fxsched.core.kv import blocks_for
from fxsched.core.memory import swap_out, swap_victim
from fxsched.core.phases import (
    AwaitRestore,
    AwaitResumeFree,
    AwaitResumeReclaim,
    AwaitResumeSlot,
    AwaitSwapInFree,
    AwaitSwapInReclaim,
    AwaitSwapInSlot,
    AwaitSwapOutFree,
    AwaitSwapOutReclaim,
    RequeueResume,
    SwapIn,
    SwapOutFor,
    SwapOutRoom,
    SwapOutStage,
)
from fxsched.core.records import replace
from fxsched.core.rows import ep_prefill_preamble
from fxsched.core.sequence import Sequence
from fxsched.core.state import Preempted, SchedulerState
from fxsched.effects import device_calls as dc
from fxsched.effects.base import Effect
from fxsched.effects.client import ErrorOut
from fxsched.effects.lifecycle import ReleaseReason, ReleaseSeq


# --- admission-time swap-out ------------------------------------------------------------------


def no_swap_out_room_needed(state: SchedulerState) -> bool:
    """Admission-time swap-out has nothing to do: no spill pool, or nothing admitted this tick."""
    return not state.config.spill_pool or not state.new_requests


def swap_out_room(state: SchedulerState, task: SwapOutRoom, out: list[Effect]) -> SchedulerState:
    if no_swap_out_room_needed(state):
        return state
    block_size = state.model.block_size
    return push(state, *(SwapOutFor(blocks_for(r.prompt_len, block_size)) for r in state.new_requests))


def swap_out_for(state: SchedulerState, task: SwapOutFor, out: list[Effect]) -> SchedulerState:
    return ask(state, out, dc.NumFreeBlocks(), AwaitSwapOutFree(task.need, SwapOutStage.RECLAIM))


def swap_out_free(state: SchedulerState, waiting: AwaitSwapOutFree, event: FreeBlocks,
                  out: list[Effect]) -> SchedulerState:
    need = waiting.need
    if waiting.stage is SwapOutStage.RECLAIM:
        if event.count >= need:
            return ask(state, out, dc.NumFreeBlocks(), AwaitSwapOutFree(need, SwapOutStage.SWAP))
        return ask(state, out, dc.ReclaimPrefixBlocks(need - event.count), AwaitSwapOutReclaim(need))
    victim = swap_victim(state.active)
    if event.count >= need or victim is None:
        return state
    state = swap_out(state, victim, out)
    return ask(state, out, dc.NumFreeBlocks(), AwaitSwapOutFree(need, SwapOutStage.SWAP))


def swap_out_reclaimed(state: SchedulerState, waiting: AwaitSwapOutReclaim, event: BlocksReclaimed,
                       out: list[Effect]) -> SchedulerState:
    stage = SwapOutStage.SWAP if event.count == 0 else SwapOutStage.RECLAIM
    return ask(state, out, dc.NumFreeBlocks(), AwaitSwapOutFree(waiting.need, stage))


# --- swap-in ------------------------------------------------------------------------------------


def _room_for_more(state: SchedulerState) -> bool:
    return len(state.rows) + len(state.prefilling) < state.config.max_batch_size


def no_swap_in_due(state: SchedulerState) -> bool:
    """Swap-in has nothing to do: nothing swapped out, or no room in the batch."""
    return not state.swapped or not _room_for_more(state)


def swap_in(state: SchedulerState, task: SwapIn, out: list[Effect]) -> SchedulerState:
    if no_swap_in_due(state):
        return state
    return ask(state, out, dc.NumFreeBlocks(), AwaitSwapInFree())


def swap_in_free(state: SchedulerState, waiting: AwaitSwapInFree, event: FreeBlocks,
                 out: list[Effect]) -> SchedulerState:
    smallest = min(w.sequence.blocks for w in state.swapped)
    if smallest > event.count:
        return ask(state, out, dc.ReclaimPrefixBlocks(smallest - event.count), AwaitSwapInReclaim(smallest))
    return _swap_in_first_fitting(state, event.count, out)


def swap_in_reclaimed(state: SchedulerState, waiting: AwaitSwapInReclaim, event: BlocksReclaimed | FreeBlocks,
                      out: list[Effect]) -> SchedulerState:
    if isinstance(event, BlocksReclaimed):
        if event.count == 0:
            return state  # nothing fits: the smallest needs more than is free
        return ask(state, out, dc.NumFreeBlocks(), waiting)
    if waiting.smallest > event.count:
        return ask(state, out, dc.ReclaimPrefixBlocks(waiting.smallest - event.count), waiting)
    return _swap_in_first_fitting(state, event.count, out)


def _swap_in_first_fitting(state: SchedulerState, free: int, out: list[Effect]) -> SchedulerState:
    fitting = next((w for w in state.swapped if w.sequence.blocks <= free), None)
    if fitting is None:
        return state
    seq = fitting.sequence
    state = replace(state, swapped=tuple(w for w in state.swapped if w is not fitting),
                    restoring=state.restoring + (seq,))
    return ask(state, out, dc.AllocSequence(seq.seq_id, 0), AwaitSwapInSlot(seq.seq_id))


def _restoring(state: SchedulerState, seq_id: int) -> Sequence:
    return next(s for s in state.restoring if s.seq_id == seq_id)


def swap_in_slot(state: SchedulerState, waiting: AwaitSwapInSlot, event: SlotAllocated,
                 out: list[Effect]) -> SchedulerState:
    seq = _restoring(state, waiting.seq_id)
    return ask(state, out, dc.RestoreSequenceState(seq.seq_id, seq.blocks), AwaitRestore(seq.seq_id, event.slot))


def restored(state: SchedulerState, waiting: AwaitRestore, event: StateRestored | DeviceFault,
             out: list[Effect]) -> SchedulerState:
    """The sequence comes back without its session number and without its cancel flag."""
    seq = _restoring(state, waiting.seq_id)
    state = replace(state, restoring=tuple(s for s in state.restoring if s.seq_id != seq.seq_id))
    error = event.message if isinstance(event, DeviceFault) else event.error
    if error is not None:
        out.append(ReleaseSeq(seq.seq_id, waiting.slot, cache=False, reason=ReleaseReason.SEND_ERROR))
        out.append(ErrorOut(seq.request_id, error, seq.request.streaming))
        return push(state, SwapIn())
    out.append(dc.AcquireAdapterSlot(seq.request.adapter_slot))
    seq = replace(seq, slot=waiting.slot, has_cancel_flag=False, cancel_requested=False)
    return push(replace(state, active=state.active + (seq,)), SwapIn())


# --- requeue resume -----------------------------------------------------------------------------


def resume_candidate(state: SchedulerState) -> Preempted:
    block_size = state.model.block_size
    return min(state.preempted, key=lambda p: blocks_for(len(p.tokens), block_size))


def no_resume_due(state: SchedulerState) -> bool:
    """Requeue resume has nothing to do: nothing preempted, or no room in the batch."""
    return not state.preempted or not _room_for_more(state)


def requeue_resume(state: SchedulerState, task: RequeueResume, out: list[Effect]) -> SchedulerState:
    if no_resume_due(state):
        return state
    entry = resume_candidate(state)
    want = blocks_for(len(entry.tokens), state.model.block_size) + 1
    if want > state.model.total_blocks:
        seq = entry.sequence
        out.append(ErrorOut(seq.request_id, f"request {seq.request_id} needs {want} KV blocks, more than the "
                                            f"{state.model.total_blocks} the device has", seq.request.streaming))
        state = replace(state, preempted=tuple(p for p in state.preempted if p is not entry))
        return push(state, RequeueResume())
    return ask(state, out, dc.NumFreeBlocks(), AwaitResumeFree(entry.sequence.seq_id, want))


def resume_free(state: SchedulerState, waiting: AwaitResumeFree, event: FreeBlocks,
                out: list[Effect]) -> SchedulerState:
    if event.count >= waiting.want:
        return ask(state, out, dc.AllocSequence(waiting.seq_id, _preempted(state, waiting.seq_id).sequence.request_id),
                   AwaitResumeSlot(waiting.seq_id))
    if waiting.reclaimed:
        return state
    return ask(state, out, dc.ReclaimPrefixBlocks(waiting.want - event.count),
               AwaitResumeReclaim(waiting.seq_id, waiting.want))


def resume_reclaimed(state: SchedulerState, waiting: AwaitResumeReclaim, event: BlocksReclaimed,
                     out: list[Effect]) -> SchedulerState:
    if event.count == 0:
        return state
    return ask(state, out, dc.NumFreeBlocks(), AwaitResumeFree(waiting.seq_id, waiting.want, reclaimed=True))


def _preempted(state: SchedulerState, seq_id: int) -> Preempted:
    return next(p for p in state.preempted if p.sequence.seq_id == seq_id)


def resume_slot(state: SchedulerState, waiting: AwaitResumeSlot, event: SlotAllocated,
                out: list[Effect]) -> SchedulerState:
    """Re-prefill the whole history; nothing is read or streamed, the last token stays."""
    entry = _preempted(state, waiting.seq_id)
    seq, tokens = entry.sequence, entry.tokens
    out.append(dc.AcquireAdapterSlot(seq.request.adapter_slot))
    ep_prefill_preamble(event.slot, len(tokens), 0, tokens, out)
    seq = replace(seq, slot=event.slot, seq_len=len(tokens), blocks=state.model.blocks_for(len(tokens)), ring=(),
                  ring_cursor=0, immune_until=len(seq.output) + state.config.preemption_immunity_tokens)
    state = replace(state, preempted=tuple(p for p in state.preempted if p is not entry),
                    active=state.active + (seq,))
    return forward(state, out, dc.Prefill(seq.seq_id, tokens, stream=0), (seq.seq_id,), RequeueResume())
