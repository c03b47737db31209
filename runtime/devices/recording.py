"""The recording device: a scripted fake model that writes one trace line per call.

It answers every call from per-request token scripts (recording-device.md §3.3), keeps just
enough bookkeeping (slots, KV blocks, sequence lengths) for its answers and free-block counts to
be realistic, and never makes a decision. The scheduler's interpreter writes its ``fx`` lines into
the same list, so the three kinds of recorded lines interleave in call order.
"""

from __future__ import annotations

from typing import Callable, Optional

import attrs

from fxsched.runtime.device import DeviceError
from fxsched.runtime.script_model import (
    Script,
    cancel_due,
    script_drafts,
    script_key,
    script_next,
    script_verify,
)
from fxsched.runtime.spill_files import SpillError, SpillFiles

EOS = 63
BF16_THIRTY = b"\xf0\x41"
BF16_ZERO = b"\x00\x00"


@attrs.frozen
class DeviceConfig:
    """The model configuration of a scenario (scenarios.md §2.3)."""

    vocab: int = 64
    block_size: int = 16
    total_blocks: int = 1000
    held_blocks: int = 0
    reclaimable: int = 0
    has_proposer: bool = False
    dflash_gamma: Optional[int] = None
    has_self_speculative: bool = False
    supports_beam: bool = False
    has_ssm_layers: bool = False
    ring_slots: int = 0
    can_batch_verify: bool = True
    slot_draft_capacity: int = 8
    kv_exhaust_at: tuple[int, ...] = ()
    twophase_ok: bool = False
    device_token_feed: bool = True
    decode_fault_at: tuple[int, ...] = ()
    spill_corrupt_for: tuple[int, ...] = ()
    spill_missing_for: tuple[int, ...] = ()


@attrs.define
class DeviceSequence:
    seq_id: int
    session: int
    slot: int
    seq_len: int = 0
    tokens: list = attrs.Factory(list)
    blocks: int = 0

    @property
    def sid(self) -> str:
        return f"s{self.session}@{self.slot}:len={self.seq_len}"


def _list(values) -> str:
    return "[" + ", ".join(str(v) for v in values) + "]"


def _lists(values) -> str:
    return "[" + ", ".join(_list(v) for v in values) + "]"


def _bool(value: bool) -> str:
    return "true" if value else "false"


