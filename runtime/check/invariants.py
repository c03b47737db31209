"""The model checker's invariants: the ``Monitor`` that runs them.

Each invariant is a named function with the rule in its docstring; ``Monitor`` calls them after
every step of the random walk and the hypothesis machine, and raises ``Violation`` naming the
first one broken. Cheap checks run on every step; whole-state checks run at tick boundaries.

The per-step checks run only where they have something to look at, which keeps the checker's own
cost per step small: a batch's checks run when the batch holds an effect of a type they read (the
type's ``ROLES``, worked out once per type, and their union per batch signature, ``BATCH_ROLES``; a
check with nothing to read would pass), an event's handling follows its type's ``EVENT_KINDS``, and
``Monitor.on_state`` re-runs a check of the device's pool and slots or of the state's in-flight
tuples only when its inputs changed since it last held (the simulated device's ``epoch``; the very
same tuples in the state, which frozen records keep when nothing in them changed; for a new tuple of
active sequences, the same sequences in the same slots, which is what most steps make of it).
"""

from __future__ import annotations

from typing import Any, Optional

from fxsched.core.config import SCRIPTED_EOS as EOS
from fxsched.core.state import SchedulerState
from fxsched.core.phases import AwaitAdapterIds, AwaitDecode, AwaitInput, AwaitPublishBlocks
from fxsched.effects import device_calls as dc
from fxsched.effects import lifecycle as lc
from fxsched.effects.base import expand_batched
from fxsched.effects.client import DoneOut, ErrorOut, ResponseOut, TokenOut, TokensOut
from fxsched.runtime.check.active_order import RESORTS, active_order
from fxsched.runtime.check.clients import client_final, predicted_final
from fxsched.runtime.check.effect_rules import EffectRules
from fxsched.runtime.check.fault_scope import RULE_BOOK, declared, fault_scope
from fxsched.runtime.check.frames import checkpoints_stream, tokens_after_checkpoints, tokens_after_cut
from fxsched.runtime.check.orderings import Orderings, SIGNATURES, Signature
from fxsched.runtime.check.progress import Progress, check_blocks, no_idle_with_work, no_shutdown_with_work
from fxsched.runtime.check.violation import Violation
from fxsched.effects import plans
from fxsched.runtime.check.outputs import (content_loop_checked_when_due, early_stop_justified, error_justified,
                                           expected_output, final_frame_matches, lossless, one_terminal_output,
                                           plain_path_only, refused_prompt)
from fxsched.runtime.check.roles import (ALLOC, ARRIVAL, BATCH_ROLES, batch_roles, BATCHED, CANCEL, CHECKPOINT,
                                         CLOCK, COMMIT, COMPACT, CUT, DECODE, DECODE_LANE, DRAFT, DRAFT_RULED,
                                         effect_role, EVENT_KINDS, FAULT, FOLD, INPUT, NAMES, OUT, PLAN, RELEASE,
                                         ROLES, ROLLBACK, SHUTDOWN)
from fxsched.runtime.check.state_checks import (acc_accounting, admission_ran, batch_bound, blocks_balance, ledgers_closed,
                                                blocks_free_at_quiescence, committed_kv, compaction_target_free,
                                                decode_rows, decode_rows_within_limits, device_arguments,
                                                drafts_verified, fold_before_commit, kv_mirror,
                                                no_effect_on_released, no_orphan_sequence, no_overtaking,
                                                no_starvation, release_cache_flag, running_sequences, _SEQ_ID,
                                                SETTLED_PHASES, SHUTDOWN_ORDER, shutdown_order, _SLOT, slots_packed,
                                                slots_unique)

# names the checker's other modules and the tests import from here
__all__ = ["ARRIVAL", "BATCH_ROLES", "CANCEL", "CLOCK", "EVENT_KINDS", "FAULT", "INPUT", "Monitor", "OUT",
           "Violation", "admission_ran", "batch_roles", "content_loop_checked_when_due", "decode_rows",
           "effect_role", "expected_output", "refused_prompt", "release_cache_flag", "slots_unique"]


# --- the monitor --------------------------------------------------------------------------------------------


