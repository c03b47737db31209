"""The scripted device's forwards and logits readers (specs/recording-device.md §3.6, §3.8.3,
§3.8.4, §3.8.5, §3.8.7): prefills, decodes and verifies answered from the scripts, with the
scheduled decode and verify faults, and the readers of the last forward's rows."""

from __future__ import annotations

from typing import Optional

from fxsched.runtime.devices.device import DeviceError
from fxsched.runtime.devices.script_rules import script_verify
from fxsched.runtime.devices.scripted_book import ScriptedBook, _bool, _list


BF16_THIRTY = b"\xf0\x41"  # the logit every scripted answer gets; every other token gets 0


class ScriptedForwards(ScriptedBook):
    """The forwards and logits readers of ``ScriptedDevice``."""

    # --- forwards -----------------------------------------------------------------------------------

    def prefill(self, seq: int, tokens, stream: int) -> None:
        s = self._seq(seq)
        self._grow_to(s, len(s.tokens) + len(tokens))
        s.tokens.extend(tokens)
        s.seq_len = len(s.tokens)
        self.rows = [self._next(s)]
        self._rows_at((seq,))
        if self.lines is not None:
            self.lines.append(f"prefill(n={len(tokens)}, {s.sid}, stream={stream})")

    def prefill_chunk(self, seq: int, prompt, start: int, length: int, last: bool, stream: int) -> None:
        s = self._seq(seq)
        self.rows = [self._slice(s, prompt, start, length)]
        self._rows_at((seq,))
        if self.lines is not None:
            self.lines.append(f"prefill_chunk(start={start}, len={length}, last={_bool(last)}, {s.sid}, "
                              f"stream={stream})")

    def _slice_text(self, sl) -> str:
        return f"{self._seq(sl.seq).sid} start={sl.start} len={sl.length} last={_bool(sl.last)}"

    def mixed_forward(self, decode_tokens, decode_seqs, prefill, stream: int) -> Optional[list[tuple[int, int]]]:
        rows = self._decode_rows(decode_tokens, decode_seqs, cancel=False)
        rows.append(self._slice(self._seq(prefill.seq), prefill.prompt, prefill.start, prefill.length))
        self.rows = rows
        self._rows_at((*decode_seqs, prefill.seq))
        if self.lines is not None:
            self.lines.append(f"mixed_forward(decode={_list(decode_tokens)}, prefill={self._slice_text(prefill)}, "
                              f"stream={stream})")
        return None  # the scripted device keeps no prefix cache

    def mixed_forward_batch(self, decode_tokens, decode_seqs, prefills, stream: int
                            ) -> Optional[list[tuple[int, int]]]:
        rows = self._decode_rows(decode_tokens, decode_seqs, cancel=False)
        rows.extend(self._slice(self._seq(sl.seq), sl.prompt, sl.start, sl.length) for sl in prefills)
        self.rows = rows
        self._rows_at((*decode_seqs, *(sl.seq for sl in prefills)))
        if self.lines is not None:
            slices = ", ".join(f'"{self._slice_text(sl)}"' for sl in prefills)
            self.lines.append(f"mixed_forward_batch(decode={_list(decode_tokens)}, prefills=[{slices}], "
                              f"stream={stream})")
        return None

    def prefill_batch_chunk(self, prefills, stream: int) -> Optional[list[tuple[int, int]]]:
        self.rows = [self._slice(self._seq(sl.seq), sl.prompt, sl.start, sl.length) for sl in prefills]
        self._rows_at(tuple(sl.seq for sl in prefills))
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
        self._rows_at(seqs)
        if self.lines is not None:
            self.lines.append(head)

    def _single_decode(self, name: str, token: int, seq: int, stream: int, cancel: bool) -> None:
        self.rows = self._decode_rows([token], [seq], cancel)
        self._rows_at((seq,))
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
        self.row_at = [(seq, s.seq_len + i) for i in range(len(tokens))]
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
        at: list[tuple[int, int]] = []
        offset = 0
        for k, seq_id in zip(ks, seqs, strict=True):
            s = self._seq(seq_id)
            mine = list(tokens[offset:offset + k])
            offset += k
            at.extend((seq_id, s.seq_len + i) for i in range(k))
            rows = script_verify(self._script(s), s.seq_len, mine)
            self._append(s, mine)
            self._count_accepted(s, mine, rows)
            outputs.extend(rows)
        self.rows = outputs
        self.row_at = at
        if self.lines is not None:
            sids = ", ".join(f'"{self._seq(i).sid}"' for i in seqs)
            self.lines.append(f"decode_verify_batched(tokens={_list(tokens)}, ks={_list(ks)}, seqs=[{sids}], "
                              f"stream={stream}, woa={_bool(woa)}) -> {_list(outputs)}")
        return outputs

    def _rows_at(self, seqs) -> None:
        """``row_at`` of a forward of one row per sequence, each fed the sequence's last KV token."""
        live = self.live
        self.row_at = [(seq, live[seq].seq_len - 1) for seq in seqs]

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
