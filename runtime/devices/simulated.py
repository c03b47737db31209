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
  ``max_batch_tokens``.

Prefix cache (``prefix_cache``): ``cache_sequence`` remembers the body of the sequence's prompt
(every token after the first, which is the request id); a later first prefill whose body shares
whole blocks with a remembered one reports those tokens as cached (``cached[request id]``). Only a
prefill or prefill chunk of one sequence looks the cache up, as on the torch device: a batched or
mixed forward's first chunk computes every row (its answer, ``ForwardDone``, has one count, not one
per sequence), so it finds nothing cached. The
``reclaimable`` blocks are part of ``held_blocks``: a reclaim moves them to the free pool.
Adapters: ``adapters`` maps an adapter slot to its id (slot -1, the base model, is id 0).

Sampled rows: the device offers ``sample_rows``, so the interpreter asks it for a sampled row's
token instead of copying the row to the host; it answers what the host copy would give, by the same
``sampling.host_pick`` over the same row (30.0 at the scripted answer, 0.0 elsewhere), memoised per
(answer, pick), with the row's weights memoised apart from the seed: the walk's seeds and answers
repeat, and a pick is its costliest call. (The
recording device keeps the host copy: its reference traces list ``copy_logits_to_host``.)

What a real device varies (the recording device never does, so the goldens stay as they are):
``short_proposals`` (a seed) cuts now and then a proposal's drafts short, to none sometimes;
``late_drafts`` (a seed) answers now and then a proposal with ``LATE_DRAFT`` placeholders, as the
torch device does (specs/async.md §16.3), and fills them in at the verify that consumes them; now
and then (``LATE_FAILURE_CHANCE`` of the late ones) such a proposal fails after its answer went
out, and the verify that consumes its drafts answers that failure;
``keep_decodes`` (a seed) keeps a plain decode's tokens on the device when its plan allows it
(``keep_ahead``: the decode is answered ahead, specs/async.md §16.6), feeds them to the next decode
(``LATE_TOKEN`` inputs) and gives them back at ``read_ahead``; now and then
(``AHEAD_FAILURE_CHANCE`` of the decodes kept) such a decode fails after its answer went out, and
the read of its tokens answers that failure;
``capacities`` are the answers of ``mtp_slot_draft_capacity`` in turn (0 included); a
self-speculative draft decode is wrong at the script's ``draft_wrong_every`` positions. The device
keeps for the invariants the drafts it proposed (``proposed``, ``proposed_at``), the capacities it
answered (``capacity_log``) and the last batched verify's sequences (``batch_seqs``).

