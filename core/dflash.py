"""Rules of DFlash: block drafts verified on the raw argmax (specs/speculation.md §6.4, §6.9,
§6.10, §6.12).

Invariants kept: a batched verify folds the GDN state (``gdn_fold_accepted``) before any
``commit_accepted_prefix``; every sequence of the batch gets its commit, finished or not; only
unfinished sequences are trimmed and re-proposed.
"""

from __future__ import annotations

from fxsched.core.agenda import ask, by_id, find_seq, push, put_seq, put_seqs
from fxsched.core.emit import spec_tokens
from fxsched.core.events import BatchVerifyAllowed, Drafts, VerifyRows
from fxsched.core.kv import blocks_for
from fxsched.core.phases import (
    AwaitBatchedDflash,
    AwaitDflashDrafts,
    AwaitDflashGate,
    AwaitDflashVerify,
    BatchedDflashVerify,
    DflashGate,
    SerialVerify,
)
from fxsched.core.records import replace
from fxsched.core.sequence import Sequence
from fxsched.core.state import SchedulerState
from fxsched.core.verdict import accepted_prefix, verify_width
from fxsched.core.verifying import mtp_bootstrap, propose, propose_after_batch, settled, start_k_verify
from fxsched.effects import device_calls as dc
from fxsched.effects.base import Effect

# --- bootstrap ----------------------------------------------------------------------------------


def bootstrap_drafts(state: SchedulerState, waiting: AwaitDflashDrafts, event: Drafts,
                     out: list[Effect]) -> SchedulerState:
    if not event.drafts:  # nothing to verify: decode the last token instead, so the sequence moves on
        return mtp_bootstrap(state, waiting.seq_id, waiting.draft_count, out)
    seq = find_seq(state, waiting.seq_id)
    k = verify_width(len(event.drafts), len(event.drafts))
    return start_k_verify(state, seq, event.drafts, k, waiting.draft_count, True, out)


# --- serial verify -------------------------------------------------------------------------------


def _settle(seq: Sequence, drafts: tuple[int, ...], rows: tuple[int, ...], pre: int, row: int, out: list[Effect],
            state: SchedulerState) -> tuple[Sequence, int]:
    """Rewind to the accepted prefix, commit the drafter context and emit; returns (seq, na)."""
    na = accepted_prefix(drafts, rows)
    changes = settled(seq, pre, pre + na + 1, out)
    out.append(dc.CommitCtx(seq.seq_id, na + 1, pre, row))
    seq = spec_tokens(seq, tuple(drafts[:na]) + (rows[na],), state.config, out, changes)
    return seq, na


def dflash_verified(state: SchedulerState, waiting: AwaitDflashVerify, event: VerifyRows,
                    out: list[Effect]) -> SchedulerState:
    seq = find_seq(state, waiting.seq_id)
    k = len(waiting.drafts) + 1
    seq, na = _settle(seq, waiting.drafts, event.rows, waiting.pre_len, 0, out, state)
    state = put_seq(state, seq)
    if seq.finished:
        return state
    out.append(dc.CommitAcceptedPrefix(seq.seq_id, na + 1, k))
    out.append(dc.SaveHiddenForMtp(na))
    out.append(dc.TrimProposerState(seq.seq_id, na))
    return propose(state, seq.seq_id, waiting.draft_count, out)


# --- the batching gate ----------------------------------------------------------------------------


def gate(state: SchedulerState, task: DflashGate, out: list[Effect]) -> SchedulerState:
    """Batch the verify sequences holding exactly as many drafts as the first one, if the device lets us."""
    active = by_id(state)
    seqs = [active[i] for i in task.seq_ids]
    gamma = len(seqs[0].drafts)
    batchable = tuple(s.seq_id for s in seqs if len(s.drafts) == gamma)
    rest = tuple(s.seq_id for s in seqs if len(s.drafts) != gamma)
    if len(batchable) < 2:
        return push(state, *(SerialVerify(i, task.draft_count) for i in task.seq_ids))
    return _ask_gate(state, AwaitDflashGate(batchable, rest, gamma + 1, len(batchable), task.draft_count), out)


def _ask_gate(state: SchedulerState, waiting: AwaitDflashGate, out: list[Effect]) -> SchedulerState:
    return ask(state, out, dc.CanBatchVerify((waiting.k,) * waiting.m), waiting)


