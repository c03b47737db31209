"""One record per call of the model-call boundary (the Device protocol).

Sequences are named by the scheduler's sequence id (``seq``), which the scheduler chooses when it
asks for a slot; the device keeps its own view of the slot and the KV length and prints the sid
(``s<session>@<slot>:len=<seq_len>``) from it. ``CALL`` is the device method (and trace name).
Records whose ``QUERY`` is true are answered with an event; the rest are fire-and-forget.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import attrs

from .base import Effect, int_pairs, int_tuple, int_tuples, quick_inits


@attrs.frozen
class DeviceCall(Effect):
    """A direct call on the device; it renders only its own line."""

    CALL: ClassVar[str] = ""


# --- start-up, snapshot, inbox -------------------------------------------------------------


@attrs.frozen
class BindGpuToThread(DeviceCall):
    CALL: ClassVar[str] = "bind_gpu_to_thread"


@attrs.frozen
class CreateStream(DeviceCall):
    CALL: ClassVar[str] = "create_stream"
    QUERY: ClassVar[bool] = True


@attrs.frozen
class CreateEvent(DeviceCall):
    CALL: ClassVar[str] = "create_event"
    QUERY: ClassVar[bool] = True


@attrs.frozen
class NumFreeBlocks(DeviceCall):
    CALL: ClassVar[str] = "num_free_blocks"
    QUERY: ClassVar[bool] = True


@attrs.frozen
class SsmSnapshotOccupancy(DeviceCall):
    """Read of the snapshot occupancy; the recording device marks ticks with these reads."""

    CALL: ClassVar[str] = "ssm_snapshot_occupancy"


@attrs.frozen
class WaitForInput(DeviceCall):
    """Blocking wait on the request inbox; answered by the host with arrivals or closure."""

    CALL: ClassVar[str] = "wait_for_input"
    QUERY: ClassVar[bool] = True


# --- sequence management -------------------------------------------------------------------


@attrs.frozen
class AllocSequence(DeviceCall):
    CALL: ClassVar[str] = "alloc_sequence"
    QUERY: ClassVar[bool] = True
    seq: int
    session: int


@attrs.frozen
class AllocSequenceFor(DeviceCall):
    CALL: ClassVar[str] = "alloc_sequence_for"
    QUERY: ClassVar[bool] = True
    seq: int
    session: int
    budget: int


@attrs.frozen
class FreeSequence(DeviceCall):
    CALL: ClassVar[str] = "free_sequence"
    seq: int


@attrs.frozen
class CacheSequence(DeviceCall):
    CALL: ClassVar[str] = "cache_sequence"
    seq: int


@attrs.frozen
class CompactSequence(DeviceCall):
    CALL: ClassVar[str] = "compact_sequence"
    seq: int
    new_slot: int


@attrs.frozen
class DetachSlotForReuse(DeviceCall):
    CALL: ClassVar[str] = "detach_slot_for_reuse"
    seq: int


@attrs.frozen
class SaveSequenceStateCall(DeviceCall):
    CALL: ClassVar[str] = "save_sequence_state"
    seq: int


@attrs.frozen
class RestoreSequenceState(DeviceCall):
    CALL: ClassVar[str] = "restore_sequence_state"
    QUERY: ClassVar[bool] = True
    seq: int
    blocks: int


@attrs.frozen
class ReclaimPrefixBlocks(DeviceCall):
    CALL: ClassVar[str] = "reclaim_prefix_blocks"
    QUERY: ClassVar[bool] = True
    n: int


@attrs.frozen
class TruncateSequence(DeviceCall):
    """Rewind the device's KV length to ``seq_len`` (the scheduler's accepted prefix).

    It renders no line: the device never rewinds by itself, the scheduler tells it to.
    """

    CALL: ClassVar[str] = "truncate_sequence"
    seq: int
    seq_len: int


# --- adapters, EP words --------------------------------------------------------------------


@attrs.frozen
class AdapterIdFor(DeviceCall):
    """One ``adapter_id_for`` line per slot, answered with the list of adapter ids."""

    CALL: ClassVar[str] = "adapter_id_for"
    QUERY: ClassVar[bool] = True
    slots: tuple[int, ...] = attrs.field(converter=int_tuple)


@attrs.frozen
class AcquireAdapterSlot(DeviceCall):
    CALL: ClassVar[str] = "acquire_adapter_slot"
    slot: int


@attrs.frozen
class SetActiveLora(DeviceCall):
    CALL: ClassVar[str] = "set_active_lora"
    QUERY: ClassVar[bool] = True
    name: str


@attrs.frozen
class EpBroadcastCmdForSeq(DeviceCall):
    CALL: ClassVar[str] = "ep_broadcast_cmd_for_seq"
    seq_slot: int
    cmd: int


@attrs.frozen
class EpBroadcastCmd(DeviceCall):
    CALL: ClassVar[str] = "ep_broadcast_cmd"
    cmd: int


@attrs.frozen
class EpBroadcastTokens(DeviceCall):
    CALL: ClassVar[str] = "ep_broadcast_tokens"
    tokens: tuple[int, ...] = attrs.field(converter=int_tuple)


@attrs.frozen
class EpSyncVisionEmbeds(DeviceCall):
    CALL: ClassVar[str] = "ep_sync_vision_embeds"
    n: int


# --- streams ---------------------------------------------------------------------------------


@attrs.frozen
class PollInnerq(DeviceCall):
    CALL: ClassVar[str] = "poll_innerq"


@attrs.frozen
class RecordEvent(DeviceCall):
    CALL: ClassVar[str] = "record_event"
    event: int
    stream: int


@attrs.frozen
class StreamWaitEvent(DeviceCall):
    CALL: ClassVar[str] = "stream_wait_event"
    stream: int
    event: int


@attrs.frozen
class Synchronize(DeviceCall):
    CALL: ClassVar[str] = "synchronize"
    stream: int


@attrs.frozen
class SyncSecondaryCall(DeviceCall):
    CALL: ClassVar[str] = "sync_secondary"


@attrs.frozen
class TeardownCall(DeviceCall):
    CALL: ClassVar[str] = "teardown"


# --- forwards --------------------------------------------------------------------------------


@attrs.frozen
class Prefill(DeviceCall):
    CALL: ClassVar[str] = "prefill"
    QUERY: ClassVar[bool] = True
    seq: int
    tokens: tuple[int, ...] = attrs.field(converter=int_tuple)
    stream: int = 0


@attrs.frozen
class PrefillChunk(DeviceCall):
    CALL: ClassVar[str] = "prefill_chunk"
    QUERY: ClassVar[bool] = True
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


def prefill_slices(value: Iterable[PrefillSlice]) -> tuple[PrefillSlice, ...]:
    """Converter: the slices of a batched forward, as a tuple."""
    return tuple(value)


@attrs.frozen
class MixedForward(DeviceCall):
    CALL: ClassVar[str] = "mixed_forward"
    QUERY: ClassVar[bool] = True
    decode_tokens: tuple[int, ...] = attrs.field(converter=int_tuple)
    decode_seqs: tuple[int, ...] = attrs.field(converter=int_tuple)
    prefill: PrefillSlice
    stream: int


@attrs.frozen
class MixedForwardBatch(DeviceCall):
    CALL: ClassVar[str] = "mixed_forward_batch"
    QUERY: ClassVar[bool] = True
    decode_tokens: tuple[int, ...] = attrs.field(converter=int_tuple)
    decode_seqs: tuple[int, ...] = attrs.field(converter=int_tuple)
    prefills: tuple[PrefillSlice, ...] = attrs.field(converter=prefill_slices)
    stream: int


@attrs.frozen
class PrefillBatchChunk(DeviceCall):
    """Chunks of several prompts in one forward (no decode rows); slice r answers at row r."""

    CALL: ClassVar[str] = "prefill_batch_chunk"
    QUERY: ClassVar[bool] = True
    prefills: tuple[PrefillSlice, ...] = attrs.field(converter=prefill_slices)
    stream: int


@attrs.frozen
class NormalizeSsmStates(DeviceCall):
    CALL: ClassVar[str] = "normalize_ssm_states"
    seq: int
    stream: int


@attrs.frozen
class DecodeCall(DeviceCall):
    CALL: ClassVar[str] = "decode"
    QUERY: ClassVar[bool] = True
    token: int
    seq: int
    stream: int = 0


@attrs.frozen
class DecodeDraft(DeviceCall):
    CALL: ClassVar[str] = "decode_draft"
    QUERY: ClassVar[bool] = True
    token: int
    seq: int
    stream: int = 0


@attrs.frozen
class HostPick:
    """How one logits row becomes a token (specs/scheduler.md §5.11): EOS masked while
    ``mask_eos``, then (temperature > 0) temperature, min-p, top-k (0: off) and top-p (1.0: off),
    one draw seeded by ``seed``. ``top_logprobs`` is the row's logprob record size. The filters
    print nothing in a trace; their defaults leave every pick as it was."""

    temperature: float
    seed: int
    mask_eos: bool
    top_logprobs: int = 0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0


def host_picks(value: Iterable[HostPick]) -> tuple[HostPick, ...]:
    """Converter: the host picks of a logits readback, as a tuple."""
    return tuple(value)


@attrs.frozen
class SerialVerify(DeviceCall):
    """A per-sequence verify over ``tokens`` (anchor + drafts); answered with its rows. ``picks``
    (one per row, empty when every row is greedy) make the rows a rejection-sampled verify's
    (specs/speculation.md §6.16); they print nothing in a trace."""

    QUERY: ClassVar[bool] = True
    seq: int
    tokens: tuple[int, ...] = attrs.field(converter=int_tuple)
    picks: tuple[HostPick, ...] = attrs.field(default=(), converter=host_picks)


@attrs.frozen
class DecodeVerify(SerialVerify):
    CALL: ClassVar[str] = "decode_verify"
    QUERY: ClassVar[bool] = True


@attrs.frozen
class DecodeVerifyGraphed(SerialVerify):
    CALL: ClassVar[str] = "decode_verify_graphed"
    QUERY: ClassVar[bool] = True


@attrs.frozen
class DecodeVerifyGraphedK3(SerialVerify):
    CALL: ClassVar[str] = "decode_verify_graphed_k3"
    QUERY: ClassVar[bool] = True


@attrs.frozen
class DecodeVerifyGraphedK4(SerialVerify):
    CALL: ClassVar[str] = "decode_verify_graphed_k4"
    QUERY: ClassVar[bool] = True


@attrs.frozen
class DecodeVerifyDflash(SerialVerify):
    CALL: ClassVar[str] = "decode_verify_dflash"
    QUERY: ClassVar[bool] = True


@attrs.frozen
class DecodeAndVerifyFused(SerialVerify):
    CALL: ClassVar[str] = "decode_and_verify_fused"
    QUERY: ClassVar[bool] = True


@attrs.frozen
class DecodeVerifyBatched(DeviceCall):
    CALL: ClassVar[str] = "decode_verify_batched"
    QUERY: ClassVar[bool] = True
    tokens: tuple[int, ...] = attrs.field(converter=int_tuple)
    ks: tuple[int, ...] = attrs.field(converter=int_tuple)
    seqs: tuple[int, ...] = attrs.field(converter=int_tuple)
    stream: int = 0
    woa: bool = True
    picks: tuple[HostPick, ...] = attrs.field(default=(), converter=host_picks)  # as SerialVerify's, row order


# --- proposers -------------------------------------------------------------------------------


@attrs.frozen
class ProposeMulti(DeviceCall):
    CALL: ClassVar[str] = "run_mtp_propose_multi"
    QUERY: ClassVar[bool] = True
    token: int
    pos: int
    n: int
    seq: int
    stream: int = 0
    mask: bool = False


@attrs.frozen
class ProposeBatched(DeviceCall):
    CALL: ClassVar[str] = "run_mtp_propose_batched"
    QUERY: ClassVar[bool] = True
    tokens: tuple[int, ...] = attrs.field(converter=int_tuple)
    positions: tuple[int, ...] = attrs.field(converter=int_tuple)
    stash: tuple[int, ...] = attrs.field(converter=int_tuple)
    n: int
    seqs: tuple[int, ...] = attrs.field(converter=int_tuple)
    stream: int = 0


@attrs.frozen
class CatchupBatched(DeviceCall):
    CALL: ClassVar[str] = "run_mtp_catchup_batched"
    tokens: tuple[tuple[int, ...], ...] = attrs.field(converter=int_tuples)
    slots: tuple[int, ...] = attrs.field(converter=int_tuple)
    pos: tuple[int, ...] = attrs.field(converter=int_tuple)


@attrs.frozen
class GenerateBeamBatch(DeviceCall):
    CALL: ClassVar[str] = "generate_beam_batch"
    QUERY: ClassVar[bool] = True
    prompts: tuple[tuple[int, ...], ...] = attrs.field(converter=int_tuples)
    num_beams: tuple[int, ...] = attrs.field(converter=int_tuple)


@attrs.frozen
class SlotDraftCapacity(DeviceCall):
    """One ``mtp_slot_draft_capacity`` line per slot, answered with the list of capacities."""

    CALL: ClassVar[str] = "mtp_slot_draft_capacity"
    QUERY: ClassVar[bool] = True
    slots: tuple[int, ...] = attrs.field(converter=int_tuple)


@attrs.frozen
class CanBatchVerify(DeviceCall):
    CALL: ClassVar[str] = "can_batch_verify"
    QUERY: ClassVar[bool] = True
    ks: tuple[int, ...] = attrs.field(converter=int_tuple)


# --- logits readers --------------------------------------------------------------------------


@attrs.frozen
class ArgmaxOnDevice(DeviceCall):
    CALL: ClassVar[str] = "argmax_on_device"
    QUERY: ClassVar[bool] = True
    row: int
    stream: int = 0


@attrs.frozen
class ReadAhead(DeviceCall):
    """Read back the tokens the last decodes of ``seqs`` kept on the device (decodes answered ahead,
    specs/async.md §16.6); answered by ``TokensSampled`` with them in ``earlier``, in order."""

    CALL: ClassVar[str] = "read_ahead"
    QUERY: ClassVar[bool] = True
    seqs: tuple[int, ...] = attrs.field(converter=int_tuple)


@attrs.frozen
class ArgmaxBatch(DeviceCall):
    CALL: ClassVar[str] = "argmax_batch"
    QUERY: ClassVar[bool] = True
    row: int
    n: int
    stream: int = 0


@attrs.frozen
class CopyLogitsToHost(DeviceCall):
    """Copy ``n`` rows to the host; answered with one pick per row, made by the rule in ``picks``."""

    CALL: ClassVar[str] = "copy_logits_to_host"
    QUERY: ClassVar[bool] = True
    row: int
    n: int
    picks: tuple[HostPick, ...] = attrs.field(converter=host_picks)


# --- speculative bookkeeping (fire-and-forget) -----------------------------------------------


@attrs.frozen
class GdnFoldAccepted(DeviceCall):
    CALL: ClassVar[str] = "gdn_fold_accepted"
    slots: tuple[int, ...] = attrs.field(converter=int_tuple)
    accepted: tuple[int, ...] = attrs.field(converter=int_tuple)
    k: int


@attrs.frozen
class CommitAcceptedPrefix(DeviceCall):
    CALL: ClassVar[str] = "commit_accepted_prefix"
    seq: int
    na: int
    k: int


@attrs.frozen
class CommitCtx(DeviceCall):
    CALL: ClassVar[str] = "commit_ctx"
    seq: int
    n: int
    base: int
    row: int


@attrs.frozen
class TrimProposerState(DeviceCall):
    CALL: ClassVar[str] = "trim_proposer_state"
    seq: int
    na: int
    stream: int = 0


@attrs.frozen
class SaveHiddenForMtp(DeviceCall):
    CALL: ClassVar[str] = "save_hidden_for_mtp"
    row: int
    stream: int = 0


@attrs.frozen
class SaveHiddenForMtpFromStash(DeviceCall):
    CALL: ClassVar[str] = "save_hidden_for_mtp_from_stash"
    index: int
    stream: int = 0


@attrs.frozen
class StashVerifyHiddenRows(DeviceCall):
    CALL: ClassVar[str] = "stash_verify_hidden_rows"
    rows: tuple[int, ...] = attrs.field(converter=int_tuple)
    stream: int = 0


@attrs.frozen
class StashVerifyCatchupRows(DeviceCall):
    CALL: ClassVar[str] = "stash_verify_catchup_rows"
    pairs: tuple[tuple[int, int], ...] = attrs.field(converter=int_pairs)


@attrs.frozen
class DflashEagleAcceptAppend(DeviceCall):
    CALL: ClassVar[str] = "dflash_eagle_accept_append"
    seq: int


@attrs.frozen
class StartCheckpointAsync(DeviceCall):
    CALL: ClassVar[str] = "start_checkpoint_async"
    seq: int


@attrs.frozen
class StartRollbackAndCheckpointAsync(DeviceCall):
    CALL: ClassVar[str] = "start_rollback_and_checkpoint_async"
    seq: int
    na: int


@attrs.frozen
class CheckpointSsmStates(DeviceCall):
    CALL: ClassVar[str] = "checkpoint_ssm_states"
    seq: int


@attrs.frozen
class RollbackSsmStates(DeviceCall):
    CALL: ClassVar[str] = "rollback_ssm_states"
    seq: int
    n: int


@attrs.frozen
class DecodeMarconiCheckpoint(DeviceCall):
    CALL: ClassVar[str] = "decode_marconi_checkpoint"
    seq: int


@attrs.frozen
class SaveDecodeSsmSnapshot(DeviceCall):
    CALL: ClassVar[str] = "save_decode_ssm_snapshot"
    seq: int
    ring: int


@attrs.frozen
class RestoreDecodeSsmSnapshot(DeviceCall):
    CALL: ClassVar[str] = "restore_decode_ssm_snapshot"
    seq: int
    ring: int


@attrs.frozen
class SaveHiddenForCatchupCall(DeviceCall):
    CALL: ClassVar[str] = "save_hidden_for_catchup"
    row: int
    pos: int


# --- batched forms: one record for the same call on many sequences, in order ------------------


# Each holds its calls' arguments as columns, one tuple per argument (the i-th call takes the i-th
# item of each), so that a batch of N calls is a few tuples rather than N entry tuples; ``entries``
# gives the calls' arguments row by row, for whoever carries them out.


@attrs.frozen
class CommitCtxBatch(DeviceCall):
    """``commit_ctx(seq, n, base, row)`` for each row of the columns, in order."""

    CALL: ClassVar[str] = "commit_ctx"
    seqs: tuple[int, ...] = attrs.field(converter=int_tuple)
    ns: tuple[int, ...] = attrs.field(converter=int_tuple)
    bases: tuple[int, ...] = attrs.field(converter=int_tuple)
    rows: tuple[int, ...] = attrs.field(converter=int_tuple)

    @property
    def entries(self) -> tuple[tuple[int, int, int, int], ...]:
        return tuple(zip(self.seqs, self.ns, self.bases, self.rows, strict=True))


@attrs.frozen
class CommitAcceptedPrefixBatch(DeviceCall):
    """``commit_accepted_prefix(seq, na, k)`` for each row of the columns, in order."""

    CALL: ClassVar[str] = "commit_accepted_prefix"
    seqs: tuple[int, ...] = attrs.field(converter=int_tuple)
    nas: tuple[int, ...] = attrs.field(converter=int_tuple)
    ks: tuple[int, ...] = attrs.field(converter=int_tuple)

    @property
    def entries(self) -> tuple[tuple[int, int, int], ...]:
        return tuple(zip(self.seqs, self.nas, self.ks, strict=True))


@attrs.frozen
class TrimProposerStateBatch(DeviceCall):
    """``trim_proposer_state(seq, na)`` for each row of the columns, in order, on ``stream``."""

    CALL: ClassVar[str] = "trim_proposer_state"
    seqs: tuple[int, ...] = attrs.field(converter=int_tuple)
    nas: tuple[int, ...] = attrs.field(converter=int_tuple)
    stream: int = 0

    @property
    def entries(self) -> tuple[tuple[int, int], ...]:
        return tuple(zip(self.seqs, self.nas, strict=True))


@attrs.frozen
class TruncateSequences(DeviceCall):
    """``TruncateSequence(seq, seq_len)`` for each row of the columns; renders no line."""

    CALL: ClassVar[str] = "truncate_sequence"
    seqs: tuple[int, ...] = attrs.field(converter=int_tuple)
    seq_lens: tuple[int, ...] = attrs.field(converter=int_tuple)

    @property
    def entries(self) -> tuple[tuple[int, int], ...]:
        return tuple(zip(self.seqs, self.seq_lens, strict=True))


quick_inits(globals())  # every record class above: a quicker __init__ (effects/base.py)
