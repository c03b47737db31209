"""The torch device's forwards and logits readers: prefills, decodes and mixed forwards (each
sequence's rows committed), verifies (rows left pending), the row table's argmax, host copy and
sampling."""

from __future__ import annotations

from itertools import accumulate
from typing import Optional, Sequence

import structlog
import torch

from fxsched.core.events import LATE_DRAFT
from fxsched.kernels.greedy_accept import greedy_accept, row_offsets_from_counts
from fxsched.kernels.row_argmax import row_argmax
from fxsched.runtime.devices.device import DeviceError
from fxsched.runtime.devices.spec_sampling import verify_sample_records
from fxsched.runtime.devices.row_processors import RowProcessors
from fxsched.runtime.devices.torch_sampling import RowLogprobs, SampledRows, logprob_records, sample_rows
from fxsched.runtime.torch_model.kernel_paths import kernels_opted_in
from fxsched.runtime.torch_model.transfers import send_ints
from fxsched.runtime.devices.torch_ahead import Ahead
from fxsched.runtime.devices.torch_book import DeviceSeq, DeviceStateError, Pending, PendingKind

log = structlog.get_logger("fxsched.torch_device")


class Forwards(Ahead):
    """Forwards, verifies and the readers of their rows."""

    def prefill(self, seq: int, tokens, stream: int) -> int:
        """Prefill the whole prompt (reusing prefix-cache blocks). Returns the prompt tokens served
        from the cache (the interpreter ignores it today; see the module notes on ``cached=``)."""
        s = self._seq(seq)
        self._settle(s, "prefill")
        self._make_room(-(-len(tokens) // self.cfg.block_size), "prefill")
        with self._errors("prefill"), self.streams.use(stream):
            logits = self.engine.prefill(s.slot, list(tokens))
        s.cached_tokens = self.engine.cached_prompt_tokens(s.slot)
        self.stats.cached_prompt_tokens += s.cached_tokens
        self._count("prefill", "prefill")
        self._set_rows(logits[None], [(seq, len(tokens) - 1)])
        self._ctx_catch_up(s)
        return s.cached_tokens

    def prefill_chunk(self, seq: int, prompt, start: int, length: int, last: bool, stream: int) -> int:
        s = self._seq(seq)
        self._settle(s, "prefill_chunk")
        chunk = list(prompt[start:start + length])
        engine = self.engine
        self._room_for([(s.slot, len(chunk))], "prefill_chunk")
        with self._errors("prefill_chunk"), self.streams.use(stream):
            if start == 0 and engine.seq_len(s.slot) == 0 and not engine.block_table(s.slot):
                logits = engine.prefill(s.slot, chunk)  # chunk 0 may start from the prefix cache
                s.cached_tokens = engine.cached_prompt_tokens(s.slot)
                self.stats.cached_prompt_tokens += s.cached_tokens
            else:
                logits = engine.prefill_chunk(s.slot, chunk, start)
        self._count("prefill", "prefill_chunk")
        self._set_rows(logits[None], [(seq, len(chunk) - 1)])
        self._ctx_catch_up(s)
        return s.cached_tokens if start == 0 else 0

    def _batched_commit_forward(self, rows: list[tuple[DeviceSeq, list[int]]], what: str, stream: int,
                                kind: str, fresh: Sequence[bool] = ()) -> Optional[list[tuple[int, int]]]:
        """One forward over several sequences' rows, all committed; the row table holds each
        sequence's last row, in order. A row marked ``fresh`` is a prompt's first chunk into an
        empty slot: it starts from the prefix cache as a lone prefill does (``engine.attach_prefix``)
        and only its other rows run. Returns (sequence id, tokens found cached) of the fresh rows
        that found any, or None."""
        seqs = [s for s, _ in rows]
        self._settle_many(seqs, what)
        slots = [s.slot for s in seqs]
        lists = [toks for _, toks in rows]
        engine = self.engine
        self._room_for(list(zip(slots, map(len, lists), strict=True)), what)
        cached = [0] * len(rows)
        with self._errors(what), self.streams.use(stream):
            for i, is_fresh in enumerate(fresh):
                if is_fresh:
                    cached[i] = engine.attach_prefix(slots[i], lists[i])
            logits = engine.commit_forward(slots, [toks[c:] for toks, c in zip(lists, cached, strict=True)])
        self._count(kind, what)
        last = [len(t) - c - 1 for t, c in zip(lists, cached, strict=True)]
        hits: list[tuple[int, int]] = []
        for i, s in enumerate(seqs):
            if cached[i]:
                last[i] = engine.capture_prompt(s.slot, len(lists[i]))
                s.cached_tokens = cached[i]
                self.stats.cached_prompt_tokens += cached[i]
                hits.append((s.seq_id, cached[i]))
        self._set_rows(logits, [(s.seq_id, row) for s, row in zip(seqs, last, strict=True)])
        for s in seqs:
            self._ctx_catch_up(s)
        return hits or None

    def _slice_rows(self, sl) -> tuple[DeviceSeq, list[int]]:
        s = self._seq(sl.seq)
        committed = self.engine.seq_len(s.slot) + (s.pending.keep if s.pending else 0)
        if sl.start != committed:
            raise DeviceStateError(f"prefill slice of sequence {sl.seq} starts at {sl.start} but the sequence "
                                   f"holds {committed} tokens")
        return s, list(sl.prompt[sl.start:sl.start + sl.length])

    def _fresh(self, prefills) -> list[bool]:
        """Which slices are a prompt's first chunk into an empty slot (prefix-cache candidates)."""
        engine = self.engine
        return [sl.start == 0 and engine.seq_len(self._seq(sl.seq).slot) == 0
                and not engine.block_table(self._seq(sl.seq).slot) for sl in prefills]

    def mixed_forward(self, decode_tokens, decode_seqs, prefill, stream: int) -> Optional[list[tuple[int, int]]]:
        return self.mixed_forward_batch(decode_tokens, decode_seqs, (prefill,), stream)

    def mixed_forward_batch(self, decode_tokens, decode_seqs, prefills, stream: int
                            ) -> Optional[list[tuple[int, int]]]:
        rows = [(self._seq(i), [int(t)]) for t, i in zip(decode_tokens, decode_seqs, strict=True)]
        rows += [self._slice_rows(sl) for sl in prefills]
        fresh = [False] * len(decode_seqs) + self._fresh(prefills)
        return self._batched_commit_forward(rows, "mixed_forward", stream, "decode", fresh)

    def prefill_batch_chunk(self, prefills, stream: int) -> Optional[list[tuple[int, int]]]:
        return self._batched_commit_forward([self._slice_rows(sl) for sl in prefills], "prefill_batch_chunk", stream,
                                            "prefill", self._fresh(prefills))

    def normalize_ssm_states(self, seq: int, stream: int) -> None:
        """GDN states are kept in fp32 and never drift: nothing to normalize."""
        self._seq(seq)

    def decode_batch(self, tokens, seqs, stream: int) -> None:
        """One plain decode row per sequence; a ``LATE_TOKEN`` input feeds the token the sequence's
        last decode kept on the device (specs/async.md §16.6, ``torch_ahead``)."""
        ds = [self._seq(i) for i in seqs]
        self._settle_many(ds, "decode_batch")
        slots = [s.slot for s in ds]
        with self._errors("decode_batch"):
            self._make_room(self.engine.decode_blocks_needed(slots), "decode_batch")
        host, on_device = self._late_inputs_of(ds, tokens)
        starts = [self.engine.seq_len(slot) for slot in slots] if on_device is not None else []
        with self._errors("decode_batch"), self.streams.use(stream):
            logits = self.engine.decode_batch(slots, host, device_tokens=on_device)
        if on_device is not None:
            self._fed_late(ds, tokens, starts)
        self._count("decode", "decode_batch")
        self._set_rows(logits, [(s.seq_id, 0) for s in ds])

    def decode(self, token: int, seq: int, stream: int) -> None:
        self.decode_batch([token], [seq], stream)

    def decode_draft(self, token: int, seq: int, stream: int) -> None:
        """A self-speculative draft step: the draft chain stays uncommitted (re-run from the
        committed state with every draft so far), so the scheduler's rewind to the anchor needs
        no undo of a committed state."""
        s = self._seq(seq)
        if s.pending is not None and s.pending.kind is PendingKind.DRAFT:
            tail = s.pending.tokens[:s.pending.keep]
        else:
            self._settle(s, "decode_draft")
            tail = []
        tokens = tail + [int(token)]
        self._room_for([(s.slot, len(tokens))], "decode_draft")
        with self._errors("decode_draft"), self.streams.use(stream):
            logits = self.engine.verify(s.slot, tokens)
        self._count("draft", "decode_draft")
        s.pending = Pending(tokens, len(tokens), PendingKind.DRAFT, len(tokens))
        self._set_rows(logits[-1:], [(seq, len(tokens) - 1)])

    def _late_inputs(self, seqs: list[DeviceSeq], lists: list[list[int]],
                     what: str) -> tuple[Optional[torch.Tensor], list[list[int]]]:
        """(the verify's inputs on the device [sum of K], or None when none is a late draft; the host
        lists with each late draft as 0): a sequence's LATE_DRAFT inputs are its anchor's successors,
        the first drafts of the proposal the device kept for it (specs/async.md §16.3; the verify
        consumes them once its forward has run, so a forward that fails leaves them for a retry)."""
        if not any(LATE_DRAFT in toks for toks in lists):
            return None, lists
        steady = self._late_rows(seqs, lists)
        if steady is not None:
            return steady
        flat: list[int] = []
        at: list[int] = []
        kept: list[torch.Tensor] = []
        for s, toks in zip(seqs, lists, strict=True):
            late = [i for i, t in enumerate(toks) if t == LATE_DRAFT]
            if late:
                held = self._late.get(s.seq_id)
                if isinstance(held, str):
                    raise DeviceError(f"{what}: the late proposal of sequence {s.seq_id} failed: {held}")
                if held is None or late != list(range(1, len(late) + 1)) or len(late) > held.numel():
                    raise DeviceStateError(f"{what}: sequence {s.seq_id} verifies late drafts at {late} but holds "
                                           f"{0 if held is None else held.numel()} (inputs {toks})")
                at += [len(flat) + i for i in late]
                kept.append(held[:len(late)])
            flat += [0 if t == LATE_DRAFT else t for t in toks]
        inputs, where = send_ints([flat, at], self.engine.device)
        inputs[where] = torch.cat(kept)
        host, start = [], 0
        for toks in lists:
            host.append(flat[start:start + len(toks)])
            start += len(toks)
        return inputs, host

    def _late_rows(self, seqs: list[DeviceSeq], lists: list[list[int]]) -> Optional[tuple[torch.Tensor, list[list[int]]]]:
        """``_late_inputs`` of the steady case, without a per-row scatter: every sequence verifies
        its anchor and k - 1 late drafts and holds at least K - 1 (K: the widest verify), so the
        held drafts stack into [B, K - 1] beside the anchors, and a ragged batch's rows are picked
        from that in one gather (None otherwise: the general path checks and names what is wrong)."""
        ks = [len(toks) for toks in lists]
        width = max(ks)
        if width < 2 or any(toks[0] == LATE_DRAFT or any(t != LATE_DRAFT for t in toks[1:]) for toks in lists):
            return None
        held = [self._late.get(s.seq_id) for s in seqs]
        if not all(isinstance(h, torch.Tensor) and h.numel() >= width - 1 for h in held):
            return None
        anchors = [toks[0] for toks in lists]
        host = [[toks[0]] + [0] * (len(toks) - 1) for toks in lists]
        fields = [anchors]
        uniform = all(k == width for k in ks)
        if not uniform:
            fields.append([b * width + j for b, k in enumerate(ks) for j in range(k)])
        batch = self._late_batch  # the held drafts as rows of their proposal: one gather, not a stack
        rows = [batch[1].get(s.seq_id, -1) for s in seqs] if batch is not None else [-1]
        whole = batch is not None and rows == list(range(batch[0].shape[0]))
        if not whole and min(rows) >= 0:
            fields.append(rows)
        sent = send_ints(fields, self.engine.device)
        if batch is not None and (whole or min(rows) >= 0):
            source = batch[0] if whole else batch[0].index_select(0, sent[-1])
            drafts = source.reshape(len(seqs), -1)[:, :width - 1]
        else:
            drafts = torch.stack([h.reshape(-1)[:width - 1] for h in held])  # type: ignore[union-attr]
        padded = torch.cat([sent[0].view(-1, 1), drafts.to(torch.int64)], 1).reshape(-1)
        return (padded, host) if uniform else (padded.index_select(0, sent[1]), host)

    @staticmethod
    def _agreed(answers: torch.Tensor, lists: list[list[int]], late: Optional[torch.Tensor]) -> torch.Tensor:
        """Per sequence, how many leading drafts the target's rows agree with (greedy_accept's
        accepted count), on the device: one comparison over [B, K - 1] (K: the widest verify; a
        shorter one's pad columns never agree), then the leading run of agreements; a ragged batch
        where the Triton kernels run takes greedy_accept's one launch instead."""
        ks = [len(t) for t in lists]
        width = max(ks)
        if width == 1:  # anchors alone: nothing to agree with
            return torch.zeros(len(ks), dtype=torch.int64, device=answers.device)
        if all(k == width for k in ks):
            if late is None:
                drafts = send_ints([[t for toks in lists for t in toks[1:]]], answers.device)[0]
            else:
                drafts = late.view(-1, width)[:, 1:]
            same = answers.view(-1, width)[:, :width - 1] == drafts.reshape(-1, width - 1)
            return same.cumprod(1).sum(1)
        if kernels_opted_in(answers):  # the ragged kernel: one launch (greedy_accept)
            ks_t, *rest = send_ints([ks, [t for toks in lists for t in toks[1:]] if late is None else
                                     [a + j for a, k in zip(accumulate(ks[:-1], initial=0), ks, strict=True)
                                      for j in range(1, k)]], answers.device)
            drafts = rest[0] if late is None else late[rest[0]]
            return greedy_accept(answers, drafts, row_offsets_from_counts(ks_t))[0]
        rows, drafts_at, valid = [], [], []  # per (sequence, column): a target row, its draft, whether real
        start = 0
        for toks in lists:
            k = len(toks)
            for j in range(width - 1):
                real = j < k - 1
                rows.append(start + j if real else start)
                drafts_at.append((toks[j + 1] if late is None else start + j + 1) if real else 0)
                valid.append(int(real))
            start += k
        rows_t, drafts_t, valid_t = send_ints([rows, drafts_at, valid], answers.device)
        if late is not None:
            drafts_t = late[drafts_t]
        same = (answers[rows_t] == drafts_t) & valid_t.bool()
        return same.view(-1, width - 1).cumprod(1).sum(1)

    def _verify_many(self, seqs: list[DeviceSeq], lists: list[list[int]], what: str) -> list[int]:
        self._settle_many(seqs, what)
        self._room_for([(s.slot, len(t)) for s, t in zip(seqs, lists, strict=True)], what)
        late, ran = self._late_inputs(seqs, lists, what)
        with self._errors(what):
            outs = self.engine.verify_batched([s.slot for s in seqs], ran, device_tokens=late)
        if late is not None:
            for s in seqs:
                self._late.pop(s.seq_id, None)
        self._count("verify", what)
        logits = outs[0] if len(outs) == 1 else torch.cat(outs)
        owners = []
        for s, toks in zip(seqs, lists, strict=True):
            s.pending = Pending(list(toks), len(toks), PendingKind.VERIFY, len(toks))
            owners += [(s.seq_id, t) for t in range(len(toks))]
        logits = self._constrain(logits, owners)  # a draft the grammar refuses is never the row's answer
        answers = row_argmax(logits)
        ks = [len(t) for t in lists]
        accepted = self._agreed(answers, lists, late)
        # the verify's one read: rows, agreements, then (late drafts) the inputs that ran
        parts = [answers, accepted] if late is None else [answers, accepted, late]
        read = torch.cat(parts).tolist()
        rows, agreed = read[:len(answers)], read[len(answers):len(answers) + len(seqs)]
        inputs = read[len(answers) + len(seqs):] if late is not None else [t for toks in lists for t in toks]
        at = 0
        for s, n, k in zip(seqs, agreed, ks, strict=True):
            assert s.pending is not None
            s.pending.agreed = n + 1
            if late is not None:
                s.pending.tokens = inputs[at:at + k]
                self.engine.set_pending_tokens(s.slot, s.pending.tokens)
            at += k
        self._verify_inputs = inputs
        self._set_rows(logits, owners, rows)
        return rows

    def verify_inputs(self) -> list[int]:
        """The last verify's inputs as they ran (late drafts filled in)."""
        return list(self._verify_inputs)

    def serial_verify(self, call: str, seq: int, tokens) -> list[int]:
        """One sequence's verify of its anchor and drafts; ``call`` (the effect's name: graphed, K = 3,
        DFlash, fused, ...) names it in the counts and errors, the work is the same."""
        return self._verify_many([self._seq(seq)], [[int(t) for t in tokens]], call)

    def decode_verify_batched(self, tokens, ks, seqs, stream: int, woa: bool) -> list[int]:
        if sum(ks) != len(tokens) or len(ks) != len(seqs):
            raise DeviceStateError(f"decode_verify_batched: {len(tokens)} tokens, ks={list(ks)}, {len(seqs)} seqs")
        self.stats.widest_batched_verify = max(self.stats.widest_batched_verify, len(seqs))
        lists, offset = [], 0
        for k in ks:
            lists.append([int(t) for t in tokens[offset:offset + k]])
            offset += k
        with self.streams.use(stream):
            return self._verify_many([self._seq(i) for i in seqs], lists, "decode_verify_batched")

    def sample_verify(self, picks, eos_ids) -> list[int]:
        """The last verify's rows redone by rejection sampling (``spec_sampling.verify_sample``, one
        pick per row in the verify's row order): the pending rows each sequence may keep become its
        accepted drafts + 1, as the greedy verify's agreement did."""
        if self._logits is None or not self._owners:
            raise DeviceError("sample_verify: no verify has produced rows")
        seqs: list[DeviceSeq] = []
        for seq_id, local in self._owners:
            if local == 0:
                seqs.append(self._seq(seq_id))
        inputs = []
        for s in seqs:
            if s.pending is None or s.pending.kind is not PendingKind.VERIFY:
                raise DeviceError(f"sample_verify: sequence {s.seq_id} has no pending verify")
            inputs.append(s.pending.tokens)
        self.stats.calls["sample_verify"] += 1
        record_rows: list[int] = []  # the rows of each sequence that asks for logprob records
        offset = 0
        for toks in inputs:
            if any(picks[r].top_logprobs for r in range(offset, offset + len(toks))):
                record_rows += range(offset, offset + len(toks))
            offset += len(toks)
        # the rows and their records in one read (specs/async.md §16.2)
        rows, accepted, row_records = verify_sample_records(self._logits, inputs, picks, eos_ids,
                                                            processed=self._processed(0, self._logits.shape[0]),
                                                            record_rows=record_rows)
        by_row = dict(zip(record_rows, row_records, strict=True))
        records: list[tuple[int, list[RowLogprobs]]] = []
        offset = 0
        for s, n, toks in zip(seqs, accepted, inputs, strict=True):
            assert s.pending is not None
            s.pending = Pending(s.pending.tokens, s.pending.keep, PendingKind.VERIFY, n + 1)
            emitted = range(offset, offset + n + 1)  # the kept drafts and the row after them
            if any(picks[r].top_logprobs for r in emitted):
                records.append((s.seq_id, [by_row[r] for r in emitted]))
            offset += len(toks)
        self.last_verify = records
        self._argmax = rows
        return rows

    last_verify: Optional[list[tuple[int, list[RowLogprobs]]]] = None  # the last sample_verify's records

    last_sample_row: int = 0  # the first row of the last sample_rows

    def row_record(self, row: int, token: int, width: int) -> RowLogprobs:
        """The logprob record of ``token`` at row ``row`` of the last forward (the first token's,
        whose pick the scheduler makes without one)."""
        self._check_rows(row, 1)
        assert self._logits is not None
        return logprob_records(self._logits[row:row + 1], [token], [width])[0]

    def argmax_on_device(self, row: int, stream: int) -> int:
        self._check_rows(row, 1)
        return self._row_tokens()[row]

    def argmax_batch(self, row: int, n: int, stream: int) -> list[int]:
        self._check_rows(row, n)
        return self._row_tokens()[row:row + n]

    def copy_logits_to_host(self, row: int, off: int, nbytes: int) -> bytes:
        """BF16 little-endian logits of rows ``row``.. (``vocab * 2`` bytes per row), from byte ``off``."""
        width = self.cfg.vocab_size * 2
        n = -(-(off + nbytes) // width)
        self._check_rows(row, n)
        if self._logits is None:
            raise DeviceError("no forward has produced logits rows yet")
        slab = self._logits[row:row + n].to(torch.bfloat16).contiguous().view(torch.uint8).cpu().numpy().tobytes()
        return slab[off:off + nbytes]

    last_sample: Optional[SampledRows] = None  # the last sample_rows answer, logprob records included

    row_processors: Optional[RowProcessors] = None  # per-request logits processing (penalties, logit_bias)

    def _processed(self, row: int, n: int) -> Optional[torch.Tensor]:
        """Rows ``row``.. of the last forward after their requests' processors (None: none has any).
        A row's context is its sequence's committed tokens, then (a verify or draft row) the
        pending inputs up to and including the row's own."""
        processors = self.row_processors
        if not processors or self._logits is None:
            return None
        owners = self._owners[row:row + n]
        seqs = [self._seqs.get(seq_id) for seq_id, _ in owners]

        def context(r: int) -> list[int]:
            s = seqs[r]
            assert s is not None
            committed = self.engine.tokens(s.slot)
            return committed + (s.pending.tokens[:owners[r][1] + 1] if s.pending is not None else [])

        sessions = [s.session if s is not None else None for s in seqs] + [None] * (n - len(seqs))
        return processors.process(self._logits[row:row + n], sessions, context)

    def sample_rows(self, row: int, n: int, picks, eos_ids) -> SampledRows:
        """Pick rows ``row``.. ``row + n - 1`` on the device by their ``HostPick`` (batched, in torch:
        ``fxsched.runtime.devices.torch_sampling``); the interpreter uses it instead of a host copy."""
        self._check_rows(row, n)
        if self._logits is None:
            raise DeviceError("no forward has produced logits rows yet")
        self.stats.calls["sample_rows"] += 1
        self.last_sample = sample_rows(self._logits[row:row + n], picks, eos_ids, self._processed(row, n))
        self.last_sample_row = row
        return self.last_sample

    def vocab_size(self) -> int:
        return self.cfg.vocab_size
