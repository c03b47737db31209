"""The scripted fake model: its answer rules (specs/recording-device.md §3.3) and ``ScriptedDevice``,
the Device protocol answered from per-request scripts, which the recording device (a trace line
per call) and the simulated device (silent, strict, with injected faults) both are."""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Optional

import attrs

from fxsched.core.kv import blocks_for
from fxsched.runtime.devices.device import DeviceError


@attrs.frozen
class Script:
    """What the fake model answers for one request."""

    prompt_len: int
    tokens: tuple[int, ...]
    draft_wrong_every: int = 0
    beam_hyp: tuple[int, ...] = ()
    cancel_at: Optional[int] = None

    def tok(self, g: int) -> int:
        """Script token at generated index ``g`` (floored at 0; past the end, the last token)."""
        tokens = self.tokens
        if g < 0:
            g = 0
        return tokens[g] if g < len(tokens) else tokens[-1]


def script_key(session: int, tokens) -> int:
    """Whose script answers a sequence: its session number, or (once swap-in lost it) the first
    token it holds, which is the request id (specs/scenarios.md §2.1)."""
    return session if session else (tokens[0] if tokens else 0)


def cancel_due(script: Script, tokens_held: int) -> bool:
    """The scripted client cancels when a cancel-checking call starts with exactly ``cancel_at``
    generated tokens in the sequence's KV."""
    return script.cancel_at is not None and script.cancel_at == tokens_held - script.prompt_len


def script_next(script: Script, position: int) -> int:
    """The answer after feeding ``position``: the script token at ``position + 1 - prompt_len``."""
    return script.tok(position + 1 - script.prompt_len)


def script_drafts(script: Script, position: int, n: int, vocab: int) -> list[int]:
    """Drafts ``tok(base + j)``, j = 1 .. n, wrong (``+ 1 mod (vocab - 1)``) at every m-th index."""
    base = position - script.prompt_len
    out = []
    m = script.draft_wrong_every
    for j in range(1, n + 1):
        tok = script.tok(base + j)
        if m > 0 and (base + j) % m == 0:
            tok = (tok + 1) % (vocab - 1)
        out.append(tok)
    return out


def script_verify(script: Script, first_position: int, inputs, drawn: Mapping[int, int] | None = None) -> list[int]:
    """Verify rows: ``tok(g + 1)`` per input until an input differs from the script, then 1s.

    ``drawn`` maps a row to the token a pick drew there instead of the script's (an EOS masked below
    ``min_tokens``, specs/speculation.md §6.16): that row answers the drawn token, and the next input
    is checked against it, so a draft equal to the drawn token goes on with the script, as a plain
    decode of the drawn token would."""
    drawn = drawn or {}
    poisoned = False
    out = []
    for t, token in enumerate(inputs):
        g_in = first_position + t - script.prompt_len
        if t > 0 and drawn.get(t - 1, script.tok(g_in)) != token:
            poisoned = True
        out.append(1 if poisoned else drawn.get(t, script.tok(g_in + 1)))
    return out


# --- the scripted device ---------------------------------------------------------------------------

BF16_THIRTY = b"\xf0\x41"  # the logit every scripted answer gets; every other token gets 0


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


