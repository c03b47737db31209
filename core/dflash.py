"""Rules of DFlash: block drafts verified on the raw argmax (specs/speculation.md §6.4, §6.9,
§6.10, §6.12).

Invariants kept: a batched verify folds the GDN state (``gdn_fold_accepted``) before any
``commit_accepted_prefix``; every sequence of the batch gets its commit, finished or not; only
unfinished sequences are trimmed and re-proposed.
"""

from __future__ import annotations

from operator import add
from typing import Any

from fxsched.core.agenda import (ask, batch_rows, by_id, drop_drafts, find_seq, in_order, keep_batch, push, put_seq)
from fxsched.core.emit import recipients, settle_tokens, spec_tokens, stream_out
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
from fxsched.core.records import replace, with_fields
from fxsched.core.rows import batch_picks, row_numbers
from fxsched.core.sequence import Sequence
from fxsched.core.state import NO_DRAFTS, SchedulerState, hot_columns, hot_fields, kept_facts
from fxsched.core.token_log import extended
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
    if seq.finished:
        return put_seq(state, seq)
    out.append(dc.CommitAcceptedPrefix(seq.seq_id, na + 1, k))
    out.append(dc.SaveHiddenForMtp(na))
    out.append(dc.TrimProposerState(seq.seq_id, na))
    return propose(state, seq.seq_id, waiting.draft_count, out, put=seq)


# --- the batching gate ----------------------------------------------------------------------------


def gate(state: SchedulerState, task: DflashGate, out: list[Effect]) -> SchedulerState:
    """Batch the verify sequences holding exactly as many drafts as the first one, if the device lets us."""
    held = state.drafts
    column = held.column_for(task.seq_ids)
    lengths = list(map(len, column)) if column is not None else [len(held[i]) for i in task.seq_ids]
    gamma = lengths[0]
    rest: tuple[int, ...] = ()
    if lengths.count(gamma) == len(lengths):  # the common case: every sequence holds gamma drafts
        batchable = task.seq_ids
    else:
        batchable = tuple(i for i in task.seq_ids if len(held[i]) == gamma)
        rest = tuple(i for i in task.seq_ids if len(held[i]) != gamma)
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
    if m >= len(ids) and not waiting.rest:  # one chunk of everyone: it is the next task, run it now
        return batched_verify(state, BatchedDflashVerify(ids, waiting.k, waiting.draft_count), out)
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
    ids = task.seq_ids
    facts = kept_facts(state)
    if facts.ids == ids if facts is not None else in_order(state.rows, ids):  # every active sequence, in order
        columns = hot_columns(state)
        rows = state.rows
        lasts = columns.last_token if columns else [s.last_token for s in rows]
        lengths = columns.seq_len if columns else tuple([s.seq_len for s in rows])
        if facts is not None and facts.all_greedy:
            picks: tuple[dc.HostPick, ...] = ()
        else:
            produced = columns.out_len if columns else [len(s.output) for s in rows]
            picks = batch_picks([s.request for s in rows], produced, (task.k,) * len(ids))
    else:
        by = by_id(state)
        if any(i not in by for i in ids):  # a fault failed some since the gate
            return push(state, *(SerialVerify(i, task.draft_count) for i in ids if i in by))
        seqs = [by[i] for i in ids]
        lasts = [s.last_token for s in seqs]
        lengths = tuple([s.seq_len for s in seqs])
        picks = batch_picks([s.request for s in seqs], [len(s.output) for s in seqs], (task.k,) * len(ids))
    held = state.drafts
    column = held.column_for(ids)
    drafts = column if column is not None else tuple([held[i] for i in ids])
    tokens: list[int] = []
    for last, mine in zip(lasts, drafts, strict=True):
        tokens.append(last)
        tokens.extend(mine)
    out.append(dc.SyncSecondaryCall())
    query = dc.DecodeVerifyBatched(tokens=tuple(tokens), ks=(task.k,) * len(ids), seqs=ids, stream=0, woa=True,
                                   picks=picks)
    return ask(state, out, query, AwaitBatchedDflash(ids, drafts, lengths, task.k, task.draft_count))


