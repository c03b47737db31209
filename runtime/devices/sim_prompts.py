"""The simulated device's prompt writes: ``SimPrompts``, the layer of ``simulated.SimDevice`` that
checks and runs prefills, prefill chunks and the batched and mixed forwards of prompt slices: a
fresh sequence for a whole prefill; a slice starts where the KV ends, is not empty, ends inside
the prompt, says ``last`` exactly when it reaches the prompt's end, and keeps its chunk budget
(specs/scheduler.md §5.10, §5.13), the wave budget and the mixed-prefill bound."""

from __future__ import annotations

from typing import NamedTuple, Optional

from fxsched.runtime.devices.scripted_book import ScriptedSequence
from fxsched.runtime.devices.sim_sampling import SimSampling


class _Slice(NamedTuple):
    """A prefill's rows in the shape of a batched call's slice (for the EP word check)."""

    seq: int
    prompt: tuple[int, ...]
    start: int
    length: int


class SimPrompts(SimSampling):
    """The prompt writes of ``SimDevice``."""

    def _check_slice(self, call: str, s: ScriptedSequence, prompt, start: int, length: int, last: bool) -> None:
        if start != s.seq_len:
            raise self._bad(call, f"sequence {s.seq_id} holds {s.seq_len} tokens, the chunk starts at {start}")
        end = start + length
        if length <= 0 or end > len(prompt):
            raise self._bad(call, f"chunk [{start}, {end}) of a {len(prompt)}-token prompt")
        if last != (end == len(prompt)):
            raise self._bad(call, f"chunk [{start}, {end}) of a {len(prompt)}-token prompt says last={last}")
        limit = self.max_prefill_tokens
        if limit > 0:
            if self.idle_fills and not any(q in self.prompted for q in self.live if q != s.seq_id):
                budget = max(limit, self.max_batch_tokens)  # no stream waits on the chunk
            elif start > 0 or any(o is not s for o in self.live.values()):
                budget = limit  # a later chunk, or chunk 0 while something else is in flight
            else:
                budget = self.max_batch_tokens
            if self.mixed_floor or self.mixed_per_decode:  # the mixed-prefill bound, counted only when on
                decoding = sum(1 for q in self.live if q != s.seq_id and q in self.prompted)
                bound = self._mixed_bound(decoding)
                if bound is not None and decoding:
                    budget = min(budget, bound)
            if length > budget:
                raise self._bad(call, f"a chunk of {length} tokens at offset {start}, budget {budget}")
            if start > 0 and not last and length >= 4 and length % 4:
                raise self._bad(call, f"a non-last chunk of {length} tokens is no multiple of 4")

    def _mixed_bound(self, decoding: int) -> Optional[int]:
        """The prompt rows a step may take beside ``decoding`` decoding sequences under the
        mixed-prefill bound (specs/scheduler.md §5.13 C); None when it is off."""
        if not (self.mixed_floor or self.mixed_per_decode) or self.max_prefill_tokens <= 0:
            return None  # off, or prompts not chunked
        return max(self.mixed_floor, self.mixed_per_decode * decoding)

    def prefill(self, seq: int, tokens, stream: int):
        s = self._seq(seq)
        if s.seq_len or not tokens:
            raise self._bad("prefill", f"{len(tokens)} tokens into sequence {seq}, which holds {s.seq_len}")
        self._adapted("prefill", (seq,))
        self._runs("prefill", prefills=(_Slice(seq, tuple(tokens), 0, len(tokens)),))
        self.prompted.add(seq)
        super().prefill(seq, tokens, stream)
        self._ring_reset(s)
        return self._first_prefill(s, tokens)

    def prefill_chunk(self, seq: int, prompt, start: int, length: int, last: bool, stream: int):
        s = self._seq(seq)
        self._check_slice("prefill_chunk", s, prompt, start, length, last)
        if last:
            self.prompted.add(seq)
        self._adapted("prefill_chunk", (seq,))
        self._runs("prefill_chunk", prefills=(_Slice(seq, tuple(prompt), start, length),))
        if start == 0:
            self._ring_reset(s)
        super().prefill_chunk(seq, prompt, start, length, last, stream)
        return self._first_prefill(s, prompt) if start == 0 else 0

    def _check_slices(self, call: str, decode_seqs, prefills, decode_tokens=()) -> Optional[list[tuple[int, int]]]:
        names = list(decode_seqs) + [sl.seq for sl in prefills]
        if len(names) != len(set(names)):
            raise self._bad(call, f"a sequence appears twice in {names}")
        self._adapted(call, names)
        if self.wave_budget and len(prefills) > 1:  # specs/scheduler.md §5.13 A: the first entry always rides
            rows = len(decode_seqs) + sum(sl.length for sl in prefills)
            if rows > self.max_batch_tokens:
                raise self._bad(call, f"{len(decode_seqs)} decode rows and chunks {[sl.length for sl in prefills]} "
                                      f"in one forward, over max_batch_tokens {self.max_batch_tokens}")
            if self.idle_fills and decode_seqs and sum(sl.length for sl in prefills) > self.max_prefill_tokens:
                raise self._bad(call, f"chunks {[sl.length for sl in prefills]} beside {len(decode_seqs)} decode "
                                      f"rows, over one chunk's max_prefill_tokens {self.max_prefill_tokens}")
        bound = self._mixed_bound(len(decode_seqs)) if decode_seqs else None
        if bound is not None and sum(sl.length for sl in prefills) > bound:
            raise self._bad(call, f"chunks {[sl.length for sl in prefills]} beside {len(decode_seqs)} decode rows, "
                                  f"over the mixed-prefill bound {bound}")
        if bound is not None and bound < self.max_prefill_tokens and not all(sl.last for sl in prefills):
            self.bounded_steps += 1
        self._runs(call, decodes=tuple(zip(decode_tokens, decode_seqs, strict=False)), prefills=prefills)
        hits = []
        for sl in prefills:
            self._check_slice(call, self._seq(sl.seq), sl.prompt, sl.start, sl.length, sl.last)
            if sl.start == 0:
                self._ring_reset(self._seq(sl.seq))
                hit = self._first_prefill(self._seq(sl.seq), sl.prompt)
                if hit:
                    hits.append((sl.seq, hit))
        self.prompted.update(sl.seq for sl in prefills if sl.last)  # after the checks: one forward's chunks
        return hits or None

    def mixed_forward(self, decode_tokens, decode_seqs, prefill, stream: int) -> Optional[list[tuple[int, int]]]:
        self._blame(list(decode_seqs) + [prefill.seq])
        hits = self._check_slices("mixed_forward", decode_seqs, (prefill,), decode_tokens)
        super().mixed_forward(decode_tokens, decode_seqs, prefill, stream)
        self.blamed = None
        return hits

    def mixed_forward_batch(self, decode_tokens, decode_seqs, prefills, stream: int) -> Optional[list[tuple[int, int]]]:
        self._blame(list(decode_seqs) + [sl.seq for sl in prefills])
        hits = self._check_slices("mixed_forward_batch", decode_seqs, prefills, decode_tokens)
        super().mixed_forward_batch(decode_tokens, decode_seqs, prefills, stream)
        self.blamed = None
        return hits

    def prefill_batch_chunk(self, prefills, stream: int) -> Optional[list[tuple[int, int]]]:
        self._blame([sl.seq for sl in prefills])
        hits = self._check_slices("prefill_batch_chunk", (), prefills)
        super().prefill_batch_chunk(prefills, stream)
        self.blamed = None
        return hits
