"""Memory pressure: preemption with requeue, admission-time swap-out and swap-in
(scheduler.md §5.9, §5.18, §5.19 steps 4–5).

Invariants kept: a preempted or swapped sequence keeps everything its client needs (output,
budget, counters) and loses nothing; it returns to active only when its blocks fit; its client
notices nothing but time.
"""

from __future__ import annotations

from typing import Optional

import attrs

from fxsched.core.events import BlocksReclaimed, DeviceFault, FreeBlocks, SlotAllocated, StateRestored
from fxsched.core.flow import forward
from fxsched.core.machine import answer_rule, ask, push, task_rule
from fxsched.core.prefill import ep_prefill_preamble
from fxsched.core.planted import planted
from fxsched.core.records import replace
from fxsched.core.request import Request
from fxsched.core.sequence import Sequence
from fxsched.core.state import Preempted, SchedulerState, Swapped
from fxsched.effects import device_calls as dc
from fxsched.effects.client import ErrorOut
from fxsched.effects.lifecycle import CompactSlot, DetachSlot, ReleaseSeq, SaveSequenceState


def preemption_victim(active: tuple[Sequence, ...]) -> Optional[Sequence]:
    """The sequence to preempt: smallest (output length, slot) among those no longer immune
    (all of them when every one is immune)."""
    if not active:
        return None
    mortal = [s for s in active if len(s.output) >= s.immune_until] or list(active)
    return min(mortal, key=lambda s: (len(s.output), s.slot))


def swap_victim(active: tuple[Sequence, ...]) -> Optional[Sequence]:
    """The sequence to spill: the longest block table; ties go to the last in active order."""
    best = None
    for s in active:
        if best is None or s.blocks >= best.blocks:
            best = s
    return best


def spill(state: SchedulerState, victim: Sequence, out: list) -> SchedulerState:
    """Save the victim's state to the spill pool and free its blocks and slot."""
    out.append(SaveSequenceState(victim.seq_id))
    out.append(ReleaseSeq(victim.seq_id, victim.slot, cache=False, reason="spill_out_sequence"))
    return replace(state, swapped=state.swapped + (Swapped(replace(victim, drafts=())),))


def preempt(state: SchedulerState, victim: Sequence, out: list) -> SchedulerState:
    """Drop the victim from the KV (or spill it, with a spill pool); its client notices nothing."""
    state = replace(state, active=tuple(s for s in state.active if s.seq_id != victim.seq_id))
    if state.config.spill_pool:
        return spill(state, victim, out)
    if not planted(state.config, "slot_leak_on_preemption"):
        out.append(ReleaseSeq(victim.seq_id, victim.slot, cache=True, reason="preempt_requeue"))
    entry = Preempted(replace(victim, drafts=()), victim.kv_tokens())
    return replace(state, preempted=state.preempted + (entry,))


def swap_out(state: SchedulerState, victim: Sequence, out: list) -> SchedulerState:
    """Spill the victim, then move the last active sequence into its place in the active order;
    if that sequence sits in a higher slot it moves into the victim's slot, freed by the spill.

    (The rule of scheduler.md §5.9 moves it to "its new index" before the spill, which would
    target a slot the victim still holds; found by the model checker.)
    """
    active = list(state.active)
    index = next(i for i, s in enumerate(active) if s.seq_id == victim.seq_id)
    last = active.pop()
    state = spill(replace(state, active=tuple(active)), victim, out)
    if last.seq_id == victim.seq_id:
        return state
    if last.slot > victim.slot:
        out.append(CompactSlot(last.seq_id, victim.slot))
        out.append(DetachSlot(last.seq_id))
        last = replace(last, slot=victim.slot)
    active[index] = last
    return replace(state, active=tuple(active))


# --- admission-time swap-out ------------------------------------------------------------------


@attrs.frozen
class SwapOutRoom:
    """Before lane 1, with a spill pool: make room for each new request's prompt."""


@attrs.frozen
class SwapOutFor:
    need: int


@attrs.frozen
class AwaitSwapOutFree:
    need: int
    phase: str  # "reclaim" or "swap"


