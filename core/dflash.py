"""Rules of DFlash: block drafts verified on the raw argmax (specs/speculation.md §6.4, §6.9,
§6.10, §6.12).

Invariants kept: a batched verify folds the GDN state (``gdn_fold_accepted``) before any
``commit_accepted_prefix``; every sequence of the batch gets its commit, finished or not; only
unfinished sequences are trimmed and re-proposed.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from itertools import repeat
from operator import add

from fxsched.core.agenda import ask, by_id, drop_drafts, find_seq, push, put_seq, put_seqs
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
from fxsched.core.records import replace, with_fields
from fxsched.core.sequence import Sequence
from fxsched.core.state import NO_DRAFTS, SchedulerState
from fxsched.core.verdict import accepted_prefix, verify_width
from fxsched.core.verifying import mtp_bootstrap, propose, propose_after_batch, settled, start_k_verify
from fxsched.effects import device_calls as dc
from fxsched.effects.base import Effect

_new = object.__new__
_set = object.__setattr__  # fills a fresh record's ``__dict__`` (as records.copy_fields does)

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
    held = state.drafts
    lengths = [len(held[i]) for i in task.seq_ids]
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
    ids, active = task.seq_ids, state.active
    if len(active) == len(ids) and all(s.seq_id == i for s, i in zip(active, ids, strict=True)):
        seqs: Seq[Sequence] = active  # the batch is every active sequence, in order
    else:
        by = by_id(state)
        if any(i not in by for i in ids):  # a fault failed some since the gate
            return push(state, *(SerialVerify(i, task.draft_count) for i in ids if i in by))
        seqs = [by[i] for i in ids]
    held = state.drafts
    drafts = tuple([held[i] for i in task.seq_ids])
    tokens: list[int] = []
    for s, mine in zip(seqs, drafts, strict=True):
        tokens.append(s.last_token)
        tokens.extend(mine)
    out.append(dc.SyncSecondaryCall())
    query = dc.DecodeVerifyBatched(tokens=tuple(tokens), ks=(task.k,) * len(seqs), seqs=task.seq_ids, stream=0,
                                   woa=True)
    waiting = AwaitBatchedDflash(task.seq_ids, drafts, tuple([s.seq_len for s in seqs]), task.k, task.draft_count)
    return ask(state, out, query, waiting)


def batched_verified(state: SchedulerState, waiting: AwaitBatchedDflash, event: VerifyRows,
                     out: list[Effect]) -> SchedulerState:
    """Settle every sequence (rewind, drafter context, emits), fold, then commit all of them.

    A row's accepted tokens are its verify rows up to the first rejected draft and the bonus (the
    accepted drafts equal their rows). The common row (nothing finishes, no watchdog) is settled
    inline, one record copy each; any other goes through the speculative sink ``settle_tokens``."""
    k, config, block_size = waiting.k, state.config, state.model.block_size
    ids, pre_lens = waiting.seq_ids, waiting.pre_lens
    active = state.active
    in_order = len(active) == len(ids) and all(s.seq_id == i for s, i in zip(active, ids, strict=True))
    rows_of = active if in_order else [by_id(state)[i] for i in ids]
    rows_all = event.rows
    settled_seqs: list[Sequence] = []
    nas: list[int] = []  # the accepted drafts of each row
    finished_rows: list[int] = []
    streamed = Streamed()
    stream_ids, stream_tokens, stream_counts, stream_logprobs = (streamed.ids, streamed.tokens, streamed.counts,
                                                                 streamed.logprobs)
    inline = not config.loop_watchdog
    eos = config.eos_set
    seq_limit = config.max_seq_len - 1
    new_record, set_fields = _new, _set
    base = 0
    short = k - 1  # a row whose drafts all match accepts k - 1 and takes the bonus row
    for seq, drafts, pre in zip(rows_of, waiting.drafts, pre_lens, strict=True):
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
        fields = seq.__dict__
        blocks = fields["blocks"] if fields["blocks"] >= need else need
        tokens = rows_all[base:base + n]
        remaining = fields["remaining"]
        if (inline and remaining > n and seq_len < seq_limit and not fields["finished"]
                and not fields["cancel_requested"] and eos.isdisjoint(tokens)):
            settled = new_record(Sequence)  # records.copy_fields, inlined: one dict copy, then the changes
            changes = fields.copy()
            changes["seq_len"] = seq_len
            changes["blocks"] = blocks
            changes["acc"] = fields["acc"] + na
            changes["output"] = fields["output"].extend(tokens)
            changes["remaining"] = remaining - n
            changes["content_count"] = fields["content_count"] + n
            changes["last_token"] = tokens[-1]
            set_fields(settled, "__dict__", changes)
            request = fields["request"]
            if request.streaming:
                stream_ids.append(request.id)
                stream_tokens.extend(tokens)
                stream_counts.append(n)
                stream_logprobs.append(request.top_logprobs if fields["logprob_records"] else 0)
        else:
            settled, sent = settle_tokens(seq, tokens, config, {"seq_len": seq_len, "blocks": blocks,
                                                                "acc": fields["acc"] + na})
            streamed.take(settled, sent)
            if settled.finished:
                finished_rows.append(len(settled_seqs))
        settled_seqs.append(settled)
        base += k
    # the device calls of the batch, built column-wise from the rows' verdicts
    accepted = [na + 1 for na in nas]
    truncations = tuple([(i, pre + na + 1) for i, pre, na in zip(ids, pre_lens, nas, strict=True) if na < short])
    if truncations:
        out.append(dc.TruncateSequences(truncations))
    out.append(dc.CommitCtxBatch(tuple(zip(ids, accepted, pre_lens, range(len(ids)), strict=True))))
    streamed.flush(out)
    out.append(dc.GdnFoldAccepted(tuple([s.slot for s in rows_of]), tuple(accepted), k))
    out.append(dc.CommitAcceptedPrefixBatch(tuple(zip(ids, accepted, repeat(k), strict=False))))
    out.append(dc.StashVerifyHiddenRows(tuple(map(add, range(0, k * len(ids), k), nas))))
    if finished_rows:  # only the unfinished are trimmed and re-proposed
        done = set(finished_rows)
        pending = [(i, seq_id) for i, seq_id in enumerate(ids) if i not in done]
        trims = tuple([(seq_id, nas[i]) for i, seq_id in pending])
    else:
        pending = list(enumerate(ids))
        trims = tuple(zip(ids, nas, strict=True))
    if trims:
        out.append(dc.TrimProposerStateBatch(trims))
    if in_order:  # every active sequence was verified: no one holds drafts now
        state = with_fields(state, {"active": tuple(settled_seqs), "drafts": NO_DRAFTS})
    else:
        state = drop_drafts(put_seqs(state, {s.seq_id: s for s in settled_seqs}), ids)
    if len(pending) >= 2 and len(pending) == len(settled_seqs):  # everyone goes on: propose from the rows at hand
        query = dc.ProposeBatched(tokens=tuple([s.last_token for s in settled_seqs]),
                                  positions=tuple([s.seq_len for s in settled_seqs]),
                                  stash=tuple(range(len(settled_seqs))), n=waiting.draft_count, seqs=ids)
        return ask(state, out, query, AwaitBatchedProposal(ids))
    return propose_after_batch(state, pending, waiting.draft_count, out)
