"""The simulated device of the model checker: the scripted model of the recording device, fast
and silent, with a finite block pool and injected faults.

It answers every call by the same rules as the recording device (``ScriptedDevice``), keeps a
strict block pool (growing past it is KV exhaustion on a decode and a fault elsewhere), refuses
calls on sequences that are not allocated, and can fail scheduled calls. It records no trace; it
keeps what the invariants need: the pool, the slots, each sequence's KV length, and the drafts it
saw accepted per request.
"""

from __future__ import annotations

from fxsched.runtime.devices.device import DeviceError
from fxsched.runtime.devices.scripted import Script, ScriptedDevice, ScriptedSequence


class SimDevice(ScriptedDevice):
    """Implements the Device protocol for the random walk and the hypothesis machine."""

    def __init__(self, scripts: dict[int, Script], *, vocab: int = 64, block_size: int = 16,
                 total_blocks: int = 1000, held_blocks: int = 0, kv_exhaust_at=(), decode_fault_at=(),
                 verify_fault_at=(), spill_corrupt_for=(), cancel_flags=(), can_batch_verify: bool = True,
                 slot_draft_capacity: int = 8, count_accepted: bool = True):
        super().__init__(scripts, vocab=vocab, block_size=block_size, total_blocks=total_blocks,
                         held_blocks=held_blocks, cancel_flags=cancel_flags, kv_exhaust_at=kv_exhaust_at,
                         decode_fault_at=decode_fault_at, verify_fault_at=verify_fault_at,
                         can_batch_verify=can_batch_verify, slot_draft_capacity=slot_draft_capacity,
                         count_accepted=count_accepted)
        self.spill_corrupt_for = set(spill_corrupt_for)
        self.spilled: dict[int, dict] = {}

    def _seq(self, seq_id: int) -> ScriptedSequence:
        seq = self.live.get(seq_id)
        if seq is None:
            raise DeviceError(f"sequence {seq_id} is not allocated")
        return seq

    def _grow_to(self, seq: ScriptedSequence, seq_len: int) -> None:
        need = self._need(seq_len)
        if need > seq.blocks:
            extra = need - seq.blocks
            if extra > self.free_count():
                raise DeviceError("out of KV blocks")
            self.used_blocks += extra
            seq.blocks = need

    def _check_room(self, seqs) -> None:
        """A decode that cannot grow every sequence by one token fails before it writes any."""
        need = sum(max(self._need(self._seq(i).seq_len + 1) - self._seq(i).blocks, 0) for i in seqs)
        if need > self.free_count():
            raise DeviceError("KV cache exhausted", kv_exhausted=True)

    def _alloc(self, seq: int, session: int) -> int:
        if seq in self.live:
            raise DeviceError(f"sequence {seq} is already allocated")
        return super()._alloc(seq, session)

    def compact_sequence(self, seq: int, new_slot: int) -> None:
        s = self._seq(seq)
        if new_slot != s.slot and any(o.slot == new_slot for o in self.live.values() if o is not s):
            raise DeviceError(f"compaction target slot {new_slot} is held by another sequence")
        super().compact_sequence(seq, new_slot)

    def save_sequence_state(self, seq: int) -> None:
        s = self._seq(seq)
        self._script(s)
        self.spilled[seq] = {"tokens": list(s.tokens), "seq_len": s.seq_len,
                             "corrupt": s.request_id in self.spill_corrupt_for}

    def restore_sequence_state(self, seq: int, blocks: int) -> None:
        s = self._seq(seq)
        saved = self.spilled.pop(seq, None)
        if saved is None:
            raise DeviceError(f"spill file for sequence {seq} is missing")
        if saved["corrupt"]:
            raise DeviceError(f"spill file for sequence {seq} is corrupted (checksum mismatch)")
        if blocks > self.free_count():
            raise DeviceError("out of KV blocks")
        s.tokens = saved["tokens"]
        s.seq_len = saved["seq_len"]
        s.blocks = blocks
        self.used_blocks += blocks
