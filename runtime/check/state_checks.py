"""The scheduler's state and the device's against the rule book (specs/checker.md §11.2): blocks and
slots, the KV mirror, releases and their caches, compaction, shutdown order, admission, drafts and
the rows of a decode. Called by ``invariants.Monitor`` after the steps whose effects they read."""

from __future__ import annotations

from operator import attrgetter

from typing import Optional


from fxsched.core.state import SchedulerState, hot_columns
from fxsched.core import phases
from fxsched.core.events import LATE_TOKEN
from fxsched.effects import device_calls as dc
from fxsched.effects import lifecycle as lc
from fxsched.effects.client import ErrorOut
from fxsched.runtime.check.violation import Violation
from fxsched.runtime.check.roles import ALLOC, ENTRIES, NAMES, NAMING, RELEASE, ROLES, SEQ, SEQS

_SEQ_ID, _SLOT, _BLOCKS = attrgetter("seq_id"), attrgetter("slot"), attrgetter("blocks")


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
    if state.rows or state.prefilling or state.swapped or state.preempted or state.restoring:
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
    """the scheduler's view of each active sequence's KV (length, blocks) equals the device's. (The
    length and blocks of ``active`` read from the hot columns where they stand over ``rows``, the
    records left as they are.)"""
    live = device.live
    for seq, seq_len, blocks in _hot_lengths(state):
        dev = live.get(seq.seq_id)
        if dev is None:
            raise Violation("kv_mirror", f"active sequence {seq.seq_id} holds no device sequence")
        if dev.seq_len != seq_len or dev.blocks != blocks or dev.slot != seq.slot:
            raise Violation("kv_mirror", f"sequence {seq.seq_id}: scheduler len={seq_len} blocks={blocks} "
                                         f"slot={seq.slot}, device len={dev.seq_len} blocks={dev.blocks} slot={dev.slot}")


def _hot_lengths(state: SchedulerState):
    """(record, seq_len, blocks) of each active sequence, in order: the lengths and blocks of
    ``state.active``, without building its records (``rows``' own ids and slots are exact)."""
    settled = hot_columns(state)
    if settled is None:
        return ((seq, seq.seq_len, seq.blocks) for seq in state.rows)
    return zip(state.rows, settled.seq_len, settled.blocks, strict=True)


def compaction_target_free(effects, device, active: tuple = ()) -> None:
    """compaction: a CompactSlot moves its sequence down into a slot no other live sequence holds.
    The holders are the device's slots when the batch starts, updated in order by the batch's own
    releases and moves (a retire releases the finished sequences before it packs the survivors).
    Which slot the rule book fixes:

    - a swap-out's move (specs/scheduler.md §5.9 step 4) follows the spill's release, into the
      victim's slot;
    - end-of-tick compaction (§5.19 step 3) moves only a sequence at slot n or above (n: the slots
      held), into the largest free slot below n, the survivors in active order (``active``: the
      records before the batch, which retirement thins but never reorders)."""
    if not any(isinstance(e, (lc.CompactSlot, dc.CompactSequence)) for e in effects):
        return
    slot_of = {seq_id: s.slot for seq_id, s in device.live.items()}
    rank = {s.seq_id: i for i, s in enumerate(active)}
    last_rank = -1
    spilled: Optional[int] = None  # the slot the last spill freed, until a move takes it
    for effect in effects:
        if isinstance(effect, (lc.ReleaseSeq, dc.FreeSequence)):
            slot_of.pop(effect.seq, None)
            if isinstance(effect, lc.ReleaseSeq) and str(effect.reason) == "spill_out_sequence":
                spilled = effect.slot
        elif isinstance(effect, (lc.CompactSlot, dc.CompactSequence)):
            target = effect.target if isinstance(effect, lc.CompactSlot) else effect.new_slot
            name = type(effect).__name__
            holders = [s for s, slot in slot_of.items() if slot == target and s != effect.seq]
            here = slot_of.get(effect.seq)
            if here is not None and target >= here:
                raise Violation("compaction_target_free", f"{name} moves sequence {effect.seq} from slot {here} up "
                                                          f"to slot {target}")
            if holders:
                raise Violation("compaction_target_free", f"{name} moves sequence {effect.seq} into slot {target}, "
                                                          f"held by sequence {holders[0]}")
            if spilled is not None:
                if target != spilled:
                    raise Violation("compaction_target_free", f"a swap-out moves sequence {effect.seq} to slot "
                                                              f"{target}, not the spilled victim's {spilled}")
                spilled = None
            elif here is not None:
                at = rank.get(effect.seq, last_rank)
                if at < last_rank:
                    raise Violation("compaction_target_free", f"{name} moves sequence {effect.seq} after a sequence "
                                                              f"behind it in active order: survivors move in active "
                                                              f"order (specs/scheduler.md §5.19 step 3)")
                last_rank = at
                n = len(slot_of)
                held = set(slot_of.values())
                free = [t for t in range(n) if t not in held]
                if here < n or not free or target != free[-1]:
                    raise Violation("compaction_target_free", f"{name} moves sequence {effect.seq} from slot {here} "
                                                              f"to {target}; with {n} slots held the rule moves only "
                                                              f"a slot >= {n}, into the largest free one below it "
                                                              f"({free[-1] if free else 'none'})")
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
    n = len(state.rows) + len(state.prefilling)
    high = [(s.seq_id, s.slot) for s in state.rows if s.slot >= n]  # (ids and slots are never in the hot columns)
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

    settled = hot_columns(state)  # (remaining = end - seq_len in the columns: core/state.py's hot_fields)
    if settled is None:
        total = sum(commit(s.seq_len + 1, s.remaining) for s in state.rows)
    else:
        total = sum(commit(n + 1, end - n) for n, end in zip(settled.seq_len, settled.end, strict=True))
    total += sum(commit(p.request.prompt_len, p.request.max_tokens) for p in state.prefilling)
    total += sum(commit(x.sequence.seq_len + 1, x.sequence.remaining) for x in state.swapped)
    total += sum(commit(len(q.tokens) + 1, q.sequence.remaining) for q in state.preempted)
    return total


