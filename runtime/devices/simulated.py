"""The simulated device of the model checker: the scripted model of the recording device, fast
and silent, with a finite block pool, injected faults, and a check of every call's arguments.

It answers every call by the same rules as the recording device (``ScriptedDevice``), keeps a
strict block pool (growing past it is KV exhaustion on a decode and a fault elsewhere), refuses
calls on sequences that are not allocated, and can fail scheduled calls. It records no trace; it
keeps what the invariants need: the pool, the slots, each sequence's KV length, the drafts it saw
accepted and the longest KV written per request, the prefix-cache hits it reported, and whom the last failed call blamed.

**The device is the judge of its own arguments.** Every bookkeeping call is checked against the
device's own state and a mismatch raises ``ArgumentError`` (a ``DeviceError`` subclass the
checker reports as ``device_refused``, never a fault the scheduler may absorb):

- prompt writes (``prefill``, chunks, slices): a fresh sequence for a whole prefill; a slice
  starts where the KV ends (the chunks cover the prompt once, in order), is not empty, ends
  inside the prompt, says ``last`` exactly when it reaches the prompt's end, and keeps its chunk
  budget (specs/scheduler.md §5.10, §5.13): chunk 0 at most ``max_batch_tokens``, and at most
  ``max_prefill_tokens`` when another sequence is on the device; later chunks at most
  ``max_prefill_tokens``, a non-last one of 4+ tokens a multiple of 4;
- ``truncate_sequence`` never lengthens the KV;
- a verify (and a plain ``decode_batch``, one row each) remembers, per sequence, its rows and the KV
  length before it; ``commit_accepted_prefix``
  commits at most those rows (and ``na <= k``), ``commit_ctx`` commits at most those rows from that
  base, ``trim_proposer_state`` trims to at most those rows, ``gdn_fold_accepted`` folds only live
  slots, once each, with ``1 <= accepted <= k``;
- hidden-row reads (``save_hidden_for_mtp``, ``stash_verify_hidden_rows``,
  ``stash_verify_catchup_rows``) name rows of the last forward; ``save_hidden_for_mtp_from_stash``
  an index of the last stash;
- proposals are asked at the sequence's next position (``pos == seq_len``), batched ones once per
  live sequence; a catch-up names distinct stash slots (4·i), at most 4 drafts each;
- ``save_sequence_state`` saves a sequence not saved already; ``restore_sequence_state`` needs a
  saved, sound file (``spill_corrupt_for`` damages one, ``spill_missing_for`` loses it) into a
  fresh sequence.

Prefix cache (``prefix_cache``): ``cache_sequence`` remembers the body of the sequence's prompt
(every token after the first, which is the request id); a later first prefill whose body shares
whole blocks with a remembered one reports those tokens as cached (``cached[request id]``). The
``reclaimable`` blocks are part of ``held_blocks``: a reclaim moves them to the free pool.
Adapters: ``adapters`` maps an adapter slot to its id (slot -1, the base model, is id 0).
"""

from __future__ import annotations

from typing import Optional

from fxsched.runtime.devices.device import DeviceError
from fxsched.runtime.devices.scripted import Script, ScriptedDevice, ScriptedSequence


class ArgumentError(DeviceError):
    """A call whose arguments do not match the device's state: a scheduler bug, never a fault."""


