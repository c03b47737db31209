"""DFlash: block drafts verified on the raw argmax (speculation.md §6.4, §6.9, §6.10, §6.12).

Invariants kept: a batched verify folds the GDN state (``gdn_fold_accepted``) before any
``commit_accepted_prefix``; every sequence of the batch gets its commit, finished or not; only
unfinished sequences are trimmed and re-proposed.
"""

from __future__ import annotations

import attrs

from fxsched.core.planted import planted
from fxsched.core.records import replace

from fxsched.core.emit import spec_tokens
from fxsched.core.events import BatchVerifyAllowed, Drafts, VerifyRows
from fxsched.core.machine import answer_rule, ask, find_seq, push, put_seq, put_seqs, task_rule
from fxsched.core.sequence import Sequence
from fxsched.core.spec_step import propose, propose_after_batch
from fxsched.core.state import SchedulerState
from fxsched.core.verdict import accepted_prefix, verify_width
from fxsched.effects import device_calls as dc


@attrs.frozen
class AwaitDflashDrafts:
    """A bootstrap's first block of drafts."""

    seq_id: int
    draft_count: int


@attrs.frozen
class AwaitDflashVerify:
    seq_id: int
    drafts: tuple[int, ...]
    pre_len: int
    draft_count: int


@attrs.frozen
class AwaitDflashGate:
    batchable: tuple[int, ...]
    rest: tuple[int, ...]
    k: int
    m: int
    draft_count: int


@attrs.frozen
class BatchedDflashVerify:
    seq_ids: tuple[int, ...]
    k: int
    draft_count: int


@attrs.frozen
class AwaitBatchedDflash:
    seq_ids: tuple[int, ...]
    drafts: tuple[tuple[int, ...], ...]
    pre_lens: tuple[int, ...]
    k: int
    draft_count: int


# --- bootstrap ----------------------------------------------------------------------------------


def bootstrap(state: SchedulerState, seq_id: int, draft_count: int, out: list) -> SchedulerState:
    """No standalone decode: propose straight from the last token, then verify through K = 4."""
    seq = find_seq(state, seq_id)
    query = dc.ProposeMulti(token=seq.last_token, pos=seq.seq_len, n=draft_count, seq=seq_id)
    return ask(state, out, query, AwaitDflashDrafts(seq_id, draft_count))


@answer_rule(AwaitDflashDrafts, Drafts)
def _bootstrap_drafts(state, waiting: AwaitDflashDrafts, event: Drafts, out):
    from fxsched.core.kverify import start_k_verify

    if not event.drafts:  # nothing to verify: decode the last token instead, so the sequence moves on
        from fxsched.core.kverify import mtp_bootstrap

        return mtp_bootstrap(state, waiting.seq_id, waiting.draft_count, out)
    seq = find_seq(state, waiting.seq_id)
    k = verify_width(len(event.drafts), len(event.drafts))
    return start_k_verify(state, seq, event.drafts, k, waiting.draft_count, True, out)


# --- serial verify -------------------------------------------------------------------------------


def serial_verify(state: SchedulerState, seq: Sequence, draft_count: int, out: list) -> SchedulerState:
    """One sequence's block verify over ``[L] + drafts``."""
    drafts = seq.drafts
    out.append(dc.SyncSecondaryCall())
    query = dc.DecodeVerifyDflash(seq.seq_id, (seq.last_token,) + drafts)
    pre = seq.seq_len
    seq = _grown(seq, pre + len(drafts) + 1, state)
    state = put_seq(state, replace(seq, drafts=()))
    return ask(state, out, query, AwaitDflashVerify(seq.seq_id, drafts, pre, draft_count))


def _grown(seq: Sequence, seq_len: int, state: SchedulerState) -> Sequence:
    from fxsched.core.decode import grow

    return grow(seq, seq_len, state.model.block_size)


def _settle(seq: Sequence, drafts, rows, pre: int, row: int, out: list, config) -> tuple[Sequence, int]:
    """Rewind to the accepted prefix, commit the drafter context and emit; returns (seq, na)."""
    from fxsched.core.kverify import settled

    na = accepted_prefix(drafts, rows)
    changes = settled(seq, pre, pre + na + 1, out, config)
    out.append(dc.CommitCtx(seq.seq_id, na + 1, pre, row))
    seq = spec_tokens(seq, tuple(drafts[:na]) + (rows[na],), config, out, changes)
    return seq, na


@answer_rule(AwaitDflashVerify, VerifyRows)
def _dflash_verified(state, waiting: AwaitDflashVerify, event: VerifyRows, out):
    seq = find_seq(state, waiting.seq_id)
    k = len(waiting.drafts) + 1
    seq, na = _settle(seq, waiting.drafts, event.rows, waiting.pre_len, 0, out, state.config)
    state = put_seq(state, seq)
    if seq.finished:
        return state
    out.append(dc.CommitAcceptedPrefix(seq.seq_id, na + 1, k))
    out.append(dc.SaveHiddenForMtp(na))
    out.append(dc.TrimProposerState(seq.seq_id, na))
    return propose(state, seq.seq_id, waiting.draft_count, out)


# --- the batching gate ----------------------------------------------------------------------------


def gate(state: SchedulerState, seq_ids: tuple[int, ...], draft_count: int, out: list) -> SchedulerState:
    """Batch the verify sequences holding exactly as many drafts as the first one, if the device lets us."""
    from fxsched.core.kverify import SerialVerify

    by_id = {s.seq_id: s for s in state.active}
    seqs = [by_id[i] for i in seq_ids]
    gamma = len(seqs[0].drafts)
    batchable = tuple(s.seq_id for s in seqs if len(s.drafts) == gamma)
    rest = tuple(s.seq_id for s in seqs if len(s.drafts) != gamma)
    if len(batchable) < 2:
        return push(state, *(SerialVerify(i, draft_count) for i in seq_ids))
    return _ask_gate(state, AwaitDflashGate(batchable, rest, gamma + 1, len(batchable), draft_count), out)


