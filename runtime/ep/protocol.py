"""The EP wire protocol: command words, message kinds, and the parser that turns messages into
commands (no torch, no I/O).

Every message is one fixed-size int64 vector ``[kind, number, a, b, n, p0 .. p10]``
(``HEADER_LEN`` = 16); ``number`` counts messages from 1; ``n`` is the payload length. A payload
of at most ``INLINE`` values rides in ``p0..``; a longer one follows as a second int64 vector of
exactly ``n`` values (the length message, then the data).

Kinds 1-4 carry the trace's EP calls one for one; kinds 5-11 are the leader's own announcements
of what the words leave out (they add no trace line):

====  ==============  =====================================  =====================================
kind  name            fields                                 sent for
====  ==============  =====================================  =====================================
1     CMD_FOR_SEQ     a = slot, b = word                     ``ep_broadcast_cmd_for_seq``
2     CMD             b = word                               ``ep_broadcast_cmd``
3     TOKENS          payload = the tokens                   ``ep_broadcast_tokens``
4     VISION          a = n                                  ``ep_sync_vision_embeds``
5     ROWS            payload = row groups (committed)       unannounced committed forwards:
                                                             ``decode_batch``, ``mixed_forward*``,
                                                             ``prefill_batch_chunk``, a
                                                             ``prefill*``/``decode`` without words
6     PENDING_ROWS    payload = row groups (uncommitted),    unannounced verifies:
                      a = 1 for draft rows                   ``decode_verify_batched`` (the batched
                                                             verify announcement), a serial verify
                                                             without words; ``decode_draft``
7     SET_LEN         a = slot, b = length                   ``truncate_sequence``
8     MOVE            a = from slot, b = to slot             ``compact_sequence``
9     RESTORE         a = slot, payload = tokens             ``restore_sequence_state``
10    TICK            a = tick, b = digest of the mirror     the ``-- tick N`` read
11    SYNC            a = sync number                        before a model answer is read
12    EXPERTS         a = MoE layer id, b = rows,            a sharded MoE layer's routed sum
                      payload = (top-k, hidden size)         (runtime/ep/experts.py): the data plane
====  ==============  =====================================  =====================================

EXPERTS is not a command: it is numbered 0, never fed to the parser, and announces two more
collectives on the same group, the layer's payload broadcast from rank 0 and a reduce of the
ranks' partial sums to rank 0 (specs/expert-parallel.md §10.3); the other kinds are numbered 1, 2, ...

A row group is ``slot, start, count, token * count``; a row payload is ``groups, group*``.
Uncommitted rows stay pending until the slot's next forward (or a length) settles them; *draft*
rows (``decode_draft``) extend the slot's pending draft chain instead.

Command words (specs/recording-device.md §3.8.8; defined in ``fxsched.effects.ep_words``, which the
scheduler uses too). The first word of a command comes with its slot (CMD_FOR_SEQ), the
following words without (CMD):

* ``PREFILL_CMD`` then chunk length, chunk start, full prompt length, TOKENS (the whole prompt),
  VISION (full length);
* ``RELEASE_CMD``: the slot's occupant is freed and the slot is allocated afresh (empty);
* ``VERIFY_CMD[K]`` (K = 2, 3, 4) then the K input tokens; after the verify one more CMD, the
  accept count ``na``: the slot keeps ``na + 1`` of the K rows;
* ``SHUTDOWN_CMD``: the workers stop;
* any other word below ``RESERVED_FROM``: a token decoded in the slot.

Answers (worker to leader, through the rendezvous store, never through the broadcast): on SYNC n
every worker sets ``ep/sync/<n>/<rank>`` to ``ok`` or its first error; on the shutdown word it
sets ``ep/final/<rank>`` to its report (JSON: per-tick snapshots, counts, error) and exits. On TICK
a worker compares the digest of its own mirror with the leader's; a difference is its error.
The digest is ``mirror.snapshot_digest`` of the mirror's snapshot (non-empty slots in order).
"""

from __future__ import annotations

from enum import IntEnum
from typing import Optional, Union

import attrs

from fxsched.effects.ep_words import PREFILL_CMD, RELEASE_CMD, RESERVED_FROM, SHUTDOWN_CMD, VERIFY_K

HEADER_LEN = 16
INLINE = HEADER_LEN - 5


