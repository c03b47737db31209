"""Token sinks: what happens to each token a step produces for a sequence.

``plain_token`` is the plain and mixed decode path (specs/scheduler.md §5.17): it checkpoints.
``spec_token`` is the speculative sink (specs/speculation.md §6.1): it takes no checkpoint. Both check
the cancel flag first: a cancelled sequence finishes without taking the token. Both keep: a finished
sequence never streams again, EOS is appended but never streamed.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from fxsched.core.records import replace, with_fields

from fxsched.core.config import ModelInfo, SchedulerConfig
from fxsched.core.sequence import Sequence
from fxsched.core.sequence import Guard
from fxsched.core.watchdog import (
    CONTENT_LOOP_SPAN,
    content_loop,
    content_loop_due,
    fuzzy_repetition,
    rollback_or_guard,
    save_snapshot,
    snapshot_wanted,
)
from fxsched.effects.base import Effect
from fxsched.effects.client import StreamOut, TokenOut, TokensOut
from fxsched.effects.lifecycle import MarconiCheckpoint


def stream_token(seq: Sequence, token: int, out: list[Effect]) -> None:
    """Send ``token`` to a streaming client (``TL`` form once the request has logprob records)."""
    if seq.request.streaming:
        k = seq.request.top_logprobs if seq.logprob_records else 0
        out.append(TokenOut(seq.request_id, token, k))


def plain_token(seq: Sequence, token: int, config: SchedulerConfig, out: list[Effect], logprobs: int = 0,
                model: ModelInfo | None = None) -> Sequence:
    """Per-token handling of a plain or mixed decode row (specs/scheduler.md §5.17); ``seq.seq_len`` is
    already advanced. A set cancel flag finishes the sequence first, the token neither appended nor
    streamed (as in specs/speculation.md §6.1). With the watchdogs armed, a content loop or a fuzzy
    repetition rolls the sequence back to a boundary, or finishes it with a guard."""
    if seq.cancel_requested:
        return replace(seq, finished=True)
    armed = config.loop_watchdog and model is not None
    remaining = seq.remaining - 1
    content = seq.content_count + 1
    if armed and model is not None and content_loop_due(content) and content_loop(seq.output.tokens()):
        return rollback_or_guard(seq, CONTENT_LOOP_SPAN, Guard.CONTENT_LOOP, config, model, out)
    records = seq.logprob_records + (1 if logprobs else 0)
    if token in config.eos_set:
        return replace(seq, output=seq.output.append(token), remaining=remaining,
                       content_count=content, finished=True, logprob_records=records)
    seq = replace(seq, output=seq.output.append(token), remaining=remaining, content_count=content,
                  last_token=token, logprob_records=records)
    if model is not None and snapshot_wanted(seq, token, config, model):
        seq = save_snapshot(seq, model, out)
    out.append(MarconiCheckpoint(seq.seq_id))
    stream_token(seq, token, out)
    if remaining <= 0 or seq.seq_len + 1 >= config.max_seq_len:
        return replace(seq, finished=True)
    if armed and model is not None:
        window = fuzzy_repetition(seq.output.tokens())
        if window is not None:
            seq = rollback_or_guard(seq, 3 * window, Guard.FUZZY_REPETITION, config, model, out)
    return seq


def spec_tokens(seq: Sequence, tokens: tuple[int, ...], config: SchedulerConfig, out: list[Effect],
                changes: dict[str, Any] | None = None) -> Sequence:
    """The speculative sink (specs/speculation.md §6.1) for ``tokens`` in order; stops at the first token
    that finishes the sequence. ``changes`` (a settled ``seq_len``, ``acc``, ...) are applied in the
    same rebuild, so a verify costs one record copy per sequence. ``changes`` must be a fresh dict:
    the sink takes it over."""
    seq, streamed = settle_tokens(seq, tokens, config, changes if changes is not None else {})
    if streamed:
        req = seq.request
        k = req.top_logprobs if seq.logprob_records else 0
        out.append(TokensOut(req.id, streamed, k) if len(streamed) > 1 else TokenOut(req.id, streamed[0], k))
    return seq


def stream_out(ids: Seq[int], tokens: Seq[int], counts: Seq[int], logprobs: Seq[int]) -> StreamOut:
    """The ``StreamOut`` of rows that sent ``counts`` of ``tokens`` to requests ``ids`` with record
    sizes ``logprobs`` (empty: 0 each); the counts are left out when each is 1, the sizes when each
    is 0."""
    return StreamOut(tuple(ids), tuple(tokens), () if counts.count(1) == len(counts) else tuple(counts),
                     tuple(logprobs) if any(logprobs) else ())


def recipients(senders: Seq[Sequence]) -> tuple[list[int], list[int]]:
    """The request ids and record sizes (``stream_out``'s ``ids`` and ``logprobs``) of the rows
    ``senders``, in order: the sinks' way when the batch's ``RowFacts`` do not apply."""
    return ([seq.request.id for seq in senders],
            [seq.request.top_logprobs if seq.logprob_records else 0 for seq in senders])


def settle_tokens(seq: Sequence, tokens: tuple[int, ...], config: SchedulerConfig,
                  fields: dict[str, Any]) -> tuple[Sequence, tuple[int, ...]]:
    """The speculative sink's decisions: the new sequence (``fields`` applied too; the dict is taken
    over) and the tokens its client is to get now (EOS never streamed; none for a blocking request)."""
    if seq.finished:
        return (with_fields(seq, fields) if fields else seq), ()
    seq_len = fields.get("seq_len", seq.seq_len)
    n = len(tokens)
    req = seq.request
    if (n and not seq.cancel_requested and seq.remaining > n and seq_len + 1 < config.max_seq_len
            and not config.loop_watchdog and config.eos_set.isdisjoint(tokens)):
        # the common case: every token is streamed and nothing finishes
        fields["output"] = seq.output.extend(tokens)
        fields["remaining"] = seq.remaining - n
        fields["content_count"] = seq.content_count + n
        fields["last_token"] = tokens[-1]
        return with_fields(seq, fields), (tokens if req.streaming else ())
    count, remaining, content, last = len(seq.output), seq.remaining, seq.content_count, seq.last_token
    finished = False
    eos_ids = config.eos_set
    streamed: list[int] = []
    taken = 0
    armed = config.loop_watchdog
    guard: Guard | None = None
    for token in tokens:
        if seq.cancel_requested:
            finished = True
            break
        if armed and content_loop_due(content + 1) and content_loop(seq.output.tokens() + tuple(tokens[:taken])):
            finished, guard = True, Guard.CONTENT_LOOP
            break
        before = count
        count += 1
        taken += 1
        remaining -= 1
        content += 1
        last = token
        if token in eos_ids:
            if before >= req.min_tokens:
                finished = True
                break
        elif req.streaming:
            streamed.append(token)
        if remaining <= 0 or seq_len + 1 >= config.max_seq_len:
            finished = True
            break
    fields.update(output=seq.output.extend(tuple(tokens[:taken])) if taken else seq.output, remaining=remaining,
                  content_count=content, last_token=last, finished=finished)
    if guard is not None:
        fields["guard"] = guard
    return with_fields(seq, fields), tuple(streamed)


def spec_token(seq: Sequence, token: int, config: SchedulerConfig, out: list[Effect]) -> Sequence:
    """The speculative sink for one token."""
    return spec_tokens(seq, (token,), config, out)
