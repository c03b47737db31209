"""Batched forms: one record for the same call on many sequences, in order (``commit_ctx``,
``commit_accepted_prefix``, ``trim_proposer_state``, ``truncate_sequence``).
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from .base import int_tuple, quick_inits
from .call_base import DeviceCall


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
