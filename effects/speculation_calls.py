"""Speculation's device calls: the proposers and beam search, the batching gates, and the
fire-and-forget bookkeeping after a verify (commits, trims, stashes, SSM checkpoints and
snapshots) (specs/recording-device.md §3.8.6, §3.8.8; specs/speculation.md).
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from .base import int_pairs, int_tuple, int_tuples, quick_inits
from .call_base import DeviceCall


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


quick_inits(globals())  # every record class above: a quicker __init__ (effects/base.py)
