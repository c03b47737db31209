"""The model checker's invariants, in one place.

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

from operator import attrgetter
from typing import Any, Optional

import attrs

from fxsched.core import events as ev
from fxsched.core.config import SCRIPTED_EOS as EOS
from fxsched.core.state import SchedulerState
from fxsched.core import phases
from fxsched.core.phases import AwaitAdapterIds, AwaitInput, AwaitPublishBlocks
from fxsched.effects import device_calls as dc
from fxsched.effects import lifecycle as lc
from fxsched.effects.base import expand_batched
from fxsched.effects.client import DoneOut, ErrorOut, ResponseOut, TokenOut, TokensOut
from fxsched.runtime.check.clients import client_final, predicted_final
from fxsched.runtime.check.fault_scope import RULE_BOOK, finishes_on, declared, fault_scope
from fxsched.runtime.check.frames import CUTS_MANY, CUTS_ONE, tokens_after_checkpoints, tokens_after_cut
from fxsched.runtime.check.progress import Progress, check_blocks, no_idle_with_work, no_shutdown_with_work
from fxsched.runtime.check.violation import Violation



WILD = -1
"""An expected position any non-EOS token may fill: EOS is masked there (``min_tokens``) and the
host pick of the masked row is not the script's."""


def expected_output(tokens: tuple[int, ...], max_tokens: int, eos: int = EOS, min_tokens: int = 0) -> tuple[int, ...]:
    """What greedy decoding of a script gives: its tokens up to EOS (included) or the budget. While
    fewer than ``min_tokens`` tokens are out, EOS is masked (specs/scheduler.md §5.11): a script EOS
    there is a ``WILD`` position and the script goes on."""
    if not min_tokens:  # the script's first ``max_tokens`` tokens (the last one repeated), cut after EOS
        head = tokens[:max_tokens]
        if len(head) < max_tokens:
            head += tokens[-1:] * (max_tokens - len(head))
        return head[:head.index(eos) + 1] if eos in head else head
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


_SEQ_ID, _SLOT, _BLOCKS = attrgetter("seq_id"), attrgetter("slot"), attrgetter("blocks")


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


def content_loop_checked_when_due(rid: int, out) -> None:
    """content_loop_due: on the plain path with the watchdogs armed, the content-loop check runs on
    the output before each token that brings the content count (output length - 1, rollbacks
    included, specs/watchdog.md §7.1) to k >= 48 with k % 16 == 0 (specs/scheduler.md §5.17 step 2),
    and a hit drops that token. So in a final output, no prefix out[:k] at such a k that is followed
    by another token may hold a loop: the check would have caught it."""
    for k in range(48, len(out), 16):
        if has_content_loop(out[:k]):
            raise Violation("content_loop_due", f"request {rid} has a content loop in its first {k} tokens, "
                                                f"yet token {k + 1} followed: the check due at content count "
                                                f"{k} did not run or did not fire")


def plain_path_only(config, model, request) -> bool:
    """Whether every token after the first goes through the plain sink: no drafting of any kind and
    no beams (specs/scheduler.md §5.15-5.17)."""
    return (not config.use_speculative and not config.ngram_speculative and not config.self_speculative
            and getattr(request, "num_beams", 1) == 1)


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
        if ended_eos or n >= request.max_tokens:
            # the deadline finishes only unfinished sequences (specs/scheduler.md §5.19 step 1)
            raise Violation("early_stop", f"request {rid} reports timeout after it finished "
                                          f"({'EOS' if ended_eos else 'budget spent'}, n={n})")
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
    tables = sum(map(_BLOCKS, device.live.values()))
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
    slots = [*map(_SLOT, state.rows), *map(_SLOT, state.prefilling)]  # (slots are never in the hot columns)
    if len(slots) != len(set(slots)):
        raise Violation("slots_unique", f"the scheduler has two sequences in one slot: {sorted(slots)}")
    dslots = list(map(_SLOT, device.live.values()))
    if len(dslots) != len(set(dslots)):
        raise Violation("slots_unique", f"the device has two sequences in one slot: {sorted(dslots)}")


