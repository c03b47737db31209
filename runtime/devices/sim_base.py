"""The simulated device's bookkeeping: the base of ``SimDevice`` (runtime/devices/simulated.py), which adds
the verifies, proposals, the SSM snapshot ring, slots and spill files to what is here: the strict block
pool, the prompt writes, plain decodes and decodes answered ahead, the EP words, sampled rows.

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
- a serial verify of fixed width gets exactly that many tokens (K = 2 / 3 / 4, the fused K = 4),
  a DFlash block verify five or more; a speculative verify (serial or batched) feeds the anchor
  then a prefix of the drafts the device itself last proposed for the sequence, and in a proposer
  mode (``strict_drafts``) none comes without a proposal since the sequence's allocation or last
  verify, none verifies a sequence twice in a tick, and (MTP) none takes a proposal of its own
  tick; ``commit_accepted_prefix`` commits exactly the drafts that verify accepted + 1, counted
  from its own inputs and rows; ``rollback_ssm_states`` rolls back exactly the rows the KV kept
  past the verify's base; a catch-up's position is ``seq_len − len(tokens)`` of the batch's
  sequence its stash slot names;
- an MTP proposal follows a hidden-row save since the last forward, from the stash entry of its
  own sequence when it came from the stash; the checkpoint after a proposal is the async one after
  a bootstrap decode and the Marconi one after a K = 2 verify, never the async one otherwise;
- ``save_sequence_state`` saves a sequence not saved already; ``restore_sequence_state`` needs a
  saved, sound file (``spill_corrupt_for`` damages one, ``spill_missing_for`` loses it) into a
  fresh sequence;
- the ledgers (``ledger``, specs/checker.md §11.8): slots, adapter slots and spill files are
  acquired and released once each; ``acquire_adapter_slot`` takes the adapter slot of the sequence
  allocated last (its request's, ``adapter_of``) and no forward runs a sequence before it; the EP
  release word names a slot a release freed, a verify's accept word the drafts it accepted; with
  ``wave_budget`` (prefill_new_together) a batched forward of two or more prompts fits
  ``max_batch_tokens``; under the mixed-prefill bound (``mixed_bound``) the chunks of a forward
  beside d decode rows (and a chunk while d prompted sequences are on the device) take at most
  max(floor, per_decode * d) rows.

Prefix cache (``prefix_cache``): ``cache_sequence`` remembers the body of the sequence's prompt
(every token after the first, which is the request id); a later first prefill whose body shares
whole blocks with a remembered one reports those tokens as cached (``cached[request id]``): a
prefill or prefill chunk of one sequence in its answer's one count, a batched or mixed forward as
(sequence id, tokens) of each first chunk that found any (specs/scheduler.md §5.10), as the torch
device does. The
``reclaimable`` blocks are part of ``held_blocks``: a reclaim moves them to the free pool.
Adapters: ``adapters`` maps an adapter slot to its id (slot -1, the base model, is id 0).


``epoch`` counts the changes to the block pool and the slots: every call that changes the used or
held blocks, a sequence's blocks or slot, or which sequences are live adds one (growing a sequence
within its blocks does not). The checker skips its pool and slot checks while it is unchanged
(runtime/check/invariants.py, ``Monitor.on_state``), so a new call that changes any of these must
count too.
"""

from __future__ import annotations

import random
from typing import NamedTuple, Optional

from fxsched.core.events import LATE_TOKEN
from fxsched.effects.ep_words import RELEASE_CMD
from fxsched.runtime.devices.device import DeviceError
from fxsched.runtime.devices.sampling import draw, pick_weights
from fxsched.runtime.devices.ep_check import EpWordCheck
from fxsched.runtime.devices.ledger import ADAPTER, SLOT, Ledger
from fxsched.runtime.devices.scripted import Script, ScriptedDevice, ScriptedSequence
from fxsched.runtime.ep.protocol import Decode as EpDecode
from fxsched.runtime.ep.protocol import Kind
from fxsched.runtime.ep.protocol import Prefill as EpPrefill
from fxsched.runtime.ep.protocol import Verify as EpVerify