def gate_answer(state: SchedulerState, waiting: AwaitDflashGate, event: BatchVerifyAllowed,
                out: list[Effect]) -> SchedulerState:
    if not event.allowed:
        if waiting.m - 1 >= 2:
            return _ask_gate(state, replace(waiting, m=waiting.m - 1), out)
        return push(state, *(SerialVerify(i, waiting.draft_count) for i in waiting.batchable + waiting.rest))
    m, ids = waiting.m, waiting.batchable
    chunks = [ids[i:i + m] for i in range(0, len(ids), m)]
    batched = [c for c in chunks if len(c) >= 2]
    singles = {i for c in chunks if len(c) < 2 for i in c} | set(waiting.rest)
    serial = [s.seq_id for s in state.active if s.seq_id in singles]
    tasks: list[object] = [BatchedDflashVerify(c, waiting.k, waiting.draft_count) for c in batched]
    tasks += [SerialVerify(i, waiting.draft_count) for i in serial]
    return push(state, *tasks)


# --- batched verify -------------------------------------------------------------------------------


def batched_verify(state: SchedulerState, task: BatchedDflashVerify, out: list[Effect]) -> SchedulerState:
    """One verify over every sequence of the chunk. While it is outstanding the sequence records
    still show the KV before it; the waiting record holds the drafts and lengths in flight."""
    active = by_id(state)
    if any(i not in active for i in task.seq_ids):  # a fault failed some since the gate
        return push(state, *(SerialVerify(i, task.draft_count) for i in task.seq_ids if i in active))
    seqs = [active[i] for i in task.seq_ids]
    tokens: list[int] = []
    for s in seqs:
        tokens.append(s.last_token)
        tokens.extend(s.drafts)
    out.append(dc.SyncSecondaryCall())
    query = dc.DecodeVerifyBatched(tokens=tokens, ks=(task.k,) * len(seqs), seqs=task.seq_ids, stream=0, woa=True)
    waiting = AwaitBatchedDflash(task.seq_ids, tuple(s.drafts for s in seqs), tuple(s.seq_len for s in seqs),
                                 task.k, task.draft_count)
    return ask(state, out, query, waiting)


def batched_verified(state: SchedulerState, waiting: AwaitBatchedDflash, event: VerifyRows,
                     out: list[Effect]) -> SchedulerState:
    """Settle every sequence (rewind, drafter context, emits), fold, then commit all of them."""
    k, config, block_size = waiting.k, state.config, state.model.block_size
    active = by_id(state)
    rows_all = event.rows
    settled_seqs, accepted = [], []
    truncations: list[tuple[int, int]] = []
    contexts: list[tuple[int, int, int, int]] = []
    emits: list[Effect] = []
    for i, seq_id in enumerate(waiting.seq_ids):
        seq, drafts, pre = active[seq_id], waiting.drafts[i], waiting.pre_lens[i]
        rows = rows_all[i * k:(i + 1) * k]
        na = accepted_prefix(drafts, rows)
        seq_len = pre + na + 1
        if seq_len < pre + k:
            truncations.append((seq_id, seq_len))
        contexts.append((seq_id, na + 1, pre, i))
        need = blocks_for(pre + k, block_size)  # the verify grew the table to cover all k rows
        blocks = seq.blocks if seq.blocks >= need else need
        seq = spec_tokens(seq, drafts[:na] + (rows[na],), config, emits,
                          {"seq_len": seq_len, "drafts": (), "blocks": blocks, "acc": seq.acc + na})
        settled_seqs.append(seq)
        accepted.append(na + 1)
    if truncations:
        out.append(dc.TruncateSequences(tuple(truncations)))
    out.append(dc.CommitCtxBatch(tuple(contexts)))
    out.extend(emits)
    out.append(dc.GdnFoldAccepted(tuple(s.slot for s in settled_seqs), tuple(accepted), k))
    out.append(dc.CommitAcceptedPrefixBatch(tuple((s.seq_id, n, k)
                                                  for s, n in zip(settled_seqs, accepted, strict=True))))
    out.append(dc.StashVerifyHiddenRows(tuple(i * k + n - 1 for i, n in enumerate(accepted))))
    pending = [(i, s.seq_id) for i, s in enumerate(settled_seqs) if not s.finished]
    if pending:
        out.append(dc.TrimProposerStateBatch(tuple((settled_seqs[i].seq_id, accepted[i] - 1) for i, _ in pending)))
    state = put_seqs(state, {s.seq_id: s for s in settled_seqs})
    return propose_after_batch(state, pending, waiting.draft_count, out)
