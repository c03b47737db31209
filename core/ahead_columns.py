"""Pipelined plain decodes of a steady batch over the hot columns (specs/async.md §16.6, rule 7).

The record path (``decode._pipelined_decode`` / ``decode._decoded_ahead``) copies each sequence
two or three times per tick (resolved, then gone ahead). A steady async batch needs none of it:
with every sequence ahead, its hot columns (specs/scheduler.md §5.2) hold ``LATE_TOKEN`` as each
row's ``last_token``, and a tick that resolves each row's kept token and sends it ahead again
leaves its offsets where they were (the output grows by the resolved token, ``seq_len`` by the fed
one, the budget shrinks by one): only ``seq_len``, ``blocks`` and the output arrays move, as in a
synchronous decode (``decode._decoded_batch``).

These rules take that path when the batch is every active sequence, in slot order, none finished,
cancelled or guarded, none asking for logprob records, and (planning) every row ahead is fed again
or (answering) every row went ahead; anything else returns None and the record path decides. Each
decision is the record path's, through the same helpers (``kept_is_last``, ``pick_for``,
``greedy_request``, ``blocks_for``); a row whose resolved token is EOS is rebuilt by the record
sink itself (``resolve_tokens``).
"""

from __future__ import annotations

from typing import Any, Optional

from fxsched.core.agenda import keep_batch, push
from fxsched.core.ahead import kept_is_last, may_answer_ahead, produced_count, resolve_tokens
from fxsched.core.events import LATE_TOKEN, TokensSampled
from fxsched.core.kv import blocks_for
from fxsched.core.phases import AwaitDecode, ResolveAhead
from fxsched.core.records import with_fields
from fxsched.core.rows import greedy_request, pick_for, slots_increasing
from fxsched.core.state import RowFacts, SchedulerState, Settled, hot_columns, hot_fields, hot_row, row_facts
from fxsched.core.token_log import extended
from fxsched.effects import plans
from fxsched.effects.base import Effect
from fxsched.effects.client import StreamOut
from fxsched.effects.lifecycle import MarconiCheckpoints

__all__ = ["answered_from_columns", "planned_from_columns"]


def _steady(state: SchedulerState) -> Optional[tuple[Settled, RowFacts]]:
    columns = hot_columns(state)
    if columns is None:
        return None
    facts = columns.facts()
    return (columns, facts) if _goes_on(facts) else None


def _goes_on(facts: RowFacts) -> bool:
    """Every row goes on the common way, in slot order, none asking for logprob records."""
    return facts.all_going and facts.all_unguarded and not facts.any_top_logprobs and slots_increasing(facts.slots)


def planned_from_columns(state: SchedulerState) -> Optional[plans.Decode]:
    """The pipelined decode of every active row, planned from the columns (module docstring): each
    row fed (a row ahead its kept token, ``LATE_TOKEN``), every kept token resolved by its answer;
    None when some row ahead is not fed again or the batch is not steady."""
    steady = _steady(state)
    if steady is None:
        return None
    columns, facts = steady
    config = state.config
    resolve = []
    for seq_id, seq_len, end, last in zip(facts.ids, columns.seq_len, columns.end, columns.last_token, strict=True):
        if last == LATE_TOKEN:
            if kept_is_last(end - seq_len, seq_len, config):
                return None
            resolve.append(seq_id)
    picks: tuple[Any, ...] = ()
    if not facts.all_greedy:
        made = list(map(produced_count, columns.out_len, columns.last_token))
        if not all(greedy_request(seq.request, n) for seq, n in zip(state.rows, made, strict=True)):
            picks = tuple(pick_for(seq.request, n) for seq, n in zip(state.rows, made, strict=True))
    return plans.Decode(tokens=columns.last_token, seqs=facts.ids, seq_lens=columns.seq_len, picks=picks,
                        ahead=may_answer_ahead(config, state.model, ()), resolve=tuple(resolve))


