"""Lane 3: choosing the decode path, and the plain decode step (scheduler.md §5.15–5.17).

Invariant kept: after a plain decode every row's ``seq_len`` has grown by one (the fed token) and
its ``blocks`` cover ``seq_len``; a failed batch changes no sequence it did not fail or preempt.
"""

from __future__ import annotations

import attrs

from fxsched.core.records import replace

from fxsched.core.emit import plain_token
from fxsched.core.events import DeviceFault, TokensSampled
from fxsched.core.machine import answer_rule, ask, push, task_rule
from fxsched.core.sequence import Sequence
from fxsched.core.state import SchedulerState
from fxsched.effects import device_calls as dc
from fxsched.effects import plans
from fxsched.effects.client import ErrorOut
from fxsched.effects.lifecycle import ReleaseSeq


@attrs.frozen
class DecodeLane:
    pass


@attrs.frozen
class PlainDecode:
    pass


@attrs.frozen
class AwaitDecode:
    seq_ids: tuple[int, ...]


def may_speculate(seq: Sequence) -> bool:
    """Not thinking and no guard set."""
    return seq.guard is None


def by_slot(active: tuple[Sequence, ...]) -> tuple[Sequence, ...]:
    return tuple(sorted(active, key=lambda s: s.slot)) if len(active) > 1 else active


def greedy_row(seq: Sequence) -> bool:
    """A row whose pick is the device argmax (scheduler.md §5.16 step 2)."""
    req = seq.request
    return req.temperature == 0 and req.top_logprobs == 0 and req.min_tokens <= len(seq.output)


def host_pick(seq: Sequence) -> dc.HostPick:
    req = seq.request
    return dc.HostPick(req.temperature, req.seed + len(seq.output), len(seq.output) < req.min_tokens,
                       req.top_logprobs)


def grow(seq: Sequence, seq_len: int, block_size: int) -> Sequence:
    """New KV length; the block table grows to cover it and never shrinks."""
    blocks = max(seq.blocks, seq_len // block_size + 1)
    return replace(seq, seq_len=seq_len, blocks=blocks)


from fxsched.core.spec_step import SpecStep  # noqa: E402
from fxsched.core.ngram import NgramStep  # noqa: E402
from fxsched.core.self_spec import SelfSpecStep  # noqa: E402


@task_rule(DecodeLane)
def _decode_lane(state: SchedulerState, task, out: list) -> SchedulerState:
    if state.mixed_step_ran:
        return state
    state = replace(state, last_decode_ms=state.now_ms)
    config, model = state.config, state.model
    if state.prefilling:
        out.append(dc.RecordEvent(state.prefill_event, state.prefill_stream))
        out.append(dc.StreamWaitEvent(0, state.prefill_event))
    active = state.active
    covered = all(s.slot < config.speculation_slot_cap for s in active)
    if config.ngram_speculative and len(active) == 1 and covered:
        return push(state, NgramStep())
    if config.self_speculative and model.has_self_speculative and len(active) == 1 and covered:
        return push(state, SelfSpecStep())
    if (config.uses_mtp(model) and len(active) <= config.mtp_width_limit and covered
            and all(may_speculate(s) for s in active)):
        return push(state, SpecStep())
    return push(state, PlainDecode())


@task_rule(PlainDecode)
def _plain_decode(state: SchedulerState, task, out: list) -> SchedulerState:
    active = by_slot(state.active)
    state = replace(state, active=active)
    picks = () if all(greedy_row(s) for s in active) else tuple(host_pick(s) for s in active)
    plan = plans.Decode(
        tokens=tuple(s.last_token for s in active),
        seqs=tuple(s.seq_id for s in active),
        seq_lens=tuple(s.seq_len for s in active),
        picks=picks,
    )
    return ask(state, out, plan, AwaitDecode(plan.seqs))


@answer_rule(AwaitDecode, TokensSampled, DeviceFault)
def _decoded(state, waiting: AwaitDecode, event, out):
    if isinstance(event, DeviceFault):
        if event.kv_exhausted and len(waiting.seq_ids) > 1:
            from fxsched.core.lifecycle import preempt, preemption_victim

            rows = tuple(s for s in state.active if s.seq_id in set(waiting.seq_ids))
            return push(preempt(state, preemption_victim(rows), out), PlainDecode())
        return fail_batch(state, waiting.seq_ids, event.message, out)
    config, block_size = state.config, state.model.block_size
    logprobs = event.logprobs or (0,) * len(event.tokens)
    updated = {}
    for seq_id, token, lp in zip(waiting.seq_ids, event.tokens, logprobs):
        seq = next(s for s in state.active if s.seq_id == seq_id)
        seq = grow(seq, seq.seq_len + 1, block_size)
        updated[seq_id] = plain_token(seq, token, config, out, lp, state.model)
    return replace(state, active=tuple(updated.get(s.seq_id, s) for s in state.active))


def fail_batch(state: SchedulerState, seq_ids, message: str, out: list) -> SchedulerState:
    """A fatal device error fails only the sequences of its batch; the others go on."""
    failed = set(seq_ids)
    for seq in state.active:
        if seq.seq_id in failed:
            out.append(ReleaseSeq(seq.seq_id, seq.slot, cache=False, reason="send_error"))
            out.append(ErrorOut(seq.request_id, message, seq.request.streaming))
    return replace(state, active=tuple(s for s in state.active if s.seq_id not in failed))
