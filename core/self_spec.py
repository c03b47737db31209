"""Self-speculative drafting: the model drafts with cheap decodes of itself, then verifies them in
one forward (speculation.md §6.15). Never counts into ``acc``.

Invariant kept: after the step the KV holds the first token plus the accepted drafts; the draft
decodes are rewound before the verify and a partial accept rolls the SSM state back.
"""

from __future__ import annotations

import attrs

from fxsched.core.decode import grow
from fxsched.core.emit import spec_tokens
from fxsched.core.events import DraftCapacity, TokenSampled, VerifyRows
from fxsched.core.flow import AskQuery, forward
from fxsched.core.machine import answer_rule, ask, find_seq, put_seq, task_rule
from fxsched.core.records import replace
from fxsched.core.state import SchedulerState
from fxsched.effects import device_calls as dc


@attrs.frozen
class SelfSpecStep:
    pass


@attrs.frozen
class AwaitSelfCapacity:
    pass


@attrs.frozen
class AwaitSelfToken:
    """The decode (``drafts`` empty, ``first`` unset) or a draft decode of the step."""

    seq_id: int
    draft_count: int
    pre_len: int = 0
    first: int = -1
    drafts: tuple[int, ...] = ()


@attrs.frozen
class AwaitSelfVerify:
    seq_id: int
    first: int
    drafts: tuple[int, ...]
    pre_len: int


@task_rule(SelfSpecStep)
def _self_spec_step(state: SchedulerState, task, out: list) -> SchedulerState:
    return ask(state, out, dc.SlotDraftCapacity(tuple(s.slot for s in state.active)), AwaitSelfCapacity())


@answer_rule(AwaitSelfCapacity, DraftCapacity)
def _self_capacity(state, waiting, event: DraftCapacity, out):
    count = min((state.config.num_drafts,) + event.capacities)
    (seq,) = state.active
    out.append(dc.EpBroadcastCmdForSeq(seq.slot, seq.last_token))
    state = put_seq(state, grow(seq, seq.seq_len + 1, state.model.block_size))
    read = AskQuery(dc.ArgmaxOnDevice(row=0, stream=0), AwaitSelfToken(seq.seq_id, count))
    return forward(state, out, dc.DecodeCall(seq.last_token, seq.seq_id, 0), (seq.seq_id,), read)


@answer_rule(AwaitSelfToken, TokenSampled)
def _self_token(state, waiting: AwaitSelfToken, event: TokenSampled, out):
    seq = find_seq(state, waiting.seq_id)
    if waiting.first < 0:
        waiting = replace(waiting, first=event.token, pre_len=seq.seq_len)
    else:
        waiting = replace(waiting, drafts=waiting.drafts + (event.token,))
    x = waiting.drafts[-1] if waiting.drafts else waiting.first
    if len(waiting.drafts) < waiting.draft_count:
        state = put_seq(state, grow(seq, seq.seq_len + 1, state.model.block_size))
        read = AskQuery(dc.ArgmaxOnDevice(row=0, stream=0), waiting)
        return forward(state, out, dc.DecodeDraft(x, seq.seq_id, 0), (seq.seq_id,), read)
    pre = waiting.pre_len
    if seq.seq_len > pre:
        out.append(dc.TruncateSequence(seq.seq_id, pre))
    out.append(dc.CheckpointSsmStates(seq.seq_id))
    tokens = (waiting.first,) + waiting.drafts
    query = dc.DecodeVerify(seq.seq_id, tokens)
    state = put_seq(state, grow(replace(seq, seq_len=pre), pre + len(tokens), state.model.block_size))
    return ask(state, out, query, AwaitSelfVerify(seq.seq_id, waiting.first, waiting.drafts, pre))


@answer_rule(AwaitSelfVerify, VerifyRows)
def _self_verified(state, waiting: AwaitSelfVerify, event: VerifyRows, out):
    seq = find_seq(state, waiting.seq_id)
    rows = event.rows
    emitted = [waiting.first]
    accepted = 0
    for i, draft in enumerate(waiting.drafts):
        if draft == rows[i]:
            emitted.append(draft)
            accepted += 1
        else:
            emitted.append(rows[i])
            break
    else:
        emitted.append(rows[len(waiting.drafts)])
    kept = waiting.pre_len + 1 + accepted
    if seq.seq_len > kept:
        out.append(dc.TruncateSequence(seq.seq_id, kept))
        out.append(dc.RollbackSsmStates(seq.seq_id, accepted + 1))
        seq = replace(seq, seq_len=kept)
    return put_seq(state, spec_tokens(seq, tuple(emitted), state.config, out))
