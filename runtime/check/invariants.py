"""The model checker's invariants, in one place.

Each invariant is a named function with the rule in its docstring; ``Monitor`` calls them after
every step of the random walk and the hypothesis machine, and raises ``Violation`` naming the
first one broken. Cheap checks run on every step; whole-state checks run at tick boundaries.
"""

from __future__ import annotations

from typing import Any, Optional

from fxsched.core import events as ev
from fxsched.core.config import SCRIPTED_EOS as EOS
from fxsched.core.state import SchedulerState
from fxsched.core.phases import AwaitPublishBlocks
from fxsched.effects import device_calls as dc
from fxsched.effects import lifecycle as lc
from fxsched.effects.client import DoneOut, ErrorOut, ResponseOut, TokenOut, TokensOut



class Violation(Exception):
    """An invariant does not hold; ``invariant`` names it."""

    def __init__(self, invariant: str, message: str):
        super().__init__(f"{invariant}: {message}")
        self.invariant = invariant
        self.message = message


WILD = -1
"""An expected position any non-EOS token may fill: EOS is masked there (``min_tokens``) and the
host pick of the masked row is not the script's."""


def expected_output(tokens: tuple[int, ...], max_tokens: int, eos: int = EOS, min_tokens: int = 0) -> tuple[int, ...]:
    """What greedy decoding of a script gives: its tokens up to EOS (included) or the budget. While
    fewer than ``min_tokens`` tokens are out, EOS is masked (specs/scheduler.md §5.11): a script EOS
    there is a ``WILD`` position and the script goes on."""
    out = []
    for g in range(max_tokens):
        tok = tokens[g] if g < len(tokens) else tokens[-1]
        if tok == eos and g < min_tokens:
            out.append(WILD)
            continue
        out.append(tok)
        if tok == eos:
            break
    return tuple(out)


def _fits(want: int, token: int) -> bool:
    return want == token or (want == WILD and token != EOS)


# --- the invariants -------------------------------------------------------------------------------


def lossless(expected: tuple[int, ...], streamed: list[int], incoming: tuple[int, ...], rid: int) -> None:
    """lossless: every token a client receives is the next token of its script (never EOS)."""
    at = len(streamed)
    for offset, token in enumerate(incoming):
        position = at + offset
        if position >= len(expected) or not _fits(expected[position], token) or token == EOS:
            want = expected[position] if position < len(expected) else "nothing"
            raise Violation("lossless", f"request {rid} got token {token} at index {position}, script says {want}")


def final_frame_matches(expected: tuple[int, ...], frame, streamed: list[int], max_tokens: int,
                        cancelled: bool, rid: int) -> None:
    """lossless (final): the final frame covers the script up to EOS or the budget, or a prefix of
    it; why it stopped early is ``early_stop_justified``'s to judge."""
    if isinstance(frame, ErrorOut):
        return
    if isinstance(frame, ResponseOut):
        tokens = tuple(frame.tokens)
        n = len(tokens)
        if n > len(expected) or not all(_fits(w, t) for w, t in zip(expected, tokens, strict=False)):
            raise Violation("lossless", f"request {rid} response {list(tokens)} is not a prefix of {list(expected)}")
    else:
        n = frame.n
        if n > len(expected) or len(streamed) != sum(1 for t in expected[:n] if t != EOS):
            raise Violation("lossless", f"request {rid} streamed {streamed} but Done says n={n}")


# --- why an output stopped: each early stop needs its cause (specs/scheduler.md §5.19) ------------------


def has_content_loop(out) -> bool:
    """Three consecutive copies of the last p tokens for some p in 2 .. 64 (specs/watchdog.md §7.2)."""
    n = len(out)
    for p in range(2, 65):
        if 3 * p > n:
            return False
        tail = out[n - p:]
        if tail == out[n - 2 * p:n - p] and tail == out[n - 3 * p:n - 2 * p]:
            return True
    return False


