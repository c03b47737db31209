"""One record per call of the model-call boundary (the Device protocol).

Sequences are named by the scheduler's sequence id (``seq``), which the scheduler chooses when it
asks for a slot; the device keeps its own view of the slot and the KV length and prints the sid
(``s<session>@<slot>:len=<seq_len>``) from it. ``CALL`` is the device method (and trace name).
Records whose ``QUERY`` is true are answered with an event; the rest are fire-and-forget.
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from fxsched.effects.base import Effect, int_tuple


@attrs.frozen
class DeviceCall(Effect):
    """A direct call on the device; it renders only its own line."""

    CALL: ClassVar[str] = ""


def _call(name: str, query: bool = False):
    def decorate(cls):
        cls.CALL = name
        cls.QUERY = query
        return attrs.frozen(cls)

    return decorate


# --- start-up, snapshot, inbox -------------------------------------------------------------


@_call("bind_gpu_to_thread")
class BindGpuToThread(DeviceCall):
    pass


@_call("create_stream", query=True)
class CreateStream(DeviceCall):
    pass


@_call("create_event", query=True)
class CreateEvent(DeviceCall):
    pass


@_call("num_free_blocks", query=True)
class NumFreeBlocks(DeviceCall):
    pass


@_call("ssm_snapshot_occupancy")
class SsmSnapshotOccupancy(DeviceCall):
    """Read of the snapshot occupancy; the recording device marks ticks with these reads."""


@_call("wait_for_input", query=True)
class WaitForInput(DeviceCall):
    """Blocking wait on the request inbox; answered by the host with arrivals or closure."""


# --- sequence management -------------------------------------------------------------------


@_call("alloc_sequence", query=True)
class AllocSequence(DeviceCall):
    seq: int
    session: int


@_call("alloc_sequence_for", query=True)
class AllocSequenceFor(DeviceCall):
    seq: int
    session: int
    budget: int


@_call("free_sequence")
class FreeSequence(DeviceCall):
    seq: int


@_call("cache_sequence")
class CacheSequence(DeviceCall):
    seq: int


@_call("compact_sequence")
class CompactSequence(DeviceCall):
    seq: int
    new_slot: int


@_call("detach_slot_for_reuse")
class DetachSlotForReuse(DeviceCall):
    seq: int


@_call("save_sequence_state")
class SaveSequenceStateCall(DeviceCall):
    seq: int


@_call("restore_sequence_state", query=True)
class RestoreSequenceState(DeviceCall):
    seq: int
    blocks: int


@_call("reclaim_prefix_blocks", query=True)
class ReclaimPrefixBlocks(DeviceCall):
    n: int


@_call("truncate_sequence")
class TruncateSequence(DeviceCall):
    """Rewind the device's KV length to ``seq_len`` (the scheduler's accepted prefix).

    It renders no line: the device never rewinds by itself, the scheduler tells it to.
    """

    seq: int
    seq_len: int


# --- adapters, EP words --------------------------------------------------------------------


@_call("adapter_id_for", query=True)
class AdapterIdFor(DeviceCall):
    """One ``adapter_id_for`` line per slot, answered with the list of adapter ids."""

    slots: tuple[int, ...] = attrs.field(converter=int_tuple)


@_call("acquire_adapter_slot")
class AcquireAdapterSlot(DeviceCall):
    slot: int


@_call("set_active_lora", query=True)
class SetActiveLora(DeviceCall):
    name: str


@_call("ep_broadcast_cmd_for_seq")
class EpBroadcastCmdForSeq(DeviceCall):
    seq_slot: int
    cmd: int


@_call("ep_broadcast_cmd")
class EpBroadcastCmd(DeviceCall):
    cmd: int


@_call("ep_broadcast_tokens")
class EpBroadcastTokens(DeviceCall):
    tokens: tuple[int, ...] = attrs.field(converter=int_tuple)


@_call("ep_sync_vision_embeds")
class EpSyncVisionEmbeds(DeviceCall):
    n: int


# --- streams ---------------------------------------------------------------------------------


@_call("poll_innerq")
class PollInnerq(DeviceCall):
    pass


@_call("record_event")
class RecordEvent(DeviceCall):
    event: int
    stream: int


@_call("stream_wait_event")
class StreamWaitEvent(DeviceCall):
    stream: int
    event: int


@_call("synchronize")
class Synchronize(DeviceCall):
    stream: int


@_call("sync_secondary")
class SyncSecondaryCall(DeviceCall):
    pass


@_call("teardown")
class TeardownCall(DeviceCall):
    pass


# --- forwards --------------------------------------------------------------------------------


@_call("prefill", query=True)
class Prefill(DeviceCall):
    seq: int
    tokens: tuple[int, ...] = attrs.field(converter=int_tuple)
    stream: int = 0


@_call("prefill_chunk", query=True)
class PrefillChunk(DeviceCall):
    seq: int
    prompt: tuple[int, ...] = attrs.field(converter=int_tuple)
    start: int
    length: int
    last: bool
    stream: int


@attrs.frozen
class PrefillSlice:
    """One prompt slice of a mixed forward."""

    seq: int
    prompt: tuple[int, ...] = attrs.field(converter=int_tuple)
    start: int
    length: int
    last: bool


@_call("mixed_forward", query=True)
class MixedForward(DeviceCall):
    decode_tokens: tuple[int, ...] = attrs.field(converter=int_tuple)
    decode_seqs: tuple[int, ...] = attrs.field(converter=int_tuple)
    prefill: PrefillSlice
    stream: int


@_call("mixed_forward_batch", query=True)
class MixedForwardBatch(DeviceCall):
    decode_tokens: tuple[int, ...] = attrs.field(converter=int_tuple)
    decode_seqs: tuple[int, ...] = attrs.field(converter=int_tuple)
    prefills: tuple[PrefillSlice, ...] = attrs.field(converter=tuple)
    stream: int


@_call("prefill_batch_chunk", query=True)
class PrefillBatchChunk(DeviceCall):
    """Chunks of several prompts in one forward (no decode rows); slice r answers at row r."""

    prefills: tuple[PrefillSlice, ...] = attrs.field(converter=tuple)
    stream: int


@_call("normalize_ssm_states")
class NormalizeSsmStates(DeviceCall):
    seq: int
    stream: int


@_call("decode", query=True)
class DecodeCall(DeviceCall):
    token: int
    seq: int
    stream: int = 0


@_call("decode_draft", query=True)
class DecodeDraft(DeviceCall):
    token: int
    seq: int
    stream: int = 0


@attrs.frozen
class SerialVerify(DeviceCall):
    """A per-sequence verify over ``tokens`` (anchor + drafts); answered with its rows."""

    QUERY: ClassVar[bool] = True
    seq: int
    tokens: tuple[int, ...] = attrs.field(converter=int_tuple)


@_call("decode_verify", query=True)
class DecodeVerify(SerialVerify):
    pass


@_call("decode_verify_graphed", query=True)
class DecodeVerifyGraphed(SerialVerify):
    pass


@_call("decode_verify_graphed_k3", query=True)
class DecodeVerifyGraphedK3(SerialVerify):
    pass


@_call("decode_verify_graphed_k4", query=True)
class DecodeVerifyGraphedK4(SerialVerify):
    pass


@_call("decode_verify_dflash", query=True)
class DecodeVerifyDflash(SerialVerify):
    pass


@_call("decode_and_verify_fused", query=True)
class DecodeAndVerifyFused(SerialVerify):
    pass


@_call("decode_verify_batched", query=True)
class DecodeVerifyBatched(DeviceCall):
    tokens: tuple[int, ...] = attrs.field(converter=int_tuple)
    ks: tuple[int, ...] = attrs.field(converter=int_tuple)
    seqs: tuple[int, ...] = attrs.field(converter=int_tuple)
    stream: int = 0
    woa: bool = True


# --- proposers -------------------------------------------------------------------------------


@_call("run_mtp_propose_multi", query=True)
class ProposeMulti(DeviceCall):
    token: int
    pos: int
    n: int
    seq: int
    stream: int = 0
    mask: bool = False


@_call("run_mtp_propose_batched", query=True)
class ProposeBatched(DeviceCall):
    tokens: tuple[int, ...] = attrs.field(converter=int_tuple)
    positions: tuple[int, ...] = attrs.field(converter=int_tuple)
    stash: tuple[int, ...] = attrs.field(converter=int_tuple)
    n: int
    seqs: tuple[int, ...] = attrs.field(converter=int_tuple)
    stream: int = 0


@_call("run_mtp_catchup_batched")
class CatchupBatched(DeviceCall):
    tokens: tuple[tuple[int, ...], ...] = attrs.field(converter=lambda v: tuple(int_tuple(x) for x in v))
    slots: tuple[int, ...] = attrs.field(converter=int_tuple)
    pos: tuple[int, ...] = attrs.field(converter=int_tuple)


@_call("generate_beam_batch", query=True)
class GenerateBeamBatch(DeviceCall):
    prompts: tuple[tuple[int, ...], ...] = attrs.field(converter=lambda v: tuple(int_tuple(x) for x in v))
    num_beams: tuple[int, ...] = attrs.field(converter=int_tuple)


@_call("mtp_slot_draft_capacity", query=True)
class SlotDraftCapacity(DeviceCall):
    """One ``mtp_slot_draft_capacity`` line per slot, answered with the list of capacities."""

    slots: tuple[int, ...] = attrs.field(converter=int_tuple)


@_call("can_batch_verify", query=True)
class CanBatchVerify(DeviceCall):
    ks: tuple[int, ...] = attrs.field(converter=int_tuple)


# --- logits readers --------------------------------------------------------------------------


@_call("argmax_on_device", query=True)
class ArgmaxOnDevice(DeviceCall):
    row: int
    stream: int = 0


@_call("argmax_batch", query=True)
class ArgmaxBatch(DeviceCall):
    row: int
    n: int
    stream: int = 0


@attrs.frozen
class HostPick:
    """How the host turns one copied logits row into a token (scheduler.md §5.11)."""

    temperature: float
    seed: int
    mask_eos: bool
    top_logprobs: int = 0


@_call("copy_logits_to_host", query=True)
class CopyLogitsToHost(DeviceCall):
    """Copy ``n`` rows to the host; answered with one pick per row, made by the rule in ``picks``."""

    row: int
    n: int
    picks: tuple[HostPick, ...] = attrs.field(converter=tuple)


# --- speculative bookkeeping (fire-and-forget) -----------------------------------------------


@_call("gdn_fold_accepted")
class GdnFoldAccepted(DeviceCall):
    slots: tuple[int, ...] = attrs.field(converter=int_tuple)
    accepted: tuple[int, ...] = attrs.field(converter=int_tuple)
    k: int


@_call("commit_accepted_prefix")
class CommitAcceptedPrefix(DeviceCall):
    seq: int
    na: int
    k: int


@_call("commit_ctx")
class CommitCtx(DeviceCall):
    seq: int
    n: int
    base: int
    row: int


@_call("trim_proposer_state")
class TrimProposerState(DeviceCall):
    seq: int
    na: int
    stream: int = 0


@_call("save_hidden_for_mtp")
class SaveHiddenForMtp(DeviceCall):
    row: int
    stream: int = 0


@_call("save_hidden_for_mtp_from_stash")
class SaveHiddenForMtpFromStash(DeviceCall):
    index: int
    stream: int = 0


@_call("stash_verify_hidden_rows")
class StashVerifyHiddenRows(DeviceCall):
    rows: tuple[int, ...] = attrs.field(converter=int_tuple)
    stream: int = 0


@_call("stash_verify_catchup_rows")
class StashVerifyCatchupRows(DeviceCall):
    pairs: tuple[tuple[int, int], ...] = attrs.field(converter=lambda v: tuple((int(a), int(b)) for a, b in v))


@_call("dflash_eagle_accept_append")
class DflashEagleAcceptAppend(DeviceCall):
    seq: int


@_call("start_checkpoint_async")
class StartCheckpointAsync(DeviceCall):
    seq: int


@_call("start_rollback_and_checkpoint_async")
class StartRollbackAndCheckpointAsync(DeviceCall):
    seq: int
    na: int


@_call("checkpoint_ssm_states")
class CheckpointSsmStates(DeviceCall):
    seq: int


@_call("rollback_ssm_states")
class RollbackSsmStates(DeviceCall):
    seq: int
    n: int


@_call("decode_marconi_checkpoint")
class DecodeMarconiCheckpoint(DeviceCall):
    seq: int


@_call("save_decode_ssm_snapshot")
class SaveDecodeSsmSnapshot(DeviceCall):
    seq: int
    ring: int


@_call("restore_decode_ssm_snapshot")
class RestoreDecodeSsmSnapshot(DeviceCall):
    seq: int
    ring: int


@_call("save_hidden_for_catchup")
class SaveHiddenForCatchupCall(DeviceCall):
    row: int
    pos: int


# --- batched forms: one record for the same call on many sequences, in order ------------------


@_call("commit_ctx")
class CommitCtxBatch(DeviceCall):
    """``commit_ctx`` for each ``(seq, n, base, row)`` entry, in order."""

    entries: tuple[tuple[int, int, int, int], ...] = attrs.field(converter=tuple)


@_call("commit_accepted_prefix")
class CommitAcceptedPrefixBatch(DeviceCall):
    """``commit_accepted_prefix`` for each ``(seq, na, k)`` entry, in order."""

    entries: tuple[tuple[int, int, int], ...] = attrs.field(converter=tuple)


@_call("trim_proposer_state")
class TrimProposerStateBatch(DeviceCall):
    """``trim_proposer_state`` for each ``(seq, na)`` entry, in order, on ``stream``."""

    entries: tuple[tuple[int, int], ...] = attrs.field(converter=tuple)
    stream: int = 0


@_call("truncate_sequence")
class TruncateSequences(DeviceCall):
    """``TruncateSequence`` for each ``(seq, seq_len)`` entry; renders no line."""

    entries: tuple[tuple[int, int], ...] = attrs.field(converter=tuple)