AHEAD_FAILURE = "the decode answered ahead"  # how the fault of a read of its lost tokens begins its reason
AHEAD_FAILURE_CHANCE = 0.02  # of the decodes answered ahead


class ArgumentError(DeviceError):
    """A call whose arguments do not match the device's state: a scheduler bug, never a fault."""


class Picked(NamedTuple):
    """What ``SimDevice.sample_rows`` answers: one token per row."""

    tokens: list[int]


_PICKED: dict[tuple, int] = {}
"""(scripted answer, vocabulary size, HostPick, EOS ids) -> the token ``host_pick`` picks from that row."""
_WEIGHED: dict[tuple, int | list[float]] = {}
"""(scripted answer, vocabulary size, the pick's temperature, filters and EOS mask, EOS ids) -> what
``sampling.pick_weights`` makes of that row: picks that differ in their seed alone share it."""


def _agreed(inputs, rows) -> int:
    """The drafts of a verify's ``inputs`` (after the anchor) that its ``rows`` agree with, in a row."""
    a = 0
    while a + 1 < len(inputs) and inputs[a + 1] == rows[a]:
        a += 1
    return a


class _Slice(NamedTuple):
    """A prefill's rows in the shape of a batched call's slice (for the EP word check)."""

    seq: int
    prompt: tuple[int, ...]
    start: int
    length: int

