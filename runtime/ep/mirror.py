"""The mirror: every slot's sequence (its tokens, hence its length) as the EP stream describes it.

Commands become *slot operations* with explicit positions, which the mirror applies to itself
and hands on (a worker's model replica runs them):

* ``Forward(rows, committed)``: each row group writes its tokens from its start position
  (a prefill sets the slot's tokens, a decode word appends one, a verify appends its K inputs);
* ``SetLength(slot, n)``: the slot keeps its first n tokens (an accept count keeps the
  verify's ``na + 1`` rows; a truncation);
* ``Release(slot)``: the slot is empty; ``Move(src, dst)``: a compaction;
  ``Restore(slot, tokens)``: a spilled sequence comes back.

Invariant: a row group never starts past the slot's end, and a length never grows it (both raise
``MirrorError``). The snapshot lists the non-empty slots in slot order.
"""

from __future__ import annotations

import hashlib
from typing import TypeAlias, Union

from fxsched.runtime.ep.protocol import (
    Accept,
    Command,
    Decode,
    Forward,
    Move,
    Prefill,
    Release,
    Restore,
    Rows,
    SetLength,
    Verify,
)

SlotOp: TypeAlias = Union[Forward, SetLength, Release, Move, Restore]
Snapshot: TypeAlias = tuple[tuple[int, tuple[int, ...]], ...]


class MirrorError(RuntimeError):
    """An operation that cannot apply to the mirrored slots (the stream is inconsistent)."""


def snapshot_digest(snapshot: Snapshot) -> int:
    """A 63-bit digest of a snapshot (fits an int64 message field)."""
    raw = hashlib.blake2b(repr(snapshot).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little") & (2**63 - 1)


class EpMirror:
    def __init__(self) -> None:
        self.slots: dict[int, list[int]] = {}
        self._verify_base: dict[int, int] = {}  # slot -> its length before the announced verify

    # --- reading -----------------------------------------------------------------------------

    def length(self, slot: int) -> int:
        return len(self.slots.get(slot, ()))

    def tokens(self, slot: int) -> list[int]:
        return list(self.slots.get(slot, ()))

    def snapshot(self) -> Snapshot:
        return tuple((slot, tuple(toks)) for slot, toks in sorted(self.slots.items()) if toks)

    def digest(self) -> int:
        return snapshot_digest(self.snapshot())

    # --- commands to operations ------------------------------------------------------------------

    def to_ops(self, command: Command) -> list[SlotOp]:
        """The slot operations of ``command`` (nothing for control commands)."""
        match command:
            case Prefill(slot=slot, start=start, chunk=chunk, prompt=prompt):
                return [Forward((Rows(slot, start, prompt[start:start + chunk]),), True)]
            case Decode(slot=slot, token=token):
                return [Forward((Rows(slot, self.length(slot), (token,)),), True)]
            case Verify(slot=slot, tokens=tokens):
                return [Forward((Rows(slot, self.length(slot), tokens),), False)]
            case Accept(slot=slot, accepted=na):
                base = self._verify_base.get(slot)
                if base is None:
                    raise MirrorError(f"accept count {na} for slot {slot} without an announced verify")
                return [SetLength(slot, base + na + 1)]
            case Forward() | SetLength() | Release() | Move() | Restore():
                return [command]
        return []

    def apply(self, command: Command) -> list[SlotOp]:
        """Apply ``command``; returns the operations it made (for a replica to run)."""
        ops = self.to_ops(command)
        if isinstance(command, Verify):
            self._verify_base[command.slot] = self.length(command.slot)
        elif isinstance(command, Accept):
            del self._verify_base[command.slot]
        for op in ops:
            self.apply_op(op)
        return ops

    def apply_op(self, op: SlotOp) -> None:
        match op:
            case Forward(rows=rows):
                for r in rows:
                    self._write(r)
            case SetLength(slot=slot, length=n):
                toks = self.slots.get(slot, [])
                if n > len(toks):
                    raise MirrorError(f"slot {slot}: length {n} would grow it past its {len(toks)} tokens")
                del toks[n:]
            case Release(slot=slot):
                self.slots.pop(slot, None)
                self._verify_base.pop(slot, None)
            case Move(src=src, dst=dst):
                if src == dst:
                    return
                if self.slots.get(dst):
                    raise MirrorError(f"move of slot {src} into slot {dst}, which still holds {len(self.slots[dst])} tokens")
                self.slots[dst] = self.slots.pop(src, [])
                self._verify_base.pop(src, None)
            case Restore(slot=slot, tokens=tokens):
                self.slots[slot] = list(tokens)

    def _write(self, r: Rows) -> None:
        toks = self.slots.setdefault(r.slot, [])
        if r.start > len(toks):
            raise MirrorError(f"slot {r.slot}: rows from position {r.start} but it holds {len(toks)} tokens")
        toks[r.start:] = r.tokens

