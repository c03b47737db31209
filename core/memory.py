"""Memory pressure helpers: choosing victims, preempting, spilling and the swap-out move
(specs/scheduler.md §5.9, §5.18). Pure functions of the state; the rules that ask the device live
in ``core/lifecycle.py``.

Invariant kept: a preempted or swapped sequence keeps everything its client needs (output,
budget, counters) and loses nothing; its client notices nothing but time.
"""

from __future__ import annotations

from typing import Optional

from fxsched.core.agenda import drop_drafts
from fxsched.core.records import replace
from fxsched.core.sequence import Sequence
from fxsched.core.state import Preempted, SchedulerState, Swapped
from fxsched.effects.base import Effect
from fxsched.effects.lifecycle import CompactSlot, DetachSlot, ReleaseReason, ReleaseSeq, SaveSequenceState


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


def spill(state: SchedulerState, victim: Sequence, out: list[Effect]) -> SchedulerState:
    """Save the victim's state to the spill pool and free its blocks and slot."""
    out.append(SaveSequenceState(victim.seq_id))
    out.append(ReleaseSeq(victim.seq_id, victim.slot, cache=False, reason=ReleaseReason.SPILL_OUT_SEQUENCE))
    state = drop_drafts(state, (victim.seq_id,))
    return replace(state, swapped=state.swapped + (Swapped(victim),))


def preempt(state: SchedulerState, victim: Sequence, out: list[Effect]) -> SchedulerState:
    """Drop the victim from the KV (or spill it, with a spill pool); its client notices nothing."""
    state = replace(state, active=tuple(s for s in state.active if s.seq_id != victim.seq_id))
    if state.config.spill_pool:
        return spill(state, victim, out)
    out.append(ReleaseSeq(victim.seq_id, victim.slot, cache=True, reason=ReleaseReason.PREEMPT_REQUEUE))
    entry = Preempted(victim, victim.kv_tokens())
    return replace(drop_drafts(state, (victim.seq_id,)), preempted=state.preempted + (entry,))


def swap_out(state: SchedulerState, victim: Sequence, out: list[Effect]) -> SchedulerState:
    """Spill the victim, then move the last active sequence into its place in the active order;
    if that sequence sits in a higher slot it moves into the victim's slot, freed by the spill.

    (Moving it before the spill would target a slot the victim still holds; found by the model
    checker, specs/scheduler.md §5.9.)
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
