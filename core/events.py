"""Events: everything that can happen to the scheduler.

Two families. *Inputs* may arrive in any phase (an arrival, a cancel, a clock reading, the inbox
closing, a LoRA rotation request). *Answers* arrive only when the phase waits for them: each is
the answer of the query that ended the previous batch of effects.
"""

from __future__ import annotations

from typing import Optional

import attrs

from fxsched.core.request import Request
from fxsched.effects.base import int_tuple, int_tuples, quick_inits


@attrs.frozen
class Event:
    """Base of every event."""


# --- inputs ----------------------------------------------------------------------------------


@attrs.frozen
class Boot(Event):
    """Starts the loop."""


@attrs.frozen
class Arrival(Event):
    request: Request


@attrs.frozen
class Cancel(Event):
    """The client of ``request_id`` cancelled; the speculative emit notices it."""

    request_id: int


@attrs.frozen
class Clock(Event):
    now_ms: float


@attrs.frozen
class InboxClosed(Event):
    pass


@attrs.frozen
class RotationRequested(Event):
    name: str


INPUT_EVENTS = (Arrival, Cancel, Clock, InboxClosed, RotationRequested)


# --- answers ---------------------------------------------------------------------------------


@attrs.frozen
class Answer(Event):
    """The answer to the query that ended the last batch."""


@attrs.frozen
class StreamCreated(Answer):
    stream: int


@attrs.frozen
class EventCreated(Answer):
    event: int


@attrs.frozen
class ForwardDone(Answer):
    """A forward (prefill, chunk, mixed step, decode) completed; a first prefill says how many
    prompt tokens it found in the prefix cache: ``cached_tokens`` for a forward of one sequence,
    ``cached_by_seq`` (sequence id, tokens) for the first chunks of a batched or mixed forward."""

    cached_tokens: int = 0
    cached_by_seq: tuple[tuple[int, int], ...] = ()


@attrs.frozen
class InputReady(Answer):
    """The blocking inbox wait returned (what arrived came as input events just before)."""


@attrs.frozen
class FreeBlocks(Answer):
    count: int


@attrs.frozen
class SlotAllocated(Answer):
    slot: int


@attrs.frozen
class AdapterIds(Answer):
    ids: tuple[int, ...] = attrs.field(converter=int_tuple)


@attrs.frozen
class TokenSampled(Answer):
    """One token read from a logits row (device argmax)."""

    token: int


@attrs.frozen
class TokensSampled(Answer):
    """Tokens read from consecutive rows; ``logprobs`` holds per-row record sizes (0: none).

    A plain decode answered ahead (specs/async.md §16.6) has a ``LATE_TOKEN`` for each row: its
    tokens stay on the device. ``earlier`` (with ``earlier_logprobs``) holds the tokens of the
    sequences whose decode was answered ahead before and that the query named to resolve
    (``Decode.resolve``, ``ReadAhead.seqs``), in that order; empty otherwise."""

    tokens: tuple[int, ...] = attrs.field(converter=int_tuple)
    logprobs: tuple[int, ...] = attrs.field(default=(), converter=int_tuple)
    earlier: tuple[int, ...] = attrs.field(default=(), converter=int_tuple)
    earlier_logprobs: tuple[int, ...] = attrs.field(default=(), converter=int_tuple)


# A draft the device holds and has not read back (specs/async.md §16.3): a proposal may answer
# LATE_DRAFT for each draft; the value arrives with the answer of the verify that consumes it.
LATE_DRAFT = -1

# A decode's token that stays on the device (specs/async.md §16.6): a plain decode answered ahead
# has one for each row, the next decode feeds it from the device, and its value arrives with the
# answer of the query that resolves it. Never a token id.
LATE_TOKEN = -1


@attrs.frozen
class VerifyRows(Answer):
    """The verify's rows; ``inputs``: the verify's inputs as the device ran them, when the query's
    tokens held late drafts (empty otherwise: they were the query's own tokens)."""

    rows: tuple[int, ...] = attrs.field(converter=int_tuple)
    inputs: tuple[int, ...] = attrs.field(default=(), converter=int_tuple)


@attrs.frozen
class Drafts(Answer):
    """A proposal's drafts (each may be LATE_DRAFT)."""

    drafts: tuple[int, ...] = attrs.field(converter=int_tuple)


@attrs.frozen
class BatchedDrafts(Answer):
    drafts: tuple[tuple[int, ...], ...] = attrs.field(converter=int_tuples)


@attrs.frozen
class DraftCapacity(Answer):
    capacities: tuple[int, ...] = attrs.field(converter=int_tuple)


@attrs.frozen
class BatchVerifyAllowed(Answer):
    allowed: bool


@attrs.frozen
class BeamHypotheses(Answer):
    hypotheses: tuple[tuple[int, ...], ...] = attrs.field(converter=int_tuples)


@attrs.frozen
class BlocksReclaimed(Answer):
    count: int


@attrs.frozen
class StateRestored(Answer):
    error: Optional[str] = None


@attrs.frozen
class LoraApplied(Answer):
    error: Optional[str] = None


@attrs.frozen
class DeviceFault(Answer):
    """The query failed on the device. ``kv_exhausted`` marks the recoverable KV-full case.
    ``earlier``: the tokens the failed query was to resolve (specs/async.md §16.6), when the device
    could still read them; empty otherwise."""

    message: str
    kv_exhausted: bool = False
    earlier: tuple[int, ...] = attrs.field(default=(), converter=int_tuple)


quick_inits(globals())  # every record class above: a quicker __init__ (effects/base.py)
