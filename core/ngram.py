"""N-gram (prompt lookup) drafting over the sequence's own tokens (specs/speculation.md §6.14).

The proposer is a pure function of the sequence's history: the tokens in the KV followed by the
pending last token L (produced, not yet fed), so a proposal guesses the token after L, which is
what the K = 2 verify of ``[L, draft]`` checks. With ``ngram_history_without_pending_token`` the
history is the KV tokens alone (the reference trace's rule): the proposal then guesses L itself
and is rarely accepted. The step decodes without a draft and verifies with K = 2 when one is
pending. N-gram steps never count into ``acc``.
"""

from __future__ import annotations

from array import array

from typing import Optional, Sequence as Seq

from fxsched.core.agenda import ask, find_seq, forward, held, put_seq, set_drafts
from fxsched.core.emit import spec_token, spec_tokens
from fxsched.core.events import TokenSampled, TokensSampled, VerifyRows
from fxsched.core.phases import AskQuery, AwaitNgramDecode, AwaitNgramVerify, NgramStep
from fxsched.core.records import replace
from fxsched.core.rows import answered_token, grow, row_query, verify_picks
from fxsched.core.sequence import Sequence
from fxsched.core.state import SchedulerState
from fxsched.effects import device_calls as dc
from fxsched.effects.base import Effect
from fxsched.effects.ep_words import VERIFY_CMD

MIN_MATCH = 2


def propose_ngram(history: Seq[int], max_match: int = 16) -> Optional[int]:
    """The token after the earliest earlier occurrence of the longest matching suffix (2..16 tokens).

    For each n, the suffix is the last n tokens; its earliest start s (with the whole match before
    the suffix itself, s <= len - n - 1) proposes ``history[s + n]``. The longest n that matches
    wins; no history of fewer than 3 tokens, or no match, proposes nothing.

    The search runs on the tokens' machine-integer bytes (``bytes.find``, at item-aligned offsets),
    so a step costs at most 15 searches in C, not a Python loop over the history. A suffix of n + 1
    tokens matches only where its last n tokens match one token later, so the first n without a
    match ends the search.
    """
    size = len(history)
    if size < 3:
        return None
    tokens = tuple(history)
    try:
        packed = array("i", tokens)
    except OverflowError:
        packed = array("q", tokens)
    width = packed.itemsize
    hay = packed.tobytes()
    limit = (size - 1) * width  # a match ends before the last token: s + n <= size - 1
    proposal: Optional[int] = None
    for n in range(MIN_MATCH, min(max_match, size - 1) + 1):
        needle = hay[(size - n) * width:]
        at = hay.find(needle, 0, limit)
        while at != -1 and at % width:
            at = hay.find(needle, at + 1, limit)
        if at == -1:
            break
        proposal = tokens[at // width + n]
    return proposal


def ngram_history(state: SchedulerState, seq: Sequence) -> tuple[int, ...]:
    """What the proposer looks at: the KV tokens, then the pending last token unless configured out."""
    if state.config.ngram_history_without_pending_token:
        return seq.kv_tokens()
    return seq.kv_tokens() + (seq.last_token,)


def _proposal(state: SchedulerState, seq: Sequence) -> tuple[int, ...]:
    p = propose_ngram(ngram_history(state, seq), state.config.ngram_max_match)
    return () if p is None else (p,)


def ngram_step(state: SchedulerState, task: NgramStep, out: list[Effect]) -> SchedulerState:
    (seq,) = state.active
    mine = held(state, seq.seq_id)
    if not mine:
        out.append(dc.EpBroadcastCmdForSeq(seq.slot, seq.last_token))
        state = put_seq(state, grow(seq, seq.seq_len + 1, state.model.block_size))
        read = AskQuery(row_query(seq), AwaitNgramDecode(seq.seq_id))
        return forward(state, out, dc.DecodeCall(seq.last_token, seq.seq_id, 0), (seq.seq_id,), read)
    draft = mine[0]
    out.append(dc.SyncSecondaryCall())
    out.append(dc.EpBroadcastCmdForSeq(seq.slot, VERIFY_CMD[2]))
    out.append(dc.EpBroadcastCmd(seq.last_token))
    out.append(dc.EpBroadcastCmd(draft))
    query = dc.DecodeVerifyGraphed(seq.seq_id, (seq.last_token, draft), verify_picks(seq, 2))
    pre = seq.seq_len
    seq = grow(seq, pre + 2, state.model.block_size)
    return ask(state, out, query, AwaitNgramVerify(seq.seq_id, draft, pre), put=seq, consumed=True)


def ngram_decoded(state: SchedulerState, waiting: AwaitNgramDecode, event: TokenSampled | TokensSampled,
                  out: list[Effect]) -> SchedulerState:
    seq = spec_token(find_seq(state, waiting.seq_id), answered_token(event), state.config, out)
    state = put_seq(state, seq)
    if not seq.finished:
        drafts = _proposal(state, seq)
        state = set_drafts(state, {seq.seq_id: drafts})
        if drafts:
            out.append(dc.StartCheckpointAsync(seq.seq_id))
    return state


def ngram_verified(state: SchedulerState, waiting: AwaitNgramVerify, event: VerifyRows,
                   out: list[Effect]) -> SchedulerState:
    seq = find_seq(state, waiting.seq_id)
    v0, v1 = event.rows[0], event.rows[1]
    accepted = waiting.draft == v0
    out.append(dc.EpBroadcastCmd(1 if accepted else 0))
    if accepted:
        seq = spec_tokens(seq, (waiting.draft, v1), state.config, out)
        if seq.finished:
            return put_seq(state, seq)
        out.append(dc.StartCheckpointAsync(seq.seq_id))
    else:
        out.append(dc.TruncateSequence(seq.seq_id, waiting.pre_len + 1))
        seq = replace(seq, seq_len=waiting.pre_len + 1)
        out.append(dc.StartRollbackAndCheckpointAsync(seq.seq_id, 1))
        seq = spec_token(seq, v0, state.config, out)
        if seq.finished:
            return put_seq(state, seq)
    state = put_seq(state, seq)
    return set_drafts(state, {seq.seq_id: _proposal(state, seq)})
