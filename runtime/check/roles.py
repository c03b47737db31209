"""Which checks a batch of effects or an event needs (specs/checker.md §11.6): each effect type's
roles (``ROLES``, worked out once per type) and their union per batch signature (``BATCH_ROLES``),
each event type's kind (``EVENT_KINDS``). ``invariants.Monitor`` runs a check only where its roles
say it has something to read."""

from __future__ import annotations


from typing import Any

import attrs

from fxsched.core import events as ev
from fxsched.effects import device_calls as dc
from fxsched.effects import lifecycle as lc
from fxsched.effects.client import TokenOut, TokensOut
from fxsched.runtime.check.frames import CUTS_MANY, CUTS_ONE
from fxsched.effects import plans


DRAFT_RULED = (dc.SlotDraftCapacity, dc.ProposeMulti, dc.ProposeBatched, dc.CatchupBatched, dc.DecodeVerify)
"""The effects ``Monitor._draft_rules`` looks at."""

DECODE_LANE = (plans.Decode, dc.DecodeCall, dc.SerialVerify, dc.DecodeVerifyBatched, dc.SlotDraftCapacity,
               dc.MixedForward, dc.MixedForwardBatch)
"""Effects only a decode-lane step or a mixed step makes: each sets ``last_decode_ms``
(specs/scheduler.md §5.4)."""


# --- the roles of an effect type: which checks of a batch it takes part in ----------------------------------

ALLOC = 1 << 0  # allocates ``seq``
RELEASE = 1 << 1  # a ReleaseSeq
SEQ = 1 << 2  # names its sequence in ``seq``
SEQS = 1 << 3  # names its sequences in ``seqs``
ENTRIES = 1 << 4  # names its sequences in ``entries`` (first items)
NAMES = SEQ | SEQS | ENTRIES
COMMIT = 1 << 5  # commits an accepted prefix
FOLD = 1 << 6  # gdn_fold_accepted
COMPACT = 1 << 7  # moves a sequence to another slot
SHUTDOWN = 1 << 8  # EpShutdown, Quiesce, Teardown
DRAFT = 1 << 9  # one of ``DRAFT_RULED``
DECODE = 1 << 10  # one of ``DECODE_LANE``
PLAN = 1 << 11  # a plain decode plan
BATCHED = 1 << 12  # a batched record standing for several effects (``split``: see ``expand_batched``)
OUT = 1 << 13  # streams tokens to a client (``TokenOut``, ``TokensOut``)
CHECKPOINT = 1 << 14  # a Marconi checkpoint of the plain sink
CUT = 1 << 15  # cuts a sequence's KV back after a verify (``frames.CUTS_ONE``, ``frames.CUTS_MANY``)
ROLLBACK = 1 << 16  # may be a watchdog rollback: a snapshot restore or a truncation (specs/watchdog.md §7.5)


def effect_role(cls: type) -> int:
    """The roles of effect type ``cls``, by the same class tests the checks make one effect at a time."""
    role = 0
    if issubclass(cls, (dc.AllocSequence, dc.AllocSequenceFor)):
        role |= ALLOC
    if issubclass(cls, lc.ReleaseSeq):
        role |= RELEASE
    if hasattr(cls, "seq") or not attrs.has(cls) or "seq" in attrs.fields_dict(cls):
        role |= SEQ  # a ``seq`` it may hold (read from the effect itself)
    if issubclass(cls, (dc.DecodeVerifyBatched, dc.ProposeBatched, plans.Decode)):
        role |= SEQS
    if issubclass(cls, (dc.CommitCtxBatch, dc.CommitAcceptedPrefixBatch, dc.TrimProposerStateBatch,
                        dc.TruncateSequences)):
        role |= ENTRIES
    if issubclass(cls, (dc.CommitAcceptedPrefix, dc.CommitAcceptedPrefixBatch)):
        role |= COMMIT
    if issubclass(cls, dc.GdnFoldAccepted):
        role |= FOLD
    if issubclass(cls, (lc.CompactSlot, dc.CompactSequence)):
        role |= COMPACT
    if issubclass(cls, (lc.EpShutdown, lc.Quiesce, lc.Teardown)):
        role |= SHUTDOWN
    if issubclass(cls, DRAFT_RULED):
        role |= DRAFT
    if issubclass(cls, DECODE_LANE):
        role |= DECODE
    if issubclass(cls, plans.Decode):
        role |= PLAN
    if hasattr(cls, "split"):
        role |= BATCHED
    if issubclass(cls, (TokenOut, TokensOut)):
        role |= OUT
    if issubclass(cls, (lc.MarconiCheckpoint, lc.MarconiCheckpoints)):
        role |= CHECKPOINT
    if issubclass(cls, CUTS_ONE + CUTS_MANY):
        role |= CUT
    if issubclass(cls, (lc.SsmSnapshotRestore, dc.TruncateSequence)):
        role |= ROLLBACK
    return role


class _Memo(dict):
    """A dict that fills itself: a missing key's value is ``work(key)``, kept (at most ``bound``
    keys: past that it starts afresh)."""

    def __init__(self, work: Any, bound: int = 65536) -> None:
        super().__init__()
        self.work, self.bound = work, bound

    def __missing__(self, key: Any) -> int:
        if len(self) >= self.bound:
            self.clear()
        value = self[key] = self.work(key)
        return value


ROLES: dict[type, int] = _Memo(effect_role)
"""Effect type -> its roles (``effect_role``), worked out once per type."""


def batch_roles(kinds) -> int:
    """The roles of a batch of effects of types ``kinds``: the union of theirs."""
    union = 0
    for cls in kinds:
        union |= ROLES[cls]
    return union


BATCH_ROLES: dict[tuple, int] = _Memo(batch_roles)
"""A batch's effect types, in order (its signature) -> ``batch_roles``, worked out once per
signature: the walk's batches repeat a few hundred signatures."""


def naming(kinds) -> tuple[int, ...]:
    """Where in a batch of effects of types ``kinds`` an effect allocates, releases or names a
    sequence (what ``no_effect_on_released`` reads)."""
    return tuple(at for at, cls in enumerate(kinds) if ROLES[cls] & (ALLOC | RELEASE | NAMES))


NAMING: dict[tuple, tuple[int, ...]] = _Memo(naming)
"""A batch's signature -> ``naming``, worked out once per signature."""


# --- the kinds of an event: what ``Monitor.on_event`` does with it ----------------------------------------

INPUT = 1 << 0  # one of ``ev.INPUT_EVENTS``
CLOCK = 1 << 1
CANCEL = 1 << 2
ARRIVAL = 1 << 3
FAULT = 1 << 4  # a ``DeviceFault``


def event_kind(cls: type) -> int:
    """The kind of event type ``cls``, by the class tests ``Monitor.on_event`` makes."""
    kind = INPUT if issubclass(cls, ev.INPUT_EVENTS) else 0
    for bit, base in ((CLOCK, ev.Clock), (CANCEL, ev.Cancel), (ARRIVAL, ev.Arrival), (FAULT, ev.DeviceFault)):
        if issubclass(cls, base):
            kind |= bit
    return kind


EVENT_KINDS: dict[type, int] = _Memo(event_kind)
"""Event type -> its kind (``event_kind``), worked out once per type."""