def _ask_gate(state: SchedulerState, waiting: AwaitDflashGate, out: list) -> SchedulerState:
    return ask(state, out, dc.CanBatchVerify((waiting.k,) * waiting.m), waiting)


@answer_rule(AwaitDflashGate, BatchVerifyAllowed)
def _gate_answer(state, waiting: AwaitDflashGate, event: BatchVerifyAllowed, out):
    from fxsched.core.kverify import SerialVerify

    if not event.allowed:
        if waiting.m - 1 >= 2:
            return _ask_gate(state, replace(waiting, m=waiting.m - 1), out)
        return push(state, *(SerialVerify(i, waiting.draft_count) for i in waiting.batchable + waiting.rest))
    m, ids = waiting.m, waiting.batchable
    chunks = [ids[i:i + m] for i in range(0, len(ids), m)]
    batched = [c for c in chunks if len(c) >= 2]
    singles = {i for c in chunks if len(c) < 2 for i in c} | set(waiting.rest)
    serial = [s.seq_id for s in state.active if s.seq_id in singles]
    tasks = [BatchedDflashVerify(c, waiting.k, waiting.draft_count) for c in batched]
    tasks += [SerialVerify(i, waiting.draft_count) for i in serial]
    return push(state, *tasks)


# --- batched verify -------------------------------------------------------------------------------


@task_rule(BatchedDflashVerify)
def _batched_verify(state: SchedulerState, task: BatchedDflashVerify, out: list) -> SchedulerState:
    """One verify over every sequence of the chunk. While it is outstanding the sequence records
    still show the KV before it; the waiting record holds the drafts and lengths in flight."""
    by_id = {s.seq_id: s for s in state.active}
    if any(i not in by_id for i in task.seq_ids):  # a fault failed some since the gate
        from fxsched.core.kverify import SerialVerify

        return push(state, *(SerialVerify(i, task.draft_count) for i in task.seq_ids if i in by_id))
    seqs = [by_id[i] for i in task.seq_ids]
    tokens = []
    for s in seqs:
        tokens.append(s.last_token)
        tokens.extend(s.drafts)
    out.append(dc.SyncSecondaryCall())
    query = dc.DecodeVerifyBatched(tokens=tokens, ks=(task.k,) * len(seqs), seqs=task.seq_ids, stream=0, woa=True)
    waiting = AwaitBatchedDflash(task.seq_ids, tuple(s.drafts for s in seqs), tuple(s.seq_len for s in seqs),
                                 task.k, task.draft_count)
    return ask(state, out, query, waiting)


@answer_rule(AwaitBatchedDflash, VerifyRows)
def _batched_verified(state, waiting: AwaitBatchedDflash, event: VerifyRows, out):
    """Settle every sequence (rewind, drafter context, emits), fold, then commit all of them."""
    k, config, block_size = waiting.k, state.config, state.model.block_size
    by_id = {s.seq_id: s for s in state.active}
    rows_all = event.rows
    settled, accepted, truncations, contexts, emits = [], [], [], [], []
    # test-only planted bugs, looked up once per batch (the loop is the hot path)
    off_by_one = planted(config, "accepted_prefix_off_by_one")
    rewind = not planted(config, "no_rewind_on_reject")
    bonus = 1 if planted(config, "acc_counts_bonus") else 0
    for i, seq_id in enumerate(waiting.seq_ids):
        seq, drafts, pre = by_id[seq_id], waiting.drafts[i], waiting.pre_lens[i]
        rows = rows_all[i * k:(i + 1) * k]
        na = accepted_prefix(drafts, rows)
        if off_by_one and na < len(drafts):
            na += 1
        seq_len = pre + na + 1
        if seq_len < pre + k and rewind:
            truncations.append((seq_id, seq_len))
        contexts.append((seq_id, na + 1, pre, i))
        need = (pre + k) // block_size + 1  # the verify grew the table to cover all k rows
        blocks = seq.blocks if seq.blocks >= need else need
        seq = spec_tokens(seq, drafts[:na] + (rows[na],), config, emits,
                          {"seq_len": seq_len, "drafts": (), "blocks": blocks,
                           "acc": seq.acc + na + bonus})
        settled.append(seq)
        accepted.append(na + 1)
    if truncations:
        out.append(dc.TruncateSequences(tuple(truncations)))
    out.append(dc.CommitCtxBatch(tuple(contexts)))
    out.extend(emits)
    fold = dc.GdnFoldAccepted(tuple(s.slot for s in settled), tuple(accepted), k)
    commits = dc.CommitAcceptedPrefixBatch(tuple((s.seq_id, n, k) for s, n in zip(settled, accepted)))
    out.extend((commits, fold) if planted(config, "commit_before_fold") else (fold, commits))
    out.append(dc.StashVerifyHiddenRows(tuple(i * k + n - 1 for i, n in enumerate(accepted))))
    pending = [(i, s.seq_id) for i, s in enumerate(settled) if not s.finished]
    if pending:
        out.append(dc.TrimProposerStateBatch(tuple((settled[i].seq_id, accepted[i] - 1) for i, _ in pending)))
    state = put_seqs(state, {s.seq_id: s for s in settled})
    return propose_after_batch(state, pending, waiting.draft_count, out)