def answered_from_columns(state: SchedulerState, waiting: AwaitDecode, event: TokensSampled,
                          out: list[Effect]) -> Optional[SchedulerState]:
    """The answer of a pipelined decode of every active row, answered ahead (a ``LATE_TOKEN`` per
    row, no logprobs), taken over the columns: each resolved token as ``resolve_tokens`` takes it,
    then each row that goes on ahead as ``went_ahead`` sends it; None when the decode or its answer
    is not of that form."""
    if event.logprobs or event.earlier_logprobs:
        return None
    columns = hot_columns(state)  # or, the first time, the records' hot fields: the columns start here
    facts = columns.facts() if columns is not None else row_facts(state.rows)
    if not _goes_on(facts) or facts.ids != waiting.seq_ids or len(event.earlier) != len(waiting.resolve):
        return None
    if not event.tokens or any(t != LATE_TOKEN for t in event.tokens):
        return None
    config, block_size = state.config, state.model.block_size
    eos = config.eos_set
    resolve, earlier = waiting.resolve, event.earlier
    streaming = facts.streaming
    hot = columns.columns() if columns is not None else tuple(zip(*map(hot_row, state.rows), strict=True))
    seq_len, blocks, acc, out_buf, out_base, end, content_base, last_token = hot
    new_len: list[int] = []
    new_blocks: list[int] = []
    new_buf: list[Any] = list(out_buf)
    shifted: Optional[tuple[list[int], list[int], list[int]]] = None  # the offsets, once a row goes ahead anew
    checkpoints: list[int] = []
    stream_ids: list[int] = []
    stream_tokens: list[int] = []
    rebuilt: dict[int, Any] = {}
    at = 0  # the next resolved token
    for i, (seq_id, s0, b0, last) in enumerate(zip(facts.ids, seq_len, blocks, last_token, strict=True)):
        if last == LATE_TOKEN:
            if at >= len(resolve) or resolve[at] != seq_id or kept_is_last(end[i] - s0, s0, config):
                return None
            token = earlier[at]
            at += 1
            if token in eos:  # resolved to EOS: the record sink ends it; its row computed ahead is dropped
                record = with_fields(state.rows[i], hot_fields(s0, b0, acc[i], out_buf[i], out_base[i], end[i],
                                                               content_base[i], last))
                solo = with_fields(state, {"rows": (record,), "settled": None})
                rebuilt[i] = resolve_tokens(solo, (seq_id,), (token,), (), out).rows[0]
                new_len.append(s0)
                new_blocks.append(b0)
                continue
            new_buf[i] = extended(out_buf[i], s0 - out_base[i], (token,))
            checkpoints.append(seq_id)
            if streaming[i]:
                stream_ids.append(state.rows[i].request.id)
                stream_tokens.append(token)
        else:  # ahead for the first time: its output and budget wait for the token, its seq_len grows
            if shifted is None:
                shifted = (list(out_base), list(end), list(content_base))
            for column in shifted:
                column[i] += 1
        s1 = s0 + 1
        new_len.append(s1)
        new_blocks.append(max(b0, blocks_for(s1, block_size)))
    if at != len(resolve):
        return None
    if checkpoints:
        out.append(MarconiCheckpoints(tuple(checkpoints)))
    if stream_ids:
        out.append(StreamOut(tuple(stream_ids), tuple(stream_tokens)))
    lasts = [last_token[i] if i in rebuilt else LATE_TOKEN for i in range(len(new_len))]
    new_out_base, new_end, new_content_base = shifted if shifted is not None else (out_base, end, content_base)
    after = keep_batch(state, True, state.rows,
                       (new_len, new_blocks, acc, new_buf, new_out_base, new_end, new_content_base, lasts), rebuilt,
                       facts=facts)
    fed_again = any(i not in rebuilt and not kept_is_last(new_end[i] - new_len[i], new_len[i], config)
                    for i in range(len(new_len)))
    # no kept token will be fed again: read them in this tick (specs/async.md §16.6 rule 2)
    return after if fed_again else push(after, ResolveAhead())
