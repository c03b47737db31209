"""What every speculative path shares: proposing drafts, starting a serial verify, settling a
verify's accepted prefix and the K = 2 / K = 3, 4 verdicts (specs/speculation.md §6.3, §6.5–6.8,
§6.13). Pure functions that end a batch with a query by parking a record of ``core/phases.py``;
the rules that take the answers live in the speculative rule modules.

Invariant kept: after a verdict the KV holds exactly the anchor plus the accepted drafts
(``seq_len`` rewound over the rejected ones, the device told with ``TruncateSequence``), and the
emitted tokens are the accepted drafts plus one model token.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence as Seq

from fxsched.core.agenda import ask, by_id, find_seq, forward, held, put_seq
from fxsched.core.emit import spec_tokens
from fxsched.core.phases import (
    AfterProposal,
    AskQuery,
    AwaitBatchedProposal,
    AwaitDflashDrafts,
    AwaitDflashVerify,
    AwaitKVerify,
    AwaitMtpDecode,
    AwaitProposal,
)
from fxsched.core.rows import grow, row_query, verify_picks
from fxsched.core.sequence import Sequence
from fxsched.core.state import SchedulerState
from fxsched.core.verdict import acc_gain
from fxsched.effects import device_calls as dc
from fxsched.effects.base import Effect
from fxsched.effects.ep_words import VERIFY_CMD

# --- proposals ------------------------------------------------------------------------------------


def propose(state: SchedulerState, seq_id: int, n: int, out: list[Effect],
            then: AfterProposal = AfterProposal.NOTHING, put: Optional[Sequence] = None) -> SchedulerState:
    """Ask the proposer for ``n`` drafts after the sequence's last token (``put``: the sequence's
    new record, not yet in the state: it goes in with the ask)."""
    seq = put if put is not None else find_seq(state, seq_id)
    query = dc.ProposeMulti(token=seq.last_token, pos=seq.seq_len, n=n, seq=seq_id)
    return ask(state, out, query, AwaitProposal(seq_id, then), put)


def propose_batched(state: SchedulerState, seq_ids: tuple[int, ...], stash: tuple[int, ...], n: int,
                    out: list[Effect]) -> SchedulerState:
    """One batched proposal for two or more sequences whose verify rows were stashed."""
    active = by_id(state)
    seqs = [active[i] for i in seq_ids]
    query = dc.ProposeBatched(
        tokens=tuple(s.last_token for s in seqs), positions=tuple(s.seq_len for s in seqs),
        stash=stash, n=n, seqs=seq_ids,
    )
    return ask(state, out, query, AwaitBatchedProposal(seq_ids))


def propose_after_batch(state: SchedulerState, pending: list[tuple[int, int]], n: int,
                        out: list[Effect]) -> SchedulerState:
    """Re-propose for the unfinished sequences of a batched verify (``(batch index, seq_id)``)."""
    if len(pending) >= 2:
        return propose_batched(state, tuple(i for _, i in pending), tuple(b for b, _ in pending), n, out)
    if len(pending) == 1:
        index, seq_id = pending[0]
        out.append(dc.SaveHiddenForMtpFromStash(index))
        return propose(state, seq_id, n, out)
    return state


# --- bootstraps -----------------------------------------------------------------------------------


def mtp_bootstrap(state: SchedulerState, seq_id: int, draft_count: int, out: list[Effect]) -> SchedulerState:
    """Decode the last token, read its successor, then propose fresh drafts."""
    seq = find_seq(state, seq_id)
    out.append(dc.EpBroadcastCmdForSeq(seq.slot, seq.last_token))
    seq = grow(seq, seq.seq_len + 1, state.model.block_size)
    state = put_seq(state, seq)
    read = AskQuery(row_query(seq), AwaitMtpDecode(seq_id, draft_count))
    return forward(state, out, dc.DecodeCall(seq.last_token, seq_id, 0), (seq_id,), read)


def dflash_bootstrap(state: SchedulerState, seq_id: int, draft_count: int, out: list[Effect]) -> SchedulerState:
    """No standalone decode: propose straight from the last token, then verify through K = 4."""
    seq = find_seq(state, seq_id)
    query = dc.ProposeMulti(token=seq.last_token, pos=seq.seq_len, n=draft_count, seq=seq_id)
    return ask(state, out, query, AwaitDflashDrafts(seq_id, draft_count))


# --- starting a serial verify ---------------------------------------------------------------------


def start_k_verify(state: SchedulerState, seq: Sequence, drafts: tuple[int, ...], k: int, propose_n: int,
                   dflash_mode: bool, out: list[Effect]) -> SchedulerState:
    """Sync, the EP words, then the K-row verify of ``[L] + drafts[:k-1]``. The drafts are consumed."""
    inputs = (seq.last_token,) + drafts[: k - 1]
    out.append(dc.SyncSecondaryCall())
    out.append(dc.EpBroadcastCmdForSeq(seq.slot, VERIFY_CMD[k]))
    for token in inputs:
        out.append(dc.EpBroadcastCmd(token))
    query: dc.DeviceCall
    picks = verify_picks(seq, k)
    if k == 2:
        query = dc.DecodeVerifyGraphed(seq.seq_id, inputs, picks)
    elif k == 3:
        query = dc.DecodeVerifyGraphedK3(seq.seq_id, inputs, picks)
    elif dflash_mode:
        query = dc.DecodeAndVerifyFused(seq.seq_id, inputs, picks)
    else:
        query = dc.DecodeVerifyGraphedK4(seq.seq_id, inputs, picks)
    pre = seq.seq_len
    seq = grow(seq, pre + k, state.model.block_size)
    return ask(state, out, query, AwaitKVerify(seq.seq_id, drafts, k, propose_n, pre, dflash_mode), put=seq,
               consumed=True)


def dflash_serial_verify(state: SchedulerState, seq: Sequence, draft_count: int, out: list[Effect]) -> SchedulerState:
    """One sequence's block verify over ``[L] + drafts`` (specs/speculation.md §6.9)."""
    drafts = held(state, seq.seq_id)
    out.append(dc.SyncSecondaryCall())
    query = dc.DecodeVerifyDflash(seq.seq_id, (seq.last_token,) + drafts, verify_picks(seq, len(drafts) + 1))
    pre = seq.seq_len
    seq = grow(seq, pre + len(drafts) + 1, state.model.block_size)
    return ask(state, out, query, AwaitDflashVerify(seq.seq_id, drafts, pre, draft_count), put=seq, consumed=True)