class SimBase(ScriptedDevice):
    """The simulated device's state and the calls every mode makes (``SimDevice`` is the whole device)."""


    def __init__(self, scripts: dict[int, Script], *, vocab: int = 64, block_size: int = 16,
                 total_blocks: int = 1000, held_blocks: int = 0, kv_exhaust_at=(), decode_fault_at=(),
                 verify_fault_at=(), spill_corrupt_for=(), spill_missing_for=(), cancel_flags=(),
                 can_batch_verify: bool = True, slot_draft_capacity: int = 8, count_accepted: bool = True,
                 reclaimable: int = 0, prefix_cache: bool = False, adapters: Optional[dict[int, int]] = None,
                 max_prefill_tokens: int = 0, max_batch_tokens: int = 8192, short_proposals: Optional[int] = None,
                 capacities: tuple[int, ...] = (), late_drafts: Optional[int] = None,
                 keep_decodes: Optional[int] = None, adapter_of: Optional[dict[int, int]] = None,
                 wave_budget: bool = False, idle_fills: bool = False, mixed_bound: tuple[int, int] = (0, 0)):
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
        self.wave_budget = wave_budget  # prefill_new_together: a batched wave fits max_batch_tokens
        # idle_prefill_fills_budget: while no sequence decodes, a chunk may take max_batch_tokens
        self.idle_fills = idle_fills
        # the mixed-prefill bound (floor, rows per decoding sequence; (0, 0): off)
        self.mixed_floor, self.mixed_per_decode = mixed_bound
        self.bounded_steps = 0  # mixed forwards whose prompt rows the bound held under max_prefill_tokens
        self.prompted: set[int] = set()  # live sequences whose whole prompt is in the KV (decoding)
        self.verified: dict[int, tuple[int, int]] = {}  # seq -> (rows, KV length before) of its last verify
        self.stash = 0  # entries of the last hidden-row stash
        self.blamed: Optional[frozenset[int]] = None  # request ids the last failed call worked on
        self.refused: Optional[str] = None  # the first call refused for its arguments
        self.reach: dict[int, int] = {}  # request id -> the longest KV a decode or verify wrote for it
        # short proposals: a seeded draw cuts a proposal's drafts (to none, sometimes)
        self.short_rng = random.Random(short_proposals) if short_proposals is not None else None
        self.capacities = tuple(capacities)  # answers of mtp_slot_draft_capacity, in turn (empty: the fixed one)
        # late drafts: a seeded draw answers a proposal with LATE_DRAFT placeholders (specs/async.md §16.3)
        self.late_rng = random.Random(late_drafts) if late_drafts is not None else None
        # decodes answered ahead (specs/async.md §16.6): their tokens stay here until read_ahead
        self.ahead_rng = random.Random(keep_decodes) if keep_decodes is not None else None
        self.kept: dict[int, int] = {}  # seq -> the token its last decode kept
        self.kept_failed: dict[int, str] = {}  # seq -> why the decode that kept its token failed
        # seq -> the kept token (or failure) a decode has fed and its answer is still to bring back:
        # that decode keeps a new token for the sequence, and the read must give the one it fed
        self.fed_kept: dict[int, int | str] = {}
        self.last_decode: tuple[int, ...] = ()  # the sequences of the last plain decode, in row order
        self.decodes_kept = 0  # decodes answered ahead
        self.late: set[int] = set()  # sequences whose pending proposal was answered late
        self.late_failed: dict[int, str] = {}  # seq -> the failure of its late proposal, for its verify
        self.drawn_short: dict[int, int] = {}  # seq -> drafts its next proposal keeps, drawn ahead (a lane)
        self.drawn_late: dict[int, tuple[bool, bool]] = {}  # seq -> (late, fails) of its next proposal, drawn ahead
        self.capacity_calls = 0
        self.proposed: dict[int, list[int]] = {}  # seq -> the drafts of its last proposal, until a verify
        self.verify_io: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}  # seq -> (inputs, rows)
        self.batch_seqs: tuple[int, ...] = ()  # the sequences of the last batched verify, in order
        self.proposed_at: dict[int, int] = {}  # seq -> the tick of its pending proposal
        self.verify_tick = -1  # the tick of the last speculative verify
        self.strict_drafts = False  # proposer modes: the draft, hidden-state and checkpoint rules hold
        self.dflash = False  # DFlash: a bootstrap's proposal is verified in its own step
        self.last_forward: dict[int, str] = {}  # seq -> the call of its last forward
        self.checkpoint_due: dict[int, str] = {}  # seq -> the checkpoint call its last proposal needs
        self.verified_tick: dict[int, int] = {}  # seq -> the tick of its last speculative verify
        self.hidden_saved = False  # a hidden row was saved for the proposer since the last forward
        self.stash_index: Optional[int] = None  # the stash entry of that save, when it came from the stash
        self.capacity_log: list[int] = []  # every draft capacity answered, in order
        self.ring_slots = 0  # the SSM snapshot ring's slots (0: no ring)
        self.rings: dict[int, tuple[dict[int, int], int]] = {}  # request id -> (ring slot -> position, cursor)
        self.epoch = 0  # changes to the pool and the slots so far (see the module docstring)
        self.verify_order: tuple[tuple[int, bool], ...] = ()  # the last verify's sequences (counted?) in row order
        self.ep_words = EpWordCheck()  # the EP words as a worker reads them, against the forwards that run
        self.ledger = Ledger()  # slots, adapter slots and spill files, acquired and released (ledger.py)
        self.adapter_of = dict(adapter_of or {})  # request id -> the adapter slot it asked for (when known)
        self.awaiting_adapter: Optional[int] = None  # the sequence allocated last, until it acquires its adapter
        self.freed_slots: set[int] = set()  # slots freed since, not allocated again nor announced released

    # --- strict bookkeeping ---------------------------------------------------------------------------

    def _seq(self, seq_id: int) -> ScriptedSequence:
        try:
            return self.live[seq_id]
        except KeyError:
            raise self._bad("device", f"sequence {seq_id} is not allocated") from None

    def _bad(self, call: str, message: str) -> ArgumentError:
        """The refusal of a call; kept in ``refused`` too, since the interpreter turns an error in a
        query into a ``DeviceFault`` answer the scheduler would take."""
        error = ArgumentError(f"{call}: {message}")
        if self.refused is None:
            self.refused = error.message
        return error

    # --- EP words: each announced forward is the one that runs next ------------------------------------

    def _refuse(self, call: str, error: Optional[str]) -> None:
        if error is not None:
            raise self._bad(call, error)

    def ep_broadcast_cmd_for_seq(self, seq_slot: int, cmd: int) -> None:
        super().ep_broadcast_cmd_for_seq(seq_slot, cmd)
        if cmd == RELEASE_CMD:  # names the slot a release just freed (specs/scheduler.md §5.20)
            if seq_slot not in self.freed_slots:
                held = self.ledger.holder(SLOT, seq_slot)
                raise self._bad("ep_broadcast_cmd_for_seq", f"the EP release word names slot {seq_slot}, which no "
                                                            f"release freed (held by sequence {held})")
            self.freed_slots.discard(seq_slot)
        self._refuse("ep_broadcast_cmd_for_seq", self.ep_words.feed(Kind.CMD_FOR_SEQ, seq_slot, cmd))

    def ep_broadcast_cmd(self, cmd: int) -> None:
        super().ep_broadcast_cmd(cmd)
        self._refuse("ep_broadcast_cmd", self.ep_words.feed(Kind.CMD, 0, cmd))
        accept = self.ep_words.accepted
        if accept is not None:  # a verify's result word: the drafts that verify accepted
            self.ep_words.accepted = None
            seq = self.ledger.holder(SLOT, accept.slot)
            io = self.verify_io.get(seq) if isinstance(seq, int) else None
            if io is not None and accept.accepted != _agreed(*io):
                raise self._bad("ep_broadcast_cmd", f"the EP accept word says {accept.accepted} for slot "
                                                    f"{accept.slot}, whose verify accepted {_agreed(*io)} drafts")

    def ep_broadcast_tokens(self, tokens) -> None:
        super().ep_broadcast_tokens(tokens)
        self._refuse("ep_broadcast_tokens", self.ep_words.feed(Kind.TOKENS, 0, 0, tokens))

    def ep_sync_vision_embeds(self, n: int) -> None:
        super().ep_sync_vision_embeds(n)
        self._refuse("ep_sync_vision_embeds", self.ep_words.feed(Kind.VISION, n))

    def _runs(self, call: str, decodes=(), prefills=(), verifies=()) -> None:
        """The forward ``call`` feeds ``decodes`` ((token, seq) pairs), prefill slices and
        ``verifies`` ((seq, tokens) pairs): what the EP words announced must be one of them."""
        if not self.ep_words.announced:
            return
        live = self.live
        runs = tuple([EpDecode(live[q].slot, t) for t, q in decodes if q in live]
                     + [EpPrefill(live[sl.seq].slot, sl.start, sl.length, tuple(sl.prompt))
                        for sl in prefills if sl.seq in live]
                     + [EpVerify(live[q].slot, tuple(tokens)) for q, tokens in verifies if q in live])
        self._refuse(call, self.ep_words.take(call, runs))

    def _adapted(self, call: str, seqs) -> None:
        """Every sequence a forward runs has acquired its adapter slot since its allocation."""
        held = self.ledger.accounts[ADAPTER]
        for seq in seqs:
            if seq not in held and seq in self.live:
                raise self._bad(call, f"sequence {seq} runs before it acquired its adapter slot")

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
            self.epoch += 1

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
        self.epoch += 1
        slot = super()._alloc(seq, session)
        self._refuse("alloc_sequence", self.ledger.acquire(SLOT, slot, seq))
        self.freed_slots.discard(slot)
        self.awaiting_adapter = seq
        return slot

    def acquire_adapter_slot(self, slot: int) -> int:
        """The adapter slot of the sequence allocated last (specs/scheduler.md §5.10 step 2), once."""
        seq = self.awaiting_adapter
        if seq is None:
            raise self._bad("acquire_adapter_slot", f"adapter slot {slot}, but no sequence was allocated since the "
                                                    f"last acquire")
        self.awaiting_adapter = None
        want = self.adapter_of.get(self._rid(self.live[seq]))
        if want is not None and want != slot:
            raise self._bad("acquire_adapter_slot", f"adapter slot {slot} for sequence {seq}, whose request asked "
                                                    f"for {want}")
        self._refuse("acquire_adapter_slot", self.ledger.acquire(ADAPTER, seq, slot))
        return super().acquire_adapter_slot(slot)

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

    def decode_batch(self, tokens, seqs, stream: int) -> None:
        if len(set(seqs)) != len(seqs):
            raise self._bad("decode_batch", f"a sequence appears twice in {list(seqs)}")
        self._adapted("decode_batch", seqs)
        tokens = self._fed(tuple(tokens), tuple(seqs))
        self._runs("decode_batch", decodes=tuple(zip(tokens, seqs, strict=False)))
        self._blame(seqs)
        self.last_decode = ()
        before = [(i, self._seq(i).seq_len) for i in seqs]
        super().decode_batch(tokens, seqs, stream)
        for i, seq_len in before:  # a plain decode commits one row per sequence (commit_ctx n=1)
            self.verified[i] = (1, seq_len)
            self.verify_io.pop(i, None)
        self.blamed = None
        self.last_decode = tuple(seqs)

    # --- decodes answered ahead (specs/async.md §16.6) -----------------------------------------------

    def _fed(self, tokens: tuple[int, ...], seqs: tuple[int, ...]) -> tuple[int, ...]:
        """A decode's inputs with each ``LATE_TOKEN`` replaced by the token its sequence's last
        decode kept. A sequence that holds a kept token is fed nothing else (its last token is on
        the device), and a ``LATE_TOKEN`` needs a kept token."""
        if not self.kept and LATE_TOKEN not in tokens:
            return tokens
        fed = []
        for token, seq in zip(tokens, seqs, strict=True):
            held = seq in self.kept or seq in self.kept_failed
            if token == LATE_TOKEN:
                if not held or seq in self.fed_kept:
                    raise self._bad("decode_batch", f"sequence {seq} is fed its kept token, but it holds none "
                                                    f"that was not fed already")
                if seq in self.kept:
                    value = self.kept.pop(seq)
                    self.fed_kept[seq] = value
                    fed.append(value)
                else:  # a failed decode's token: the read reports the failure
                    self.fed_kept[seq] = self.kept_failed.pop(seq)
                    fed.append(0)
            elif held or seq in self.fed_kept:
                raise self._bad("decode_batch", f"sequence {seq} holds a kept token but is fed {token}")
            else:
                fed.append(token)
        return tuple(fed)

    def keep_ahead(self, row: int, n: int, picks, eos_ids) -> bool:
        """Keep the tokens of the last decode's rows ``row``.. on the device, picked as the
        interpreter would pick them, and answer it ahead (None for a device without the seed)."""
        rng = self.ahead_rng
        seqs = self.last_decode[row:row + n]
        if any(p.top_logprobs > 0 for p in picks):  # the plan may say ahead only without logprob records
            raise self._bad("keep_ahead", "a decode answered ahead has rows asking for logprob records")
        if rng is None or len(seqs) != n or rng.random() < 0.25:  # now and then answered with the tokens
            return False
        for r, seq in enumerate(seqs):
            answer = self._row(row + r)
            token = self._pick(answer, picks[r], eos_ids) if picks else answer
            if rng.random() < AHEAD_FAILURE_CHANCE:
                self.kept_failed[seq] = f"{AHEAD_FAILURE} of sequence {seq} failed: device error (simulated)"
            else:
                self.kept[seq] = token
        self.decodes_kept += 1
        return True

    def read_ahead(self, seqs, fed=()) -> list[int]:
        """The kept tokens of ``seqs``, forgotten once read; a decode that kept one and then failed
        answers its failure (its tokens are lost, and so is the decode ``fed`` this read answers
        with: the scheduler fails the sequences of both, specs/async.md §16.6)."""
        if len(set(seqs)) != len(seqs):
            raise self._bad("read_ahead", f"a sequence appears twice in {list(seqs)}")
        got: list[int | str] = []
        for s in seqs:  # the token a decode fed is the one to give back, else the one still kept
            if s in self.fed_kept:
                got.append(self.fed_kept.pop(s))
            elif s in self.kept:
                got.append(self.kept.pop(s))
            elif s in self.kept_failed:
                got.append(self.kept_failed.pop(s))
            else:
                raise self._bad("read_ahead", f"sequence {s} holds no kept token (of {list(seqs)})")
        failed = [g for g in got if isinstance(g, str)]
        if failed:  # the decode that kept them failed after its answer: every token read is lost
            self.blamed = frozenset(self._rid(self.live[s]) for s in (*seqs, *fed) if s in self.live)
            raise DeviceError(failed[0])
        return [int(g) for g in got]

    def _single_decode(self, name: str, token: int, seq: int, stream: int, cancel: bool) -> None:
        self._adapted(name, (seq,))
        self._runs(name, decodes=((token, seq),))
        super()._single_decode(name, token, seq, stream, cancel)
        self.last_forward[seq] = name
        self.hidden_saved = False

    def decode_draft(self, token: int, seq: int, stream: int) -> None:
        """A self-speculative draft decode: the script's answer, but wrong (``+ 1 mod (vocab - 1)``)
        at every ``draft_wrong_every``-th generated index, like the proposers' drafts, so the
        verify that follows sometimes rejects and the SSM state is rolled back."""
        super().decode_draft(token, seq, stream)
        s = self._seq(seq)
        script = self._script(s)
        m = script.draft_wrong_every
        if m > 0 and (s.seq_len - script.prompt_len) % m == 0:
            self.rows = [(self.rows[0] + 1) % (self.vocab - 1)]

    def truncate_sequence(self, seq: int, seq_len: int) -> None:
        s = self._seq(seq)
        if not 0 <= seq_len <= s.seq_len:
            raise self._bad("truncate_sequence", f"to {seq_len} tokens, sequence {seq} holds {s.seq_len}")
        super().truncate_sequence(seq, seq_len)

    def _ring_reset(self, s: ScriptedSequence) -> None:
        """A prompt written from its start (a first prefill or a requeue resume): an empty ring."""
        self.rings[self._rid(s)] = ({}, 0)

    def sample_rows(self, row: int, n: int, picks, eos_ids) -> Picked:
        """Rows ``row`` .. ``row + n - 1`` picked by their ``HostPick``s exactly as the interpreter
        picks a host copy of them (``sampling.host_pick`` over the floats of the BF16 rows
        ``copy_logits_to_host`` gives: 30.0 at the scripted answer, 0.0 elsewhere), without the
        copy. A pick is a function of the answer, the pick and the EOS ids alone, so each one is
        worked out once (``_PICKED``: the walk's seeds and answers repeat across episodes), and
        the row's weights once for all the seeds (``_WEIGHED``): only the draw is the seed's."""
        return Picked([self._pick(self._row(r), pick, eos_ids) for r, pick in zip(range(row, row + n), picks,
                                                                                   strict=True)])

    def _pick(self, answer: int, pick, eos_ids) -> int:
        """The token ``pick`` draws from a row whose scripted answer is ``answer``."""
        vocab = self.vocab
        key = (answer, vocab, pick, eos_ids)
        token = _PICKED.get(key)
        if token is None:
            shape = (answer, vocab, pick.temperature, pick.top_p, pick.top_k, pick.min_p, pick.mask_eos, eos_ids)
            weights = _WEIGHED.get(shape)
            if weights is None:
                logits = [0.0] * vocab
                if 0 <= answer < vocab:
                    logits[answer] = 30.0
                if len(_WEIGHED) >= 4096:
                    _WEIGHED.clear()
                weights = _WEIGHED[shape] = pick_weights(logits, pick, eos_ids)
            if len(_PICKED) >= 65536:
                _PICKED.clear()
            token = _PICKED[key] = weights if isinstance(weights, int) else draw(weights, pick.seed)
        return token