def no_effect_on_released(effects, released: set, live: set, kinds: Optional[tuple] = None) -> None:
    """released sequences: no effect names a sequence after its release (until it is allocated
    again); a released slot is never used by an effect again. (An effect names the sequences of
    its ``seq``, of its ``seqs`` for the batched records, or of its ``entries``' first items;
    ``kinds``: the effects' types in order, when the caller has them. Only the effects that
    allocate, release or name a sequence are looked at: ``NAMING``.)"""
    roles = ROLES
    for at in NAMING[tuple(map(type, effects)) if kinds is None else kinds]:
        effect = effects[at]
        role = roles[type(effect)]
        if role & ALLOC:
            released.discard(effect.seq)
            live.add(effect.seq)
            continue
        if released and role & NAMES:
            seqs: tuple[int, ...] = ()
            if role & SEQ:
                seq = getattr(effect, "seq", None)
                if seq is not None:
                    seqs = (seq,)
            if not seqs:
                if role & SEQS:
                    seqs = effect.seqs
                elif role & ENTRIES:
                    seqs = tuple(e[0] for e in effect.entries)
            for s in seqs:
                if s in released:
                    raise Violation("no_effect_on_released",
                                    f"{type(effect).__name__} names sequence {s} after its release")
        if role & RELEASE:
            release_cache_flag(effect)
            released.add(effect.seq)
            live.discard(effect.seq)


RELEASE_CACHES = {"finish_sequence": True, "preempt_requeue": True, "spill_out_sequence": False,
                  "send_error": False}


def release_cache_flag(effect) -> None:
    """release: the prefix-cache flag follows the reason (specs/scheduler.md §5.20, §5.18, §5.9,
    specs/faults.md): a finished or requeued sequence's blocks enter the cache, a spilled or
    failed one's never do."""
    want = RELEASE_CACHES.get(str(effect.reason))
    if want is not None and effect.cache != want:
        raise Violation("release_cache_flag", f"ReleaseSeq of sequence {effect.seq} for {effect.reason} has "
                                              f"cache={effect.cache}")


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


SETTLED_PHASES = frozenset(getattr(phases, name) for name in (
    "AwaitCapacity", "AwaitSelfCapacity", "AwaitProposal", "AwaitBatchedProposal", "AwaitDflashDrafts",
    "AwaitDflashGate", "AwaitMtpGate", "AwaitSlot", "AwaitLaneAdapter", "AwaitFirstToken", "AwaitPrefillToken",
    "AwaitSwapOutFree", "AwaitSwapOutReclaim", "AwaitSwapInFree", "AwaitSwapInReclaim", "AwaitSwapInSlot",
    "AwaitRestore", "AwaitResumeFree", "AwaitResumeReclaim", "AwaitResumeSlot", "AwaitRotation", "AwaitInput"))
"""The queries that wait on no forward over active sequences (draft capacities, gates, proposals,
slots, adapters, free counts, restores, rotations, the inbox): when the scheduler parks on one, every
answer before it has been settled, so its view of each active sequence's KV is the device's
(``kv_mirror`` runs there as well as at every tick start)."""


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
            here = slot_of.get(effect.seq)
            if here is not None and target >= here:
                # compaction (§5.19 step 3) and a swap-out's move (§5.9 step 4) only ever move down
                raise Violation("compaction_target_free", f"{type(effect).__name__} moves sequence {effect.seq} from "
                                                          f"slot {here} up to slot {target}")
            if holders:
                raise Violation("compaction_target_free", f"{type(effect).__name__} moves sequence {effect.seq} "
                                                          f"into slot {target}, held by sequence {holders[0]}")
            slot_of[effect.seq] = target


def running_sequences(state: SchedulerState) -> set[int]:
    """The sequences the scheduler runs, which may hold a device sequence: active, prefilling and
    being restored."""
    running = set(map(_SEQ_ID, state.rows))  # (ids are never in the hot columns)
    if state.prefilling:
        running.update(map(_SEQ_ID, state.prefilling))
    if state.restoring:
        running.update(map(_SEQ_ID, state.restoring))
    return running


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


