"""The simulated device's state and strict bookkeeping: ``SimBase``, the lowest of the layers that
make ``simulated.SimDevice`` (specs/checker.md §11.2). It holds every piece of state the layers
keep, and the checks every call shares: a sequence is looked up among the allocated ones, a call
refused for its arguments raises ``ArgumentError`` (kept in ``refused`` too), the block pool is
strict (growing past it is KV exhaustion on a decode and a fault elsewhere), a failed call says
whom it worked on (``take_blame``), the longest KV written per request is kept (``reach``), a
forward runs only sequences that acquired their adapter slot, and the EP command words announce
each forward that runs next (the ledgers: specs/checker.md §11.8).

``epoch`` counts the changes to the block pool and the slots: every call that changes the used or
held blocks, a sequence's blocks or slot, or which sequences are live adds one (growing a sequence
within its blocks does not). The checker skips its pool and slot checks while it is unchanged
(runtime/check/invariants.py, ``Monitor.on_state``), so a new call that changes any of these must
count too.
"""

from __future__ import annotations

import random
from typing import Optional

from fxsched.core.request import Request
from fxsched.effects.ep_words import RELEASE_CMD
from fxsched.runtime.devices.device import DeviceError
from fxsched.runtime.devices.ep_check import EpWordCheck
from fxsched.runtime.devices.ledger import ADAPTER, SLOT, Ledger
from fxsched.runtime.devices.script_rules import Script
from fxsched.runtime.devices.scripted import ScriptedDevice
from fxsched.runtime.devices.scripted_book import ScriptedSequence
from fxsched.runtime.ep.protocol import Decode as EpDecode
from fxsched.runtime.ep.protocol import Kind
from fxsched.runtime.ep.protocol import Prefill as EpPrefill
from fxsched.runtime.ep.protocol import Verify as EpVerify


class ArgumentError(DeviceError):
    """A call whose arguments do not match the device's state: a scheduler bug, never a fault."""


def _agreed(inputs, rows) -> int:
    """The drafts of a verify's ``inputs`` (after the anchor) that its ``rows`` agree with, in a row."""
    a = 0
    while a + 1 < len(inputs) and inputs[a + 1] == rows[a]:
        a += 1
    return a


class SimBase(ScriptedDevice):
    """The simulated device's state and the checks every call shares (``SimDevice`` is the whole device)."""

    def __init__(self, scripts: dict[int, Script], *, vocab: int = 64, block_size: int = 16,
                 total_blocks: int = 1000, held_blocks: int = 0, kv_exhaust_at=(), decode_fault_at=(),
                 verify_fault_at=(), spill_corrupt_for=(), spill_missing_for=(), cancel_flags=(),
                 can_batch_verify: bool = True, slot_draft_capacity: int = 8, count_accepted: bool = True,
                 reclaimable: int = 0, prefix_cache: bool = False, adapters: Optional[dict[int, int]] = None,
                 max_prefill_tokens: int = 0, max_batch_tokens: int = 8192, short_proposals: Optional[int] = None,
                 capacities: tuple[int, ...] = (), late_drafts: Optional[int] = None,
                 keep_decodes: Optional[int] = None, ahead_failures: Optional[float] = None,
                 adapter_of: Optional[dict[int, int]] = None,
                 wave_budget: bool = False, idle_fills: bool = False, mixed_bound: tuple[int, int] = (0, 0),
                 requests: Optional[dict[int, Request]] = None):
        super().__init__(scripts, vocab=vocab, block_size=block_size, total_blocks=total_blocks,
                         held_blocks=held_blocks, reclaimable=min(reclaimable, held_blocks),
                         cancel_flags=cancel_flags, kv_exhaust_at=kv_exhaust_at,
                         decode_fault_at=decode_fault_at, verify_fault_at=verify_fault_at,
                         can_batch_verify=can_batch_verify, slot_draft_capacity=slot_draft_capacity,
                         count_accepted=count_accepted)
        self.spill_corrupt_for = set(spill_corrupt_for)
        self.requests = requests  # by id: the sampling settings every pick of its rows must carry (None: unchecked)
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
        self.ctx_owed: set[int] = set()  # DFlash: serial verifies of k >= 3 rows whose commit_ctx is still due
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
        self.ahead_failures = ahead_failures  # the chance a kept decode fails afterwards (None: the module's)
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
        self.last_freed: Optional[int] = None  # the slot the last free_sequence freed, until a release word names one

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

    def _ctx_committed(self, what: str, seq: int) -> None:
        """DFlash: a serial verify of k >= 3 rows commits the drafter context of its rows
        (``commit_ctx``) before its verdict commits, trims or proposes, and before anything else
        runs on the sequence (specs/speculation.md §6.8 step 4, §6.9 step 4)."""
        if seq in self.ctx_owed:
            raise self._bad(what, f"sequence {seq}'s last verify (DFlash, k >= 3) has not committed its drafter "
                                  f"context (commit_ctx)")

    def ep_broadcast_cmd_for_seq(self, seq_slot: int, cmd: int) -> None:
        super().ep_broadcast_cmd_for_seq(seq_slot, cmd)
        if cmd == RELEASE_CMD:  # names the slot a release just freed (specs/scheduler.md §5.20)
            if seq_slot not in self.freed_slots:
                held = self.ledger.holder(SLOT, seq_slot)
                raise self._bad("ep_broadcast_cmd_for_seq", f"the EP release word names slot {seq_slot}, which no "
                                                            f"release freed (held by sequence {held})")
            if self.last_freed is not None and seq_slot != self.last_freed:  # a ReleaseSeq: the free, then its word
                raise self._bad("ep_broadcast_cmd_for_seq", f"the EP release word names slot {seq_slot}; the "
                                                            f"release it follows freed slot {self.last_freed}")
            self.last_freed = None
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

    # --- blame and the strict block pool ----------------------------------------------------------------

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
