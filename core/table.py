"""The transition table: every task type to its rule, every waiting type to the answers it
accepts, what a ``DeviceFault`` there fails, and the rule that takes the answer.

This literal table *is* the scheduler's transition relation: ``core/machine.py``'s ``step`` only
looks rules up here. A (waiting, answer) pair that is not listed is refused with ``PhaseError`` and
changes nothing; a ``DeviceFault`` not accepted by a phase is handled as its fault scope declares
(``core/faults.py``, specs/faults.md §8.1). ``fxsched phases`` prints this table.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs

from fxsched.core import decode, dflash, flow, kverify, lifecycle, mtp_batch, ngram, prefill, self_spec, spec_step, tick
from fxsched.core import events as ev
from fxsched.core import phases as ph
from fxsched.core.faults import (
    FailActive,
    FailRequests,
    FailRotation,
    FailSeqs,
    FaultScope,
    Halt,
    RuleTakesFault,
)
from fxsched.core.state import SchedulerState
from fxsched.effects.base import Effect

TaskRule = Callable[[SchedulerState, Any, list[Effect]], SchedulerState]
AnswerRule = Callable[[SchedulerState, Any, Any, list[Effect]], SchedulerState]


@attrs.frozen
class Phase:
    """A waiting phase: the answers it accepts, what a fault there fails, and its rule."""

    accepts: tuple[type[ev.Answer], ...]
    fault: FaultScope
    rule: AnswerRule


SEQ = FailSeqs(("seq_id",))
SEQS = FailSeqs(("seq_ids",))
NEW = FailSeqs(("seq_id",), request="request", slot="slot")
NO_COUNT = "the device cannot count its free blocks"
NO_RECLAIM = "the device cannot reclaim prefix-cache blocks"

TASKS: dict[type, TaskRule] = {
    # the loop
    ph.StartUp: tick.start_up,
    ph.TickStart: tick.tick_start,
    ph.Admit: tick.admit,
    ph.Publish: tick.publish,
    ph.Rotate: tick.rotate,
    ph.IdleCheck: tick.idle_check,
    ph.EmptyBatchExit: tick.empty_batch_exit,
    ph.EmptyBatchSkip: tick.empty_batch_skip,
    ph.EndOfTick: tick.end_of_tick,
    ph.RetireResolved: tick.retire_resolved,
    ph.Shutdown: tick.shutdown,
    # control flow
    ph.EmitEffects: flow.emit_effects,
    ph.AskQuery: flow.ask_query,
    # lane 1
    ph.StartRequests: prefill.start_requests,
    ph.StartRequest: prefill.start_request,
    ph.BeamGroup: prefill.beam_group,
    ph.Chunk0Done: prefill.chunk0_done,
    # lane 2
    ph.ContinuePrefills: prefill.continue_prefills,
    ph.PickPrefillToken: prefill.pick_prefill_token,
    ph.Barrier: prefill.barrier,
    ph.MixedReadback: prefill.mixed_readback,
    ph.Promote: prefill.promote,
    # lane 3
    ph.DecodeLane: decode.decode_lane,
    ph.PlainDecode: decode.plain_decode,
    ph.ResolveAhead: decode.resolve_ahead,
    ph.SpecStep: spec_step.spec_step,
    ph.Bootstrap: spec_step.bootstrap,
    ph.Verifies: spec_step.verifies,
    ph.SerialVerify: kverify.serial_verify,
    ph.DflashGate: dflash.gate,
    ph.BatchedDflashVerify: dflash.batched_verify,
    ph.MtpGate: mtp_batch.gate,
    ph.MtpGateCheck: mtp_batch.gate_check,
    ph.NgramStep: ngram.ngram_step,
    ph.SelfSpecStep: self_spec.self_spec_step,
    # memory pressure
    ph.SwapOutRoom: lifecycle.swap_out_room,
    ph.SwapOutFor: lifecycle.swap_out_for,
    ph.SwapIn: lifecycle.swap_in,
    ph.RequeueResume: lifecycle.requeue_resume,
}

IDLE: dict[type, Callable[[SchedulerState], bool]] = {
    # tasks whose rule would return the state as it is and emit nothing when the predicate holds;
    # ``advance`` drops them without running the rule (or copying the state to pop them). Each
    # predicate is the rule's own first test (the rule calls it too), so the two cannot drift apart.
    ph.Rotate: tick.no_rotation_due,
    ph.IdleCheck: tick.not_idle,
    ph.SwapOutRoom: lifecycle.no_swap_out_room_needed,
    ph.StartRequests: prefill.nothing_admitted,
    ph.ContinuePrefills: prefill.nothing_prefilling,
    ph.EmptyBatchExit: tick.batch_not_empty,
    ph.EmptyBatchSkip: tick.batch_not_empty,
    ph.RequeueResume: lifecycle.no_resume_due,
    ph.ResolveAhead: decode.nothing_ahead,
    ph.SwapIn: lifecycle.no_swap_in_due,
}

ANSWERS: dict[type, Phase] = {
    # the loop
    ph.AwaitStream: Phase((ev.StreamCreated,), Halt("the device has no prefill stream"), tick.stream_created),
    ph.AwaitEvent: Phase((ev.EventCreated,), Halt("the device has no stream event"), tick.event_created),
    ph.AwaitInput: Phase((ev.InputReady,), Halt("the inbox wait failed"), tick.input_ready),
    ph.AwaitAdapterIds: Phase((ev.AdapterIds,), FailRequests("new"), tick.adapter_ids),
    ph.AwaitPublishBlocks: Phase((ev.FreeBlocks,), Halt(NO_COUNT), tick.published),
    ph.AwaitRotation: Phase((ev.LoraApplied,), FailRotation("name"), tick.rotated),
    # control flow
    ph.AwaitForward: Phase((ev.ForwardDone,), FailSeqs(("seq_ids",), request="request", slot="slot"),
                           flow.forward_done),
    # lane 1
    ph.AwaitSlot: Phase((ev.SlotAllocated,), FailSeqs(("seq_id",), request="request"), prefill.slot_allocated),
    ph.AwaitLaneAdapter: Phase((ev.AdapterIds,), NEW, prefill.lane_adapter),
    ph.AwaitFirstToken: Phase((ev.TokenSampled, ev.TokensSampled), NEW, prefill.first_token),
    ph.AwaitBeam: Phase((ev.BeamHypotheses,), NEW, prefill.beam_done),
    ph.AwaitBeamGroup: Phase((ev.BeamHypotheses,), FailRequests("requests"), prefill.beam_group_done),
    # lane 2
    ph.AwaitPrefillToken: Phase((ev.TokenSampled, ev.TokensSampled), SEQ, prefill.prefill_token),
    ph.AwaitMixedReadback: Phase((ev.TokensSampled,), FailSeqs(("seq_ids",), all_prefilling=True),
                                 prefill.mixed_read),
    # lane 3
    ph.AwaitDecode: Phase((ev.TokensSampled, ev.DeviceFault), RuleTakesFault(), decode.decoded),
    ph.AwaitAhead: Phase((ev.TokensSampled,), SEQS, decode.ahead_read),
    ph.AwaitCapacity: Phase((ev.DraftCapacity,), FailActive(), spec_step.capacity),
    ph.AwaitProposal: Phase((ev.Drafts,), SEQ, spec_step.proposed),
    ph.AwaitBatchedProposal: Phase((ev.BatchedDrafts,), SEQS, spec_step.batched_proposed),
    ph.AwaitKVerify: Phase((ev.VerifyRows,), SEQ, kverify.k_verified),
    ph.AwaitMtpDecode: Phase((ev.TokenSampled, ev.TokensSampled), SEQ, kverify.mtp_decoded),
    ph.AwaitDflashDrafts: Phase((ev.Drafts,), SEQ, dflash.bootstrap_drafts),
    ph.AwaitDflashVerify: Phase((ev.VerifyRows,), SEQ, dflash.dflash_verified),
    ph.AwaitDflashGate: Phase((ev.BatchVerifyAllowed,), FailSeqs(("batchable", "rest")), dflash.gate_answer),
    ph.AwaitBatchedDflash: Phase((ev.VerifyRows,), SEQS, dflash.batched_verified),
    ph.AwaitMtpGate: Phase((ev.BatchVerifyAllowed,), FailSeqs(("batch.seq_ids",)), mtp_batch.gate_answer),
    ph.AwaitMtpBatch: Phase((ev.VerifyRows,), SEQS, mtp_batch.batch_verified),
    ph.AwaitNgramDecode: Phase((ev.TokenSampled, ev.TokensSampled), SEQ, ngram.ngram_decoded),
    ph.AwaitNgramVerify: Phase((ev.VerifyRows,), SEQ, ngram.ngram_verified),
    ph.AwaitSelfCapacity: Phase((ev.DraftCapacity,), FailActive(), self_spec.self_capacity),
    ph.AwaitSelfToken: Phase((ev.TokenSampled,), SEQ, self_spec.self_token),
    ph.AwaitSelfVerify: Phase((ev.VerifyRows,), SEQ, self_spec.self_verified),
    # memory pressure
    ph.AwaitSwapOutFree: Phase((ev.FreeBlocks,), Halt(NO_COUNT), lifecycle.swap_out_free),
    ph.AwaitSwapOutReclaim: Phase((ev.BlocksReclaimed,), Halt(NO_RECLAIM), lifecycle.swap_out_reclaimed),
    ph.AwaitSwapInFree: Phase((ev.FreeBlocks,), Halt(NO_COUNT), lifecycle.swap_in_free),
    ph.AwaitSwapInReclaim: Phase((ev.BlocksReclaimed, ev.FreeBlocks), Halt(NO_RECLAIM), lifecycle.swap_in_reclaimed),
    ph.AwaitSwapInSlot: Phase((ev.SlotAllocated,), SEQ, lifecycle.swap_in_slot),
    ph.AwaitRestore: Phase((ev.StateRestored, ev.DeviceFault), RuleTakesFault(), lifecycle.restored),
    ph.AwaitResumeFree: Phase((ev.FreeBlocks,), SEQ, lifecycle.resume_free),
    ph.AwaitResumeReclaim: Phase((ev.BlocksReclaimed,), SEQ, lifecycle.resume_reclaimed),
    ph.AwaitResumeSlot: Phase((ev.SlotAllocated,), SEQ, lifecycle.resume_slot),
}


def rows() -> list[tuple[str, str, str, str]]:
    """The table as text rows: (phase, what it waits for, which rule takes it, what a fault fails)."""
    out = []
    for task, rule in TASKS.items():
        out.append((task.__name__, "- (a task)", f"{rule.__module__.rsplit('.', 1)[-1]}.{rule.__name__}", "-"))
    for waiting, phase in ANSWERS.items():
        accepts = " | ".join(t.__name__ for t in phase.accepts)
        name = f"{phase.rule.__module__.rsplit('.', 1)[-1]}.{phase.rule.__name__}"
        out.append((waiting.__name__, accepts, name, phase.fault.describe()))
    return out