def decode_rows_within_limits(state: SchedulerState) -> None:
    """decode rows within limits (specs/scheduler.md §5.17, async.md §16.6): a plain decode feeds only
    sequences that have a token of their budget left and room for it below the context ceiling,
    counting a token kept on the device as produced (a sequence whose kept token is its last is
    only resolved, never fed again)."""
    waiting = state.waiting
    fed = set(waiting.seq_ids)
    limit = state.config.max_seq_len
    for seq in state.active:
        if seq.seq_id not in fed:
            continue
        # a row writes its input at position seq_len: below the ceiling; a kept token fed again would
        # itself have ended the sequence at the ceiling (the sink's seq_len + 1 >= max_seq_len)
        left = seq.remaining - (1 if seq.ahead else 0)
        if left < 1 or seq.seq_len + (1 if seq.ahead else 0) >= limit:
            raise Violation("decode_rows_within_limits",
                            f"sequence {seq.seq_id} (request {seq.request_id}) is fed with {left} tokens of its "
                            f"budget left and KV {seq.seq_len} of a {limit}-token context"
                            + (" (a token kept on the device)" if seq.ahead else ""))


def batch_bound(state: SchedulerState) -> None:
    """batch size: active + prefilling never exceed ``max_batch_size`` (specs/scheduler.md §5.4)."""
    n = len(state.rows) + len(state.prefilling)
    if n > state.config.max_batch_size:
        raise Violation("batch_bound", f"{len(state.rows)} active + {len(state.prefilling)} prefilling > "
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


def drafts_verified(state: SchedulerState, device) -> None:
    """every pending draft block is verified (specs/speculation.md §6.2 step 5): in a tick that
    verified drafts, and saw no fault, every active unfinished sequence still holding a proposal
    from an earlier tick was verified too (a gate's left-outs go serial after its chunks)."""
    proposed_at = getattr(device, "proposed_at", None)
    if not proposed_at or device.verify_tick != device.tick:
        return
    for seq in state.active:
        at = proposed_at.get(seq.seq_id)
        if at is not None and at < device.tick and not seq.finished:
            raise Violation("drafts_verified", f"sequence {seq.seq_id} holds drafts proposed in tick {at} that tick "
                                               f"{device.tick} did not verify, though it verified others")


def committed_kv(state: SchedulerState) -> int:
    """The KV blocks committed to everything in flight, by the rule book's formula (specs/scheduler.md
    §5.5 step 4): commitment(current, budget) = blocks_for(min(current + min(budget, W), max(W,
    current))) over active (seq_len + 1, remaining), prefilling (prompt_len, max_tokens), swapped
    (seq_len + 1, remaining) and preempted (len(tokens) + 1, remaining)."""
    w = state.config.admission_watermark
    bs = state.model.block_size

    def commit(current: int, budget: int) -> int:
        return min(current + min(budget, w), max(w, current)) // bs + 1

    total = sum(commit(s.seq_len + 1, s.remaining) for s in state.active)
    total += sum(commit(p.request.prompt_len, p.request.max_tokens) for p in state.prefilling)
    total += sum(commit(x.sequence.seq_len + 1, x.sequence.remaining) for x in state.swapped)
    total += sum(commit(len(q.tokens) + 1, q.sequence.remaining) for q in state.preempted)
    return total


def no_overtaking(selection, admitted, adapters, refused: set, committed: int, state: SchedulerState) -> None:
    """admission by the KV reservation (specs/scheduler.md §5.5 step 4): of a selection, the
    admitted requests are the longest prefix, in selection order, of the selected ones of their
    adapter cohort that were not refused whose commitments fit ``total_blocks`` on top of what was
    committed (the first is admitted anyway when nothing was); the first that does not fit stops
    the walk, so no later request overtakes it."""
    if not admitted or adapters is None:
        return

    def adapter(r) -> int:
        return adapters.get(getattr(r, "adapter_slot", -1), -1)

    cohort = adapter(admitted[0])
    candidates = [r for r in selection if adapter(r) == cohort and r.id not in refused]
    total = state.model.total_blocks
    want = []
    if total == 0:
        want = [r.id for r in candidates]
    else:
        w = state.config.admission_watermark
        for index, r in enumerate(candidates):
            need = min(r.prompt_len + min(r.max_tokens, w), max(w, r.prompt_len)) // state.model.block_size + 1
            if committed + need <= total or (index == 0 and committed == 0):
                committed += need
                want.append(r.id)
            else:
                break
    ids = [r.id for r in admitted]
    if ids != want:
        raise Violation("admission_order", f"admitted {ids} of the selection {[r.id for r in selection]}; the KV "
                                           f"reservation admits {want} (no overtaking)")


def refused_prompt(request, frame, max_seq_len: int) -> None:
    """refused prompt (specs/scheduler.md §5.5): a prompt as long as the context or longer is
    refused with an ``Error``; it never runs."""
    if request.prompt_len >= max_seq_len and not isinstance(frame, ErrorOut):
        raise Violation("refused_prompt", f"request {request.id} with a {request.prompt_len}-token prompt (context "
                                          f"{max_seq_len}) ended with {type(frame).__name__}, not an Error")


def error_justified(request, message: str, *, in_fault_step: bool, blamed, in_flight: bool, model,
                    config, adapter_id: int, requeued_kv: Optional[int] = None) -> None:
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
    if requeued_kv is None:
        if model.total_blocks and (request.prompt_len + request.max_tokens) // bs + 2 > model.total_blocks:
            return  # a requeue resume that can never fit (the bound of any KV it could hold)
    elif model.total_blocks and requeued_kv // bs + 2 > model.total_blocks:
        return  # a requeue resume that can never fit: want = len(tokens) // block_size + 1, plus 1 (§5.19 step 5)
    if in_fault_step:
        if not in_flight:
            raise Violation("early_stop", f"request {rid} failed by a fault before it arrived or after it ended")
        if blamed is not None and rid not in blamed:
            raise Violation("early_stop", f"request {rid} failed ({message}) by a fault of a call on {sorted(blamed)}")
        return
    raise Violation("early_stop", f"request {rid} failed ({message}) with no fault and no reason to refuse it")


def decode_rows(effect, device, requests) -> None:
    """plain decode rows (specs/scheduler.md §5.16, §5.11): a decode of several sequences lists them
    in slot order, and a host pick of a row is seeded with the request's seed plus its output
    length (the tokens already out: the KV holds prompt + output but the last token, which this
    decode feeds), with EOS masked exactly while that length is below ``min_tokens``."""
    seqs = effect.seqs
    live = device.live
    if len(seqs) > 1:
        slots = [live[i].slot for i in seqs if i in live]
        if slots != sorted(slots):
            raise Violation("decode_rows", f"a decode lists sequences {list(seqs)} in slots {slots}, not in slot order")
    if not effect.picks:
        return
    for seq_id, pick in zip(seqs, effect.picks, strict=False):
        s = live.get(seq_id)
        request = requests.get(device._rid(s)) if s is not None else None
        if request is None:
            continue
        out = s.seq_len - request.prompt_len + 1
        seed = getattr(request, "seed", 42) + out
        if pick.seed != seed or pick.mask_eos != (out < getattr(request, "min_tokens", 0)):
            raise Violation("decode_rows", f"request {request.id} with {out} tokens out picks with seed {pick.seed} "
                                           f"mask_eos={pick.mask_eos}; the rule says seed {seed}")


from fxsched.effects import plans  # noqa: E402


DRAFT_RULED = (dc.SlotDraftCapacity, dc.ProposeMulti, dc.ProposeBatched, dc.CatchupBatched, dc.DecodeVerify)
"""The effects ``Monitor._draft_rules`` looks at."""

DECODE_LANE = (plans.Decode, dc.DecodeCall, dc.SerialVerify, dc.DecodeVerifyBatched, dc.SlotDraftCapacity,
               dc.MixedForward, dc.MixedForwardBatch)
"""Effects only a decode-lane step or a mixed step makes: each sets ``last_decode_ms``
(specs/scheduler.md §5.4)."""


# --- the roles of an effect type: which checks of a batch it takes part in ----------------------------------

ALLOC = 1 << 0  # allocates ``seq``
RELEASE = 1 << 1  # a ReleaseSeq
SEQ = 1 << 2  # names its sequence in ``seq``
SEQS = 1 << 3  # names its sequences in ``seqs``
ENTRIES = 1 << 4  # names its sequences in ``entries`` (first items)
NAMES = SEQ | SEQS | ENTRIES
COMMIT = 1 << 5  # commits an accepted prefix
FOLD = 1 << 6  # gdn_fold_accepted
COMPACT = 1 << 7  # moves a sequence to another slot
SHUTDOWN = 1 << 8  # EpShutdown, Quiesce, Teardown
DRAFT = 1 << 9  # one of ``DRAFT_RULED``
DECODE = 1 << 10  # one of ``DECODE_LANE``
PLAN = 1 << 11  # a plain decode plan
BATCHED = 1 << 12  # a batched record standing for several effects (``split``: see ``expand_batched``)
OUT = 1 << 13  # streams tokens to a client (``TokenOut``, ``TokensOut``)
CHECKPOINT = 1 << 14  # a Marconi checkpoint of the plain sink
CUT = 1 << 15  # cuts a sequence's KV back after a verify (``frames.CUTS_ONE``, ``frames.CUTS_MANY``)


def effect_role(cls: type) -> int:
    """The roles of effect type ``cls``, by the same class tests the checks make one effect at a time."""
    role = 0
    if issubclass(cls, (dc.AllocSequence, dc.AllocSequenceFor)):
        role |= ALLOC
    if issubclass(cls, lc.ReleaseSeq):
        role |= RELEASE
    if hasattr(cls, "seq") or not attrs.has(cls) or "seq" in attrs.fields_dict(cls):
        role |= SEQ  # a ``seq`` it may hold (read from the effect itself)
    if issubclass(cls, (dc.DecodeVerifyBatched, dc.ProposeBatched, plans.Decode)):
        role |= SEQS
    if issubclass(cls, (dc.CommitCtxBatch, dc.CommitAcceptedPrefixBatch, dc.TrimProposerStateBatch,
                        dc.TruncateSequences)):
        role |= ENTRIES
    if issubclass(cls, (dc.CommitAcceptedPrefix, dc.CommitAcceptedPrefixBatch)):
        role |= COMMIT
    if issubclass(cls, dc.GdnFoldAccepted):
        role |= FOLD
    if issubclass(cls, (lc.CompactSlot, dc.CompactSequence)):
        role |= COMPACT
    if issubclass(cls, (lc.EpShutdown, lc.Quiesce, lc.Teardown)):
        role |= SHUTDOWN
    if issubclass(cls, DRAFT_RULED):
        role |= DRAFT
    if issubclass(cls, DECODE_LANE):
        role |= DECODE
    if issubclass(cls, plans.Decode):
        role |= PLAN
    if hasattr(cls, "split"):
        role |= BATCHED
    if issubclass(cls, (TokenOut, TokensOut)):
        role |= OUT
    if issubclass(cls, (lc.MarconiCheckpoint, lc.MarconiCheckpoints)):
        role |= CHECKPOINT
    if issubclass(cls, CUTS_ONE + CUTS_MANY):
        role |= CUT
    return role


class _Memo(dict):
    """A dict that fills itself: a missing key's value is ``work(key)``, kept (at most ``bound``
    keys: past that it starts afresh)."""

    def __init__(self, work: Any, bound: int = 65536) -> None:
        super().__init__()
        self.work, self.bound = work, bound

    def __missing__(self, key: Any) -> int:
        if len(self) >= self.bound:
            self.clear()
        value = self[key] = self.work(key)
        return value


ROLES: dict[type, int] = _Memo(effect_role)
"""Effect type -> its roles (``effect_role``), worked out once per type."""


def batch_roles(kinds) -> int:
    """The roles of a batch of effects of types ``kinds``: the union of theirs."""
    union = 0
    for cls in kinds:
        union |= ROLES[cls]
    return union


BATCH_ROLES: dict[tuple, int] = _Memo(batch_roles)
"""A batch's effect types, in order (its signature) -> ``batch_roles``, worked out once per
signature: the walk's batches repeat a few hundred signatures."""


def naming(kinds) -> tuple[int, ...]:
    """Where in a batch of effects of types ``kinds`` an effect allocates, releases or names a
    sequence (what ``no_effect_on_released`` reads)."""
    return tuple(at for at, cls in enumerate(kinds) if ROLES[cls] & (ALLOC | RELEASE | NAMES))


NAMING: dict[tuple, tuple[int, ...]] = _Memo(naming)
"""A batch's signature -> ``naming``, worked out once per signature."""


# --- the kinds of an event: what ``Monitor.on_event`` does with it ----------------------------------------

INPUT = 1 << 0  # one of ``ev.INPUT_EVENTS``
CLOCK = 1 << 1
CANCEL = 1 << 2
ARRIVAL = 1 << 3
FAULT = 1 << 4  # a ``DeviceFault``


def event_kind(cls: type) -> int:
    """The kind of event type ``cls``, by the class tests ``Monitor.on_event`` makes."""
    kind = INPUT if issubclass(cls, ev.INPUT_EVENTS) else 0
    for bit, base in ((CLOCK, ev.Clock), (CANCEL, ev.Cancel), (ARRIVAL, ev.Arrival), (FAULT, ev.DeviceFault)):
        if issubclass(cls, base):
            kind |= bit
    return kind


EVENT_KINDS: dict[type, int] = _Memo(event_kind)
"""Event type -> its kind (``event_kind``), worked out once per type."""


def admission_ran(state: SchedulerState, now_ms: float, last_decode_ms: float, selected: bool) -> None:
    """admission decision (specs/scheduler.md §5.4 step 3), checked at the tick's publish, which
    directly follows the selection and its admission check (``selected``: the tick asked the
    adapter ids of a selection; the check may defer some back): with requests pending and a free
    seat the tick selects some
    unless the policy declines; FIFO never declines, SLAI declines exactly while something is
    active and ``now − last_decode ≥ 0.8 × slai_deadline_ms`` (``last_decode`` is the checker's
    own clock reading at the last decode-lane or mixed step)."""
    config = state.config
    cap = config.max_batch_size - len(state.active) - len(state.prefilling) - len(state.new_requests)
    if not selected and (not state.pending or cap <= 0):
        return
    declines = (config.policy == "slai" and bool(state.active)
                and now_ms - last_decode_ms >= 0.8 * config.slai_deadline_ms)
    if declines and selected:
        raise Violation("admission_decision", f"SLAI admitted at {now_ms} ms, {now_ms - last_decode_ms} ms after the "
                                              f"last decode (deadline {config.slai_deadline_ms} ms): it must decline")
    if not declines and not selected:
        raise Violation("admission_decision", f"{config.policy} admitted nothing at {now_ms} ms with requests pending "
                                              f"and {cap} seats free (last decode at {last_decode_ms} ms)")


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
    early-stop causes, the admission order and decision, the KV reservation, the batch bound, the
    packed slots, refused prompts, the draft count, drafts for finished sequences, every pending
    draft block verified, the preemption victim (with the checker's own immunity record), cancels
    ending streams. Every batch's release flags, compaction moves and decode rows are checked too.
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
        self.requeued_kv: dict[int, int] = {}  # request id -> KV tokens it held when preempted (requeued)
        self.last_decode_rows: tuple[int, ...] = ()
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

    def on_effects(self, effects, kinds: Optional[tuple] = None) -> None:
        """A batch of effects, before it is carried out (``kinds``: their types in order, when the
        caller has them). The roles of its effect types (``BATCH_ROLES``) say which checks have
        anything to look at in it: a check that none of the batch's effects takes part in would
        pass, so it does not run (a batch of no role at all is done with at once)."""
        if not effects:
            return
        if kinds is None:
            kinds = tuple(map(type, effects))
        roles = BATCH_ROLES[kinds]
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
            compaction_target_free(effects, self.device)
        if roles & CHECKPOINT and roles & OUT and self.rids:  # (batched records are expanded by now)
            tokens_after_checkpoints(effects, self.device)
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
                        decode_rows(effect, self.device, self.requests)
        else:
            acts = roles
            if roles & (ALLOC | PLAN):
                table = ROLES
                for effect in effects:
                    role = table[type(effect)]
                    if role & ALLOC and effect.session:
                        self.served.add(effect.session)
                    elif role & PLAN and self.rids:
                        decode_rows(effect, self.device, self.requests)
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

    def _preemption(self, effects) -> None:
        """preemption victim (specs/scheduler.md §5.18): after a KV-exhausted decode, the sequence
        preempted (requeued or spilled) is, among the failed decode's rows, the smallest
        (output length, slot), ignoring the rows still immune unless all are. Immunity is the
        checker's own record: a sequence requeue-resumed after a preemption is immune until its
        output grows by ``preemption_immunity_tokens`` (§5.19 step 5; a swap-in keeps what it had)."""
        rows: tuple[int, ...] = self.last_decode_rows
        # a sequence ahead has produced one token more than its output holds (specs/async.md §16.6)
        self.prev_active = {seq.seq_id: (len(seq.output) + (1 if seq.ahead else 0), seq.slot, seq.request.id,
                                         seq.seq_id)
                            for seq in (self.seen_state.active if self.seen_state is not None else ())}
        resolved = self.fault_resolved
        if resolved and self.seen_state is not None:  # rows a resolved token ended are no victims
            rows = tuple(i for i in rows if not (i in resolved and finishes_on(self.seen_state, i, resolved[i])))
        for effect in effects:
            if isinstance(effect, plans.Decode):
                rows = effect.seqs
            elif (isinstance(effect, lc.ReleaseSeq) and self.kv_fault
                  and str(effect.reason) in ("preempt_requeue", "spill_out_sequence")):
                known = [self.prev_active[i] for i in rows if i in self.prev_active]
                if len(known) == len(rows) and effect.seq in rows:
                    mortal = [k for k in known if k[0] >= self.immune.get(k[2], 0)] or known
                    want = min(mortal)
                    if want[3] != effect.seq:
                        raise Violation("preemption_victim", f"preempted sequence {effect.seq}; of the failed rows "
                                                             f"(output, slot, request, seq) {sorted(known)} with "
                                                             f"immunity {self.immune} the rule picks {want[3]}")
                self.kv_fault = False
            if isinstance(effect, lc.ReleaseSeq) and str(effect.reason) in ("preempt_requeue", "spill_out_sequence"):
                rid = self.prev_active.get(effect.seq, (0, 0, None, 0))[2]
                if rid is not None:
                    self.moved.add(rid)
                    self.progress.let_go(rid)
                    if str(effect.reason) == "spill_out_sequence":  # it comes back without its cancel flag
                        self.flagless.add(rid)
                        self.cancelled.discard(rid)
                    if str(effect.reason) == "preempt_requeue":
                        self.evicted.add(rid)
                        held = self.device.live.get(effect.seq)
                        if held is not None:
                            self.requeued_kv[rid] = held.seq_len
        self.last_decode_rows = rows

    def _draft_rules(self, effects) -> None:
        """The draft count of a step and who may get drafts (specs/speculation.md §6.2, §6.15):
        every proposal asks for count = min(base, the step's capacities) drafts, where base is
        ``num_drafts`` for DFlash and the MTP ladder (3 while at most 8 sequences are active,
        else 1, clamped to [1, num_drafts]) for MTP; a self-speculative verify feeds
        min(num_drafts, capacity) drafts; and no proposal or catch-up names a sequence whose
        request has spent its budget (its last token is out, earlier in the same batch or before)."""
        config = self.config
        device = self.device
        out: dict[int, int] = {}
        roles = ROLES
        for effect in effects:
            if not roles[type(effect)] & (DRAFT | OUT):
                continue
            if isinstance(effect, dc.SlotDraftCapacity):
                self.capacity_query = (len(device.capacity_log), len(effect.slots))
            elif isinstance(effect, (TokenOut, TokensOut)):
                rid = effect.request_id
                out[rid] = out.get(rid, len(self.streamed.get(rid, ()))) + (
                    1 if isinstance(effect, TokenOut) else len(effect.tokens))
            elif isinstance(effect, (dc.ProposeMulti, dc.ProposeBatched, dc.CatchupBatched, dc.DecodeVerify)):
                start, n_active = self.capacity_query
                caps = device.capacity_log[start:start + n_active]
                if isinstance(effect, dc.DecodeVerify):
                    if config.self_speculative and caps:
                        count = min([config.num_drafts] + caps)
                        if len(effect.tokens) - 1 != count:
                            raise Violation("draft_count", f"a self-speculative verify feeds {len(effect.tokens) - 1} "
                                                           f"drafts, the step's count is {count}")
                    continue
                if isinstance(effect, dc.CatchupBatched):
                    batch = device.batch_seqs
                    seqs = tuple(batch[s // 4] for s in effect.slots if s // 4 < len(batch))
                else:
                    seqs = (effect.seq,) if isinstance(effect, dc.ProposeMulti) else effect.seqs
                    if config.dflash:
                        base = config.num_drafts
                    else:
                        base = max(1, min(3 if n_active <= 8 else 1, config.num_drafts))
                    count = min([base] + caps)
                    if len(caps) == n_active and effect.n != count:
                        raise Violation("draft_count", f"{type(effect).__name__} asks {effect.n} drafts with "
                                                       f"{n_active} active and capacities {caps}; the count is {count}")
                for seq_id in seqs:
                    s = device.live.get(seq_id)
                    request = self.requests.get(device._rid(s)) if s is not None else None
                    if request is None or not getattr(request, "streaming", True):
                        continue
                    rid = request.id
                    if out.get(rid, len(self.streamed[rid])) >= request.max_tokens:
                        raise Violation("finished_gets_drafts", f"{type(effect).__name__} names sequence {seq_id} "
                                                                f"of request {rid}, whose budget is spent")

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
        self.seen_state = state
        if type(state.waiting) is phases.AwaitDecode and state.config.async_scheduling:
            decode_rows_within_limits(state)
        rows, prefilling, restoring = state.rows, state.prefilling, state.restoring  # (see ``running_sequences``)
        epoch = device.epoch if self.counts_epochs else None
        device_new = epoch is None or epoch != self.seen_epoch
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
        phase = type(state.waiting)  # (no phase record is subclassed)
        if phase in SETTLED_PHASES and (device_new or rows is not self.mirrored or settled is not self.mirrored_settled):
            kv_mirror(state, device)  # (the answers before this query are settled)
            self.mirrored, self.mirrored_settled = rows, settled
        if self.progress.deadlines:
            self.progress.on_state(state, self.now_ms)
        if phase is AwaitInput and not repeat:  # (input events while it waits fill the inbox)
            no_idle_with_work(state)
        if phase is AwaitPublishBlocks:
            if not repeat and self.config is not None:
                admission_ran(state, self.now_ms, self.last_decode_ms, self.selected_in_tick)
                self.selected_in_tick = False
        elif phase is AwaitAdapterIds:
            self.selected_in_tick = True
            self.admitting = state.waiting.new
            self.committed = committed_kv(state)
            return
        if self.admitting:  # the tick's admission check is done: the whole-state checks of a tick start
            self._tick_checks(state, running)

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
                      self.committed, state)
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
        missing = [rid for rid in self.requests if rid not in self.final]
        if missing:
            raise Violation("one_terminal_output", f"requests {missing} never got a final frame")
        if len(self.shutdown_tail) != len(SHUTDOWN_ORDER):
            raise Violation("shutdown_order", f"the run ended after {self.shutdown_tail}")