# --- verdicts -------------------------------------------------------------------------------------


def settled(seq: Sequence, pre_len: int, seq_len: int, out: list[Effect]) -> dict[str, Any]:
    """Rewind to ``seq_len`` (telling the device) and count the kept drafts into ``acc``.

    ``acc`` grows by ``seq_len - pre_len - 1`` (specs/speculation.md §6.13): a sequence is verified
    at most once per step and nothing else in that step changes its length, so the KV length before
    the verify is the length at the start of the step.
    """
    if seq_len < seq.seq_len:
        out.append(dc.TruncateSequence(seq.seq_id, seq_len))
    return {"seq_len": seq_len, "acc": seq.acc + acc_gain(pre_len, seq_len)}


def k2_verdict(state: SchedulerState, seq: Sequence, draft: int, rows: Seq[int], pre_len: int, propose_n: int,
               out: list[Effect]) -> SchedulerState:
    """K = 2 (specs/speculation.md §6.6): full accept emits first; a reject commits first."""
    config = state.config
    if draft == rows[0]:
        seq = spec_tokens(seq, (draft, rows[1]), config, out, settled(seq, pre_len, pre_len + 2, out))
        state = put_seq(state, seq)
        if seq.finished:
            return state
        out.append(dc.CommitAcceptedPrefix(seq.seq_id, 2, 2))
        out.append(dc.DflashEagleAcceptAppend(seq.seq_id))
        out.append(dc.SaveHiddenForMtp(1))
        out.append(dc.TrimProposerState(seq.seq_id, 1))
    else:
        changes = settled(seq, pre_len, pre_len + 1, out)
        out.append(dc.TrimProposerState(seq.seq_id, 0))
        out.append(dc.CommitAcceptedPrefix(seq.seq_id, 1, 2))
        seq = spec_tokens(seq, (rows[0],), config, out, changes)
        state = put_seq(state, seq)
        if seq.finished:
            return state
        out.append(dc.SaveHiddenForMtp(0))
    return propose(state, seq.seq_id, propose_n, out, then=AfterProposal.MARCONI)


def shared_verdict(state: SchedulerState, seq: Sequence, drafts: Seq[int], rows: Seq[int], k: int, na: int,
                   nd: int, pre_len: int, propose_n: int, out: list[Effect],
                   deferred: bool = False) -> SchedulerState:
    """The verdict of K = 3 / K = 4 verifies (specs/speculation.md §6.7).

    Full accept (na == nd): emit, then commit. Partial: rewind and commit, then emit. With
    ``deferred`` (batched MTP) there is no hidden save and no proposal here.
    """
    config = state.config
    if na == nd:
        seq = spec_tokens(seq, tuple(drafts[:nd]) + (rows[nd],), config, out, settled(seq, pre_len, pre_len + k, out))
        state = put_seq(state, seq)
        if seq.finished:
            return state
        out.append(dc.CommitAcceptedPrefix(seq.seq_id, k, k))
        if not deferred:
            out.append(dc.SaveHiddenForMtp(na))
        out.append(dc.TrimProposerState(seq.seq_id, na))
    else:
        changes = settled(seq, pre_len, pre_len + k - (nd - na), out)
        out.append(dc.TrimProposerState(seq.seq_id, na))
        out.append(dc.CommitAcceptedPrefix(seq.seq_id, na + 1, k))
        seq = spec_tokens(seq, tuple(drafts[:na]) + (rows[na],), config, out, changes)
        state = put_seq(state, seq)
        if seq.finished or deferred:
            return state
        out.append(dc.SaveHiddenForMtp(na))
    if deferred:
        return state
    return propose(state, seq.seq_id, propose_n, out)
