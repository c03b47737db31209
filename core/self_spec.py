"""Rules of self-speculative drafting: the model drafts with cheap decodes of itself, then
verifies them in one forward (specs/speculation.md §6.15). Never counts into ``acc``.

Invariant kept: after the step the KV holds the first token plus the accepted drafts; the draft
decodes are rewound before the verify and a partial accept rolls the SSM state back.
"""

from __future__ import annotations

from fxsched.core.agenda import ask, find_seq, forward, put_seq
from fxsched.core.emit import spec_tokens
from fxsched.core.events import DraftCapacity, TokenSampled, VerifyRows
from fxsched.core.phases import AskQuery, AwaitSelfCapacity, AwaitSelfToken, AwaitSelfVerify, SelfSpecStep
from fxsched.core.records import replace
from fxsched.core.rows import grow
from fxsched.core.state import SchedulerState
from fxsched.effects import device_calls as dc
from fxsched.effects.base import Effect


def self_spec_step(state: SchedulerState, task: SelfSpecStep, out: list[Effect]) -> SchedulerState:
    return ask(state, out, dc.SlotDraftCapacity(tuple(s.slot for s in state.active)), AwaitSelfCapacity())


def self_capacity(state: SchedulerState, waiting: AwaitSelfCapacity, event: DraftCapacity,
                  out: list[Effect]) -> SchedulerState:
    count = min((state.config.num_drafts,) + event.capacities)
    (seq,) = state.active
    out.append(dc.EpBroadcastCmdForSeq(seq.slot, seq.last_token))
    state = put_seq(state, grow(seq, seq.seq_len + 1, state.model.block_size))
    read = AskQuery(dc.ArgmaxOnDevice(row=0, stream=0), AwaitSelfToken(seq.seq_id, count))
    return forward(state, out, dc.DecodeCall(seq.last_token, seq.seq_id, 0), (seq.seq_id,), read)


def self_token(state: SchedulerState, waiting: AwaitSelfToken, event: TokenSampled,
               out: list[Effect]) -> SchedulerState:
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


def self_verified(state: SchedulerState, waiting: AwaitSelfVerify, event: VerifyRows,
                  out: list[Effect]) -> SchedulerState:
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
