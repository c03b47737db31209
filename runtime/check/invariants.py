"""The model checker's invariants, in one place.

Each invariant is a named function with the rule in its docstring; ``Monitor`` calls them after
every step of the random walk and the hypothesis machine, and raises ``Violation`` naming the
first one broken. Cheap checks run on every step; whole-state checks run at tick boundaries.
"""

from __future__ import annotations

from typing import Optional

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


def expected_output(tokens: tuple[int, ...], max_tokens: int, eos: int = EOS) -> tuple[int, ...]:
    """What greedy decoding of a script gives: its tokens up to EOS (included) or the budget."""
    out = []
    for g in range(max_tokens):
        tok = tokens[g] if g < len(tokens) else tokens[-1]
        out.append(tok)
        if tok == eos:
            break
    return tuple(out)


# --- the invariants -------------------------------------------------------------------------------


def lossless(expected: tuple[int, ...], streamed: list[int], incoming: tuple[int, ...], rid: int) -> None:
    """lossless: every token a client receives is the next token of its script (never EOS)."""
    at = len(streamed)
    for offset, token in enumerate(incoming):
        position = at + offset
        if position >= len(expected) or expected[position] != token or token == EOS:
            want = expected[position] if position < len(expected) else "nothing"
            raise Violation("lossless", f"request {rid} got token {token} at index {position}, script says {want}")


def final_frame_matches(expected: tuple[int, ...], frame, streamed: list[int], max_tokens: int,
                        cancelled: bool, rid: int) -> None:
    """lossless (final): the final frame covers the script up to EOS or the budget, or a prefix of
    it when the request was cancelled, timed out or stopped by a guard."""
    if isinstance(frame, ErrorOut):
        return
    if isinstance(frame, ResponseOut):
        tokens = tuple(frame.tokens)
        n = len(tokens)
        if tokens != expected[:n]:
            raise Violation("lossless", f"request {rid} response {list(tokens)} is not a prefix of {list(expected)}")
        reason, guard = frame.reason, None
    else:
        n = frame.n
        if [t for t in expected[:n] if t != EOS] != streamed:
            raise Violation("lossless", f"request {rid} streamed {streamed} but Done says n={n}")
        reason, guard = frame.reason, frame.guard
    complete = n == len(expected)
    if reason == "stop" and not cancelled and not (complete and expected[-1] == EOS):
        raise Violation("lossless", f"request {rid} stopped after {n} tokens without EOS or a cancel")
    if reason == "length" and guard is None and not (complete and n == max_tokens):
        raise Violation("lossless", f"request {rid} finished by length after {n} of {max_tokens} tokens")


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


from fxsched.effects import plans  # noqa: E402


# --- the monitor --------------------------------------------------------------------------------------------


class Monitor:
    """Watches one run: every batch of effects, every client output, the device after each step.

    Starvation bound: every tick each active sequence gains at least one token and a prefilling
    prompt at least one chunk, so all the work still to do when a request is admitted is at most
    the sum over requests of (prompt + budget) tick-steps; a preempted sequence waits for others'
    work and re-prefills once per preemption. The bound is that sum, plus 4 ticks per request and
    16 of slack, counted from the admission tick.
    """

    def __init__(self, requests, device, counts_acc: bool):
        self.device = device
        self.counts_acc = counts_acc
        self.requests = {r.id: r for r in requests}
        self.expected = {r.id: expected_output(r.tokens, r.max_tokens) for r in requests}
        self.streamed: dict[int, list[int]] = {r.id: [] for r in requests}
        self.final: dict[int, object] = {}
        self.released: set = set()
        self.live: set = set()
        self.shutdown_tail: list[str] = []
        self.cancelled: set = set()
        self.admitted_by: dict[int, int] = {}
        self.running: set[int] = set()
        self.work = sum(r.prompt_len + r.max_tokens for r in requests) + 4 * len(requests) + 16

    def add_request(self, request) -> None:
        """A request that arrived during the run (the hypothesis machine makes them up as it goes)."""
        self.requests[request.id] = request
        self.expected[request.id] = expected_output(request.tokens, request.max_tokens)
        self.streamed[request.id] = []
        self.work += request.prompt_len + request.max_tokens + 4

    def on_effects(self, effects) -> None:
        no_effect_on_released(effects, self.released, self.live)
        fold_before_commit(effects)
        compaction_target_free(effects, self.device)
        for effect in effects:
            if self.shutdown_tail or isinstance(effect, (lc.EpShutdown, lc.Quiesce, lc.Teardown)):
                shutdown_order(self.shutdown_tail, effect)

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
            final_frame_matches(self.expected[rid], output, self.streamed[rid], self.requests[rid].max_tokens,
                                rid in self.cancelled, rid)
            if isinstance(output, (DoneOut, ResponseOut)):
                n = output.n if isinstance(output, DoneOut) else len(output.tokens)
                counted = self.device.accepted.get(rid, 0) if self.counts_acc else None
                acc_accounting(rid, output.acc, n, counted)

    def on_state(self, state: SchedulerState) -> None:
        blocks_balance(self.device)
        slots_unique(state, self.device)
        running = running_sequences(state)
        no_orphan_sequence(self.device, running, self.running - running)
        self.running = running
        for request in state.new_requests:
            self.admitted_by.setdefault(request.id, state.tick + self.work)
        if isinstance(state.waiting, AwaitPublishBlocks):
            kv_mirror(state, self.device)
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