``epoch`` counts the changes to the block pool and the slots: every call that changes the used or
held blocks, a sequence's blocks or slot, or which sequences are live adds one (growing a sequence
within its blocks does not). The checker skips its pool and slot checks while it is unchanged
(runtime/check/invariants.py, ``Monitor.on_state``), so a new call that changes any of these must
count too.
"""

from __future__ import annotations

import random
from typing import NamedTuple, Optional

from fxsched.core.events import LATE_DRAFT, LATE_TOKEN
from fxsched.effects.ep_words import RELEASE_CMD
from fxsched.runtime.devices.device import DeviceError
from fxsched.runtime.devices.sampling import draw, pick_weights
from fxsched.runtime.devices.ep_check import EpWordCheck
from fxsched.runtime.devices.ledger import ADAPTER, SLOT, SPILL, Ledger
from fxsched.runtime.devices.scripted import Script, ScriptedDevice, ScriptedSequence, script_verify
from fxsched.runtime.ep.protocol import Decode as EpDecode
from fxsched.runtime.ep.protocol import Kind
from fxsched.runtime.ep.protocol import Prefill as EpPrefill
from fxsched.runtime.ep.protocol import Verify as EpVerify

LATE_FAILURE = "the late proposal"  # how the fault of a verify whose late proposal failed begins its reason
LATE_FAILURE_CHANCE = 0.05  # of the proposals answered late
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


class SimDevice(ScriptedDevice):
    """Implements the Device protocol for the random walk and the hypothesis machine."""

    def __init__(self, scripts: dict[int, Script], *, vocab: int = 64, block_size: int = 16,
                 total_blocks: int = 1000, held_blocks: int = 0, kv_exhaust_at=(), decode_fault_at=(),
                 verify_fault_at=(), spill_corrupt_for=(), spill_missing_for=(), cancel_flags=(),
                 can_batch_verify: bool = True, slot_draft_capacity: int = 8, count_accepted: bool = True,
                 reclaimable: int = 0, prefix_cache: bool = False, adapters: Optional[dict[int, int]] = None,
                 max_prefill_tokens: int = 0, max_batch_tokens: int = 8192, short_proposals: Optional[int] = None,
                 capacities: tuple[int, ...] = (), late_drafts: Optional[int] = None,
                 keep_decodes: Optional[int] = None, adapter_of: Optional[dict[int, int]] = None,
                 wave_budget: bool = False):
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
            if start > 0 or any(o is not s for o in self.live.values()):
                budget = limit  # a later chunk, or chunk 0 while something else is in flight
            else:
                budget = self.max_batch_tokens
            if length > budget:
                raise self._bad(call, f"a chunk of {length} tokens at offset {start}, budget {budget}")
            if start > 0 and not last and length >= 4 and length % 4:
                raise self._bad(call, f"a non-last chunk of {length} tokens is no multiple of 4")

    def _first_prefill(self, s: ScriptedSequence, prompt, looks_up: bool = True) -> int:
        """The prefix-cache hit a first prefill reports (0 when the cache is off or misses, or the
        forward does not look the cache up: ``looks_up`` false, a batched or mixed forward)."""
        rid = self._rid(s)
        if rid in self.prefilled:
            return 0
        self.prefilled.add(rid)
        if not self.prefix_cache or not looks_up:
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
        super().prefill(seq, tokens, stream)
        self._ring_reset(s)
        return self._first_prefill(s, tokens)

    def prefill_chunk(self, seq: int, prompt, start: int, length: int, last: bool, stream: int):
        s = self._seq(seq)
        self._check_slice("prefill_chunk", s, prompt, start, length, last)
        self._adapted("prefill_chunk", (seq,))
        self._runs("prefill_chunk", prefills=(_Slice(seq, tuple(prompt), start, length),))
        if start == 0:
            self._ring_reset(s)
        super().prefill_chunk(seq, prompt, start, length, last, stream)
        return self._first_prefill(s, prompt) if start == 0 else 0

    def _check_slices(self, call: str, decode_seqs, prefills, decode_tokens=()) -> None:
        names = list(decode_seqs) + [sl.seq for sl in prefills]
        if len(names) != len(set(names)):
            raise self._bad(call, f"a sequence appears twice in {names}")
        self._adapted(call, names)
        if self.wave_budget and len(prefills) > 1:  # specs/scheduler.md §5.13 A: the first entry always rides
            rows = len(decode_seqs) + sum(sl.length for sl in prefills)
            if rows > self.max_batch_tokens:
                raise self._bad(call, f"{len(decode_seqs)} decode rows and chunks {[sl.length for sl in prefills]} "
                                      f"in one forward, over max_batch_tokens {self.max_batch_tokens}")
        self._runs(call, decodes=tuple(zip(decode_tokens, decode_seqs, strict=False)), prefills=prefills)
        for sl in prefills:
            self._check_slice(call, self._seq(sl.seq), sl.prompt, sl.start, sl.length, sl.last)
            if sl.start == 0:
                self._ring_reset(self._seq(sl.seq))
                self._first_prefill(self._seq(sl.seq), sl.prompt, looks_up=False)

    def mixed_forward(self, decode_tokens, decode_seqs, prefill, stream: int) -> None:
        self._blame(list(decode_seqs) + [prefill.seq])
        self._check_slices("mixed_forward", decode_seqs, (prefill,), decode_tokens)
        super().mixed_forward(decode_tokens, decode_seqs, prefill, stream)
        self.blamed = None

    def mixed_forward_batch(self, decode_tokens, decode_seqs, prefills, stream: int) -> None:
        self._blame(list(decode_seqs) + [sl.seq for sl in prefills])
        self._check_slices("mixed_forward_batch", decode_seqs, prefills, decode_tokens)
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

    # --- verifies and what they leave to commit -------------------------------------------------------

    WIDTHS = {"decode_verify_graphed": 2, "decode_verify_graphed_k3": 3, "decode_verify_graphed_k4": 4,
              "decode_and_verify_fused": 4}
    """The verifies of a fixed width (anchor + drafts)."""

    def _check_drafts(self, call: str, seq: int, tokens) -> None:
        """A verify after a proposal feeds the anchor then a prefix of the drafts that proposal
        returned (specs/speculation.md §6.5: keep ≤ the drafts held; the surplus is dropped)."""
        drafts = self.proposed.pop(seq, None)
        at = self.proposed_at.pop(seq, None)
        self.verify_tick = self.tick
        if self.strict_drafts:
            if self.verified_tick.get(seq) == self.tick:
                raise self._bad(call, f"sequence {seq} verified twice in tick {self.tick}")
            if at == self.tick and not self.dflash:  # an MTP bootstrap is verified from the next step on
                raise self._bad(call, f"sequence {seq} verifies the drafts proposed in this step (tick {self.tick})")
        self.verified_tick[seq] = self.tick
        self.last_forward[seq] = call
        self.hidden_saved = False
        if drafts is None:
            if self.strict_drafts and len(tokens) > 1:
                raise self._bad(call, f"inputs {list(tokens)} for sequence {seq}, which has no proposal since its "
                                      f"allocation or last verify")
        elif list(tokens[1:]) != drafts[:len(tokens) - 1]:
            raise self._bad(call, f"inputs {list(tokens)} for sequence {seq}, whose proposal was {drafts}")

    def serial_verify(self, name: str, seq: int, tokens) -> list[int]:
        s = self._seq(seq)
        width = self.WIDTHS.get(name)
        if width is not None and len(tokens) != width:
            raise self._bad(name, f"{len(tokens)} tokens for a width-{width} verify")
        if name == "decode_verify_dflash" and len(tokens) < 5:  # keep >= 4 (specs/speculation.md §6.5)
            raise self._bad(name, f"a block verify of {len(tokens) - 1} drafts (four or more take it)")
        self._adapted(name, (seq,))
        self._runs(name, verifies=((seq, tokens),))  # the EP words announced the inputs as the query holds them
        tokens = self._resolve(name, seq, tokens)
        if name != "decode_verify":
            self._check_drafts(name, seq, tokens)
        self.blamed = frozenset((self._rid(s),))
        self.verified[seq] = (len(tokens), s.seq_len)
        rows = super().serial_verify(name, seq, tokens)
        self.verify_io[seq] = (tuple(tokens), tuple(rows))
        self.verify_order = ((seq, name != "decode_verify"),)
        self.blamed = None
        return rows

    def _accepted(self, seq: int) -> Optional[int]:
        """The drafts the last verify of ``seq`` accepted, from its own inputs and rows (None: no
        verify since the last plain decode)."""
        io = self.verify_io.get(seq)
        return None if io is None else _agreed(*io)

    def decode_verify_batched(self, tokens, ks, seqs, stream: int, woa: bool) -> list[int]:
        if len(set(seqs)) != len(seqs) or len(ks) != len(seqs) or sum(ks) != len(tokens):
            raise self._bad("decode_verify_batched", f"ks={list(ks)} seqs={list(seqs)} for {len(tokens)} tokens")
        self._adapted("decode_verify_batched", seqs)
        self._blame(seqs)
        verifies, offset = [], 0
        for k, seq_id in zip(ks, seqs, strict=True):
            verifies.append((seq_id, tokens[offset:offset + k]))
            offset += k
        self._runs("decode_verify_batched", verifies=tuple(verifies))
        tokens = tuple(t for seq_id, run in verifies for t in self._resolve("decode_verify_batched", seq_id, run))
        offset = 0
        for k, seq_id in zip(ks, seqs, strict=True):
            self.verified[seq_id] = (k, self._seq(seq_id).seq_len)
            self._check_drafts("decode_verify_batched", seq_id, tokens[offset:offset + k])
            offset += k
        rows = super().decode_verify_batched(tokens, ks, seqs, stream, woa)
        offset = 0
        for k, seq_id in zip(ks, seqs, strict=True):
            self.verify_io[seq_id] = (tuple(tokens[offset:offset + k]), tuple(rows[offset:offset + k]))
            offset += k
        self.batch_seqs = tuple(seqs)
        self.verify_order = tuple((seq_id, True) for seq_id in seqs)
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
        accepted = self._accepted(seq)
        if accepted is not None and na != accepted + 1:
            raise self._bad("commit_accepted_prefix", f"na={na} for sequence {seq}, whose verify accepted {accepted} "
                                                      f"drafts (commit accepted + 1)")
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
        self.hidden_saved = True
        self.stash_index = None
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
        self.hidden_saved = True
        self.stash_index = index
        super().save_hidden_for_mtp_from_stash(index, stream)

    def run_mtp_propose_multi(self, token: int, pos: int, n: int, seq: int, stream: int, mask: bool) -> list[int]:
        s = self._seq(seq)
        if pos != s.seq_len or n < 1:
            raise self._bad("run_mtp_propose_multi", f"pos={pos}, n={n} for sequence {seq}, which holds {s.seq_len}")
        if self.strict_drafts and not self.dflash and not self.hidden_saved:
            # (a DFlash bootstrap proposes straight from the last token: specs/speculation.md §6.4)
            raise self._bad("run_mtp_propose_multi", f"sequence {seq}: no hidden state saved since the last forward")
        index, self.stash_index = self.stash_index, None
        if index is not None and self.hidden_saved and (index >= len(self.batch_seqs) or self.batch_seqs[index] != seq):
            # the stash holds the batched verify's rows in batch order (specs/speculation.md §6.12)
            owner = self.batch_seqs[index] if index < len(self.batch_seqs) else None
            raise self._bad("run_mtp_propose_multi", f"sequence {seq} proposes from stash entry {index}, which is "
                                                     f"sequence {owner}'s")
        self.hidden_saved = False
        after = self.last_forward.get(seq)
        self.checkpoint_due[seq] = {"decode": "start_checkpoint_async",
                                    "decode_verify_graphed": "decode_marconi_checkpoint"}.get(after or "", "")
        drafts = self._short(seq, super().run_mtp_propose_multi(token, pos, n, seq, stream, mask))
        self.proposed[seq] = list(drafts)
        self.proposed_at[seq] = self.tick
        return self._answer(seq, drafts)

    def _answer(self, seq: int, drafts: list[int]) -> list[int]:
        """A proposal's answer: its drafts, or with late drafts on, now and then a LATE_DRAFT for
        each (the values stay here until the verify that consumes them)."""
        self.late_failed.pop(seq, None)
        drawn = self.drawn_late.pop(seq, None)
        late, fails = drawn if drawn is not None else self._draw_late(len(drafts))
        if not late:
            self.late.discard(seq)
            return drafts
        self.late.add(seq)
        if fails:  # its forward fails after the answer went out
            self.late_failed[seq] = f"{LATE_FAILURE} of sequence {seq} failed: out of drafter cache (simulated)"
        return [LATE_DRAFT] * len(drafts)

    def _draw_late(self, n: int) -> tuple[bool, bool]:
        """Whether a proposal of ``n`` drafts is answered late, and whether it then fails."""
        rng = self.late_rng
        if rng is None or not n or rng.random() >= 0.7:
            return False, False
        return True, rng.random() < LATE_FAILURE_CHANCE

    def late_proposal(self, seqs, n: int) -> Optional[int]:
        """With a lane (specs/async.md §16.5): draw now, in the order the proposal itself would,
        how many drafts each sequence keeps and whether it is answered late; the proposal takes
        these draws when it runs. The count when every sequence is late with the same count (the
        interpreter then answers ahead), None otherwise. Script proposals hold ``n`` drafts."""
        if self.late_rng is None:
            return None
        keeps = [self._draw_short(n) for _ in seqs]
        lates = [self._draw_late(k) for k in keeps]
        self.drawn_short.update(zip(seqs, keeps, strict=True))
        self.drawn_late.update(zip(seqs, lates, strict=True))
        if all(late for late, _ in lates) and len(set(keeps)) == 1:
            return keeps[0]
        return None

    def _resolve(self, call: str, seq: int, tokens) -> tuple[int, ...]:
        """A verify's inputs with its late drafts filled in: they must be the drafts right after the
        anchor, of a proposal this device answered late, at most as many as it proposed."""
        tokens = tuple(tokens)
        late = [i for i, t in enumerate(tokens) if t == LATE_DRAFT]
        if not late:
            return tokens
        held = self.proposed.get(seq)
        failure = self.late_failed.pop(seq, None) if seq in self.late else None
        if failure is not None:  # the failure of a late proposal is its verify's (specs/async.md §16.3)
            if self.blamed is None:
                self.blamed = frozenset((self._rid(self._seq(seq)),))
            raise DeviceError(f"{call}: {failure}")
        if seq not in self.late or held is None or late != list(range(1, len(late) + 1)) or len(late) > len(held):
            raise self._bad(call, f"late drafts at {late} of inputs {list(tokens)} for sequence {seq}, whose "
                                  f"proposal was {'late' if seq in self.late else 'answered'} with {held}")
        self.late.discard(seq)
        return tokens[:1] + tuple(held[:len(late)]) + tokens[len(late) + 1:]

    def _short(self, seq: int, drafts: list[int]) -> list[int]:
        """A proposal as the proposer may really return it: with short proposals on, now and then
        fewer drafts than asked, or none."""
        drawn = self.drawn_short.pop(seq, None)
        return drafts[:drawn if drawn is not None else self._draw_short(len(drafts))]

    def _draw_short(self, n: int) -> int:
        """How many of a proposal's ``n`` drafts it keeps."""
        rng = self.short_rng
        if rng is None or not n or rng.random() >= 0.3:
            return n
        return rng.randrange(n)

    def mtp_slot_draft_capacity(self, slot: int) -> int:
        if not self.capacities:
            answer = super().mtp_slot_draft_capacity(slot)
        else:
            answer = self.capacities[self.capacity_calls % len(self.capacities)]
            self.capacity_calls += 1
        self.capacity_log.append(answer)
        return answer

    def _checkpoint(self, call: str, seq: int) -> None:
        """The checkpoint after a proposal (specs/speculation.md §6.3 step 5, §6.6 step 5): the
        async one after a bootstrap decode, the Marconi one after a K = 2 verify, none after a
        K = 3 / 4 verify (a later plain decode makes its own Marconi checkpoint, scheduler.md
        §5.16, so only an async one is wrong there)."""
        self._seq(seq)
        due = self.checkpoint_due.pop(seq, None)
        if self.strict_drafts and due is not None and due != call and (due or call == "start_checkpoint_async"):
            raise self._bad(call, f"sequence {seq}: after its proposal the rule book calls {due or 'no checkpoint'}")

    def start_checkpoint_async(self, seq: int) -> None:
        self._checkpoint("start_checkpoint_async", seq)
        super().start_checkpoint_async(seq)

    def decode_marconi_checkpoint(self, seq: int) -> None:
        self._checkpoint("decode_marconi_checkpoint", seq)
        super().decode_marconi_checkpoint(seq)

    def run_mtp_propose_batched(self, tokens, positions, stash, n: int, seqs, stream: int) -> list[list[int]]:
        if len(set(seqs)) != len(seqs) or not len(tokens) == len(positions) == len(seqs) or n < 1:
            raise self._bad("run_mtp_propose_batched", f"{len(tokens)} tokens, {len(positions)} positions for "
                                                       f"sequences {list(seqs)}")
        for seq_id, pos in zip(seqs, positions, strict=True):
            if pos != self._seq(seq_id).seq_len:
                raise self._bad("run_mtp_propose_batched", f"pos={pos} for sequence {seq_id}, which holds "
                                                           f"{self._seq(seq_id).seq_len}")
        self._blame(seqs)
        drafts = [self._short(seq_id, d) for seq_id, d in
                  zip(seqs, super().run_mtp_propose_batched(tokens, positions, stash, n, seqs, stream), strict=True)]
        for seq_id, mine in zip(seqs, drafts, strict=True):
            self.proposed[seq_id] = list(mine)
            self.proposed_at[seq_id] = self.tick
        self.blamed = None
        return [self._answer(seq_id, mine) for seq_id, mine in zip(seqs, drafts, strict=True)]

    def run_mtp_catchup_batched(self, tokens, slots, pos) -> int:
        """Stash slots ``4·i`` of the batch's pending sequences, at most 4 accepted drafts each
        (specs/speculation.md §6.12 step 9)."""
        if (len(tokens) != len(slots) or len(pos) != len(slots) or len(set(slots)) != len(slots)
                or any(slot % 4 or len(t) > 4 for slot, t in zip(slots, tokens, strict=True))):
            raise self._bad("run_mtp_catchup_batched", f"slots={list(slots)}, {len(tokens)} token lists "
                                                       f"{[len(t) for t in tokens]}, {len(pos)} positions")
        for slot, mine, p in zip(slots, tokens, pos, strict=True):  # slot 4·i: the batch's i-th sequence
            i = slot // 4
            seq_id = self.batch_seqs[i] if i < len(self.batch_seqs) else None
            s = self.live.get(seq_id) if seq_id is not None else None
            if s is None or p != s.seq_len - len(mine):
                held = s.seq_len if s is not None else None
                raise self._bad("run_mtp_catchup_batched", f"pos={p} for stash slot {slot} (sequence {seq_id}, "
                                                           f"holding {held}) with {len(mine)} drafts")
        return super().run_mtp_catchup_batched(tokens, slots, pos)

    def rollback_ssm_states(self, seq: int, n: int) -> None:
        """Roll the SSM state back to ``n`` steps past the last verify's base, which is where the
        KV now ends (the truncate came first)."""
        s = self._seq(seq)
        _, before = self._verified("rollback_ssm_states", seq)
        if n != s.seq_len - before:
            raise self._bad("rollback_ssm_states", f"n={n} for sequence {seq}, which holds {s.seq_len - before} "
                                                   f"tokens past its verify's base {before}")
        super().rollback_ssm_states(seq, n)

    # --- the SSM snapshot ring (specs/watchdog.md §7.4, §7.5) ------------------------------------------

    def _ring_reset(self, s: ScriptedSequence) -> None:
        """A prompt written from its start (a first prefill or a requeue resume): an empty ring."""
        self.rings[self._rid(s)] = ({}, 0)

    def save_decode_ssm_snapshot(self, seq: int, ring: int) -> None:
        """A save goes to the ring's cursor, then the cursor moves on (mod ``ring_slots``); the
        entry's position is the output length, the new token included (the KV holds it but that
        token)."""
        s = self._seq(seq)
        if self.ring_slots:
            entries, cursor = self.rings.get(self._rid(s), ({}, 0))
            if ring != cursor:
                raise self._bad("save_decode_ssm_snapshot", f"ring slot {ring} for sequence {seq}, the cursor is "
                                                            f"at {cursor} of {self.ring_slots}")
            entries = dict(entries)
            entries[ring] = s.seq_len - self._script(s).prompt_len + 1
            self.rings[self._rid(s)] = (entries, (cursor + 1) % self.ring_slots)
        super().save_decode_ssm_snapshot(seq, ring)

    def restore_decode_ssm_snapshot(self, seq: int, ring: int) -> None:
        """A restore names a slot holding an entry; the ring then keeps the entries up to its
        position and the cursor follows the kept entry of the largest position."""
        s = self._seq(seq)
        if self.ring_slots:
            entries, _ = self.rings.get(self._rid(s), ({}, 0))
            if ring not in entries:
                raise self._bad("restore_decode_ssm_snapshot", f"ring slot {ring} of sequence {seq} holds nothing "
                                                               f"(the ring holds {entries})")
            at = entries[ring]
            kept = {slot: pos for slot, pos in entries.items() if pos <= at}
            top = max(kept, key=lambda slot: kept[slot])
            self.rings[self._rid(s)] = (kept, (top + 1) % self.ring_slots)
        super().restore_decode_ssm_snapshot(seq, ring)

    # --- slots, spill, prefix cache, adapters ---------------------------------------------------------

    def compact_sequence(self, seq: int, new_slot: int) -> None:
        s = self._seq(seq)
        if new_slot != s.slot and any(o.slot == new_slot for o in self.live.values() if o is not s):
            raise DeviceError(f"compaction target slot {new_slot} is held by another sequence")
        if new_slot != s.slot:
            self._refuse("compact_sequence", self.ledger.release(SLOT, s.slot))
            self._refuse("compact_sequence", self.ledger.acquire(SLOT, new_slot, seq))
        self.epoch += 1
        super().compact_sequence(seq, new_slot)

    def free_sequence(self, seq: int) -> None:
        slot = self._seq(seq).slot
        self.epoch += 1
        super().free_sequence(seq)
        self._refuse("free_sequence", self.ledger.release(SLOT, slot))
        self.ledger.accounts[ADAPTER].pop(seq, None)  # (none when it failed before its acquire)
        self.freed_slots.add(slot)
        if self.awaiting_adapter == seq:
            self.awaiting_adapter = None
        self.verified.pop(seq, None)
        for held in (self.verify_io, self.proposed, self.proposed_at, self.last_forward, self.checkpoint_due,
                     self.verified_tick):
            held.pop(seq, None)
        self.late.discard(seq)
        for drawn in (self.late_failed, self.drawn_short, self.drawn_late, self.kept, self.kept_failed,
                      self.fed_kept):
            drawn.pop(seq, None)

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
        self.epoch += 1
        return got

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

    def sample_verify(self, picks, eos_ids) -> list[int]:
        """The last verify's rows under their picks (specs/speculation.md §6.16): a row whose pick
        masks EOS (its output position is below ``min_tokens``) and whose scripted answer is EOS
        answers what the pick draws instead, as a plain decode's host pick does; every other row
        keeps its answer (the scripted logits put all the mass on it, so a rejection-sampled
        verify keeps exactly the greedy verify's drafts). The accepted-draft count follows."""
        rows = list(self.rows)
        if len(picks) != len(rows):
            raise self._bad("sample_verify", f"{len(picks)} picks for the {len(rows)} rows of the last verify")
        offset = 0
        for seq_id, counted in self.verify_order:
            inputs, old = self.verify_io[seq_id]
            new = list(old)
            drawn: dict[int, int] = {}
            for i in range(len(new)):
                pick = picks[offset + i]
                if pick.mask_eos and new[i] in eos_ids:
                    drawn[i] = self._pick(new[i], pick, eos_ids)
                    # the rows after a drawn one follow from it: a draft equal to the drawn token
                    # goes on with the script (script_verify's rule), any other is rejected
                    new = script_verify(self._script(self._seq(seq_id)), self.verified[seq_id][1], inputs, drawn)
            if new != list(old):
                if counted and self.count_accepted:
                    rid = self.live[seq_id].request_id
                    self.accepted[rid] = self.accepted.get(rid, 0) - _agreed(inputs, old) + _agreed(inputs, new)
                self.verify_io[seq_id] = (inputs, tuple(new))
                rows[offset:offset + len(new)] = new
            offset += len(new)
        self.rows = rows
        return rows

    def adapter_id_for(self, slot: int) -> int:
        return self.adapters.get(slot, -1)

    def save_sequence_state(self, seq: int) -> None:
        s = self._seq(seq)
        self._script(s)
        self._refuse("save_sequence_state", self.ledger.acquire(SPILL, seq, s.request_id))
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
        self._refuse("restore_sequence_state", self.ledger.release(SPILL, seq))
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
        self.epoch += 1