class Kind(IntEnum):
    CMD_FOR_SEQ = 1
    CMD = 2
    TOKENS = 3
    VISION = 4
    ROWS = 5
    PENDING_ROWS = 6
    SET_LEN = 7
    MOVE = 8
    RESTORE = 9
    TICK = 10
    SYNC = 11
    EXPERTS = 12


class ProtocolError(RuntimeError):
    """A message that does not fit the protocol (a bug on one side, never a fault to answer)."""


@attrs.frozen
class Message:
    """One wire message; ``number`` is stamped by the sender."""

    kind: Kind
    a: int = 0
    b: int = 0
    payload: tuple[int, ...] = attrs.field(default=(), converter=lambda v: tuple(int(x) for x in v))
    number: int = 0


def encode(message: Message) -> tuple[list[int], Optional[list[int]]]:
    """(header, tail): the fixed-size header and, for a long payload, the vector that follows it."""
    p = list(message.payload)
    header = [int(message.kind), message.number, message.a, message.b, len(p)]
    if len(p) <= INLINE:
        return header + p + [0] * (INLINE - len(p)), None
    return header + [0] * INLINE, p


def decode_header(header: list[int]) -> tuple[Message, int]:
    """(message without a long payload, length of the tail still to receive: 0 if none)."""
    if len(header) != HEADER_LEN:
        raise ProtocolError(f"a header has {HEADER_LEN} values, got {len(header)}")
    kind, number, a, b, n = header[:5]
    try:
        kind = Kind(kind)
    except ValueError:
        raise ProtocolError(f"message {number}: unknown kind {kind}") from None
    if n <= INLINE:
        return Message(kind, a, b, header[5:5 + n], number), 0
    return Message(kind, a, b, (), number), n


# --- row groups ------------------------------------------------------------------------------


@attrs.frozen
class Rows:
    """Tokens written into ``slot`` from position ``start`` by one forward."""

    slot: int
    start: int
    tokens: tuple[int, ...] = attrs.field(converter=lambda v: tuple(int(x) for x in v))


def pack_rows(rows: list[Rows]) -> list[int]:
    out = [len(rows)]
    for r in rows:
        out += [r.slot, r.start, len(r.tokens), *r.tokens]
    return out


def unpack_rows(payload: tuple[int, ...]) -> tuple[Rows, ...]:
    if not payload:
        raise ProtocolError("a row message without groups")
    count, i, out = payload[0], 1, []
    for _ in range(count):
        if i + 3 > len(payload):
            raise ProtocolError(f"row groups cut short: {list(payload)}")
        slot, start, n = payload[i:i + 3]
        out.append(Rows(slot, start, payload[i + 3:i + 3 + n]))
        i += 3 + n
    if i != len(payload):
        raise ProtocolError(f"row groups leave {len(payload) - i} values over")
    return tuple(out)


# --- commands: what a message (or a run of words) means -----------------------------------------


@attrs.frozen
class Prefill:
    slot: int
    start: int
    chunk: int
    prompt: tuple[int, ...]


@attrs.frozen
class Release:
    slot: int


@attrs.frozen
class Decode:
    slot: int
    token: int


@attrs.frozen
class Verify:
    slot: int
    tokens: tuple[int, ...]


@attrs.frozen
class Accept:
    slot: int
    accepted: int


@attrs.frozen
class Shutdown:
    pass


@attrs.frozen
class Forward:
    """Announced rows (kinds 5 and 6); ``committed`` is false for verify and draft rows, ``draft``
    marks the rows of a self-speculative draft chain."""

    rows: tuple[Rows, ...]
    committed: bool
    draft: bool = False


@attrs.frozen
class SetLength:
    slot: int
    length: int


@attrs.frozen
class Move:
    src: int
    dst: int


@attrs.frozen
class Restore:
    slot: int
    tokens: tuple[int, ...]


@attrs.frozen
class Tick:
    tick: int
    digest: int


@attrs.frozen
class Sync:
    number: int


WordCommand = Union[Prefill, Release, Decode, Verify, Accept, Shutdown]
Command = Union[WordCommand, Forward, SetLength, Move, Restore, Tick, Sync]


@attrs.define
class _Partial:
    """A word command still collecting its following words."""

    slot: int
    word: int
    words: list = attrs.Factory(list)
    tokens: Optional[tuple[int, ...]] = None