class Monitor(EffectRules):
    """Watches one run: every event, every batch of effects, every client output, the device after
    each step.

    Starvation bound: every tick each active sequence gains at least one token and a prefilling
    prompt at least one chunk, so all the work still to do when a request is admitted is at most
    the sum over requests of (prompt + budget) tick-steps; a preempted sequence waits for others'
    work and re-prefills once per preemption. The bound is that sum, plus 4 ticks per request and
    16 of slack, counted from the admission tick; with the watchdogs armed each budget counts
    1 + max_rollbacks times (a rollback gives the dropped tokens back).

    ``config`` and ``model`` (when given) arm the oracles that need the rule book's settings: the
    early-stop causes, the admission order and decision, the KV reservation, the batch bound, the
    packed slots, refused prompts, the draft count, drafts for finished sequences, every pending
    draft block verified, the preemption victim (with the checker's own immunity record), the
    swap-out victim, the rollback cap (the checker's own count), cancels ending streams. Every
    batch's release flags, compaction moves and decode rows are checked too.
    """

    def __init__(self, requests, device, counts_acc: bool, config=None, model=None):
        self.device = device
        self.counts_acc = counts_acc
        self.config = config
        self.model = model
        # a watchdog rollback gives back the tokens it drops, at most max_rollbacks times
        self.replays = 1 + (config.max_rollbacks if config is not None and config.loop_watchdog else 0)
        self.requests: dict[int, Any] = {}
        self.expected: dict[int, tuple[int, ...]] = {}
        self.streamed: dict[int, list[int]] = {}
        self.work = 16
        self.progress = Progress()
        for r in requests:
            self.add_request(r)
        self.final: dict[int, object] = {}
        self.released: set = set()
        self.live: set = set()
        self.shutdown_tail: list[str] = []
        # the orders between two effects no other check sees
        self.orderings = Orderings(mtp=config is not None and config.use_speculative and not config.dflash)
        self.cancelled: set = set()
        self.admitted_by: dict[int, int] = {}
        self.running: set[int] = set()
        self.now_ms = 0.0
        self.arrived: set[int] = set()
        self.queue: list = []  # the checker's model of ``pending`` (Request records)
        self.selection: tuple = ()  # the last selection, some of which an admission may defer
        self.selected: tuple = ()  # what is left of it in ``new_requests``
        self.served: set[int] = set()  # requests allocated a sequence or finished
        self.fault_step = False
        self.tick_fault = False  # a fault came in the tick now running
        self.capacity_query = (0, 0)  # the last capacity query: (its first answer in the device's log, slots)
        self.kv_fault = False  # the event being stepped is a KV-exhaustion fault
        self.fault_resolved: dict[int, int] = {}  # seq -> kept token a pipelined decode's fault brought
        self.last_decode_ms = 0.0
        self.selected_in_tick = False  # this tick's admission asked the adapter ids of a selection
        # the state on_state sees next is the one an input event left (the waiting record parked
        # before it, already checked), or the same state again (an extra look): no new publish
        self.nothing_new = False
        self.admitting: tuple = ()  # the selection whose admission check is under way
        self.committed = 0  # the KV blocks committed when it began
        self.resorted = False  # the last batch re-sorted active by slot (active_order.RESORTS)
        self.running_slot: Optional[int] = None  # then the adapter slot of the first running sequence (None: none ran)
        self.requeued_kv: dict[int, int] = {}  # request id -> KV tokens it held when preempted (requeued)
        self.last_decode_rows: tuple[int, ...] = ()
        self.rollbacks: dict[int, int] = {}  # request id -> watchdog rollbacks counted (EffectRules._rollback_cap)
        self.plain = config is not None and plain_path_only(config, model, None)  # nothing speculates
        self.prev_active: dict[int, tuple] = {}  # seq -> (output length, slot, request id, seq) after the last step
        self.evicted: set[int] = set()  # requests preempted (requeued), not yet resumed
        self.moved: set[int] = set()  # requests ever spilled or requeued
        self.flagless: set[int] = set()  # requests spilled: no cancel reaches them any more
        self.disturbed: set[int] = set()  # requests a cancel or a fault reached (client_final leaves them)
        self.first_token_owed: set[int] = set()  # cancelled before they were active: the first token may stream
        self.immune: dict[int, int] = {}  # request id -> the output length its immunity lasts to
        self.blamed = None
        self.fault_expect: Optional[tuple[set[int], str]] = None  # who the fault being stepped must fail
        self.fault_errors: set[int] = set()  # who the step that takes it failed
        # what the per-step checks of ``on_state`` last looked at (see there)
        self.seen_epoch: Optional[int] = None
        self.seen_config: Any = None
        self.seen_active: Any = None  # the active records (``rows``) after the last step
        self.seen_state: Optional[SchedulerState] = None  # the last state seen
        self.seen_prefilling: Any = None
        self.seen_settled: Any = None  # the hot columns and records the block check last read
        self.seen_rows: Any = None
        self.mirrored: Any = None  # the records kv_mirror last compared
        self.mirrored_settled: Any = None  # and their hot columns
        self.seen_restoring: Any = None
        self.seen_new: Any = None
        self.seen_slots: list[int] = []  # the slots of ``seen_active``, in order
        self.seen_ids: list[int] = []  # and its sequences
        # what the device offers the checks (the simulated device all of it), looked up once
        self.refusable = hasattr(device, "refused")
        self.counts_epochs = hasattr(device, "epoch")
        self.rids = hasattr(device, "_rid")
        self.logs_capacities = hasattr(device, "capacity_log")

    def add_request(self, request) -> None:
        """A request of the run (the hypothesis machine makes them up as it goes)."""
        self.requests[request.id] = request
        self.expected[request.id] = expected_output(request.tokens, request.max_tokens,
                                                    min_tokens=getattr(request, "min_tokens", 0))
        self.streamed[request.id] = []
        self.progress.add_request(request)
        self.work += request.prompt_len + request.max_tokens * self.replays + 4

    def on_event(self, event, kind: Optional[int] = None) -> None:
        """An event about to be stepped: clocks, arrivals, cancels and faults are causes (``kind``:
        its ``EVENT_KINDS`` entry, when the caller has it)."""
        if kind is None:
            kind = EVENT_KINDS[type(event)]
        self.fault_step = self.kv_fault = self.nothing_new = False
        if not kind:
            return  # an answer
        if kind & INPUT:
            self.nothing_new = True
        if kind & CLOCK:
            self.progress.on_clock(self.final, self.seen_state.tick if self.seen_state is not None else 0)
            self.now_ms = event.now_ms
        elif kind & CANCEL:
            rid = event.request_id
            self.disturbed.add(rid)
            if self._cancel_lands(rid):
                if rid not in self.cancelled and rid in self.streamed and not self.streamed[rid]:
                    self.first_token_owed.add(rid)
                self.cancelled.add(rid)
        elif kind & ARRIVAL:
            self.arrived.add(event.request.id)
            self.queue.append(event.request)
        elif kind & FAULT:
            self.fault_step = True
            self.tick_fault = True
            self.kv_fault = event.kv_exhausted
            state = self.seen_state
            name = type(state.waiting).__name__ if state is not None else ""
            resolve = getattr(state.waiting, "resolve", ()) if state is not None else ()
            # a pipelined decode's fault brings the kept tokens it resolves (specs/async.md §16.6)
            self.fault_resolved = dict(zip(resolve, event.earlier, strict=True)) if (
                resolve and len(event.earlier) == len(resolve)) else {}
            if state is not None and name in RULE_BOOK:
                self.fault_expect = (declared(state, event.kv_exhausted, event.earlier)[0], name)
                self.fault_errors = set()
            take = getattr(self.device, "take_blame", None)
            self.blamed = take() if take is not None else None

    def _cancel_lands(self, rid: int) -> bool:
        """Whether a cancel of ``rid`` can stop it (specs/scheduler.md §5.2, §5.12, §5.19 step 4): an
        active sequence takes it only with its cancel flag (streaming, and never swapped in since,
        for a swap-in comes back without one); a request not yet active has it remembered and set at
        activation; a swapped or preempted sequence is not active, and its remembered cancel is never
        read again (it comes back by swap-in or resume, not by activation)."""
        request = self.requests.get(rid)
        state = self.seen_state
        if request is None or state is None:
            return True
        if rid in self.flagless:
            return False
        for seq in state.rows:
            if seq.request.id == rid:
                return bool(getattr(request, "streaming", True))
        if any(x.sequence.request.id == rid for x in state.swapped) or any(
                q.sequence.request.id == rid for q in state.preempted):
            return False
        return True

    def on_effects(self, effects, kinds: Optional[tuple] = None, known: Optional[Signature] = None) -> None:
        """A batch of effects, before it is carried out (``kinds``: their types in order, or ``known``:
        their ``orderings.SIGNATURES`` entry, when the caller has them). The roles of its effect
        types (``BATCH_ROLES``) say which checks have anything to look at in it: a check that none of
        the batch's effects takes part in would pass, so it does not run (a batch of no role at all
        is done with at once)."""
        if not effects:
            self.resorted = False
            return
        if known is None:
            known = SIGNATURES[tuple(map(type, effects)) if kinds is None else kinds]
        kinds = known.kinds
        self.resorted = not RESORTS.isdisjoint(kinds)
        self.orderings.check(effects, kinds, self.fault_step, known.plan)
        roles = known.roles
        if not roles and not self.shutdown_tail:
            return
        if roles & BATCHED:
            effects = expand_batched(effects)  # a batched record's rows are checked one by one
            kinds = tuple(map(type, effects))
            roles = batch_roles(kinds)
        if roles & (ALLOC | RELEASE) or (roles & NAMES and self.released):
            no_effect_on_released(effects, self.released, self.live, kinds)
            if roles & RELEASE:
                for effect in effects:
                    if type(effect) is lc.ReleaseSeq:
                        self.progress.released(effect.seq)
        if roles & COMMIT and roles & FOLD:
            fold_before_commit(effects)
        if roles & COMPACT:
            compaction_target_free(effects, self.device, self.seen_state.active if self.seen_state is not None else ())
        if roles & ROLLBACK and self.config is not None:
            self._rollback_cap(effects)
        if roles & CHECKPOINT and self.rids:  # (batched records are expanded by now)
            if roles & OUT:
                tokens_after_checkpoints(effects, self.device)
            if self.plain:
                checkpoints_stream(effects, self.device, self.requests)
        if roles & CUT and roles & OUT and self.rids:
            tokens_after_cut(effects, self.device)
        if self.shutdown_tail or roles & SHUTDOWN:
            acts = 0  # the roles of the effects before the shutdown, for the rules below
            for effect in effects:  # the shutdown's order, and nothing after it
                if self.shutdown_tail or isinstance(effect, (lc.EpShutdown, lc.Quiesce, lc.Teardown)):
                    if not self.shutdown_tail and self.seen_state is not None and not self.tick_fault:
                        no_shutdown_with_work(self.seen_state)
                    shutdown_order(self.shutdown_tail, effect)
                elif isinstance(effect, (dc.AllocSequence, dc.AllocSequenceFor)) and effect.session:
                    self.served.add(effect.session)
                elif isinstance(effect, lc.ReleaseSeq):
                    acts |= RELEASE
                elif isinstance(effect, DRAFT_RULED):
                    acts |= DRAFT
                if isinstance(effect, DECODE_LANE):
                    acts |= DECODE
                    if isinstance(effect, plans.Decode) and self.rids:
                        self._decode_rows(effect)
        else:
            acts = roles
            if roles & (ALLOC | PLAN):
                table = ROLES
                for effect in effects:
                    role = table[type(effect)]
                    if role & ALLOC and effect.session:
                        self.served.add(effect.session)
                    elif role & PLAN and self.rids:
                        self._decode_rows(effect)
        if self.config is None:
            return
        if acts & DRAFT and self.logs_capacities:
            self._draft_rules(effects)
        if acts & RELEASE:
            self._preemption(effects)
        elif self.kv_fault is False and roles & PLAN:
            for effect in reversed(effects):
                if isinstance(effect, plans.Decode):
                    self.last_decode_rows = effect.seqs
                    break
        if acts & DECODE:
            self.last_decode_ms = self.now_ms

    def on_output(self, output) -> None:
        rid = output.request_id
        one_terminal_output(rid, rid in self.final, output)
        if isinstance(output, (TokenOut, TokensOut)) and rid in self.cancelled and rid not in self.moved:
            # a delivered cancel ends the stream at the next emit (specs/scheduler.md §5.17, speculation.md
            # §6.1); one that came before the request was active lets its first token through (§5.12); a
            # sequence once spilled or requeued is exempt (a swap-in comes back without its cancel flag)
            if rid in self.first_token_owed and isinstance(output, TokenOut):
                self.first_token_owed.discard(rid)
            else:
                raise Violation("cancel_ends_stream", f"request {rid} streams {type(output).__name__} after its "
                                                      f"cancel was delivered")
        if isinstance(output, TokenOut):
            lossless(self.expected[rid], self.streamed[rid], (output.token,), rid)
            self.streamed[rid].append(output.token)
        elif isinstance(output, TokensOut):
            lossless(self.expected[rid], self.streamed[rid], output.tokens, rid)
            self.streamed[rid].extend(output.tokens)
        else:
            self.final[rid] = output
            self.served.add(rid)
            self.progress.finished(rid)
            request = self.requests[rid]
            expected = self.expected[rid]
            final_frame_matches(expected, output, self.streamed[rid], request.max_tokens,
                                rid in self.cancelled, rid)
            if self.config is not None:
                refused_prompt(request, output, self.config.max_seq_len)
            if isinstance(output, (DoneOut, ResponseOut)):
                n = output.n if isinstance(output, DoneOut) else len(output.tokens)
                counted = self.device.accepted.get(rid, 0) if self.counts_acc else None
                acc_accounting(rid, output.acc, n, counted)
                if self.config is not None:
                    if isinstance(output, ResponseOut):
                        out = tuple(output.tokens)
                    else:
                        out = tuple(self.streamed[rid]) + ((EOS,) if n > len(self.streamed[rid]) else ())
                    if self.config.loop_watchdog and plain_path_only(self.config, self.model, request):
                        content_loop_checked_when_due(rid, out)
                    early_stop_justified(request, expected, output, out, cancelled=rid in self.cancelled,
                                         now_ms=self.now_ms, max_seq_len=self.config.max_seq_len,
                                         armed=self.config.loop_watchdog,
                                         reach=getattr(self.device, "reach", {}).get(rid, 0))
                    if (rid not in self.disturbed and request.prompt_len < self.config.max_seq_len
                            and not self.config.loop_watchdog and getattr(request, "deadline_ms", None) is None
                            and plain_path_only(self.config, self.model, request)):
                        client_final(rid, predicted_final(expected, request.prompt_len, self.config.max_seq_len, EOS),
                                     n, str(output.reason))
                cached = getattr(self.device, "cached", None)
                if cached is not None and output.cached != cached.get(rid, 0):
                    raise Violation("prefix_cache", f"request {rid} reports cached={output.cached}, the device "
                                                    f"found {cached.get(rid, 0)} prompt tokens cached")
            elif isinstance(output, ErrorOut) and self.fault_expect is not None:
                self.fault_errors.add(rid)
            if isinstance(output, ErrorOut) and self.config is not None and self.model is not None:
                adapters = getattr(self.device, "adapters", {-1: 0})
                slot = getattr(request, "adapter_slot", -1)
                error_justified(request, output.message, in_fault_step=self.fault_step, blamed=self.blamed,
                                in_flight=rid in self.arrived, model=self.model, config=self.config,
                                adapter_id=adapters.get(slot, -1), requeued_kv=self.requeued_kv.get(rid))

    def on_state(self, state: SchedulerState) -> None:
        """The state after a batch was carried out (and the device with it). The per-step checks
        run on what changed: each is a function of the device's pool and slots, unchanged while
        its ``epoch`` is, and of state fields that are the very same tuples as at the last step when
        nothing in them changed (or, for ``active``, hold the same sequences in the same slots: the
        slot check reads only the slots, the running set only the sequences, the batch bound only
        the count); a check whose inputs are all the same held already."""
        device = self.device
        repeat = self.nothing_new
        self.nothing_new = True  # until the next event is stepped
        if self.fault_expect is not None:
            expected, faulted = self.fault_expect
            self.fault_expect = None
            fault_scope(expected, self.fault_errors, faulted)
        if self.refusable and device.refused is not None:
            device_arguments(device)
        if self.evicted and self.config is not None:
            self._resumed(state.active, self.config)
        before, self.seen_state = self.seen_state, state
        phase = type(state.waiting)  # (no phase record is subclassed)
        if phase is AwaitDecode and state.config.async_scheduling:
            decode_rows_within_limits(state)
        rows, prefilling, restoring = state.rows, state.prefilling, state.restoring  # (see ``running_sequences``)
        if self.counts_epochs:
            epoch = device.epoch
            device_new = epoch != self.seen_epoch
        else:
            epoch, device_new = None, True
        if device_new:
            blocks_balance(device)
            self.seen_epoch = epoch
        running = self.running
        if rows is not self.seen_active or prefilling is not self.seen_prefilling:
            # a new tuple of active sequences is mostly the same sequences in the same slots, one
            # token on: the slot and running-set checks run when the slots or the sequences differ
            slots, ids = list(map(_SLOT, rows)), list(map(_SEQ_ID, rows))
            prefills_new = prefilling is not self.seen_prefilling
            if device_new or prefills_new or slots != self.seen_slots:
                slots_unique(state, device)
            if prefills_new or len(ids) != len(self.seen_ids):
                batch_bound(state)
            if prefills_new or ids != self.seen_ids or restoring is not self.seen_restoring:
                running = self._running(state)
            if ids != self.seen_ids and before is not None:
                active_order(before, state, self.resorted)
            self.seen_active, self.seen_prefilling, self.seen_slots, self.seen_ids = rows, prefilling, slots, ids
        elif device_new:
            slots_unique(state, device)
            if restoring is not self.seen_restoring:
                running = self._running(state)
        elif restoring is not self.seen_restoring:
            running = self._running(state)
        settled = state.settled
        if settled is not self.seen_settled or rows is not self.seen_rows:
            check_blocks(self.progress, rows, settled)
            self.seen_settled, self.seen_rows = settled, rows
        if state.config is not self.seen_config:
            batch_bound(state)
            self.seen_config = state.config
        self.seen_restoring = restoring
        new = state.new_requests
        if new is not self.seen_new:
            if new and new is not self.selected and self.config is not None:
                self._selection(state)
            self.seen_new = new
            for request in new:
                self.admitted_by.setdefault(request.id, state.tick + self.work)
        if phase in SETTLED_PHASES and (device_new or rows is not self.mirrored or settled is not self.mirrored_settled):
            kv_mirror(state, device)  # (the answers before this query are settled)
            self.mirrored, self.mirrored_settled = rows, settled
        if self.progress.deadlines:
            self.progress.on_state(state, self.now_ms)
        if phase is AwaitInput:
            if not repeat:  # (input events while it waits fill the inbox)
                no_idle_with_work(state)
        elif phase is AwaitPublishBlocks:
            if not repeat and self.config is not None:
                admission_ran(state, self.now_ms, self.last_decode_ms, self.selected_in_tick)
                self.selected_in_tick = False
        elif phase is AwaitAdapterIds:
            self.selected_in_tick = True
            self.admitting = state.waiting.new
            self.committed = committed_kv(state)
            first = state.rows[0].request if state.rows else state.prefilling[0].request if state.prefilling else None
            self.running_slot = None if first is None else first.adapter_slot
            return
        if self.admitting:  # the tick's admission check is done: the whole-state checks of a tick start
            self._tick_checks(state, running)

    def _decode_rows(self, effect) -> None:
        """``decode_rows`` of a decode plan, with the requests a delivered cancel ended."""
        decode_rows(effect, self.device, self.requests, self.cancelled - self.moved if self.cancelled else ())

    def _running(self, state: SchedulerState) -> set[int]:
        """The running set of a step that changed it; no sequence it dropped may hold a device sequence."""
        running = running_sequences(state)
        no_orphan_sequence(self.device, running, self.running - running)
        self.running = running
        return running

    def _resumed(self, active, config) -> None:
        """Requeue-resumed sequences: immune for the next tokens (specs/scheduler.md §5.19)."""
        for seq in active:
            rid = seq.request.id
            if rid in self.evicted:
                self.evicted.discard(rid)
                self.immune[rid] = len(seq.output) + config.preemption_immunity_tokens

    def _tick_checks(self, state: SchedulerState, running: set[int]) -> None:
        """The whole-state checks, once a tick (after its admission check)."""
        device = self.device
        no_overtaking(self.admitting, state.new_requests, getattr(device, "adapters", None), set(self.final),
                      self.committed, state, self.running_slot)
        self.admitting = ()
        if not self.tick_fault:
            drafts_verified(state, device)
        self.tick_fault = False
        kv_mirror(state, device)
        slots_packed(state)
        blocks_free_at_quiescence(state, device)
        no_starvation(state.tick, self.admitted_by, set(self.final))
        no_orphan_sequence(device, running)

    def at_end(self, state: SchedulerState) -> None:
        blocks_free_at_quiescence(state, self.device)
        ledgers_closed(self.device, self.final)
        missing = [rid for rid in self.requests if rid not in self.final]
        if missing:
            raise Violation("one_terminal_output", f"requests {missing} never got a final frame")
        if len(self.shutdown_tail) != len(SHUTDOWN_ORDER):
            raise Violation("shutdown_order", f"the run ended after {self.shutdown_tail}")