class SimDevice(ScriptedDevice):
    """Implements the Device protocol for the random walk and the hypothesis machine."""

    def __init__(self, scripts: dict[int, Script], *, vocab: int = 64, block_size: int = 16,
                 total_blocks: int = 1000, held_blocks: int = 0, kv_exhaust_at=(), decode_fault_at=(),
                 verify_fault_at=(), spill_corrupt_for=(), spill_missing_for=(), cancel_flags=(),
                 can_batch_verify: bool = True, slot_draft_capacity: int = 8, count_accepted: bool = True,
                 reclaimable: int = 0, prefix_cache: bool = False, adapters: Optional[dict[int, int]] = None,
                 max_prefill_tokens: int = 0, max_batch_tokens: int = 8192):
        super().__init__(scripts, vocab=vocab, block_size=block_size, total_blocks=total_blocks,
                         held_blocks=held_blocks, reclaimable=min(reclaimable, held_blocks),
                         cancel_flags=cancel_flags, kv_exhaust_at=kv_exhaust_at,
                         decode_fault_at=decode_fault_at, verify_fault_at=verify_fault_at,
                         can_batch_verify=can_batch_verify, slot_draft_capacity=slot_draft_capacity,
                         count_accepted=count_accepted)
        self.spill_corrupt_for = set(spill_corrupt_for)
        self.spill_missing_for = set(spill_missing_for)
        self.spilled: dict[int, dict] = {}
        self.spill_owner: dict[int, int] = {}  # seq -> the request whose state it saved
        self.prefix_cache = prefix_cache
        self.cached_bodies: list[tuple[int, ...]] = []
        self.cached: dict[int, int] = {}  # request id -> prompt tokens its first prefill found cached
        self.prefilled: set[int] = set()  # request ids whose first prefill ran
        self.adapters = {-1: 0} if adapters is None else dict(adapters)
        self.max_prefill_tokens = max_prefill_tokens
        self.max_batch_tokens = max_batch_tokens
        self.verified: dict[int, tuple[int, int]] = {}  # seq -> (rows, KV length before) of its last verify
        self.stash = 0  # entries of the last hidden-row stash
        self.blamed: Optional[frozenset[int]] = None  # request ids the last failed call worked on
        self.refused: Optional[str] = None  # the first call refused for its arguments
        self.reach: dict[int, int] = {}  # request id -> the longest KV a decode or verify wrote for it

    # --- strict bookkeeping ---------------------------------------------------------------------------

    def _seq(self, seq_id: int) -> ScriptedSequence:
        seq = self.live.get(seq_id)
        if seq is None:
            raise self._bad("device", f"sequence {seq_id} is not allocated")
        return seq

    def _bad(self, call: str, message: str) -> ArgumentError:
        """The refusal of a call; kept in ``refused`` too, since the interpreter turns an error in a
        query into a ``DeviceFault`` answer the scheduler would take."""
        error = ArgumentError(f"{call}: {message}")
        if self.refused is None:
            self.refused = error.message
        return error

    def _blame(self, seqs) -> None:
        self.blamed = frozenset(self._rid(self.live[i]) for i in seqs if i in self.live)

    def _rid(self, s: ScriptedSequence) -> int:
        return s.session if s.session else (s.tokens[0] if s.tokens else 0)

    def take_blame(self) -> Optional[frozenset[int]]:
        """Whom the last failed call worked on (None: no call failed since the last take)."""
        blamed, self.blamed = self.blamed, None
        return blamed

    def _grow_to(self, seq: ScriptedSequence, seq_len: int) -> None:
        need = self._need(seq_len)
        if need > seq.blocks:
            extra = need - seq.blocks
            if extra > self.free_count():
                if self.blamed is None:  # a forward of several sequences blamed them all already
                    self.blamed = frozenset((self._rid(seq),))
                raise DeviceError("out of KV blocks")
            self.used_blocks += extra
            seq.blocks = need

    def _check_room(self, seqs) -> None:
        """A decode that cannot grow every sequence by one token fails before it writes any."""
        need = sum(max(self._need(self._seq(i).seq_len + 1) - self._seq(i).blocks, 0) for i in seqs)
        if need > self.free_count():
            self._blame(seqs)
            raise DeviceError("KV cache exhausted", kv_exhausted=True)

    def _append(self, seq: ScriptedSequence, tokens) -> None:
        super()._append(seq, tokens)
        rid = self._rid(seq)
        if seq.seq_len > self.reach.get(rid, 0):
            self.reach[rid] = seq.seq_len

    def _alloc(self, seq: int, session: int) -> int:
        if seq in self.live:
            raise self._bad("alloc_sequence", f"sequence {seq} is already allocated")
        return super()._alloc(seq, session)

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
            if start > 0 or any(o is not s for o in self.live.values()):
                budget = limit  # a later chunk, or chunk 0 while something else is in flight
            else:
                budget = self.max_batch_tokens
            if length > budget:
                raise self._bad(call, f"a chunk of {length} tokens at offset {start}, budget {budget}")
            if start > 0 and not last and length >= 4 and length % 4:
                raise self._bad(call, f"a non-last chunk of {length} tokens is no multiple of 4")

    def _first_prefill(self, s: ScriptedSequence, prompt) -> int:
        """The prefix-cache hit a first prefill reports (0 when the cache is off or misses)."""
        rid = self._rid(s)
        if rid in self.prefilled:
            return 0
        self.prefilled.add(rid)
        if not self.prefix_cache:
            return 0
        body = tuple(prompt[1:])
        best = 0
        for cached in self.cached_bodies:
            n = 0
            for a, b in zip(body, cached, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        hit = (best // self.block_size) * self.block_size
        if hit:
            self.cached[rid] = hit
        return hit

    def prefill(self, seq: int, tokens, stream: int):
        s = self._seq(seq)
        if s.seq_len or not tokens:
            raise self._bad("prefill", f"{len(tokens)} tokens into sequence {seq}, which holds {s.seq_len}")
        super().prefill(seq, tokens, stream)
        return self._first_prefill(s, tokens)

    def prefill_chunk(self, seq: int, prompt, start: int, length: int, last: bool, stream: int):
        s = self._seq(seq)
        self._check_slice("prefill_chunk", s, prompt, start, length, last)
        super().prefill_chunk(seq, prompt, start, length, last, stream)
        return self._first_prefill(s, prompt) if start == 0 else 0

    def _check_slices(self, call: str, decode_seqs, prefills) -> None:
        names = list(decode_seqs) + [sl.seq for sl in prefills]
        if len(names) != len(set(names)):
            raise self._bad(call, f"a sequence appears twice in {names}")
        for sl in prefills:
            self._check_slice(call, self._seq(sl.seq), sl.prompt, sl.start, sl.length, sl.last)
            if sl.start == 0:
                self._first_prefill(self._seq(sl.seq), sl.prompt)

    def mixed_forward(self, decode_tokens, decode_seqs, prefill, stream: int) -> None:
        self._blame(list(decode_seqs) + [prefill.seq])
        self._check_slices("mixed_forward", decode_seqs, (prefill,))
        super().mixed_forward(decode_tokens, decode_seqs, prefill, stream)
        self.blamed = None

    def mixed_forward_batch(self, decode_tokens, decode_seqs, prefills, stream: int) -> None:
        self._blame(list(decode_seqs) + [sl.seq for sl in prefills])
        self._check_slices("mixed_forward_batch", decode_seqs, prefills)
        super().mixed_forward_batch(decode_tokens, decode_seqs, prefills, stream)
        self.blamed = None

    def prefill_batch_chunk(self, prefills, stream: int) -> None:
        self._blame([sl.seq for sl in prefills])
        self._check_slices("prefill_batch_chunk", (), prefills)
        super().prefill_batch_chunk(prefills, stream)
        self.blamed = None

    def decode_batch(self, tokens, seqs, stream: int) -> None:
        if len(set(seqs)) != len(seqs):
            raise self._bad("decode_batch", f"a sequence appears twice in {list(seqs)}")
        self._blame(seqs)
        before = [(i, self._seq(i).seq_len) for i in seqs]
        super().decode_batch(tokens, seqs, stream)
        for i, seq_len in before:  # a plain decode commits one row per sequence (commit_ctx n=1)
            self.verified[i] = (1, seq_len)
        self.blamed = None

    def truncate_sequence(self, seq: int, seq_len: int) -> None:
        s = self._seq(seq)
        if not 0 <= seq_len <= s.seq_len:
            raise self._bad("truncate_sequence", f"to {seq_len} tokens, sequence {seq} holds {s.seq_len}")
        super().truncate_sequence(seq, seq_len)

    # --- verifies and what they leave to commit -------------------------------------------------------

    def _verify(self, name: str, seq: int, tokens) -> list[int]:
        s = self._seq(seq)
        self.blamed = frozenset((self._rid(s),))
        self.verified[seq] = (len(tokens), s.seq_len)
        rows = super()._verify(name, seq, tokens)
        self.blamed = None
        return rows

    def decode_verify_batched(self, tokens, ks, seqs, stream: int, woa: bool) -> list[int]:
        if len(set(seqs)) != len(seqs) or len(ks) != len(seqs) or sum(ks) != len(tokens):
            raise self._bad("decode_verify_batched", f"ks={list(ks)} seqs={list(seqs)} for {len(tokens)} tokens")
        self._blame(seqs)
        for k, seq_id in zip(ks, seqs, strict=True):
            self.verified[seq_id] = (k, self._seq(seq_id).seq_len)
        rows = super().decode_verify_batched(tokens, ks, seqs, stream, woa)
        self.blamed = None
        return rows

    def _verified(self, call: str, seq: int) -> tuple[int, int]:
        self._seq(seq)
        got = self.verified.get(seq)
        if got is None:
            raise self._bad(call, f"sequence {seq} has no verify to commit")
        return got

    def commit_accepted_prefix(self, seq: int, na: int, k: int) -> None:
        rows, _ = self._verified("commit_accepted_prefix", seq)
        if not 0 <= na <= min(k, rows):
            raise self._bad("commit_accepted_prefix", f"na={na}, k={k} for sequence {seq}, whose verify had {rows} rows")
        super().commit_accepted_prefix(seq, na, k)

    def commit_ctx(self, seq: int, n: int, base: int, row: int) -> None:
        rows, before = self._verified("commit_ctx", seq)
        if not 1 <= n <= rows or base != before:
            raise self._bad("commit_ctx", f"n={n}, base={base} for sequence {seq}, whose verify had {rows} rows "
                                          f"from {before}")
        super().commit_ctx(seq, n, base, row)

    def trim_proposer_state(self, seq: int, na: int, stream: int) -> None:
        rows, _ = self._verified("trim_proposer_state", seq)
        if not 0 <= na <= rows:
            raise self._bad("trim_proposer_state", f"na={na} for sequence {seq}, whose verify had {rows} rows")
        super().trim_proposer_state(seq, na, stream)

    def gdn_fold_accepted(self, slots, accepted, k: int) -> bool:
        live = {s.slot for s in self.live.values()}
        if (len(slots) != len(accepted) or len(set(slots)) != len(slots) or not set(slots) <= live
                or any(not 1 <= a <= k for a in accepted)):
            raise self._bad("gdn_fold_accepted", f"slots={list(slots)} accepted={list(accepted)} k={k}, "
                                                 f"live slots {sorted(live)}")
        return super().gdn_fold_accepted(slots, accepted, k)

    # --- hidden rows and proposals --------------------------------------------------------------------

    def _check_row(self, call: str, row: int) -> None:
        if not 0 <= row < len(self.rows):
            raise self._bad(call, f"row {row}, the last forward made {len(self.rows)}")

    def save_hidden_for_mtp(self, row: int, stream: int) -> None:
        self._check_row("save_hidden_for_mtp", row)
        super().save_hidden_for_mtp(row, stream)

    def stash_verify_hidden_rows(self, rows, stream: int) -> None:
        for row in rows:
            self._check_row("stash_verify_hidden_rows", row)
        self.stash = len(rows)
        super().stash_verify_hidden_rows(rows, stream)

    def stash_verify_catchup_rows(self, pairs) -> None:
        for _, row in pairs:
            self._check_row("stash_verify_catchup_rows", row)
        super().stash_verify_catchup_rows(pairs)

    def save_hidden_for_mtp_from_stash(self, index: int, stream: int) -> None:
        if not 0 <= index < self.stash:
            raise self._bad("save_hidden_for_mtp_from_stash", f"index {index}, the stash holds {self.stash}")
        super().save_hidden_for_mtp_from_stash(index, stream)

    def run_mtp_propose_multi(self, token: int, pos: int, n: int, seq: int, stream: int, mask: bool) -> list[int]:
        s = self._seq(seq)
        if pos != s.seq_len or n < 1:
            raise self._bad("run_mtp_propose_multi", f"pos={pos}, n={n} for sequence {seq}, which holds {s.seq_len}")
        return super().run_mtp_propose_multi(token, pos, n, seq, stream, mask)

    def run_mtp_propose_batched(self, tokens, positions, stash, n: int, seqs, stream: int) -> list[list[int]]:
        if len(set(seqs)) != len(seqs) or not len(tokens) == len(positions) == len(seqs) or n < 1:
            raise self._bad("run_mtp_propose_batched", f"{len(tokens)} tokens, {len(positions)} positions for "
                                                       f"sequences {list(seqs)}")
        for seq_id, pos in zip(seqs, positions, strict=True):
            if pos != self._seq(seq_id).seq_len:
                raise self._bad("run_mtp_propose_batched", f"pos={pos} for sequence {seq_id}, which holds "
                                                           f"{self._seq(seq_id).seq_len}")
        self._blame(seqs)
        drafts = super().run_mtp_propose_batched(tokens, positions, stash, n, seqs, stream)
        self.blamed = None
        return drafts

    def run_mtp_catchup_batched(self, tokens, slots, pos) -> int:
        """Stash slots ``4·i`` of the batch's pending sequences, at most 4 accepted drafts each
        (specs/speculation.md §6.12 step 9)."""
        if (len(tokens) != len(slots) or len(pos) != len(slots) or len(set(slots)) != len(slots)
                or any(slot % 4 or len(t) > 4 for slot, t in zip(slots, tokens, strict=True))):
            raise self._bad("run_mtp_catchup_batched", f"slots={list(slots)}, {len(tokens)} token lists "
                                                       f"{[len(t) for t in tokens]}, {len(pos)} positions")
        return super().run_mtp_catchup_batched(tokens, slots, pos)

    # --- slots, spill, prefix cache, adapters ---------------------------------------------------------

    def compact_sequence(self, seq: int, new_slot: int) -> None:
        s = self._seq(seq)
        if new_slot != s.slot and any(o.slot == new_slot for o in self.live.values() if o is not s):
            raise DeviceError(f"compaction target slot {new_slot} is held by another sequence")
        super().compact_sequence(seq, new_slot)

    def free_sequence(self, seq: int) -> None:
        super().free_sequence(seq)
        self.verified.pop(seq, None)

    def cache_sequence(self, seq: int) -> None:
        s = self._seq(seq)
        if self.prefix_cache and len(s.tokens) > 1:
            self.cached_bodies.append(tuple(s.tokens[1:]))
            del self.cached_bodies[:-4]
        super().cache_sequence(seq)

    def reclaim_prefix_blocks(self, n: int) -> int:
        if n < 1:
            raise self._bad("reclaim_prefix_blocks", f"n={n}")
        got = min(n, self.reclaimable)
        self.reclaimable -= got
        self.held_blocks -= got
        return got

    def adapter_id_for(self, slot: int) -> int:
        return self.adapters.get(slot, -1)

    def save_sequence_state(self, seq: int) -> None:
        s = self._seq(seq)
        if seq in self.spilled:
            raise self._bad("save_sequence_state", f"sequence {seq} is saved already")
        self._script(s)
        self.spill_owner[seq] = s.request_id
        if s.request_id in self.spill_missing_for:
            return
        self.spilled[seq] = {"tokens": list(s.tokens), "seq_len": s.seq_len, "blocks": s.blocks,
                             "corrupt": s.request_id in self.spill_corrupt_for}

    def restore_sequence_state(self, seq: int, blocks: int) -> None:
        s = self._seq(seq)
        if s.seq_len or s.blocks:
            raise self._bad("restore_sequence_state", f"into sequence {seq}, which holds {s.seq_len} tokens")
        saved = self.spilled.pop(seq, None)
        if saved is None:
            self.blamed = frozenset((self.spill_owner.get(seq, 0),))
            raise DeviceError(f"spill file for sequence {seq} is missing")
        self.blamed = frozenset((saved["tokens"][0] if saved["tokens"] else 0,))
        if saved["corrupt"]:
            raise DeviceError(f"spill file for sequence {seq} is corrupted (checksum mismatch)")
        if blocks > self.free_count():
            raise DeviceError("out of KV blocks")
        if blocks != saved["blocks"]:
            raise self._bad("restore_sequence_state", f"blocks={blocks}, the sequence held {saved['blocks']}")
        self.blamed = None
        s.tokens = saved["tokens"]
        s.seq_len = saved["seq_len"]
        s.blocks = blocks
        self.used_blocks += blocks