class RecordingDevice:
    """Implements the Device protocol from scripts; ``lines`` is the trace."""

    def __init__(self, config: DeviceConfig, scripts: dict[int, Script],
                 cancel_flags: Optional[set[int]] = None):
        self.config = config
        self.scripts = scripts
        self.cancel_registered = set(cancel_flags or ())
        self.cancels_fired: list[int] = []
        self.lines: list[str] = []
        self.sequences: dict[int, DeviceSequence] = {}
        self.free_slots: list[int] = []
        self.next_slot = 0
        self.used_blocks = 0
        self.reclaimable = config.reclaimable
        self.rows: list[int] = []
        self.decode_batch_calls = 0
        self.occupancy_reads = 0
        self.tick = 0
        self.on_tick: Callable[[int], None] = lambda tick: None
        self.spill = SpillFiles()

    # --- bookkeeping ----------------------------------------------------------------------

    def _rec(self, line: str) -> None:
        self.lines.append(line)

    def note_fx(self, line: str) -> None:
        self._rec(line)

    def _seq(self, seq_id: int) -> DeviceSequence:
        try:
            return self.sequences[seq_id]
        except KeyError:
            raise DeviceError(f"unknown sequence {seq_id}") from None

    def _script(self, seq: DeviceSequence) -> Script:
        key = script_key(seq.session, seq.tokens)
        try:
            return self.scripts[key]
        except KeyError:
            raise DeviceError(f"no script for request {key}") from None

    def _grow(self, seq: DeviceSequence) -> None:
        need = seq.seq_len // self.config.block_size + 1
        if need > seq.blocks:
            self.used_blocks += need - seq.blocks
            seq.blocks = need

    def _append(self, seq: DeviceSequence, tokens) -> None:
        seq.tokens.extend(tokens)
        seq.seq_len += len(tokens)
        self._grow(seq)

    def _answer_after(self, seq: DeviceSequence, position: int) -> int:
        return script_next(self._script(seq), position)

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

    def _cancel_trigger(self, seq: DeviceSequence) -> None:
        if cancel_due(self._script(seq), len(seq.tokens)) and seq.session in self.cancel_registered:
            self.cancels_fired.append(seq.session)

    def take_cancels(self) -> list[int]:
        """Request ids whose scripted client cancelled since the last call."""
        fired, self.cancels_fired = self.cancels_fired, []
        return fired

    def drafts_for(self, seq: DeviceSequence, position: int, n: int) -> list[int]:
        return script_drafts(self._script(seq), position, n, self.config.vocab)

    def verify_row(self, seq: DeviceSequence, first_position: int, inputs) -> list[int]:
        return script_verify(self._script(seq), first_position, inputs)

    def free_count(self) -> int:
        return max(self.config.total_blocks - self.used_blocks - self.config.held_blocks, 0)

    # --- start-up and snapshot --------------------------------------------------------------

    def bind_gpu_to_thread(self) -> None:
        self._rec("bind_gpu_to_thread()")

    def create_stream(self) -> int:
        self._rec("create_stream() -> 1")
        return 1

    def create_event(self) -> int:
        self._rec("create_event() -> 2")
        return 2

    def num_free_blocks(self) -> int:
        count = self.free_count()
        self._rec(f"num_free_blocks() -> {count}")
        return count

    def ssm_snapshot_occupancy(self) -> None:
        self.occupancy_reads += 1
        if self.occupancy_reads % 2 == 1:
            self.tick += 1
            self._rec(f"-- tick {self.tick}")
            self.on_tick(self.tick)

    # --- sequences ------------------------------------------------------------------------------

    def alloc_sequence(self, seq: int, session: int) -> int:
        slot = self._allocate_slot()
        self.sequences[seq] = DeviceSequence(seq, session, slot)
        self._rec(f"alloc_sequence() -> slot {slot}")
        return slot

    def alloc_sequence_for(self, seq: int, session: int, budget: int) -> int:
        slot = self._allocate_slot()
        self.sequences[seq] = DeviceSequence(seq, session, slot)
        self._rec(f"alloc_sequence_for(budget={budget}) -> slot {slot}")
        return slot

    def free_sequence(self, seq: int) -> None:
        s = self._seq(seq)
        self._rec(f"free_sequence({s.sid}, blocks={s.blocks})")
        self.used_blocks -= s.blocks
        s.blocks = 0
        self._release_slot(s.slot)

    def cache_sequence(self, seq: int) -> None:
        self._rec(f"cache_sequence({self._seq(seq).sid})")

    def compact_sequence(self, seq: int, new_slot: int) -> None:
        s = self._seq(seq)
        self._rec(f"compact_sequence({s.sid}, new_slot={new_slot})")
        if new_slot != s.slot:
            if new_slot in self.free_slots:
                self.free_slots.remove(new_slot)
            self._release_slot(s.slot)
            s.slot = new_slot

    def detach_slot_for_reuse(self, seq: int) -> None:
        self._rec(f"detach_slot_for_reuse({self._seq(seq).sid})")

    def save_sequence_state(self, seq: int) -> None:
        """Spill the sequence to a file; the scenario may corrupt or lose it afterwards."""
        s = self._seq(seq)
        self._rec(f"save_sequence_state({s.sid}, blocks={s.blocks})")
        path = self.spill.path_for(seq)
        self.spill.write(seq, {"session": s.session, "tokens": list(s.tokens), "seq_len": s.seq_len,
                               "blocks": s.blocks})
        request = s.session or (s.tokens[0] if s.tokens else 0)
        if request in self.config.spill_corrupt_for:
            data = bytearray(path.read_bytes())
            data[-2] ^= 0xFF
            path.write_bytes(bytes(data))
        if request in self.config.spill_missing_for:
            path.unlink()

    def restore_sequence_state(self, seq: int, blocks: int) -> None:
        """Read the spill file back and check it; the session number is not restored."""
        s = self._seq(seq)
        head = f"restore_sequence_state({s.sid}, blocks={blocks})"
        try:
            saved = self.spill.read(seq)
        except SpillError as err:
            self._rec(f"{head} -> ERR {err}")
            raise DeviceError(str(err)) from None
        self._rec(head)
        s.tokens = list(saved["tokens"])
        s.seq_len = saved["seq_len"]
        s.blocks = blocks
        self.used_blocks += blocks

    def reclaim_prefix_blocks(self, n: int) -> int:
        got = min(n, self.reclaimable)
        self.reclaimable -= got
        self.used_blocks = max(self.used_blocks - got, 0)
        self._rec(f"reclaim_prefix_blocks({n}) -> {got}")
        return got

    def truncate_sequence(self, seq: int, seq_len: int) -> None:
        s = self._seq(seq)
        s.seq_len = seq_len
        del s.tokens[seq_len:]

    # --- adapters, EP ---------------------------------------------------------------------------

    def adapter_id_for(self, slot: int) -> int:
        self._rec(f"adapter_id_for({slot})")
        return 0 if slot == -1 else -1  # only the active adapter (slot -1) is loaded

    def acquire_adapter_slot(self, slot: int) -> int:
        self._rec(f"acquire_adapter_slot({slot})")
        return slot

    def set_active_lora(self, name: str) -> None:
        self._rec(f"set_active_lora({name})")

    def ep_broadcast_cmd_for_seq(self, seq_slot: int, cmd: int) -> None:
        self._rec(f"ep_broadcast_cmd_for_seq(seq={seq_slot}, cmd={cmd:#x})")

    def ep_broadcast_cmd(self, cmd: int) -> None:
        self._rec(f"ep_broadcast_cmd({cmd:#x})")

    def ep_broadcast_tokens(self, tokens) -> None:
        self._rec(f"ep_broadcast_tokens(n={len(tokens)})")

    def ep_sync_vision_embeds(self, n: int) -> None:
        self._rec(f"ep_sync_vision_embeds(n={n})")

    # --- streams ----------------------------------------------------------------------------------

    def poll_innerq(self) -> None:
        self._rec("poll_innerq()")

    def record_event(self, event: int, stream: int) -> None:
        self._rec(f"record_event(event={event}, stream={stream})")

    def stream_wait_event(self, stream: int, event: int) -> None:
        self._rec(f"stream_wait_event(stream={stream}, event={event})")

    def synchronize(self, stream: int) -> None:
        self._rec(f"synchronize(stream={stream})")

    def sync_secondary(self) -> None:
        self._rec("sync_secondary()")

    def teardown(self) -> None:
        self._rec("teardown()")
        self.spill.close()

    # --- forwards -----------------------------------------------------------------------------------

    def prefill(self, seq: int, tokens, stream: int) -> None:
        s = self._seq(seq)
        s.tokens.extend(tokens)
        s.seq_len = len(s.tokens)
        self._grow(s)
        self.rows = [self._answer_after(s, s.seq_len - 1)]
        self._rec(f"prefill(n={len(tokens)}, {s.sid}, stream={stream})")

    def _apply_slice(self, s: DeviceSequence, prompt, start: int, length: int) -> int:
        s.tokens.extend(prompt[start:start + length])
        s.seq_len = start + length
        self._grow(s)
        return self._answer_after(s, s.seq_len - 1)

    def prefill_chunk(self, seq: int, prompt, start: int, length: int, last: bool, stream: int) -> None:
        s = self._seq(seq)
        self.rows = [self._apply_slice(s, prompt, start, length)]
        self._rec(f"prefill_chunk(start={start}, len={length}, last={_bool(last)}, {s.sid}, stream={stream})")

    def _decode_rows(self, tokens, seqs) -> list[int]:
        rows = []
        for token, seq_id in zip(tokens, seqs):
            s = self._seq(seq_id)
            self._append(s, [token])
            rows.append(self._answer_after(s, s.seq_len - 1))
        return rows

    def _slice_text(self, sl) -> str:
        s = self._seq(sl.seq)
        return f"{s.sid} start={sl.start} len={sl.length} last={_bool(sl.last)}"

    def mixed_forward(self, decode_tokens, decode_seqs, prefill, stream: int) -> None:
        rows = self._decode_rows(decode_tokens, decode_seqs)
        rows.append(self._apply_slice(self._seq(prefill.seq), prefill.prompt, prefill.start, prefill.length))
        self.rows = rows
        self._rec(f"mixed_forward(decode={_list(decode_tokens)}, prefill={self._slice_text(prefill)}, stream={stream})")

    def mixed_forward_batch(self, decode_tokens, decode_seqs, prefills, stream: int) -> None:
        rows = self._decode_rows(decode_tokens, decode_seqs)
        for sl in prefills:
            rows.append(self._apply_slice(self._seq(sl.seq), sl.prompt, sl.start, sl.length))
        self.rows = rows
        slices = ", ".join(f'"{self._slice_text(sl)}"' for sl in prefills)
        self._rec(f"mixed_forward_batch(decode={_list(decode_tokens)}, prefills=[{slices}], stream={stream})")

    def prefill_batch_chunk(self, prefills, stream: int) -> None:
        self.rows = [self._apply_slice(self._seq(sl.seq), sl.prompt, sl.start, sl.length) for sl in prefills]
        slices = ", ".join(f'"{self._slice_text(sl)}"' for sl in prefills)
        self._rec(f"prefill_batch_chunk(streams=[{slices}], stream={stream})")

    def normalize_ssm_states(self, seq: int, stream: int) -> None:
        self._rec(f"normalize_ssm_states({self._seq(seq).sid}, stream={stream})")

    def decode_batch(self, tokens, seqs, stream: int) -> None:
        call = self.decode_batch_calls
        self.decode_batch_calls += 1
        sids = ", ".join(f'"{self._seq(i).sid}"' for i in seqs)
        head = f"decode_batch(tokens={_list(tokens)}, seqs=[{sids}], stream={stream})"
        if call in self.config.kv_exhaust_at:
            self._rec(head + " -> ERR KV cache exhausted")
            raise DeviceError("KV cache exhausted", kv_exhausted=True)
        if call in self.config.decode_fault_at:
            self._rec(head + " -> ERR scripted device fault")
            raise DeviceError("scripted device fault")
        rows = []
        for token, seq_id in zip(tokens, seqs):
            s = self._seq(seq_id)
            self._cancel_trigger(s)
            self._append(s, [token])
            rows.append(self._answer_after(s, s.seq_len - 1))
        self.rows = rows
        self._rec(head)

    def _single_decode(self, name: str, token: int, seq: int, stream: int, cancel: bool) -> None:
        s = self._seq(seq)
        if cancel:
            self._cancel_trigger(s)
        self._append(s, [token])
        self.rows = [self._answer_after(s, s.seq_len - 1)]
        self._rec(f"{name}(token={token}, {s.sid}, stream={stream})")

    def decode(self, token: int, seq: int, stream: int) -> None:
        self._single_decode("decode", token, seq, stream, cancel=True)

    def decode_draft(self, token: int, seq: int, stream: int) -> None:
        self._single_decode("decode_draft", token, seq, stream, cancel=False)

    def _verify(self, name: str, seq: int, tokens) -> list[int]:
        s = self._seq(seq)
        self._cancel_trigger(s)
        outputs = self.verify_row(s, s.seq_len, tokens)
        self._append(s, tokens)
        self.rows = outputs
        self._rec(f"{name}(tokens={_list(tokens)}, {s.sid}) -> {_list(outputs)}")
        return outputs

    def decode_verify(self, seq: int, tokens) -> list[int]:
        return self._verify("decode_verify", seq, tokens)

    def decode_verify_graphed(self, seq: int, tokens) -> list[int]:
        return self._verify("decode_verify_graphed", seq, tokens)

    def decode_verify_graphed_k3(self, seq: int, tokens) -> list[int]:
        return self._verify("decode_verify_graphed_k3", seq, tokens)

    def decode_verify_graphed_k4(self, seq: int, tokens) -> list[int]:
        return self._verify("decode_verify_graphed_k4", seq, tokens)

    def decode_verify_dflash(self, seq: int, tokens) -> list[int]:
        return self._verify("decode_verify_dflash", seq, tokens)

    def decode_and_verify_fused(self, seq: int, tokens) -> list[int]:
        return self._verify("decode_and_verify_fused", seq, tokens)

    def decode_verify_batched(self, tokens, ks, seqs, stream: int, woa: bool) -> list[int]:
        outputs, offset = [], 0
        for k, seq_id in zip(ks, seqs):
            s = self._seq(seq_id)
            mine = list(tokens[offset:offset + k])
            offset += k
            outputs.extend(self.verify_row(s, s.seq_len, mine))
            self._append(s, mine)
        self.rows = outputs
        sids = ", ".join(f'"{self._seq(i).sid}"' for i in seqs)
        self._rec(f"decode_verify_batched(tokens={_list(tokens)}, ks={_list(ks)}, seqs=[{sids}], "
                  f"stream={stream}, woa={_bool(woa)}) -> {_list(outputs)}")
        return outputs

    # --- proposers ------------------------------------------------------------------------------------

    def run_mtp_propose_multi(self, token: int, pos: int, n: int, seq: int, stream: int, mask: bool) -> list[int]:
        s = self._seq(seq)
        drafts = self.drafts_for(s, pos, n)
        self._rec(f"run_mtp_propose_multi(token={token}, pos={pos}, n={n}, {s.sid}, stream={stream}, "
                  f"mask={_bool(mask)}) -> {_list(drafts)}")
        return drafts

    def run_mtp_propose_batched(self, tokens, positions, stash, n: int, seqs, stream: int) -> list[list[int]]:
        drafts = [self.drafts_for(self._seq(i), p, n) for i, p in zip(seqs, positions)]
        self._rec(f"run_mtp_propose_batched(tokens={_list(tokens)}, positions={_list(positions)}, "
                  f"stash={_list(stash)}, n={n}, stream={stream}) -> {_lists(drafts)}")
        return drafts

    def run_mtp_catchup_batched(self, tokens, slots, pos) -> int:
        self._rec(f"run_mtp_catchup_batched(tokens={_lists(tokens)}, slots={_list(slots)}, pos={_list(pos)}) -> 0")
        return 0

    def generate_beam_batch(self, prompts, num_beams) -> list[list[int]]:
        hyps = []
        for prompt in prompts:
            script = self.scripts.get(prompt[0]) if prompt else None
            hyps.append(list(script.beam_hyp) if script else [])
        self._rec(f"generate_beam_batch(n={len(prompts)}) -> {_lists(hyps)}")
        return hyps

    def mtp_slot_draft_capacity(self, slot: int) -> int:
        self._rec(f"mtp_slot_draft_capacity({slot})")
        return self.config.slot_draft_capacity

    def can_batch_verify(self, ks) -> bool:
        answer = self.config.can_batch_verify
        self._rec(f"can_batch_verify({_list(ks)}) -> {_bool(answer)}")
        return answer

    # --- logits readers --------------------------------------------------------------------------------

    def _row(self, row: int) -> int:
        if not 0 <= row < len(self.rows):
            raise DeviceError(f"row {row} was not produced by the last forward ({len(self.rows)} rows)")
        return self.rows[row]

    def argmax_on_device(self, row: int, stream: int) -> int:
        token = self._row(row)
        self._rec(f"argmax_on_device(row={row}, stream={stream}) -> {token}")
        return token

    def argmax_batch(self, row: int, n: int, stream: int) -> list[int]:
        tokens = [self._row(r) for r in range(row, row + n)]
        self._rec(f"argmax_batch(row={row}, n={n}, stream={stream}) -> {_list(tokens)}")
        return tokens

    def vocab_size(self) -> int:
        return self.config.vocab

    def copy_logits_to_host(self, row: int, off: int, nbytes: int) -> bytes:
        vocab = self.config.vocab
        n = nbytes // (vocab * 2)
        slab = bytearray()
        for r in range(row, row + n):
            answer = self._row(r)
            slab += b"".join(BF16_THIRTY if t == answer else BF16_ZERO for t in range(vocab))
        self._rec(f"copy_logits_to_host(row={row}, off={off}, bytes={nbytes})")
        return bytes(slab)

    # --- speculative bookkeeping -----------------------------------------------------------------------

    def gdn_fold_accepted(self, slots, accepted, k: int) -> bool:
        self._rec(f"gdn_fold_accepted(slots={_list(slots)}, accepted={_list(accepted)}, k={k}) -> true")
        return True

    def commit_accepted_prefix(self, seq: int, na: int, k: int) -> None:
        self._rec(f"commit_accepted_prefix({self._seq(seq).sid}, na={na}, k={k})")

    def commit_ctx(self, seq: int, n: int, base: int, row: int) -> None:
        self._rec(f"commit_ctx({self._seq(seq).sid}, n={n}, base={base}, row={row})")

    def trim_proposer_state(self, seq: int, na: int, stream: int) -> None:
        self._rec(f"trim_proposer_state({self._seq(seq).sid}, na={na}, stream={stream})")

    def save_hidden_for_mtp(self, row: int, stream: int) -> None:
        self._rec(f"save_hidden_for_mtp({row}, stream={stream})")

    def save_hidden_for_mtp_from_stash(self, index: int, stream: int) -> None:
        self._rec(f"save_hidden_for_mtp_from_stash({index}, stream={stream})")

    def stash_verify_hidden_rows(self, rows, stream: int) -> None:
        self._rec(f"stash_verify_hidden_rows({_list(rows)}, stream={stream})")

    def stash_verify_catchup_rows(self, pairs) -> None:
        self._rec("stash_verify_catchup_rows([" + ", ".join(f"({a}, {b})" for a, b in pairs) + "])")

    def dflash_eagle_accept_append(self, seq: int) -> None:
        self._rec(f"dflash_eagle_accept_append({self._seq(seq).sid})")

    def start_checkpoint_async(self, seq: int) -> None:
        self._rec(f"start_checkpoint_async({self._seq(seq).sid})")

    def start_rollback_and_checkpoint_async(self, seq: int, na: int) -> None:
        self._rec(f"start_rollback_and_checkpoint_async({self._seq(seq).sid}, na={na})")

    def checkpoint_ssm_states(self, seq: int) -> None:
        self._rec(f"checkpoint_ssm_states({self._seq(seq).sid})")

    def rollback_ssm_states(self, seq: int, n: int) -> None:
        self._rec(f"rollback_ssm_states({self._seq(seq).sid}, n={n})")

    def decode_marconi_checkpoint(self, seq: int) -> None:
        self._rec(f"decode_marconi_checkpoint({self._seq(seq).sid})")

    def save_decode_ssm_snapshot(self, seq: int, ring: int) -> None:
        self._rec(f"save_decode_ssm_snapshot({self._seq(seq).sid}, ring={ring})")

    def restore_decode_ssm_snapshot(self, seq: int, ring: int) -> None:
        self._rec(f"restore_decode_ssm_snapshot({self._seq(seq).sid}, ring={ring})")

    def save_hidden_for_catchup(self, row: int, pos: int) -> None:
        self._rec(f"save_hidden_for_catchup({row}, pos={pos})")