def batched_verified(state: SchedulerState, waiting: AwaitBatchedDflash, event: VerifyRows,
                     out: list[Effect]) -> SchedulerState:
    """Settle every sequence (rewind, drafter context, emits), fold, then commit all of them.

    A row's accepted tokens are its verify rows up to the first rejected draft and the bonus (the
    accepted drafts equal their rows). The common row (nothing finishes, no watchdog) is settled
    inline into the new hot columns; any other goes through the speculative sink ``settle_tokens``.
    When every active sequence was in the batch and every row was common, the state keeps its
    records and gets the columns (``state.settled``, specs/scheduler.md §5.2): no record is copied.
    Otherwise the records are rebuilt, one copy each."""
    k, config, block_size = waiting.k, state.config, state.model.block_size
    ids, pre_lens = waiting.seq_ids, waiting.pre_lens
    ordered, seqs, hot = batch_rows(state, ids)
    facts = kept_facts(state) if ordered else None
    # every row goes on: a row's record and request are read only if it leaves the common way
    quiet = facts if facts is not None and facts.all_going else None
    streaming = quiet.streaming if quiet is not None else None
    rows_all = event.rows
    new_len: list[int] = []
    new_blocks: list[int] = []
    new_acc: list[int] = []
    new_buf: list[Any] = []  # each row's output array (its length is the new seq_len less ``out_base``)
    new_last: list[int] = []
    nas: list[int] = []  # the accepted drafts of each row
    slow: dict[int, Sequence] = {}  # rows settled by the sink: their records
    sent: dict[int, bool] = {}  # ... and whether each streamed
    finished_rows: list[int] = []
    stream_tokens: list[int] = []  # what the rows stream, in row order ...
    stream_counts: list[int] = []  # ... and how many tokens each
    inline = not config.loop_watchdog
    eos = config.eos_set
    seq_limit = config.max_seq_len - 1
    short = k - 1  # a row whose drafts all match accepts k - 1 and takes the bonus row
    base = 0
    # a common row grows its output and content count and spends its budget by the n tokens it takes,
    # as its seq_len: its offsets (``out_base``, ``end``, ``content_base``) stay
    for i, (drafts, pre, blocks0, acc0, buf0, out_base, end) in enumerate(
            zip(waiting.drafts, pre_lens, hot[1], hot[2], hot[3], hot[4], hot[5], strict=True)):
        limit = len(drafts)
        if limit > short:
            limit = short
        na = 0
        while na < limit and drafts[na] == rows_all[base + na]:
            na += 1
        nas.append(na)
        n = na + 1
        seq_len = pre + n
        need = (pre + k) // block_size + 1  # kv.blocks_for: the verify grew the table to cover all k rows
        blocks = blocks0 if blocks0 >= need else need
        tokens = rows_all[base:base + n]
        common = inline and seq_len < end and seq_len < seq_limit and eos.isdisjoint(tokens)
        if streaming is not None:
            streams = streaming[i]
        elif common:
            fields = seqs[i].__dict__
            common = not fields["finished"] and not fields["cancel_requested"]
            streams = fields["request"].streaming
        if common:
            new_len.append(seq_len)
            new_blocks.append(blocks)
            new_acc.append(acc0 + na if na else acc0)
            new_buf.append(extended(buf0, pre - out_base, tokens))
            new_last.append(tokens[-1])
            if streams:
                stream_tokens.extend(tokens)
                stream_counts.append(n)
        else:
            # the record with the row's newest hot fields (the records may be older than the columns)
            current = with_fields(seqs[i], hot_fields(pre, blocks0, acc0, buf0, out_base, end, hot[6][i], hot[7][i]))
            settled, out_tokens = settle_tokens(current, tokens, config, {"seq_len": seq_len, "blocks": blocks,
                                                                          "acc": acc0 + na})
            if out_tokens:
                stream_tokens.extend(out_tokens)
                stream_counts.append(len(out_tokens))
            sent[i] = bool(out_tokens)
            slow[i] = settled
            if settled.finished:
                finished_rows.append(i)
            # (keep_batch takes this row's record from ``slow``; the proposal below reads its seq_len and last token)
            new_len.append(settled.seq_len)
            new_blocks.append(settled.blocks)
            new_acc.append(settled.acc)
            new_buf.append(buf0)
            new_last.append(settled.last_token)
        base += k
    # the device calls of the batch, built column-wise from the rows' verdicts
    accepted = tuple([na + 1 for na in nas])
    if nas.count(short) != len(nas):  # the rows that rejected a draft are cut back
        cut = [i for i, na in enumerate(nas) if na < short]
        out.append(dc.TruncateSequences(tuple([ids[i] for i in cut]), tuple([pre_lens[i] + accepted[i] for i in cut])))
    count = len(ids)
    out.append(dc.CommitCtxBatch(ids, accepted, pre_lens, row_numbers(count)))
    if stream_counts:  # the ids and record sizes of the rows that streamed, in order
        if quiet is not None and not slow:
            out.append(stream_out(quiet.stream_ids, stream_tokens, stream_counts, quiet.stream_logprobs))
        else:
            to, sizes = recipients([slow.get(i, seq) for i, seq in enumerate(seqs)
                                    if (sent[i] if i in sent else seq.request.streaming)])
            out.append(stream_out(to, stream_tokens, stream_counts, sizes))
    out.append(dc.GdnFoldAccepted(facts.slots if facts is not None else tuple([s.slot for s in seqs]), accepted, k))
    out.append(dc.CommitAcceptedPrefixBatch(ids, accepted, (k,) * count))
    out.append(dc.StashVerifyHiddenRows(tuple(map(add, range(0, k * count, k), nas))))
    pending: list[tuple[int, int]] = []  # (row, seq_id) of the unfinished, when some finished
    if finished_rows:  # only the unfinished are trimmed and re-proposed
        done = set(finished_rows)
        pending = [(i, seq_id) for i, seq_id in enumerate(ids) if i not in done]
        if pending:
            out.append(dc.TrimProposerStateBatch(tuple([seq_id for _, seq_id in pending]),
                                                 tuple([nas[i] for i, _ in pending])))
    else:
        out.append(dc.TrimProposerStateBatch(ids, tuple(nas)))
    lengths, lasts = tuple(new_len), tuple(new_last)
    columns = (lengths, new_blocks, new_acc, new_buf, hot[4], hot[5], hot[6], lasts)
    # when every active sequence was verified, no one holds drafts now
    state = keep_batch(state, ordered, seqs, columns, slow, {"drafts": NO_DRAFTS} if ordered else None)
    if not ordered:
        state = drop_drafts(state, ids)
    if not finished_rows and len(ids) >= 2:  # everyone goes on: propose from the rows at hand
        query = dc.ProposeBatched(tokens=lasts, positions=lengths, stash=row_numbers(len(ids)),
                                  n=waiting.draft_count, seqs=ids)
        return ask(state, out, query, AwaitBatchedProposal(ids))
    if not finished_rows:
        pending = list(enumerate(ids))
    return propose_after_batch(state, pending, waiting.draft_count, out)
