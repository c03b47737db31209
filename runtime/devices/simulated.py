"""The simulated device of the model checker: the scripted model of the recording device, fast
and silent, with a finite block pool and injected faults.

It answers every call by the same rules as the recording device (``script_model``), keeps a
strict block pool (growing past it is KV exhaustion on a decode and a fault elsewhere), and can
fail scheduled calls. It records no trace; it keeps what the invariants need: the pool, the
slots, each sequence's KV length, and the drafts it saw accepted per request.
"""

from __future__ import annotations

from typing import Optional

from fxsched.runtime.device import DeviceError
from fxsched.runtime.script_model import Script, cancel_due, script_drafts, script_key, script_next, script_verify


class SimSequence:
    __slots__ = ("seq_id", "session", "slot", "seq_len", "tokens", "blocks", "request_id")

    def __init__(self, seq_id: int, session: int, slot: int):
        self.seq_id = seq_id
        self.session = session
        self.slot = slot
        self.seq_len = 0
        self.tokens: list[int] = []
        self.blocks = 0
        self.request_id = session


class SimDevice:
    """Implements the Device protocol for the random walk and the hypothesis machine."""

    def __init__(self, scripts: dict[int, Script], *, vocab: int = 64, block_size: int = 16,
                 total_blocks: int = 1000, held_blocks: int = 0, kv_exhaust_at=(), decode_fault_at=(),
                 verify_fault_at=(), spill_corrupt_for=(), cancel_flags=(), can_batch_verify: bool = True,
                 slot_draft_capacity: int = 8, count_accepted: bool = True):
        self.scripts = scripts
        self.vocab = vocab
        self.block_size = block_size
        self.total_blocks = total_blocks
        self.held_blocks = held_blocks
        self.used_blocks = 0
        self.kv_exhaust_at = set(kv_exhaust_at)
        self.decode_fault_at = set(decode_fault_at)
        self.verify_fault_at = set(verify_fault_at)
        self.spill_corrupt_for = set(spill_corrupt_for)
        self.cancel_registered = set(cancel_flags)
        self.batch_verify_ok = can_batch_verify
        self.slot_capacity = slot_draft_capacity
        self.count_accepted = count_accepted
        self.sequences: dict[int, SimSequence] = {}
        self.live: dict[int, SimSequence] = {}
        self.free_slots: list[int] = []
        self.next_slot = 0
        self.rows: list[int] = []
        self.decode_calls = 0
        self.verify_calls = 0
        self.cancels_fired: list[int] = []
        self.accepted: dict[int, int] = {}
        self.spilled: dict[int, dict] = {}
        self.tick = 0
        self.occupancy_reads = 0
        self.on_tick = lambda tick: None
        self.torn_down = False

    # --- bookkeeping --------------------------------------------------------------------------

    def free_count(self) -> int:
        return self.total_blocks - self.used_blocks - self.held_blocks

    def _seq(self, seq_id: int) -> SimSequence:
        seq = self.live.get(seq_id)
        if seq is None:
            raise DeviceError(f"sequence {seq_id} is not allocated")
        return seq

    def _script(self, seq: SimSequence) -> Script:
        key = script_key(seq.session, seq.tokens)
        script = self.scripts.get(key)
        if script is None:
            raise DeviceError(f"no script for request {key}")
        seq.request_id = key
        return script

    def _need(self, seq_len: int) -> int:
        return seq_len // self.block_size + 1

    def _grow_to(self, seq: SimSequence, seq_len: int, kv_exhausted: bool = False) -> None:
        need = self._need(seq_len)
        if need > seq.blocks:
            extra = need - seq.blocks
            if extra > self.free_count():
                raise DeviceError("KV cache exhausted" if kv_exhausted else "out of KV blocks",
                                  kv_exhausted=kv_exhausted)
            self.used_blocks += extra
            seq.blocks = need

    def _append(self, seq: SimSequence, tokens) -> None:
        self._grow_to(seq, seq.seq_len + len(tokens))
        seq.tokens.extend(tokens)
        seq.seq_len += len(tokens)

    def _cancel_trigger(self, seq: SimSequence) -> None:
        if cancel_due(self._script(seq), len(seq.tokens)) and seq.session in self.cancel_registered:
            self.cancels_fired.append(seq.session)

    def take_cancels(self) -> list[int]:
        fired, self.cancels_fired = self.cancels_fired, []
        return fired

    def _count_accepted(self, seq: SimSequence, inputs, outputs) -> None:
        if not self.count_accepted:
            return
        na = 0
        while na < len(inputs) - 1 and inputs[na + 1] == outputs[na]:
            na += 1
        self.accepted[seq.request_id] = self.accepted.get(seq.request_id, 0) + na

    def note_fx(self, line: str) -> None:
        pass

    # --- start-up and snapshot ----------------------------------------------------------------

    def bind_gpu_to_thread(self) -> None:
        pass

    def create_stream(self) -> int:
        return 1

    def create_event(self) -> int:
        return 2

    def num_free_blocks(self) -> int:
        return self.free_count()

    def ssm_snapshot_occupancy(self) -> None:
        self.occupancy_reads += 1
        if self.occupancy_reads % 2 == 1:
            self.tick += 1
            self.on_tick(self.tick)

    # --- sequences ----------------------------------------------------------------------------

    def _alloc(self, seq: int, session: int) -> int:
        if seq in self.live:
            raise DeviceError(f"sequence {seq} is already allocated")
        if self.free_slots:
            self.free_slots.sort()
            slot = self.free_slots.pop(0)
        else:
            slot = self.next_slot
            self.next_slot += 1
        sim = SimSequence(seq, session, slot)
        self.sequences[seq] = sim
        self.live[seq] = sim
        return slot

    def alloc_sequence(self, seq: int, session: int) -> int:
        return self._alloc(seq, session)

    def alloc_sequence_for(self, seq: int, session: int, budget: int) -> int:
        return self._alloc(seq, session)

    def free_sequence(self, seq: int) -> None:
        s = self._seq(seq)
        self.used_blocks -= s.blocks
        s.blocks = 0
        del self.live[seq]
        if s.slot not in self.free_slots:
            self.free_slots.append(s.slot)

    def cache_sequence(self, seq: int) -> None:
        self._seq(seq)

    def compact_sequence(self, seq: int, new_slot: int) -> None:
        s = self._seq(seq)
        if new_slot != s.slot:
            if any(o.slot == new_slot for o in self.live.values() if o is not s):
                raise DeviceError(f"compaction target slot {new_slot} is held by another sequence")
            if new_slot in self.free_slots:
                self.free_slots.remove(new_slot)
            if s.slot not in self.free_slots:
                self.free_slots.append(s.slot)
            s.slot = new_slot

    def detach_slot_for_reuse(self, seq: int) -> None:
        self._seq(seq)

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

    def reclaim_prefix_blocks(self, n: int) -> int:
        return 0

    def truncate_sequence(self, seq: int, seq_len: int) -> None:
        s = self._seq(seq)
        s.seq_len = seq_len
        del s.tokens[seq_len:]

    # --- adapters, EP, streams (no state) ----------------------------------------------------------

    def adapter_id_for(self, slot: int) -> int:
        return 0 if slot == -1 else -1

    def acquire_adapter_slot(self, slot: int) -> int:
        return slot

    def set_active_lora(self, name: str) -> None:
        pass

    def ep_broadcast_cmd_for_seq(self, seq_slot: int, cmd: int) -> None:
        pass

    def ep_broadcast_cmd(self, cmd: int) -> None:
        pass

    def ep_broadcast_tokens(self, tokens) -> None:
        pass

    def ep_sync_vision_embeds(self, n: int) -> None:
        pass

    def poll_innerq(self) -> None:
        pass

    def record_event(self, event: int, stream: int) -> None:
        pass

    def stream_wait_event(self, stream: int, event: int) -> None:
        pass

    def synchronize(self, stream: int) -> None:
        pass

    def sync_secondary(self) -> None:
        pass

    def teardown(self) -> None:
        self.torn_down = True

    # --- forwards -------------------------------------------------------------------------------------

    def prefill(self, seq: int, tokens, stream: int) -> None:
        s = self._seq(seq)
        self._grow_to(s, len(s.tokens) + len(tokens))
        s.tokens.extend(tokens)
        s.seq_len = len(s.tokens)
        self.rows = [script_next(self._script(s), s.seq_len - 1)]

    def _slice(self, sl) -> int:
        s = self._seq(sl.seq)
        self._grow_to(s, sl.start + sl.length)
        s.tokens.extend(sl.prompt[sl.start:sl.start + sl.length])
        s.seq_len = sl.start + sl.length
        return script_next(self._script(s), s.seq_len - 1)

    def prefill_chunk(self, seq: int, prompt, start: int, length: int, last: bool, stream: int) -> None:
        from fxsched.effects.device_calls import PrefillSlice

        self.rows = [self._slice(PrefillSlice(seq, prompt, start, length, last))]

    def prefill_batch_chunk(self, prefills, stream: int) -> None:
        self.rows = [self._slice(sl) for sl in prefills]

    def normalize_ssm_states(self, seq: int, stream: int) -> None:
        self._seq(seq)

    def _decode_rows(self, tokens, seqs, cancel: bool) -> list[int]:
        rows = []
        for token, seq_id in zip(tokens, seqs):
            s = self._seq(seq_id)
            if cancel:
                self._cancel_trigger(s)
            self._append(s, [token])
            rows.append(script_next(self._script(s), s.seq_len - 1))
        return rows

    def mixed_forward(self, decode_tokens, decode_seqs, prefill, stream: int) -> None:
        rows = self._decode_rows(decode_tokens, decode_seqs, cancel=False)
        rows.append(self._slice(prefill))
        self.rows = rows

    def mixed_forward_batch(self, decode_tokens, decode_seqs, prefills, stream: int) -> None:
        rows = self._decode_rows(decode_tokens, decode_seqs, cancel=False)
        rows.extend(self._slice(sl) for sl in prefills)
        self.rows = rows

    def decode_batch(self, tokens, seqs, stream: int) -> None:
        call = self.decode_calls
        self.decode_calls += 1
        if call in self.kv_exhaust_at:
            raise DeviceError("KV cache exhausted", kv_exhausted=True)
        if call in self.decode_fault_at:
            raise DeviceError("scripted device fault")
        need = sum(max(self._need(self._seq(i).seq_len + 1) - self._seq(i).blocks, 0) for i in seqs)
        if need > self.free_count():
            raise DeviceError("KV cache exhausted", kv_exhausted=True)
        self.rows = self._decode_rows(tokens, seqs, cancel=True)

    def decode(self, token: int, seq: int, stream: int) -> None:
        self.rows = self._decode_rows([token], [seq], cancel=True)

    def decode_draft(self, token: int, seq: int, stream: int) -> None:
        self.rows = self._decode_rows([token], [seq], cancel=False)

    def _verify(self, seq: int, tokens, cancel: bool = True, count: bool = True) -> list[int]:
        call = self.verify_calls
        self.verify_calls += 1
        if call in self.verify_fault_at:
            raise DeviceError("scripted verify fault")
        s = self._seq(seq)
        if cancel:
            self._cancel_trigger(s)
        outputs = script_verify(self._script(s), s.seq_len, tokens)
        self._append(s, list(tokens))
        if count:
            self._count_accepted(s, tokens, outputs)
        self.rows = outputs
        return outputs

    def decode_verify(self, seq: int, tokens) -> list[int]:
        return self._verify(seq, tokens, count=False)

    def decode_verify_graphed(self, seq: int, tokens) -> list[int]:
        return self._verify(seq, tokens)

    def decode_verify_graphed_k3(self, seq: int, tokens) -> list[int]:
        return self._verify(seq, tokens)

    def decode_verify_graphed_k4(self, seq: int, tokens) -> list[int]:
        return self._verify(seq, tokens)

    def decode_verify_dflash(self, seq: int, tokens) -> list[int]:
        return self._verify(seq, tokens)

    def decode_and_verify_fused(self, seq: int, tokens) -> list[int]:
        return self._verify(seq, tokens)

    def decode_verify_batched(self, tokens, ks, seqs, stream: int, woa: bool) -> list[int]:
        call = self.verify_calls
        self.verify_calls += 1
        if call in self.verify_fault_at:
            raise DeviceError("scripted verify fault")
        outputs, off = [], 0
        for k, seq_id in zip(ks, seqs):
            s = self._seq(seq_id)
            mine = list(tokens[off:off + k])
            off += k
            rows = script_verify(self._script(s), s.seq_len, mine)
            self._append(s, mine)
            self._count_accepted(s, mine, rows)
            outputs.extend(rows)
        self.rows = outputs
        return outputs

    # --- proposers ------------------------------------------------------------------------------------

    def run_mtp_propose_multi(self, token: int, pos: int, n: int, seq: int, stream: int, mask: bool) -> list[int]:
        return script_drafts(self._script(self._seq(seq)), pos, n, self.vocab)

    def run_mtp_propose_batched(self, tokens, positions, stash, n: int, seqs, stream: int) -> list[list[int]]:
        return [script_drafts(self._script(self._seq(i)), p, n, self.vocab) for i, p in zip(seqs, positions)]

    def run_mtp_catchup_batched(self, tokens, slots, pos) -> int:
        return 0

    def generate_beam_batch(self, prompts, num_beams) -> list[list[int]]:
        return [list(self.scripts[p[0]].beam_hyp) if p and p[0] in self.scripts else [] for p in prompts]

    def mtp_slot_draft_capacity(self, slot: int) -> int:
        return self.slot_capacity

    def can_batch_verify(self, ks) -> bool:
        return self.batch_verify_ok

    # --- logits readers --------------------------------------------------------------------------------

    def _row(self, row: int) -> int:
        if not 0 <= row < len(self.rows):
            raise DeviceError(f"row {row} was not produced by the last forward")
        return self.rows[row]

    def argmax_on_device(self, row: int, stream: int) -> int:
        return self._row(row)

    def argmax_batch(self, row: int, n: int, stream: int) -> list[int]:
        return [self._row(r) for r in range(row, row + n)]

    def vocab_size(self) -> int:
        return self.vocab

    def copy_logits_to_host(self, row: int, off: int, nbytes: int) -> bytes:
        n = nbytes // (self.vocab * 2)
        slab = bytearray(n * self.vocab * 2)
        for r in range(n):
            answer = self._row(row + r)
            at = (r * self.vocab + answer) * 2
            slab[at:at + 2] = b"\xf0\x41"
        return bytes(slab)

    # --- bookkeeping calls (no state) -------------------------------------------------------------------

    def gdn_fold_accepted(self, slots, accepted, k: int) -> bool:
        return True

    def commit_accepted_prefix(self, seq: int, na: int, k: int) -> None:
        self._seq(seq)

    def commit_ctx(self, seq: int, n: int, base: int, row: int) -> None:
        self._seq(seq)

    def trim_proposer_state(self, seq: int, na: int, stream: int) -> None:
        self._seq(seq)

    def save_hidden_for_mtp(self, row: int, stream: int) -> None:
        pass

    def save_hidden_for_mtp_from_stash(self, index: int, stream: int) -> None:
        pass

    def stash_verify_hidden_rows(self, rows, stream: int) -> None:
        pass

    def stash_verify_catchup_rows(self, pairs) -> None:
        pass

    def dflash_eagle_accept_append(self, seq: int) -> None:
        self._seq(seq)

    def start_checkpoint_async(self, seq: int) -> None:
        self._seq(seq)

    def start_rollback_and_checkpoint_async(self, seq: int, na: int) -> None:
        self._seq(seq)

    def checkpoint_ssm_states(self, seq: int) -> None:
        self._seq(seq)

    def rollback_ssm_states(self, seq: int, n: int) -> None:
        self._seq(seq)

    def decode_marconi_checkpoint(self, seq: int) -> None:
        self._seq(seq)

    def save_decode_ssm_snapshot(self, seq: int, ring: int) -> None:
        self._seq(seq)

    def restore_decode_ssm_snapshot(self, seq: int, ring: int) -> None:
        self._seq(seq)

    def save_hidden_for_catchup(self, row: int, pos: int) -> None:
        pass