class CommandParser:
    """Messages in, commands out. Word commands complete when their last word arrives; an accept
    count is the first bare word after a verify's inputs. The other kinds are commands by
    themselves and may arrive between any two word commands."""

    def __init__(self) -> None:
        self._partial: Optional[_Partial] = None
        self._awaiting_accept: Optional[int] = None  # slot of a verify whose accept count is due

    @property
    def idle(self) -> bool:
        return self._partial is None

    def feed(self, m: Message) -> Optional[Command]:
        return self.feed_fields(m.kind, m.a, m.b, m.payload, m.number)

    def feed_fields(self, kind: Kind, a: int, b: int, payload: tuple[int, ...], number: int) -> Optional[Command]:
        """``feed`` of a message given by its fields (a sender in the same process, such as the
        simulated device, builds no ``Message``)."""
        if kind == Kind.CMD_FOR_SEQ:  # (the words first: nearly every message is one)
            return self._first_word(a, b, number)
        if kind == Kind.CMD:
            return self._next_word(b, number)
        match kind:
            case Kind.TOKENS:
                self._tokens(payload, number)
                return None
            case Kind.VISION:
                return self._vision(a, number)
            case Kind.ROWS:
                return Forward(unpack_rows(payload), True)
            case Kind.PENDING_ROWS:
                return Forward(unpack_rows(payload), False, draft=a == 1)
            case Kind.SET_LEN:
                return SetLength(a, b)
            case Kind.MOVE:
                return Move(a, b)
            case Kind.RESTORE:
                return Restore(a, payload)
            case Kind.TICK:
                return Tick(a, b)
            case Kind.SYNC:
                return Sync(a)
            case Kind.EXPERTS:
                raise ProtocolError(f"message {number}: an expert call is data, not a command")
        raise ProtocolError(f"message {number}: kind {kind} has no meaning")  # pragma: no cover

    def _first_word(self, slot: int, word: int, number: int) -> Optional[Command]:
        if word == SHUTDOWN_CMD:  # ends everything, also a command cut short by a failed run
            self._partial = self._awaiting_accept = None
            return Shutdown()
        if self._partial is not None:
            raise ProtocolError(f"message {number}: command {word:#x} for slot {slot} starts while "
                                f"{self._partial.word:#x} for slot {self._partial.slot} is incomplete")
        self._awaiting_accept = None  # a verify whose accept never came (its sequence failed)
        if word == RELEASE_CMD:
            return Release(slot)
        if word == PREFILL_CMD or word in VERIFY_K:
            self._partial = _Partial(slot, word)
            return None
        if word >= RESERVED_FROM:
            raise ProtocolError(f"message {number}: reserved word {word:#x} has no meaning")
        return Decode(slot, word)

    def _next_word(self, word: int, number: int) -> Optional[Command]:
        p = self._partial
        if p is None:
            if self._awaiting_accept is None:
                raise ProtocolError(f"message {number}: word {word:#x} outside any command")
            slot, self._awaiting_accept = self._awaiting_accept, None
            return Accept(slot, word)
        if p.word == PREFILL_CMD:
            if len(p.words) == 3:
                raise ProtocolError(f"message {number}: prefill of slot {p.slot} expects its tokens, got a word")
            p.words.append(word)
            return None
        p.words.append(word)
        if len(p.words) < VERIFY_K[p.word]:
            return None
        self._partial = None
        self._awaiting_accept = p.slot
        return Verify(p.slot, tuple(p.words))

    def _tokens(self, tokens: tuple[int, ...], number: int) -> None:
        p = self._partial
        if p is None or p.word != PREFILL_CMD or len(p.words) != 3 or p.tokens is not None:
            raise ProtocolError(f"message {number}: tokens outside a prefill announcement")
        if len(tokens) != p.words[2]:
            raise ProtocolError(f"message {number}: prefill of slot {p.slot} announced {p.words[2]} tokens, "
                                f"got {len(tokens)}")
        p.tokens = tokens

    def _vision(self, n: int, number: int) -> Prefill:
        p = self._partial
        if p is None or p.tokens is None:
            raise ProtocolError(f"message {number}: vision sync outside a prefill announcement")
        self._partial = None
        chunk, start, _ = p.words
        if n != len(p.tokens) or start + chunk > len(p.tokens):
            raise ProtocolError(f"message {number}: prefill of slot {p.slot} chunk {start}+{chunk} of "
                                f"{len(p.tokens)} tokens, vision n={n}")
        return Prefill(p.slot, start, chunk, p.tokens)
