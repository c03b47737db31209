"""Lifecycle effects: rendered ``fx apply <label>`` (or ``fx lora`` / ``fx teardown``) first.

Each record expands, in the interpreter, into the device calls listed in specs/trace-format.md §1.6.
"""

from __future__ import annotations

import enum
from typing import ClassVar

import attrs

from .base import Effect, quick_inits


class FxKind(enum.StrEnum):
    """The word after ``fx`` on a lifecycle effect's trace line."""

    APPLY = "apply"
    LORA = "lora"
    TEARDOWN = "teardown"


@attrs.frozen
class Lifecycle(Effect):
    """An effect announced with an ``fx`` line (``fx apply <label>``, ``fx lora ...``, ``fx teardown``)."""

    KIND: ClassVar[FxKind] = FxKind.APPLY

    @property
    def label(self) -> str:
        return type(self).__name__

    @property
    def fx_line(self) -> str:
        if self.KIND is FxKind.TEARDOWN:
            return "fx teardown"
        return f"fx {self.KIND} {self.label}"


class ReleaseReason(enum.StrEnum):
    """Why a sequence's slot is given back; ``ReleaseSeq`` renders the bare value.

    The members are strings: a ``ReleaseSeq`` built with the plain string is equal to one built
    with the member.
    """

    FINISH_SEQUENCE = "finish_sequence"
    PREEMPT_REQUEUE = "preempt_requeue"
    SPILL_OUT_SEQUENCE = "spill_out_sequence"
    SEND_ERROR = "send_error"


RELEASE_REASONS: tuple[ReleaseReason, ...] = tuple(ReleaseReason)


@attrs.frozen
class ReleaseSeq(Lifecycle):
    """Give a sequence's slot and blocks back; ``cache`` inserts its blocks in the prefix cache."""

    seq: int
    slot: int
    cache: bool
    reason: ReleaseReason = attrs.field(validator=attrs.validators.in_(RELEASE_REASONS))

    @property
    def label(self) -> str:
        return f"ReleaseSeq{{cache={'true' if self.cache else 'false'}, {self.reason}}}"


@attrs.frozen
class CompactSlot(Lifecycle):
    seq: int
    target: int

    @property
    def label(self) -> str:
        return f"CompactSlot{{target={self.target}}}"


@attrs.frozen
class DetachSlot(Lifecycle):
    seq: int


@attrs.frozen
class SaveSequenceState(Lifecycle):
    seq: int


@attrs.frozen
class MarconiCheckpoint(Lifecycle):
    seq: int


@attrs.frozen
class MarconiCheckpoints(Lifecycle):
    """The Marconi checkpoints of a batched decode, one record for all its rows: it expands into a
    ``MarconiCheckpoint`` per sequence of ``seqs``, in order, each with its own ``fx`` line."""

    seqs: tuple[int, ...]

    @property
    def label(self) -> str:
        return "MarconiCheckpoint"

    def split(self) -> tuple[MarconiCheckpoint, ...]:
        return tuple(MarconiCheckpoint(seq) for seq in self.seqs)


@attrs.frozen
class SsmSnapshotSave(Lifecycle):
    seq: int
    slot: int

    @property
    def label(self) -> str:
        return f"SsmSnapshotSave{{slot={self.slot}}}"


@attrs.frozen
class SsmSnapshotRestore(Lifecycle):
    seq: int
    slot: int

    @property
    def label(self) -> str:
        return f"SsmSnapshotRestore{{slot={self.slot}}}"


@attrs.frozen
class SaveHiddenCatchup(Lifecycle):
    row: int
    pos: int

    @property
    def label(self) -> str:
        return f"SaveHiddenCatchup{{row={self.row},pos={self.pos}}}"


@attrs.frozen
class ReadLogits(Lifecycle):
    rows: int

    @property
    def label(self) -> str:
        return f"ReadLogits{{rows={self.rows}}}"


@attrs.frozen
class SyncSecondary(Lifecycle):
    pass


@attrs.frozen
class ReserveKv(Lifecycle):
    seq: int


@attrs.frozen
class Rollback(Lifecycle):
    seq: int
    seq_len: int


@attrs.frozen
class EpShutdown(Lifecycle):
    pass


@attrs.frozen
class Quiesce(Lifecycle):
    stream: int

    @property
    def label(self) -> str:
        return f"Quiesce{{stream={self.stream}}}"


@attrs.frozen
class LoraRotate(Lifecycle):
    """Apply a queued LoRA rotation; a query answered with the rotation's outcome."""

    KIND: ClassVar[FxKind] = FxKind.LORA
    QUERY: ClassVar[bool] = True
    name: str

    @property
    def label(self) -> str:
        return f"Rotate({self.name})"


@attrs.frozen
class Teardown(Lifecycle):
    """The last effect of a run."""

    KIND: ClassVar[FxKind] = FxKind.TEARDOWN


quick_inits(globals())  # every record class above: a quicker __init__ (effects/base.py)