@attrs.frozen
class AwaitSwapOutReclaim:
    need: int


@task_rule(SwapOutRoom)
def _swap_out_room(state: SchedulerState, task, out: list) -> SchedulerState:
    if not state.config.spill_pool or not state.new_requests:
        return state
    block_size = state.model.block_size
    return push(state, *(SwapOutFor(r.prompt_len // block_size + 1) for r in state.new_requests))


@task_rule(SwapOutFor)
def _swap_out_for(state: SchedulerState, task: SwapOutFor, out: list) -> SchedulerState:
    return ask(state, out, dc.NumFreeBlocks(), AwaitSwapOutFree(task.need, "reclaim"))


@answer_rule(AwaitSwapOutFree, FreeBlocks)
def _swap_out_free(state, waiting: AwaitSwapOutFree, event: FreeBlocks, out):
    need = waiting.need
    if waiting.phase == "reclaim":
        if event.count >= need:
            return ask(state, out, dc.NumFreeBlocks(), AwaitSwapOutFree(need, "swap"))
        return ask(state, out, dc.ReclaimPrefixBlocks(need - event.count), AwaitSwapOutReclaim(need))
    if event.count >= need or not state.active:
        return state
    state = swap_out(state, swap_victim(state.active), out)
    return ask(state, out, dc.NumFreeBlocks(), AwaitSwapOutFree(need, "swap"))


@answer_rule(AwaitSwapOutReclaim, BlocksReclaimed)
def _swap_out_reclaimed(state, waiting: AwaitSwapOutReclaim, event: BlocksReclaimed, out):
    phase = "swap" if event.count == 0 else "reclaim"
    return ask(state, out, dc.NumFreeBlocks(), AwaitSwapOutFree(waiting.need, phase))


# --- swap-in ------------------------------------------------------------------------------------


@attrs.frozen
class SwapIn:
    pass


@attrs.frozen
class AwaitSwapInFree:
    pass


@attrs.frozen
class AwaitSwapInReclaim:
    smallest: int


@attrs.frozen
class AwaitSwapInSlot:
    seq_id: int


@attrs.frozen
class AwaitRestore:
    seq_id: int
    slot: int


def _room_for_more(state: SchedulerState) -> bool:
    return len(state.active) < state.config.max_batch_size


@task_rule(SwapIn)
def _swap_in(state: SchedulerState, task, out: list) -> SchedulerState:
    if not state.swapped or not _room_for_more(state):
        return state
    return ask(state, out, dc.NumFreeBlocks(), AwaitSwapInFree())


@answer_rule(AwaitSwapInFree, FreeBlocks)
def _swap_in_free(state, waiting, event: FreeBlocks, out):
    smallest = min(w.sequence.blocks for w in state.swapped)
    if smallest > event.count:
        return ask(state, out, dc.ReclaimPrefixBlocks(smallest - event.count), AwaitSwapInReclaim(smallest))
    return _swap_in_first_fitting(state, event.count, out)


@answer_rule(AwaitSwapInReclaim, BlocksReclaimed, FreeBlocks)
def _swap_in_reclaimed(state, waiting: AwaitSwapInReclaim, event, out):
    if isinstance(event, BlocksReclaimed):
        if event.count == 0:
            return state  # nothing fits: the smallest needs more than is free
        return ask(state, out, dc.NumFreeBlocks(), waiting)
    if waiting.smallest > event.count:
        return ask(state, out, dc.ReclaimPrefixBlocks(waiting.smallest - event.count), waiting)
    return _swap_in_first_fitting(state, event.count, out)


def _swap_in_first_fitting(state: SchedulerState, free: int, out: list) -> SchedulerState:
    fitting = next((w for w in state.swapped if w.sequence.blocks <= free), None)
    if fitting is None:
        return state
    seq = fitting.sequence
    state = replace(state, swapped=tuple(w for w in state.swapped if w is not fitting),
                    restoring=state.restoring + (seq,))
    return ask(state, out, dc.AllocSequence(seq.seq_id, 0), AwaitSwapInSlot(seq.seq_id))


def _restoring(state: SchedulerState, seq_id: int) -> Sequence:
    return next(s for s in state.restoring if s.seq_id == seq_id)


@answer_rule(AwaitSwapInSlot, SlotAllocated)
def _swap_in_slot(state, waiting: AwaitSwapInSlot, event: SlotAllocated, out):
    seq = _restoring(state, waiting.seq_id)
    return ask(state, out, dc.RestoreSequenceState(seq.seq_id, seq.blocks), AwaitRestore(seq.seq_id, event.slot))


@answer_rule(AwaitRestore, StateRestored, DeviceFault)
def _restored(state, waiting: AwaitRestore, event, out):
    """The sequence comes back without its session number and without its cancel flag."""
    seq = _restoring(state, waiting.seq_id)
    state = replace(state, restoring=tuple(s for s in state.restoring if s.seq_id != seq.seq_id))
    error = event.message if isinstance(event, DeviceFault) else event.error
    if error is not None:
        out.append(ReleaseSeq(seq.seq_id, waiting.slot, cache=False, reason="send_error"))
        out.append(ErrorOut(seq.request_id, error, seq.request.streaming))
        return push(state, SwapIn())
    out.append(dc.AcquireAdapterSlot(seq.request.adapter_slot))
    seq = replace(seq, slot=waiting.slot, has_cancel_flag=False, cancel_requested=False)
    return push(replace(state, active=state.active + (seq,)), SwapIn())


# --- requeue resume -----------------------------------------------------------------------------


@attrs.frozen
class RequeueResume:
    pass


@attrs.frozen
class AwaitResumeFree:
    seq_id: int
    want: int
    reclaimed: bool = False


@attrs.frozen
class AwaitResumeReclaim:
    seq_id: int
    want: int


@attrs.frozen
class AwaitResumeSlot:
    seq_id: int


def resume_candidate(state: SchedulerState) -> Preempted:
    block_size = state.model.block_size
    return min(state.preempted, key=lambda p: len(p.tokens) // block_size + 1)


@task_rule(RequeueResume)
def _requeue_resume(state: SchedulerState, task, out: list) -> SchedulerState:
    if not state.preempted or not _room_for_more(state):
        return state
    entry = resume_candidate(state)
    want = len(entry.tokens) // state.model.block_size + 2
    if want > state.model.total_blocks:
        seq = entry.sequence
        out.append(ErrorOut(seq.request_id, f"request {seq.request_id} needs {want} KV blocks, more than the "
                                            f"{state.model.total_blocks} the device has", seq.request.streaming))
        state = replace(state, preempted=tuple(p for p in state.preempted if p is not entry))
        return push(state, RequeueResume())
    return ask(state, out, dc.NumFreeBlocks(), AwaitResumeFree(entry.sequence.seq_id, want))


@answer_rule(AwaitResumeFree, FreeBlocks)
def _resume_free(state, waiting: AwaitResumeFree, event: FreeBlocks, out):
    if event.count >= waiting.want:
        return ask(state, out, dc.AllocSequence(waiting.seq_id, _preempted(state, waiting.seq_id).sequence.request_id),
                   AwaitResumeSlot(waiting.seq_id))
    if waiting.reclaimed:
        return state
    return ask(state, out, dc.ReclaimPrefixBlocks(waiting.want - event.count),
               AwaitResumeReclaim(waiting.seq_id, waiting.want))


@answer_rule(AwaitResumeReclaim, BlocksReclaimed)
def _resume_reclaimed(state, waiting: AwaitResumeReclaim, event: BlocksReclaimed, out):
    if event.count == 0:
        return state
    return ask(state, out, dc.NumFreeBlocks(), AwaitResumeFree(waiting.seq_id, waiting.want, reclaimed=True))


def _preempted(state: SchedulerState, seq_id: int) -> Preempted:
    return next(p for p in state.preempted if p.sequence.seq_id == seq_id)


@answer_rule(AwaitResumeSlot, SlotAllocated)
def _resume_slot(state, waiting: AwaitResumeSlot, event: SlotAllocated, out):
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