class ScriptedDevice:
    """The Device protocol answered from per-request scripts: what the recording device and the
    simulated device share.

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

    # --- start-up and snapshot ----------------------------------------------------------------------

    def bind_gpu_to_thread(self) -> None:
        if self.lines is not None:
            self.lines.append("bind_gpu_to_thread()")

    def create_stream(self) -> int:
        if self.lines is not None:
            self.lines.append("create_stream() -> 1")
        return 1

    def create_event(self) -> int:
        if self.lines is not None:
            self.lines.append("create_event() -> 2")
        return 2

    def num_free_blocks(self) -> int:
        count = self.free_count()
        if self.lines is not None:
            self.lines.append(f"num_free_blocks() -> {count}")
        return count

    def ssm_snapshot_occupancy(self) -> None:
        self.occupancy_reads += 1
        if self.occupancy_reads % 2 == 1:
            self.tick += 1
            if self.lines is not None:
                self.lines.append(f"-- tick {self.tick}")
            self.on_tick(self.tick)

    # --- sequences ----------------------------------------------------------------------------------

    def _alloc(self, seq: int, session: int) -> int:
        slot = self._allocate_slot()
        s = ScriptedSequence(seq, session, slot)
        self.sequences[seq] = s
        self.live[seq] = s
        return slot

    def alloc_sequence(self, seq: int, session: int) -> int:
        slot = self._alloc(seq, session)
        if self.lines is not None:
            self.lines.append(f"alloc_sequence() -> slot {slot}")
        return slot

    def alloc_sequence_for(self, seq: int, session: int, budget: int) -> int:
        slot = self._alloc(seq, session)
        if self.lines is not None:
            self.lines.append(f"alloc_sequence_for(budget={budget}) -> slot {slot}")
        return slot

    def free_sequence(self, seq: int) -> None:
        s = self._seq(seq)
        if self.lines is not None:
            self.lines.append(f"free_sequence({s.sid}, blocks={s.blocks})")
        self.used_blocks -= s.blocks
        s.blocks = 0
        self.live.pop(seq, None)
        self._release_slot(s.slot)

    def cache_sequence(self, seq: int) -> None:
        s = self._seq(seq)
        if self.lines is not None:
            self.lines.append(f"cache_sequence({s.sid})")

    def compact_sequence(self, seq: int, new_slot: int) -> None:
        s = self._seq(seq)
        if self.lines is not None:
            self.lines.append(f"compact_sequence({s.sid}, new_slot={new_slot})")
        if new_slot != s.slot:
            if new_slot in self.free_slots:
                self.free_slots.remove(new_slot)
            self._release_slot(s.slot)
            s.slot = new_slot

    def detach_slot_for_reuse(self, seq: int) -> None:
        s = self._seq(seq)
        if self.lines is not None:
            self.lines.append(f"detach_slot_for_reuse({s.sid})")

    def reclaim_prefix_blocks(self, n: int) -> int:
        got = min(n, self.reclaimable)
        self.reclaimable -= got
        self.used_blocks = max(self.used_blocks - got, 0)
        if self.lines is not None:
            self.lines.append(f"reclaim_prefix_blocks({n}) -> {got}")
        return got

    def truncate_sequence(self, seq: int, seq_len: int) -> None:
        s = self._seq(seq)
        s.seq_len = seq_len
        del s.tokens[seq_len:]

    # --- adapters, EP, streams ----------------------------------------------------------------------

    def adapter_id_for(self, slot: int) -> int:
        if self.lines is not None:
            self.lines.append(f"adapter_id_for({slot})")
        return 0 if slot == -1 else -1  # only the active adapter (slot -1) is loaded

    def acquire_adapter_slot(self, slot: int) -> int:
        if self.lines is not None:
            self.lines.append(f"acquire_adapter_slot({slot})")
        return slot

    def set_active_lora(self, name: str) -> None:
        if self.lines is not None:
            self.lines.append(f"set_active_lora({name})")

    def ep_broadcast_cmd_for_seq(self, seq_slot: int, cmd: int) -> None:
        if self.lines is not None:
            self.lines.append(f"ep_broadcast_cmd_for_seq(seq={seq_slot}, cmd={cmd:#x})")

    def ep_broadcast_cmd(self, cmd: int) -> None:
        if self.lines is not None:
            self.lines.append(f"ep_broadcast_cmd({cmd:#x})")

    def ep_broadcast_tokens(self, tokens) -> None:
        if self.lines is not None:
            self.lines.append(f"ep_broadcast_tokens(n={len(tokens)})")

    def ep_sync_vision_embeds(self, n: int) -> None:
        if self.lines is not None:
            self.lines.append(f"ep_sync_vision_embeds(n={n})")

    def poll_innerq(self) -> None:
        if self.lines is not None:
            self.lines.append("poll_innerq()")

    def record_event(self, event: int, stream: int) -> None:
        if self.lines is not None:
            self.lines.append(f"record_event(event={event}, stream={stream})")

    def stream_wait_event(self, stream: int, event: int) -> None:
        if self.lines is not None:
            self.lines.append(f"stream_wait_event(stream={stream}, event={event})")

    def synchronize(self, stream: int) -> None:
        if self.lines is not None:
            self.lines.append(f"synchronize(stream={stream})")

    def sync_secondary(self) -> None:
        if self.lines is not None:
            self.lines.append("sync_secondary()")

    def teardown(self) -> None:
        if self.lines is not None:
            self.lines.append("teardown()")
        self.torn_down = True

    # --- forwards -----------------------------------------------------------------------------------

    def prefill(self, seq: int, tokens, stream: int) -> None:
        s = self._seq(seq)
        self._grow_to(s, len(s.tokens) + len(tokens))
        s.tokens.extend(tokens)
        s.seq_len = len(s.tokens)
        self.rows = [self._next(s)]
        if self.lines is not None:
            self.lines.append(f"prefill(n={len(tokens)}, {s.sid}, stream={stream})")

    def prefill_chunk(self, seq: int, prompt, start: int, length: int, last: bool, stream: int) -> None:
        s = self._seq(seq)
        self.rows = [self._slice(s, prompt, start, length)]
        if self.lines is not None:
            self.lines.append(f"prefill_chunk(start={start}, len={length}, last={_bool(last)}, {s.sid}, "
                              f"stream={stream})")

    def _slice_text(self, sl) -> str:
        return f"{self._seq(sl.seq).sid} start={sl.start} len={sl.length} last={_bool(sl.last)}"

    def mixed_forward(self, decode_tokens, decode_seqs, prefill, stream: int) -> Optional[list[tuple[int, int]]]:
        rows = self._decode_rows(decode_tokens, decode_seqs, cancel=False)
        rows.append(self._slice(self._seq(prefill.seq), prefill.prompt, prefill.start, prefill.length))
        self.rows = rows
        if self.lines is not None:
            self.lines.append(f"mixed_forward(decode={_list(decode_tokens)}, prefill={self._slice_text(prefill)}, "
                              f"stream={stream})")
        return None  # the scripted device keeps no prefix cache

    def mixed_forward_batch(self, decode_tokens, decode_seqs, prefills, stream: int
                            ) -> Optional[list[tuple[int, int]]]:
        rows = self._decode_rows(decode_tokens, decode_seqs, cancel=False)
        rows.extend(self._slice(self._seq(sl.seq), sl.prompt, sl.start, sl.length) for sl in prefills)
        self.rows = rows
        if self.lines is not None:
            slices = ", ".join(f'"{self._slice_text(sl)}"' for sl in prefills)
            self.lines.append(f"mixed_forward_batch(decode={_list(decode_tokens)}, prefills=[{slices}], "
                              f"stream={stream})")
        return None

    def prefill_batch_chunk(self, prefills, stream: int) -> Optional[list[tuple[int, int]]]:
        self.rows = [self._slice(self._seq(sl.seq), sl.prompt, sl.start, sl.length) for sl in prefills]
        if self.lines is not None:
            slices = ", ".join(f'"{self._slice_text(sl)}"' for sl in prefills)
            self.lines.append(f"prefill_batch_chunk(streams=[{slices}], stream={stream})")
        return None

    def normalize_ssm_states(self, seq: int, stream: int) -> None:
        s = self._seq(seq)
        if self.lines is not None:
            self.lines.append(f"normalize_ssm_states({s.sid}, stream={stream})")

    def decode_batch(self, tokens, seqs, stream: int) -> None:
        call = self.decode_calls
        self.decode_calls += 1
        head = ""
        if self.lines is not None:
            sids = ", ".join(f'"{self._seq(i).sid}"' for i in seqs)
            head = f"decode_batch(tokens={_list(tokens)}, seqs=[{sids}], stream={stream})"
        if call in self.kv_exhaust_at:
            if self.lines is not None:
                self.lines.append(head + " -> ERR KV cache exhausted")
            raise DeviceError("KV cache exhausted", kv_exhausted=True)
        if call in self.decode_fault_at:
            if self.lines is not None:
                self.lines.append(head + " -> ERR scripted device fault")
            raise DeviceError("scripted device fault")
        self._check_room(seqs)
        self.rows = self._decode_rows(tokens, seqs, cancel=True)
        if self.lines is not None:
            self.lines.append(head)

    def _single_decode(self, name: str, token: int, seq: int, stream: int, cancel: bool) -> None:
        self.rows = self._decode_rows([token], [seq], cancel)
        if self.lines is not None:
            self.lines.append(f"{name}(token={token}, {self._seq(seq).sid}, stream={stream})")

    def decode(self, token: int, seq: int, stream: int) -> None:
        self._single_decode("decode", token, seq, stream, cancel=True)

    def decode_draft(self, token: int, seq: int, stream: int) -> None:
        self._single_decode("decode_draft", token, seq, stream, cancel=False)

    inputs: tuple[int, ...] = ()  # the last verify's tokens (this device never answers late drafts)

    def verify_inputs(self) -> list[int]:
        return list(self.inputs)

    def serial_verify(self, name: str, seq: int, tokens) -> list[int]:
        self._verify_call()
        self.inputs = tuple(tokens)
        s = self._seq(seq)
        self._cancel_trigger(s)
        outputs = script_verify(self._script(s), s.seq_len, tokens)
        self._append(s, list(tokens))
        if name != "decode_verify":  # the plain verify's acceptances are not speculative drafts
            self._count_accepted(s, tokens, outputs)
        self.rows = outputs
        if self.lines is not None:
            self.lines.append(f"{name}(tokens={_list(tokens)}, {s.sid}) -> {_list(outputs)}")
        return outputs

    def decode_verify_batched(self, tokens, ks, seqs, stream: int, woa: bool) -> list[int]:
        self._verify_call()
        self.inputs = tuple(tokens)
        outputs: list[int] = []
        offset = 0
        for k, seq_id in zip(ks, seqs, strict=True):
            s = self._seq(seq_id)
            mine = list(tokens[offset:offset + k])
            offset += k
            rows = script_verify(self._script(s), s.seq_len, mine)
            self._append(s, mine)
            self._count_accepted(s, mine, rows)
            outputs.extend(rows)
        self.rows = outputs
        if self.lines is not None:
            sids = ", ".join(f'"{self._seq(i).sid}"' for i in seqs)
            self.lines.append(f"decode_verify_batched(tokens={_list(tokens)}, ks={_list(ks)}, seqs=[{sids}], "
                              f"stream={stream}, woa={_bool(woa)}) -> {_list(outputs)}")
        return outputs

    # --- proposers ----------------------------------------------------------------------------------

    def run_mtp_propose_multi(self, token: int, pos: int, n: int, seq: int, stream: int, mask: bool) -> list[int]:
        s = self._seq(seq)
        drafts = script_drafts(self._script(s), pos, n, self.vocab)
        if self.lines is not None:
            self.lines.append(f"run_mtp_propose_multi(token={token}, pos={pos}, n={n}, {s.sid}, stream={stream}, "
                              f"mask={_bool(mask)}) -> {_list(drafts)}")
        return drafts

    def run_mtp_propose_batched(self, tokens, positions, stash, n: int, seqs, stream: int) -> list[list[int]]:
        drafts = [script_drafts(self._script(self._seq(i)), p, n, self.vocab)
                  for i, p in zip(seqs, positions, strict=True)]
        if self.lines is not None:
            self.lines.append(f"run_mtp_propose_batched(tokens={_list(tokens)}, positions={_list(positions)}, "
                              f"stash={_list(stash)}, n={n}, stream={stream}) -> {_lists(drafts)}")
        return drafts

    def run_mtp_catchup_batched(self, tokens, slots, pos) -> int:
        if self.lines is not None:
            self.lines.append(f"run_mtp_catchup_batched(tokens={_lists(tokens)}, slots={_list(slots)}, "
                              f"pos={_list(pos)}) -> 0")
        return 0

    def generate_beam_batch(self, prompts, num_beams) -> list[list[int]]:
        hyps = []
        for prompt in prompts:
            script = self.scripts.get(prompt[0]) if prompt else None
            hyps.append(list(script.beam_hyp) if script is not None else [])
        if self.lines is not None:
            self.lines.append(f"generate_beam_batch(n={len(prompts)}) -> {_lists(hyps)}")
        return hyps

    def mtp_slot_draft_capacity(self, slot: int) -> int:
        if self.lines is not None:
            self.lines.append(f"mtp_slot_draft_capacity({slot})")
        return self.slot_capacity

    def can_batch_verify(self, ks) -> bool:
        answer = self.batch_verify_ok
        if self.lines is not None:
            self.lines.append(f"can_batch_verify({_list(ks)}) -> {_bool(answer)}")
        return answer

    # --- logits readers -----------------------------------------------------------------------------

    def _row(self, row: int) -> int:
        if not 0 <= row < len(self.rows):
            raise DeviceError(f"row {row} was not produced by the last forward ({len(self.rows)} rows)")
        return self.rows[row]

    def argmax_on_device(self, row: int, stream: int) -> int:
        token = self._row(row)
        if self.lines is not None:
            self.lines.append(f"argmax_on_device(row={row}, stream={stream}) -> {token}")
        return token

    def argmax_batch(self, row: int, n: int, stream: int) -> list[int]:
        tokens = [self._row(r) for r in range(row, row + n)]
        if self.lines is not None:
            self.lines.append(f"argmax_batch(row={row}, n={n}, stream={stream}) -> {_list(tokens)}")
        return tokens

    def vocab_size(self) -> int:
        return self.vocab

    def copy_logits_to_host(self, row: int, off: int, nbytes: int) -> bytes:
        """BF16 rows: 30.0 at the scripted answer, 0.0 elsewhere."""
        n = nbytes // (self.vocab * 2)
        slab = bytearray(n * self.vocab * 2)
        for r in range(n):
            answer = self._row(row + r)
            if 0 <= answer < self.vocab:
                at = (r * self.vocab + answer) * 2
                slab[at:at + 2] = BF16_THIRTY
        if self.lines is not None:
            self.lines.append(f"copy_logits_to_host(row={row}, off={off}, bytes={nbytes})")
        return bytes(slab)

    # --- speculative bookkeeping --------------------------------------------------------------------

    def gdn_fold_accepted(self, slots, accepted, k: int) -> bool:
        if self.lines is not None:
            self.lines.append(f"gdn_fold_accepted(slots={_list(slots)}, accepted={_list(accepted)}, k={k}) -> true")
        return True

    def commit_accepted_prefix(self, seq: int, na: int, k: int) -> None:
        s = self._seq(seq)
        if self.lines is not None:
            self.lines.append(f"commit_accepted_prefix({s.sid}, na={na}, k={k})")

    def commit_ctx(self, seq: int, n: int, base: int, row: int) -> None:
        s = self._seq(seq)
        if self.lines is not None:
            self.lines.append(f"commit_ctx({s.sid}, n={n}, base={base}, row={row})")

    def trim_proposer_state(self, seq: int, na: int, stream: int) -> None:
        s = self._seq(seq)
        if self.lines is not None:
            self.lines.append(f"trim_proposer_state({s.sid}, na={na}, stream={stream})")

    def save_hidden_for_mtp(self, row: int, stream: int) -> None:
        if self.lines is not None:
            self.lines.append(f"save_hidden_for_mtp({row}, stream={stream})")

    def save_hidden_for_mtp_from_stash(self, index: int, stream: int) -> None:
        if self.lines is not None:
            self.lines.append(f"save_hidden_for_mtp_from_stash({index}, stream={stream})")

    def stash_verify_hidden_rows(self, rows, stream: int) -> None:
        if self.lines is not None:
            self.lines.append(f"stash_verify_hidden_rows({_list(rows)}, stream={stream})")

    def stash_verify_catchup_rows(self, pairs) -> None:
        if self.lines is not None:
            self.lines.append("stash_verify_catchup_rows([" + ", ".join(f"({a}, {b})" for a, b in pairs) + "])")

    def dflash_eagle_accept_append(self, seq: int) -> None:
        s = self._seq(seq)
        if self.lines is not None:
            self.lines.append(f"dflash_eagle_accept_append({s.sid})")

    def start_checkpoint_async(self, seq: int) -> None:
        s = self._seq(seq)
        if self.lines is not None:
            self.lines.append(f"start_checkpoint_async({s.sid})")

    def start_rollback_and_checkpoint_async(self, seq: int, na: int) -> None:
        s = self._seq(seq)
        if self.lines is not None:
            self.lines.append(f"start_rollback_and_checkpoint_async({s.sid}, na={na})")

    def checkpoint_ssm_states(self, seq: int) -> None:
        s = self._seq(seq)
        if self.lines is not None:
            self.lines.append(f"checkpoint_ssm_states({s.sid})")

    def rollback_ssm_states(self, seq: int, n: int) -> None:
        s = self._seq(seq)
        if self.lines is not None:
            self.lines.append(f"rollback_ssm_states({s.sid}, n={n})")

    def decode_marconi_checkpoint(self, seq: int) -> None:
        s = self._seq(seq)
        if self.lines is not None:
            self.lines.append(f"decode_marconi_checkpoint({s.sid})")

    def save_decode_ssm_snapshot(self, seq: int, ring: int) -> None:
        s = self._seq(seq)
        if self.lines is not None:
            self.lines.append(f"save_decode_ssm_snapshot({s.sid}, ring={ring})")

    def restore_decode_ssm_snapshot(self, seq: int, ring: int) -> None:
        s = self._seq(seq)
        if self.lines is not None:
            self.lines.append(f"restore_decode_ssm_snapshot({s.sid}, ring={ring})")

    def save_hidden_for_catchup(self, row: int, pos: int) -> None:
        if self.lines is not None:
            self.lines.append(f"save_hidden_for_catchup({row}, pos={pos})")
