"""The scripted device's bookkeeping (specs/recording-device.md §3.1, §3.2, §3.4, §3.5):
``ScriptedBook``, the state every part of ``scripted.ScriptedDevice`` shares (scripts, sequences,
slots, KV blocks, the last forward's rows, cancels, scheduled faults, the trace list) and the
helpers that keep it, with ``ScriptedSequence`` and the trace's value formats."""

from __future__ import annotations

from typing import Callable, Iterable, Optional

from fxsched.core.kv import blocks_for
from fxsched.runtime.devices.device import DeviceError
from fxsched.runtime.devices.script_rules import Script, cancel_due, script_key, script_next


class ScriptedSequence:
    """A sequence as a scripted device holds it: its slot, the tokens in its KV, its blocks."""

    __slots__ = ("seq_id", "session", "slot", "seq_len", "tokens", "blocks", "request_id")

    def __init__(self, seq_id: int, session: int, slot: int):
        self.seq_id = seq_id
        self.session = session
        self.slot = slot
        self.seq_len = 0
        self.tokens: list[int] = []
        self.blocks = 0
        self.request_id = session

    @property
    def sid(self) -> str:
        """How the trace names the sequence: session, slot and KV length."""
        return f"s{self.session}@{self.slot}:len={self.seq_len}"


def _list(values) -> str:
    return "[" + ", ".join(str(v) for v in values) + "]"


def _lists(values) -> str:
    return "[" + ", ".join(_list(v) for v in values) + "]"


def _bool(value: bool) -> str:
    return "true" if value else "false"


class ScriptedBook:
    """The state of a scripted device and its bookkeeping: what the parts of ``ScriptedDevice``
    share.

    It keeps the slots (lowest free slot first), each sequence's tokens, length and blocks, the
    rows of the last forward, the scripted cancels, the tick count (every other occupancy read),
    the scheduled faults (``kv_exhaust_at`` and ``decode_fault_at`` count ``decode_batch`` calls,
    ``verify_fault_at`` verify calls) and, with ``count_accepted``, the drafts each request had
    accepted. ``lines`` is the trace: a list to write one line per call into, or None for a silent
    device. Subclasses say how a sequence is looked up (``_seq``), how its blocks grow
    (``_grow_to``), and how a sequence is spilled and restored.
    """

    def __init__(self, scripts: dict[int, Script], *, vocab: int, block_size: int, total_blocks: int,
                 held_blocks: int = 0, reclaimable: int = 0, cancel_flags: Iterable[int] = (),
                 kv_exhaust_at: Iterable[int] = (), decode_fault_at: Iterable[int] = (),
                 verify_fault_at: Iterable[int] = (), can_batch_verify: bool = True, slot_draft_capacity: int = 8,
                 count_accepted: bool = False, lines: Optional[list[str]] = None):
        self.scripts = scripts
        self.vocab = vocab
        self.block_size = block_size
        self.total_blocks = total_blocks
        self.held_blocks = held_blocks
        self.reclaimable = reclaimable
        self.used_blocks = 0
        self.cancel_registered = set(cancel_flags)
        self.cancels_fired: list[int] = []
        self.kv_exhaust_at = set(kv_exhaust_at)
        self.decode_fault_at = set(decode_fault_at)
        self.verify_fault_at = set(verify_fault_at)
        self.batch_verify_ok = can_batch_verify
        self.slot_capacity = slot_draft_capacity
        self.count_accepted = count_accepted
        self.accepted: dict[int, int] = {}
        self.lines = lines
        self.sequences: dict[int, ScriptedSequence] = {}  # every sequence ever allocated
        self.live: dict[int, ScriptedSequence] = {}  # the allocated ones
        self.free_slots: list[int] = []
        self.next_slot = 0
        self.rows: list[int] = []
        # each row of the last forward: (its sequence, the KV position of the token it was fed)
        self.row_at: list[tuple[int, int]] = []
        self.decode_calls = 0
        self.verify_calls = 0
        self.occupancy_reads = 0
        self.tick = 0
        self.on_tick: Callable[[int], None] = lambda tick: None
        self.torn_down = False

    # --- what subclasses decide ---------------------------------------------------------------------

    def _seq(self, seq_id: int) -> ScriptedSequence:
        raise NotImplementedError

    def _grow_to(self, seq: ScriptedSequence, seq_len: int) -> None:
        """Give ``seq`` the blocks for ``seq_len`` tokens."""
        raise NotImplementedError

    def free_count(self) -> int:
        return self.total_blocks - self.used_blocks - self.held_blocks

    def _check_room(self, seqs) -> None:
        """Called before a ``decode_batch`` grows ``seqs`` by one token each."""

    # --- bookkeeping ------------------------------------------------------------------------------

    def _need(self, seq_len: int) -> int:
        return blocks_for(seq_len, self.block_size)

    def _script(self, seq: ScriptedSequence) -> Script:
        key = script_key(seq.session, seq.tokens)
        script = self.scripts.get(key)
        if script is None:
            raise DeviceError(f"no script for request {key}")
        seq.request_id = key
        return script

    def _next(self, seq: ScriptedSequence) -> int:
        """The answer after the sequence's last token."""
        return script_next(self._script(seq), seq.seq_len - 1)

    def _append(self, seq: ScriptedSequence, tokens) -> None:
        self._grow_to(seq, seq.seq_len + len(tokens))
        seq.tokens.extend(tokens)
        seq.seq_len += len(tokens)

    def _slice(self, seq: ScriptedSequence, prompt, start: int, length: int) -> int:
        """Write ``prompt[start:start + length]`` into ``seq``; the answer after it."""
        self._grow_to(seq, start + length)
        seq.tokens.extend(prompt[start:start + length])
        seq.seq_len = start + length
        return self._next(seq)

    def _decode_rows(self, tokens, seqs, cancel: bool) -> list[int]:
        rows = []
        for token, seq_id in zip(tokens, seqs, strict=True):
            s = self._seq(seq_id)
            if cancel:
                self._cancel_trigger(s)
            self._append(s, [token])
            rows.append(self._next(s))
        return rows

    def _allocate_slot(self) -> int:
        if self.free_slots:
            self.free_slots.sort()
            return self.free_slots.pop(0)
        slot = self.next_slot
        self.next_slot += 1
        return slot

    def _release_slot(self, slot: int) -> None:
        if slot not in self.free_slots:
            self.free_slots.append(slot)

    def _cancel_trigger(self, seq: ScriptedSequence) -> None:
        if cancel_due(self._script(seq), len(seq.tokens)) and seq.session in self.cancel_registered:
            self.cancels_fired.append(seq.session)

    def take_cancels(self) -> list[int]:
        """Request ids whose scripted client cancelled since the last call."""
        fired = self.cancels_fired
        if fired:  # (none fired: the device's own empty list, which the caller only reads)
            self.cancels_fired = []
        return fired

    def _count_accepted(self, seq: ScriptedSequence, inputs, outputs) -> None:
        if not self.count_accepted:
            return
        na = 0
        while na < len(inputs) - 1 and inputs[na + 1] == outputs[na]:
            na += 1
        self.accepted[seq.request_id] = self.accepted.get(seq.request_id, 0) + na

    def _verify_call(self) -> None:
        call = self.verify_calls
        self.verify_calls += 1
        if call in self.verify_fault_at:
            raise DeviceError("scripted verify fault")

    def note_fx(self, line: str) -> None:
        if self.lines is not None:
            self.lines.append(line)
