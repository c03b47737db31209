"""Every task and every waiting record of the engine, as one namespace.

A *task* is work on the agenda of the current tick; its rule either finishes at once or ends the
batch of effects with a query. A *waiting* record (``Await...``) is parked in ``state.waiting``
while that query is outstanding: it says what answer the engine waits for and carries what the rule
needs to go on. Rules hand work to another lane only by pushing one of these records, never by
calling into another rule module. ``core/table.py`` maps each type below to its rule, and each
waiting type to the answers it accepts and to what a ``DeviceFault`` there fails.

This module defines nothing: being that one namespace (``phases.X``, ``ph.X``) is its concern. The
records live in one module per lane, grouped in the order a tick meets them (specs/scheduler.md
§5.3), and every name is re-exported from there (``__all__``):

- ``loop_phases``: the loop (``core/tick.py``);
- ``flow_phases``: generic control flow (``core/flow.py``);
- ``prefill_phases``: lanes 1 and 2, new requests and chunked prefill (``core/prefill.py``);
- ``decode_phases``: lane 3, dispatch and plain decode (``core/decode.py``);
- ``spec_phases``: the MTP / DFlash step, serial verifies, DFlash, the batched MTP verify, n-gram
  and self-speculation (``core/spec_step.py``, ``kverify.py``, ``dflash.py``, ``mtp_batch.py``,
  ``ngram.py``, ``self_spec.py``);
- ``memory_phases``: memory pressure (``core/lifecycle.py``).
"""

from __future__ import annotations

from fxsched.core.loop_phases import (StartUp, TickStart, Admit, Publish, Rotate, IdleCheck, EmptyBatchExit,
    EmptyBatchSkip, EndOfTick, Shutdown, AwaitStream, AwaitEvent, AwaitInput, AwaitAdapterIds, AwaitPublishBlocks,
    AwaitRotation)
from fxsched.core.flow_phases import AwaitForward, EmitEffects, AskQuery
from fxsched.core.prefill_phases import (StartRequests, StartRequest, BeamGroup, AwaitSlot, AwaitLaneAdapter,
    AwaitFirstToken, AwaitBeam, AwaitBeamGroup, Chunk0Done, ContinuePrefills, PickPrefillToken, AwaitPrefillToken,
    Barrier, MixedReadback, AwaitMixedReadback, Promote)
from fxsched.core.decode_phases import DecodeLane, PlainDecode, AwaitDecode, ResolveAhead, RetireResolved, AwaitAhead
from fxsched.core.spec_phases import (AfterProposal, SpecStep, AwaitCapacity, Bootstrap, Verifies, AwaitProposal,
    AwaitBatchedProposal, SerialVerify, AwaitKVerify, AwaitMtpDecode, AwaitDflashDrafts, AwaitDflashVerify, DflashGate,
    AwaitDflashGate, BatchedDflashVerify, AwaitBatchedDflash, MtpBatch, MtpGate, MtpGateCheck, AwaitMtpGate,
    AwaitMtpBatch, NgramStep, AwaitNgramDecode, AwaitNgramVerify, SelfSpecStep, AwaitSelfCapacity, AwaitSelfToken,
    AwaitSelfVerify)
from fxsched.core.memory_phases import (SwapOutStage, SwapOutRoom, SwapOutFor, AwaitSwapOutFree, AwaitSwapOutReclaim,
    SwapIn, AwaitSwapInFree, AwaitSwapInReclaim, AwaitSwapInSlot, AwaitRestore, RequeueResume, AwaitResumeFree,
    AwaitResumeReclaim, AwaitResumeSlot)

__all__ = ["StartUp", "TickStart", "Admit", "Publish", "Rotate", "IdleCheck", "EmptyBatchExit", "EmptyBatchSkip",
    "EndOfTick", "Shutdown", "AwaitStream", "AwaitEvent", "AwaitInput", "AwaitAdapterIds", "AwaitPublishBlocks",
    "AwaitRotation", "AwaitForward", "EmitEffects", "AskQuery", "StartRequests", "StartRequest", "BeamGroup",
    "AwaitSlot", "AwaitLaneAdapter", "AwaitFirstToken", "AwaitBeam", "AwaitBeamGroup", "Chunk0Done", "ContinuePrefills",
    "PickPrefillToken", "AwaitPrefillToken", "Barrier", "MixedReadback", "AwaitMixedReadback", "Promote", "DecodeLane",
    "PlainDecode", "AwaitDecode", "ResolveAhead", "RetireResolved", "AwaitAhead", "AfterProposal", "SpecStep",
    "AwaitCapacity", "Bootstrap", "Verifies", "AwaitProposal", "AwaitBatchedProposal", "SerialVerify", "AwaitKVerify",
    "AwaitMtpDecode", "AwaitDflashDrafts", "AwaitDflashVerify", "DflashGate", "AwaitDflashGate", "BatchedDflashVerify",
    "AwaitBatchedDflash", "MtpBatch", "MtpGate", "MtpGateCheck", "AwaitMtpGate", "AwaitMtpBatch", "NgramStep",
    "AwaitNgramDecode", "AwaitNgramVerify", "SelfSpecStep", "AwaitSelfCapacity", "AwaitSelfToken", "AwaitSelfVerify",
    "SwapOutStage", "SwapOutRoom", "SwapOutFor", "AwaitSwapOutFree", "AwaitSwapOutReclaim", "SwapIn", "AwaitSwapInFree",
    "AwaitSwapInReclaim", "AwaitSwapInSlot", "AwaitRestore", "RequeueResume", "AwaitResumeFree", "AwaitResumeReclaim",
    "AwaitResumeSlot"]