def has_fuzzy_repetition(out) -> bool:
    """Some window P in 40 .. 15 whose last three copies differ pairwise by at most max(P // 12, 1)
    tokens, on an output of 90 tokens or more (specs/watchdog.md §7.3)."""
    n = len(out)
    if n < 90:
        return False
    for p in range(15, 41):
        if 3 * p > n:
            break
        a, b, c = out[n - 3 * p:n - 2 * p], out[n - 2 * p:n - p], out[n - p:]
        tolerance = max(p // 12, 1)
        if (sum(x != y for x, y in zip(a, b, strict=True)) <= tolerance
                and sum(x != y for x, y in zip(b, c, strict=True)) <= tolerance):
            return True
    return False


def guard_held(guard: Optional[str], out, armed: bool) -> bool:
    """A watchdog guard finishes a sequence only when armed and its condition holds on the output
    it leaves (the content-loop check runs from 48 tokens on)."""
    if not armed:
        return False
    if guard in (None, "content_loop_watchdog") and len(out) >= 48 and has_content_loop(out):
        return True
    return guard in (None, "fuzzy_repetition") and has_fuzzy_repetition(out)


def early_stop_justified(request, expected: tuple[int, ...], frame, out, *, cancelled: bool, now_ms: float,
                         max_seq_len: int, armed: bool, reach: int = 0) -> None:
    """early_stop: a final frame's reason matches what really happened (specs/scheduler.md §5.19):
    ``timeout`` only once the deadline passed on the scheduler's clock; ``stop`` only at EOS (EOS
    ends a request as ``stop`` even when it is the budget's last token) or after a cancel really
    delivered; ``length`` only with the budget spent, the context ceiling reached, or a watchdog
    guard whose condition held."""
    rid = request.id
    n = len(out)
    ended_eos = n > 0 and out[-1] == EOS
    guard = frame.guard if isinstance(frame, DoneOut) else None
    reason = str(frame.reason)
    if reason == "timeout":
        if request.deadline_ms is None or request.deadline_ms > now_ms:
            raise Violation("early_stop", f"request {rid} timed out at {now_ms} ms, deadline {request.deadline_ms}")
        return
    if guard == "request_timeout":
        raise Violation("early_stop", f"request {rid} has guard request_timeout but reason {reason}")
    if reason == "stop":
        if not ended_eos and not cancelled:
            raise Violation("early_stop", f"request {rid} stopped after {n} tokens without EOS or a cancel")
        if guard is not None:
            raise Violation("early_stop", f"request {rid} stopped with guard {guard}")
        return
    if reason == "length":
        if ended_eos:
            raise Violation("early_stop", f"request {rid} ended with EOS but reports length (EOS is stop)")
        budget = n >= request.max_tokens or max(request.prompt_len + n, reach + 1) >= max_seq_len
        if guard is not None:
            if not guard_held(guard, out, armed):
                raise Violation("early_stop", f"request {rid} finished by guard {guard} after {n} tokens, "
                                              f"which does not hold")
        elif not budget and not guard_held(None, out, armed):
            raise Violation("early_stop", f"request {rid} finished by length after {n} of {request.max_tokens} "
                                          f"tokens (prompt {request.prompt_len}, context {max_seq_len})")
        return
    raise Violation("early_stop", f"request {rid} finished with reason {reason}")


def one_terminal_output(rid: int, already_final: bool, output) -> None:
    """one terminal output: exactly one Done, Response or Error per request, and nothing after it."""
    if already_final:
        raise Violation("one_terminal_output", f"request {rid} got {type(output).__name__} after its final frame")


def blocks_balance(device) -> None:
    """blocks: free + used + held == total, none negative, and used == the sum of block tables."""
    free = device.free_count()
    used = device.used_blocks
    if free < 0 or used < 0:
        raise Violation("blocks_balance", f"free {free}, used {used}")
    if free + used + device.held_blocks != device.total_blocks:
        raise Violation("blocks_balance", f"free {free} + used {used} + held {device.held_blocks} != {device.total_blocks}")
    tables = sum(s.blocks for s in device.live.values())
    if tables != used:
        raise Violation("blocks_balance", f"block tables hold {tables} blocks but {used} are used")


def blocks_free_at_quiescence(state: SchedulerState, device) -> None:
    """blocks: when nothing is in flight every block is free and no sequence holds a slot."""
    if state.active or state.prefilling or state.swapped or state.preempted or state.restoring:
        return
    if device.used_blocks or device.live:
        held = {s.seq_id: s.slot for s in device.live.values()}
        raise Violation("blocks_free_at_quiescence",
                        f"nothing is in flight but {device.used_blocks} blocks are used by {held}")


def slots_unique(state: SchedulerState, device) -> None:
    """slots: no two live sequences share a slot (scheduler view and device view)."""
    slots = [s.slot for s in state.active] + [e.slot for e in state.prefilling]
    if len(slots) != len(set(slots)):
        raise Violation("slots_unique", f"the scheduler has two sequences in one slot: {sorted(slots)}")
    dslots = [s.slot for s in device.live.values()]
    if len(dslots) != len(set(dslots)):
        raise Violation("slots_unique", f"the device has two sequences in one slot: {sorted(dslots)}")


_SEQ_FIELDS = ("seq",)


def no_effect_on_released(effects, released: set, live: set) -> None:
    """released sequences: no effect names a sequence after its release (until it is allocated
    again); a released slot is never used by an effect again."""
    for effect in effects:
        if isinstance(effect, (dc.AllocSequence, dc.AllocSequenceFor)):
            released.discard(effect.seq)
            live.add(effect.seq)
            continue
        seqs: tuple[int, ...] = ()
        seq = getattr(effect, "seq", None)
        if seq is not None:
            seqs = (seq,)
        elif isinstance(effect, (dc.DecodeVerifyBatched, dc.ProposeBatched)):
            seqs = effect.seqs
        elif isinstance(effect, plans.Decode):
            seqs = effect.seqs
        elif isinstance(effect, (dc.CommitCtxBatch, dc.CommitAcceptedPrefixBatch, dc.TrimProposerStateBatch,
                                 dc.TruncateSequences)):
            seqs = tuple(e[0] for e in effect.entries)
        for s in seqs:
            if s in released:
                raise Violation("no_effect_on_released", f"{type(effect).__name__} names sequence {s} after its release")
        if isinstance(effect, lc.ReleaseSeq):
            released.add(effect.seq)
            live.discard(effect.seq)


def fold_before_commit(effects) -> None:
    """batched verify: gdn_fold_accepted comes before any commit_accepted_prefix of its batch."""
    commit_seen = False
    for effect in effects:
        if isinstance(effect, (dc.CommitAcceptedPrefix, dc.CommitAcceptedPrefixBatch)):
            commit_seen = True
        elif isinstance(effect, dc.GdnFoldAccepted) and commit_seen:
            raise Violation("fold_before_commit", "commit_accepted_prefix came before gdn_fold_accepted")
        elif isinstance(effect, (dc.DecodeVerifyBatched, dc.SerialVerify)):
            commit_seen = False


SHUTDOWN_ORDER = ("EpShutdown", "Quiesce0", "Quiesce1", "Teardown")


def shutdown_order(tail: list[str], effect) -> None:
    """shutdown: EpShutdown, Quiesce(0), Quiesce(1), Teardown, each once, and nothing after."""
    name = type(effect).__name__ + (str(effect.stream) if isinstance(effect, lc.Quiesce) else "")
    if tail:
        if len(tail) >= len(SHUTDOWN_ORDER) or SHUTDOWN_ORDER[len(tail)] != name:
            raise Violation("shutdown_order", f"{name} after {tail}")
        tail.append(name)
    elif isinstance(effect, (lc.EpShutdown, lc.Quiesce, lc.Teardown)):
        if name != "EpShutdown":
            raise Violation("shutdown_order", f"{name} before EpShutdown")
        tail.append(name)


def acc_accounting(rid: int, acc: int, n: int, counted: Optional[int]) -> None:
    """acc: at most the tokens after the first, and equal to the accepted drafts the device saw
    (capped the same way); 0 for drafting modes that never count."""
    if acc > max(n - 1, 0):
        raise Violation("acc_accounting", f"request {rid} reports acc={acc} for n={n}")
    want = 0 if counted is None else min(counted, max(n - 1, 0))
    if acc != want:
        raise Violation("acc_accounting", f"request {rid} reports acc={acc}, the device counted {want}")


def kv_mirror(state: SchedulerState, device) -> None:
    """the scheduler's view of each active sequence's KV (length, blocks) equals the device's."""
    for seq in state.active:
        dev = device.live.get(seq.seq_id)
        if dev is None:
            raise Violation("kv_mirror", f"active sequence {seq.seq_id} holds no device sequence")
        if dev.seq_len != seq.seq_len or dev.blocks != seq.blocks or dev.slot != seq.slot:
            raise Violation("kv_mirror", f"sequence {seq.seq_id}: scheduler len={seq.seq_len} blocks={seq.blocks} "
                                         f"slot={seq.slot}, device len={dev.seq_len} blocks={dev.blocks} slot={dev.slot}")


def compaction_target_free(effects, device) -> None:
    """compaction: a CompactSlot moves its sequence into a slot no other live sequence holds. The
    holders are the device's slots when the batch starts, updated in order by the batch's own
    releases and moves (a retire releases the finished sequences before it packs the survivors)."""
    if not any(isinstance(e, (lc.CompactSlot, dc.CompactSequence)) for e in effects):
        return
    slot_of = {seq_id: s.slot for seq_id, s in device.live.items()}
    for effect in effects:
        if isinstance(effect, (lc.ReleaseSeq, dc.FreeSequence)):
            slot_of.pop(effect.seq, None)
        elif isinstance(effect, (lc.CompactSlot, dc.CompactSequence)):
            target = effect.target if isinstance(effect, lc.CompactSlot) else effect.new_slot
            holders = [s for s, slot in slot_of.items() if slot == target and s != effect.seq]
            if holders:
                raise Violation("compaction_target_free", f"{type(effect).__name__} moves sequence {effect.seq} "
                                                          f"into slot {target}, held by sequence {holders[0]}")
            slot_of[effect.seq] = target


def running_sequences(state: SchedulerState) -> set[int]:
    """The sequences the scheduler runs, which may hold a device sequence: active, prefilling and
    being restored."""
    return ({s.seq_id for s in state.active} | {e.seq_id for e in state.prefilling}
            | {s.seq_id for s in state.restoring})


def no_orphan_sequence(device, running: set[int], dropped: Optional[set[int]] = None) -> None:
    """no orphan: every sequence the device holds (a slot, blocks) is one the scheduler runs. One
    it stopped running (finished, cancelled, preempted, spilled, failed) without a ReleaseSeq
    leaks its slot and blocks. Checked after every step for the sequences that step stopped
    running (``dropped``: their release is in the same batch), and at tick boundaries for all."""
    if not device.live:
        return
    if dropped is None:
        orphans = sorted(set(device.live) - running)
    else:
        orphans = sorted(i for i in dropped if i in device.live)
    if orphans:
        held = {i: device.live[i].slot for i in orphans}
        raise Violation("no_orphan_sequence", f"the device holds sequences {held} (id: slot) that the scheduler "
                                              f"no longer runs")


def no_starvation(tick: int, deadline_tick: dict[int, int], finished: set) -> None:
    """no starvation: under FIFO an admitted request finishes within its bound (see Monitor)."""
    for rid, limit in deadline_tick.items():
        if rid not in finished and tick > limit:
            raise Violation("no_starvation", f"request {rid} admitted but unfinished after tick {limit}")


def device_arguments(device) -> None:
    """device arguments: the simulated device found no call whose arguments contradict its own
    state (runtime/devices/simulated.py lists the checks); checked after every step, since a
    refused query reaches the scheduler as a fault it might absorb."""
    refused = getattr(device, "refused", None)
    if refused is not None:
        raise Violation("device_arguments", refused)


def batch_bound(state: SchedulerState) -> None:
    """batch size: active + prefilling never exceed ``max_batch_size`` (specs/scheduler.md §5.4)."""
    n = len(state.active) + len(state.prefilling)
    if n > state.config.max_batch_size:
        raise Violation("batch_bound", f"{len(state.active)} active + {len(state.prefilling)} prefilling > "
                                       f"max_batch_size {state.config.max_batch_size}")


def slots_packed(state: SchedulerState) -> None:
    """packed slots: after the end of tick's compaction every surviving active sequence holds a slot
    below n = active + prefilling (specs/scheduler.md §5.19 step 3; prefilling prompts never move,
    and a swap-in or resume takes the lowest free slot, which stays below the new n); checked at
    the tick start."""
    n = len(state.active) + len(state.prefilling)
    high = [(s.seq_id, s.slot) for s in state.active if s.slot >= n]
    if high:
        raise Violation("slots_packed", f"active (sequence, slot) {high} at the tick start, with {n} running")


def admission_order(policy: str, queue: list, selected: tuple, cap: int) -> None:
    """admission order (specs/scheduler.md §5.4): the selected requests are the first
    ``min(cap, waiting)`` of the queue (FIFO), or the queue's front then the rest of the queue
    stably sorted by ascending prompt length (SLAI). ``queue`` is the checker's own model of
    ``pending``: arrival order, with requests an admission deferred back at the front."""
    ids = [r.id for r in selected]
    if len(ids) > max(cap, 0):
        raise Violation("admission_order", f"selected {ids} with room for {cap}")
    take = min(max(cap, 0), len(queue))
    if policy == "slai":
        want = ([queue[0]] + sorted(queue[1:], key=lambda r: r.prompt_len)[:take - 1]) if take else []
    else:
        want = queue[:take]
    if ids != [r.id for r in want]:
        raise Violation("admission_order", f"{policy} selected {ids} from the queue {[r.id for r in queue]} "
                                           f"(room {cap}); the policy says {[r.id for r in want]}")


def error_justified(request, message: str, *, in_fault_step: bool, blamed, in_flight: bool, model,
                    config, adapter_id: int) -> None:
    """early_stop (errors): an ``Error`` only for a request the rule book fails
    (specs/faults.md §8.1–8.4, specs/scheduler.md §5.5, §5.19 step 5): one no device could serve (an
    unknown adapter, a prompt past the context or the block pool), one whose preempted KV could
    never fit again, or one in flight when a device call failed, and then, when the failing call
    named its sequences, one of them."""
    rid = request.id
    bs = model.block_size
    if adapter_id == -1 or request.prompt_len >= config.max_seq_len:
        return
    if model.total_blocks and request.prompt_len // bs + 1 > model.total_blocks:
        return
    if model.total_blocks and (request.prompt_len + request.max_tokens) // bs + 2 > model.total_blocks:
        return  # a requeue resume that can never fit (the bound of any KV it could hold)
    if in_fault_step:
        if not in_flight:
            raise Violation("early_stop", f"request {rid} failed by a fault before it arrived or after it ended")
        if blamed is not None and rid not in blamed:
            raise Violation("early_stop", f"request {rid} failed ({message}) by a fault of a call on {sorted(blamed)}")
        return
    raise Violation("early_stop", f"request {rid} failed ({message}) with no fault and no reason to refuse it")


from fxsched.effects import plans  # noqa: E402


# --- the monitor --------------------------------------------------------------------------------------------


class Monitor:
    """Watches one run: every event, every batch of effects, every client output, the device after
    each step.

    Starvation bound: every tick each active sequence gains at least one token and a prefilling
    prompt at least one chunk, so all the work still to do when a request is admitted is at most
    the sum over requests of (prompt + budget) tick-steps; a preempted sequence waits for others'
    work and re-prefills once per preemption. The bound is that sum, plus 4 ticks per request and
    16 of slack, counted from the admission tick; with the watchdogs armed each budget counts
    1 + max_rollbacks times (a rollback gives the dropped tokens back).

    ``config`` and ``model`` (when given) arm the oracles that need the rule book's settings: the
    early-stop causes, the admission order, the batch bound and the packed slots.
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
        for r in requests:
            self.add_request(r)
        self.final: dict[int, object] = {}
        self.released: set = set()
        self.live: set = set()
        self.shutdown_tail: list[str] = []
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
        self.blamed = None

    def add_request(self, request) -> None:
        """A request of the run (the hypothesis machine makes them up as it goes)."""
        self.requests[request.id] = request
        self.expected[request.id] = expected_output(request.tokens, request.max_tokens,
                                                    min_tokens=getattr(request, "min_tokens", 0))
        self.streamed[request.id] = []
        self.work += request.prompt_len + request.max_tokens * self.replays + 4

    def on_event(self, event) -> None:
        """An event about to be stepped: clocks, arrivals, cancels and faults are causes."""
        self.fault_step = False
        if isinstance(event, ev.Clock):
            self.now_ms = event.now_ms
        elif isinstance(event, ev.Cancel):
            self.cancelled.add(event.request_id)
        elif isinstance(event, ev.Arrival):
            self.arrived.add(event.request.id)
            self.queue.append(event.request)
        elif isinstance(event, ev.DeviceFault):
            self.fault_step = True
            take = getattr(self.device, "take_blame", None)
            self.blamed = take() if take is not None else None

    def on_effects(self, effects) -> None:
        no_effect_on_released(effects, self.released, self.live)
        fold_before_commit(effects)
        compaction_target_free(effects, self.device)
        for effect in effects:
            if self.shutdown_tail or isinstance(effect, (lc.EpShutdown, lc.Quiesce, lc.Teardown)):
                shutdown_order(self.shutdown_tail, effect)
            elif isinstance(effect, (dc.AllocSequence, dc.AllocSequenceFor)) and effect.session:
                self.served.add(effect.session)

    def on_output(self, output) -> None:
        rid = output.request_id
        one_terminal_output(rid, rid in self.final, output)
        if isinstance(output, TokenOut):
            lossless(self.expected[rid], self.streamed[rid], (output.token,), rid)
            self.streamed[rid].append(output.token)
        elif isinstance(output, TokensOut):
            lossless(self.expected[rid], self.streamed[rid], output.tokens, rid)
            self.streamed[rid].extend(output.tokens)
        else:
            self.final[rid] = output
            self.served.add(rid)
            request = self.requests[rid]
            expected = self.expected[rid]
            final_frame_matches(expected, output, self.streamed[rid], request.max_tokens,
                                rid in self.cancelled, rid)
            if isinstance(output, (DoneOut, ResponseOut)):
                n = output.n if isinstance(output, DoneOut) else len(output.tokens)
                counted = self.device.accepted.get(rid, 0) if self.counts_acc else None
                acc_accounting(rid, output.acc, n, counted)
                if self.config is not None:
                    if isinstance(output, ResponseOut):
                        out = tuple(output.tokens)
                    else:
                        out = tuple(self.streamed[rid]) + ((EOS,) if n > len(self.streamed[rid]) else ())
                    early_stop_justified(request, expected, output, out, cancelled=rid in self.cancelled,
                                         now_ms=self.now_ms, max_seq_len=self.config.max_seq_len,
                                         armed=self.config.loop_watchdog,
                                         reach=getattr(self.device, "reach", {}).get(rid, 0))
                cached = getattr(self.device, "cached", None)
                if cached is not None and output.cached != cached.get(rid, 0):
                    raise Violation("prefix_cache", f"request {rid} reports cached={output.cached}, the device "
                                                    f"found {cached.get(rid, 0)} prompt tokens cached")
            elif isinstance(output, ErrorOut) and self.config is not None and self.model is not None:
                adapters = getattr(self.device, "adapters", {-1: 0})
                slot = getattr(request, "adapter_slot", -1)
                error_justified(request, output.message, in_fault_step=self.fault_step, blamed=self.blamed,
                                in_flight=rid in self.arrived, model=self.model, config=self.config,
                                adapter_id=adapters.get(slot, -1))

    def _selection(self, state: SchedulerState) -> None:
        new = state.new_requests
        if not new or new is self.selected:
            return
        previous = {r.id for r in self.selected}
        if previous and {r.id for r in new} <= previous:
            self.selected = new  # an admission or a fault kept part of the selection
            return
        deferred = [r for r in self.selection if r.id not in self.served]
        waiting = {r.id for r in deferred}
        self.queue = deferred + [r for r in self.queue if r.id not in waiting and r.id not in self.served]
        cap = state.config.max_batch_size - len(state.active) - len(state.prefilling)
        admission_order(state.config.policy, self.queue, new, cap)
        taken = {r.id for r in new}
        self.queue = [r for r in self.queue if r.id not in taken]
        self.selected = self.selection = new

    def on_state(self, state: SchedulerState) -> None:
        device_arguments(self.device)
        blocks_balance(self.device)
        slots_unique(state, self.device)
        batch_bound(state)
        running = running_sequences(state)
        no_orphan_sequence(self.device, running, self.running - running)
        self.running = running
        if self.config is not None:
            self._selection(state)
        for request in state.new_requests:
            self.admitted_by.setdefault(request.id, state.tick + self.work)
        if isinstance(state.waiting, AwaitPublishBlocks):
            kv_mirror(state, self.device)
            slots_packed(state)
            blocks_free_at_quiescence(state, self.device)
            no_starvation(state.tick, self.admitted_by, set(self.final))
            no_orphan_sequence(self.device, running)

    def at_end(self, state: SchedulerState) -> None:
        blocks_free_at_quiescence(state, self.device)
        missing = [rid for rid in self.requests if rid not in self.final]
        if missing:
            raise Violation("one_terminal_output", f"requests {missing} never got a final frame")
        if len(self.shutdown_tail) != len(SHUTDOWN_ORDER):
            raise Violation("shutdown_order", f"the run ended after {self.shutdown_tail}")
