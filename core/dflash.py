"""Rules of DFlash: block drafts verified on the raw argmax (specs/speculation.md §6.4, §6.9,
§6.10, §6.12).

Invariants kept: a batched verify folds the GDN state (``gdn_fold_accepted``) before any
``commit_accepted_prefix``; every sequence of the batch gets its commit, finished or not; only
unfinished sequences are trimmed and re-proposed.
"""

from __future__ import annotations

from fxsched.core.agenda import ask, by_id, find_seq, push, put_seq, put_seqs
from fxsched.core.emit import Streamed, settle_tokens, spec_tokens
from fxsched.core.events import BatchVerifyAllowed, Drafts, VerifyRows
from fxsched.core.phases import (
    AwaitBatchedDflash,
    AwaitBatchedProposal,
    AwaitDflashDrafts,
    AwaitDflashGate,
    AwaitDflashVerify,
    BatchedDflashVerify,
    DflashGate,
    SerialVerify,
)
from fxsched.core.records import copy_fields, replace, with_fields
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
    query = dc.DecodeVerifyBatched(tokens=tuple(tokens), ks=(task.k,) * len(seqs), seqs=task.seq_ids, stream=0,
                                   woa=True)
    waiting = AwaitBatchedDflash(task.seq_ids, tuple(s.drafts for s in seqs), tuple(s.seq_len for s in seqs),
                                 task.k, task.draft_count)
    return ask(state, out, query, waiting)


def batched_verified(state: SchedulerState, waiting: AwaitBatchedDflash, event: VerifyRows,
                     out: list[Effect]) -> SchedulerState:
    """Settle every sequence (rewind, drafter context, emits), fold, then commit all of them.

    A row's accepted tokens are its verify rows up to the first rejected draft and the bonus (the
    accepted drafts equal their rows). The common row (nothing finishes, no watchdog) is settled
    inline, one record copy each; any other goes through the speculative sink ``settle_tokens``."""
    k, config, block_size = waiting.k, state.config, state.model.block_size
    ids = waiting.seq_ids
    active = state.active
    in_order = len(active) == len(ids) and all(s.seq_id == i for s, i in zip(active, ids, strict=True))
    rows_of = active if in_order else [by_id(state)[i] for i in ids]
    rows_all = event.rows
    settled_seqs: list[Sequence] = []
    slots: list[int] = []
    accepted: list[int] = []
    commits: list[tuple[int, int, int]] = []
    stash_rows: list[int] = []
    truncations: list[tuple[int, int]] = []
    contexts: list[tuple[int, int, int, int]] = []
    pending: list[tuple[int, int]] = []
    trims: list[tuple[int, int]] = []
    streamed = Streamed()
    stream_ids, stream_tokens, stream_counts, stream_logprobs = (streamed.ids, streamed.tokens, streamed.counts,
                                                                 streamed.logprobs)
    inline = not config.loop_watchdog
    eos = config.eos_set
    seq_limit = config.max_seq_len - 1
    base = 0
    for i, (seq, drafts, pre) in enumerate(zip(rows_of, waiting.drafts, waiting.pre_lens, strict=True)):
        seq_id = seq.seq_id
        limit = len(drafts) if len(drafts) < k - 1 else k - 1
        na = 0
        while na < limit and drafts[na] == rows_all[base + na]:
            na += 1
        n = na + 1
        seq_len = pre + n
        if na < k - 1:
            truncations.append((seq_id, seq_len))
        contexts.append((seq_id, n, pre, i))
        need = (pre + k) // block_size + 1  # kv.blocks_for: the verify grew the table to cover all k rows
        fields = seq.__dict__
        blocks = fields["blocks"] if fields["blocks"] >= need else need
        tokens = rows_all[base:base + n]
        remaining = fields["remaining"]
        if (inline and remaining > n and seq_len < seq_limit and not fields["finished"]
                and not fields["cancel_requested"] and eos.isdisjoint(tokens)):
            settled, changes = copy_fields(seq)
            changes["seq_len"] = seq_len
            changes["drafts"] = ()
            changes["blocks"] = blocks
            changes["acc"] = fields["acc"] + na
            changes["output"] = fields["output"].extend(tokens)
            changes["remaining"] = remaining - n
            changes["content_count"] = fields["content_count"] + n
            changes["last_token"] = tokens[-1]
            request = fields["request"]
            if request.streaming:
                stream_ids.append(request.id)
                stream_tokens.extend(tokens)
                stream_counts.append(n)
                stream_logprobs.append(request.top_logprobs if fields["logprob_records"] else 0)
            finished = False
        else:
            settled, sent = settle_tokens(seq, tokens, config, {"seq_len": seq_len, "drafts": (), "blocks": blocks,
                                                                "acc": fields["acc"] + na})
            streamed.take(settled, sent)
            finished = settled.finished
        settled_seqs.append(settled)
        slots.append(fields["slot"])
        accepted.append(n)
        commits.append((seq_id, n, k))
        stash_rows.append(base + na)
        if not finished:
            pending.append((i, seq_id))
            trims.append((seq_id, na))
        base += k
    if truncations:
        out.append(dc.TruncateSequences(tuple(truncations)))
    out.append(dc.CommitCtxBatch(tuple(contexts)))
    streamed.flush(out)
    out.append(dc.GdnFoldAccepted(tuple(slots), tuple(accepted), k))
    out.append(dc.CommitAcceptedPrefixBatch(tuple(commits)))
    out.append(dc.StashVerifyHiddenRows(tuple(stash_rows)))
    if trims:
        out.append(dc.TrimProposerStateBatch(tuple(trims)))
    if in_order:
        state = with_fields(state, {"active": tuple(settled_seqs)})
    else:
        state = put_seqs(state, {s.seq_id: s for s in settled_seqs})
    if len(pending) >= 2 and len(pending) == len(settled_seqs):  # everyone goes on: propose from the rows at hand
        query = dc.ProposeBatched(tokens=tuple([s.last_token for s in settled_seqs]),
                                  positions=tuple([s.seq_len for s in settled_seqs]),
                                  stash=tuple(range(len(settled_seqs))), n=waiting.draft_count, seqs=ids)
        return ask(state, out, query, AwaitBatchedProposal(ids))
    return propose_after_batch(state, pending, waiting.draft_count, out)