def no_overtaking(selection, admitted, adapters, refused: set, committed: int, state: SchedulerState,
                  running_slot: Optional[int] = None) -> None:
    """admission by the KV reservation (specs/scheduler.md §5.5 steps 3 and 4): of a selection, the
    admitted requests are the longest prefix, in selection order, of the selected ones of the
    adapter cohort (of all, with ``mixed_adapters``) that were not refused whose commitments fit
    ``total_blocks`` on top of what was committed (the first is admitted anyway when nothing was);
    the first that does not fit stops the walk, so no later request overtakes it. The cohort is
    the adapter of the first sequence running when the check began (``running_slot``: active, else
    prefilling), else the first selected request's that was not refused."""
    if adapters is None:
        return

    def adapter(r) -> int:
        return adapters.get(getattr(r, "adapter_slot", -1), -1)

    served = [r for r in selection if r.id not in refused]
    if not served:
        return
    cohort = adapters.get(running_slot, -1) if running_slot is not None else adapter(served[0])
    mixed = state.config.mixed_adapters  # no cohort: every request not refused is a candidate
    candidates = [r for r in selection if (mixed or adapter(r) == cohort) and r.id not in refused]
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



def decode_rows(effect, device, requests, ended=frozenset()) -> None:
    """plain decode rows (specs/scheduler.md §5.16, §5.11): a decode of several sequences lists them
    in slot order, and a host pick of a row is seeded with the request's seed plus its output
    length (the tokens already out: the KV holds prompt + output but the last token, which this
    decode feeds), with EOS masked exactly while that length is below ``min_tokens``. A sequence
    holding a token on the device that a cancel already ends (its request in ``ended``) is only
    resolved, never fed again (specs/async.md §16.6 rule 2)."""
    seqs = effect.seqs
    live = device.live
    if ended and LATE_TOKEN in effect.tokens:
        for token, seq_id in zip(effect.tokens, seqs, strict=False):
            s = live.get(seq_id)
            if token == LATE_TOKEN and s is not None and device._rid(s) in ended:
                raise Violation("ahead_ends_at_cancel", f"sequence {seq_id} (request {device._rid(s)}) is fed its "
                                                        f"kept token after a cancel ended it")
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


def ledgers_closed(device, final: dict) -> None:
    """ledgers: when the run ends, the simulated device's accounts (runtime/devices/ledger.py) hold
    nothing but the spill files of requests that ended in an error (the engine's teardown deletes
    those with its private folder; a request that finished or was served left one behind only by a
    path that saved its state and never restored it)."""
    ledger = getattr(device, "ledger", None)
    if ledger is None:
        return
    for kind, held in ledger.open().items():
        if kind == "spill file":
            held = {seq: rid for seq, rid in held.items() if not isinstance(final.get(rid), ErrorOut)}
        if held:
            raise Violation("ledgers_closed", f"the run ended with {kind}s still held: {held} (key: holder)")


def admission_ran(state: SchedulerState, now_ms: float, last_decode_ms: float, selected: bool) -> None:
    """admission decision (specs/scheduler.md §5.4 step 3), checked at the tick's publish, which
    directly follows the selection and its admission check (``selected``: the tick asked the
    adapter ids of a selection; the check may defer some back): with requests pending and a free
    seat the tick selects some
    unless the policy declines; FIFO never declines, SLAI declines exactly while something is
    active and ``now − last_decode ≥ 0.8 × slai_deadline_ms`` (``last_decode`` is the checker's
    own clock reading at the last decode-lane or mixed step)."""
    config = state.config
    # (``rows`` holds as many records as ``active``: the hot columns stand over these very records)
    cap = config.max_batch_size - len(state.rows) - len(state.prefilling) - len(state.new_requests)
    if not selected and (not state.pending or cap <= 0):
        return
    declines = (config.policy == "slai" and bool(state.rows)
                and now_ms - last_decode_ms >= 0.8 * config.slai_deadline_ms)
    if declines and selected:
        raise Violation("admission_decision", f"SLAI admitted at {now_ms} ms, {now_ms - last_decode_ms} ms after the "
                                              f"last decode (deadline {config.slai_deadline_ms} ms): it must decline")
    if not declines and not selected:
        raise Violation("admission_decision", f"{config.policy} admitted nothing at {now_ms} ms with requests pending "
                                              f"and {cap} seats free (last decode at {last_decode_ms} ms)")
