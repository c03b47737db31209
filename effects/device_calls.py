"""The device-call records as one namespace: one record per call of the model-call boundary (the
Device protocol), as ``dc.<Record>`` (``from fxsched.effects import device_calls as dc``).

This module defines nothing: being the namespace is its concern. Each record lives in the module of
its family, and every name below is re-exported from there (``__all__``), so the core, the
interpreter and the devices name any call as ``dc.X`` whatever its family:

- ``call_base``: ``DeviceCall``, the base of every record;
- ``loop_calls``: start-up, snapshot reads, the inbox wait, streams and events, teardown;
- ``sequence_calls``: a sequence's slot and KV blocks;
- ``adapter_calls``: LoRA adapters; ``ep_calls``: the EP word broadcasts;
- ``forward_calls``: prefill and decode forwards (and ``PrefillSlice``);
- ``readback_calls``: logits readers (and ``HostPick``, a row's pick rule);
- ``verify_calls``: serial and batched verifies;
- ``speculation_calls``: proposers, beam search, gates and speculative bookkeeping;
- ``batched_calls``: one record for the same call on many sequences.

Sequences are named by the scheduler's sequence id (``seq``), which the scheduler chooses when it
asks for a slot; the device keeps its own view of the slot and the KV length and prints the sid
(``s<session>@<slot>:len=<seq_len>``) from it (specs/recording-device.md §3.2, §3.8). ``CALL`` is
the device method (and trace name). Records whose ``QUERY`` is true are answered with an event; the
rest are fire-and-forget.
"""

from __future__ import annotations

from .call_base import DeviceCall
from .loop_calls import (BindGpuToThread, CreateStream, CreateEvent, NumFreeBlocks, SsmSnapshotOccupancy, WaitForInput,
    PollInnerq, RecordEvent, StreamWaitEvent, Synchronize, SyncSecondaryCall, TeardownCall)
from .sequence_calls import (AllocSequence, AllocSequenceFor, FreeSequence, CacheSequence, CompactSequence,
    DetachSlotForReuse, SaveSequenceStateCall, RestoreSequenceState, ReclaimPrefixBlocks, TruncateSequence)
from .adapter_calls import AdapterIdFor, AcquireAdapterSlot, SetActiveLora
from .ep_calls import EpBroadcastCmdForSeq, EpBroadcastCmd, EpBroadcastTokens, EpSyncVisionEmbeds
from .forward_calls import (Prefill, PrefillChunk, PrefillSlice, prefill_slices, MixedForward, MixedForwardBatch,
    PrefillBatchChunk, NormalizeSsmStates, DecodeCall, DecodeDraft)
from .readback_calls import HostPick, host_picks, ArgmaxOnDevice, ReadAhead, ArgmaxBatch, CopyLogitsToHost
from .verify_calls import (SerialVerify, DecodeVerify, DecodeVerifyGraphed, DecodeVerifyGraphedK3,
    DecodeVerifyGraphedK4, DecodeVerifyDflash, DecodeAndVerifyFused, DecodeVerifyBatched)
from .speculation_calls import (ProposeMulti, ProposeBatched, CatchupBatched, GenerateBeamBatch, SlotDraftCapacity,
    CanBatchVerify, GdnFoldAccepted, CommitAcceptedPrefix, CommitCtx, TrimProposerState, SaveHiddenForMtp,
    SaveHiddenForMtpFromStash, StashVerifyHiddenRows, StashVerifyCatchupRows, DflashEagleAcceptAppend,
    StartCheckpointAsync, StartRollbackAndCheckpointAsync, CheckpointSsmStates, RollbackSsmStates,
    DecodeMarconiCheckpoint, SaveDecodeSsmSnapshot, RestoreDecodeSsmSnapshot, SaveHiddenForCatchupCall)
from .batched_calls import CommitCtxBatch, CommitAcceptedPrefixBatch, TrimProposerStateBatch, TruncateSequences

__all__ = ["DeviceCall", "BindGpuToThread", "CreateStream", "CreateEvent", "NumFreeBlocks", "SsmSnapshotOccupancy",
    "WaitForInput", "AllocSequence", "AllocSequenceFor", "FreeSequence", "CacheSequence", "CompactSequence",
    "DetachSlotForReuse", "SaveSequenceStateCall", "RestoreSequenceState", "ReclaimPrefixBlocks", "TruncateSequence",
    "AdapterIdFor", "AcquireAdapterSlot", "SetActiveLora", "EpBroadcastCmdForSeq", "EpBroadcastCmd",
    "EpBroadcastTokens", "EpSyncVisionEmbeds", "PollInnerq", "RecordEvent", "StreamWaitEvent", "Synchronize",
    "SyncSecondaryCall", "TeardownCall", "Prefill", "PrefillChunk", "PrefillSlice", "prefill_slices", "MixedForward",
    "MixedForwardBatch", "PrefillBatchChunk", "NormalizeSsmStates", "DecodeCall", "DecodeDraft", "HostPick",
    "host_picks", "SerialVerify", "DecodeVerify", "DecodeVerifyGraphed", "DecodeVerifyGraphedK3",
    "DecodeVerifyGraphedK4", "DecodeVerifyDflash", "DecodeAndVerifyFused", "DecodeVerifyBatched", "ProposeMulti",
    "ProposeBatched", "CatchupBatched", "GenerateBeamBatch", "SlotDraftCapacity", "CanBatchVerify", "ArgmaxOnDevice",
    "ReadAhead", "ArgmaxBatch", "CopyLogitsToHost", "GdnFoldAccepted", "CommitAcceptedPrefix", "CommitCtx",
    "TrimProposerState", "SaveHiddenForMtp", "SaveHiddenForMtpFromStash", "StashVerifyHiddenRows",
    "StashVerifyCatchupRows", "DflashEagleAcceptAppend", "StartCheckpointAsync", "StartRollbackAndCheckpointAsync",
    "CheckpointSsmStates", "RollbackSsmStates", "DecodeMarconiCheckpoint", "SaveDecodeSsmSnapshot",
    "RestoreDecodeSsmSnapshot", "SaveHiddenForCatchupCall", "CommitCtxBatch", "CommitAcceptedPrefixBatch",
    "TrimProposerStateBatch", "TruncateSequences"]
