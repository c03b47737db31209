"""Token sinks: what happens to each token a step produces for a sequence.

``plain_token`` is the plain and mixed decode path (scheduler.md §5.17): it checkpoints and never
looks at the cancel flag. ``spec_token`` is the speculative sink (speculation.md §6.1): it checks
the cancel flag first and takes no checkpoint. Both keep: a finished sequence never streams again,
EOS is appended but never streamed.
"""

from __future__ import annotations

import attrs

from fxsched.core.config import SchedulerConfig
from fxsched.core.sequence import Sequence
from fxsched.effects.client import TokenOut
from fxsched.effects.lifecycle import MarconiCheckpoint


def stream_token(seq: Sequence, token: int, out: list) -> None:
    """Send ``token`` to a streaming client (``TL`` form once the request has logprob records)."""
    if seq.request.streaming:
        k = seq.request.top_logprobs if seq.logprob_records else 0
        out.append(TokenOut(seq.request_id, token, k))


def _is_eos(token: int, config: SchedulerConfig) -> bool:
    return token in config.eos_ids


def plain_token(seq: Sequence, token: int, config: SchedulerConfig, out: list, logprobs: int = 0) -> Sequence:
    """Per-token handling of a plain or mixed decode row. ``seq.seq_len`` is already advanced."""
    remaining = seq.remaining - 1
    content = seq.content_count + 1
    records = seq.logprob_records + (1 if logprobs else 0)
    if _is_eos(token, config):
        return attrs.evolve(seq, output=seq.output + (token,), remaining=remaining,
                            content_count=content, finished=True, logprob_records=records)
    seq = attrs.evolve(seq, output=seq.output + (token,), remaining=remaining, content_count=content,
                       last_token=token, logprob_records=records)
    out.append(MarconiCheckpoint(seq.seq_id))
    stream_token(seq, token, out)
    if remaining <= 0 or seq.seq_len + 1 >= config.max_seq_len:
        seq = attrs.evolve(seq, finished=True)
    return seq


def spec_token(seq: Sequence, token: int, config: SchedulerConfig, out: list) -> Sequence:
    """The speculative sink for one token; a finished sequence takes no more tokens."""
    if seq.finished:
        return seq
    if seq.cancel_requested:
        return attrs.evolve(seq, finished=True)
    before = len(seq.output)
    seq = attrs.evolve(seq, output=seq.output + (token,), remaining=seq.remaining - 1,
                       content_count=seq.content_count + 1, last_token=token)
    if _is_eos(token, config):
        if before >= seq.request.min_tokens:
            return attrs.evolve(seq, finished=True)
    else:
        stream_token(seq, token, out)
    if seq.remaining <= 0 or seq.seq_len + 1 >= config.max_seq_len:
        seq = attrs.evolve(seq, finished=True)
    return seq


def spec_tokens(seq: Sequence, tokens, config: SchedulerConfig, out: list) -> Sequence:
    """Emit ``tokens`` in order, stopping at the first that finishes the sequence."""
    for token in tokens:
        seq = spec_token(seq, token, config, out)
        if seq.finished:
            break
    return seq
