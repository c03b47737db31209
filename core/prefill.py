"""Lanes 1 and 2: starting new requests and continuing chunked prefills (scheduler.md §5.10–5.14).

Invariant kept: a request becomes an active sequence only once its whole prompt is in the KV and
its first token is known; that token is streamed when it becomes active.
"""

from __future__ import annotations

import attrs

from fxsched.core.records import replace

from fxsched.core.events import AdapterIds, BeamHypotheses, SlotAllocated, TokenSampled, TokensSampled
from fxsched.core.machine import answer_rule, ask, push, task_rule
from fxsched.core.request import Request
from fxsched.core.retire import finish_and_release
from fxsched.core.sequence import Sequence
from fxsched.core.state import SchedulerState
from fxsched.effects import device_calls as dc
from fxsched.effects.client import TokenOut

PREFILL_CMD = 0xFFFFFFF0


# --- tasks and waiting records ----------------------------------------------------------------


@attrs.frozen
class StartRequests:
    """Lane 1 for this tick's new requests."""


@attrs.frozen
class StartRequest:
    request: Request


@attrs.frozen
class ContinuePrefills:
    """Lane 2."""


@attrs.frozen
class AwaitSlot:
    request: Request
    seq_id: int


@attrs.frozen
class AwaitLaneAdapter:
    request: Request
    seq_id: int
    slot: int


@attrs.frozen
class AwaitFirstToken:
    request: Request
    seq_id: int
    slot: int


@attrs.frozen
class AwaitBeam:
    request: Request
    seq_id: int
    slot: int


# --- shared pieces ----------------------------------------------------------------------------


def ep_prefill_preamble(slot: int, chunk: int, start: int, prompt: tuple[int, ...], out: list) -> None:
    """The EP words announcing a prefill chunk; tokens and vision sync always cover the whole prompt."""
    out.append(dc.EpBroadcastCmdForSeq(slot, PREFILL_CMD))
    out.append(dc.EpBroadcastCmd(chunk))
    out.append(dc.EpBroadcastCmd(start))
    out.append(dc.EpBroadcastCmd(len(prompt)))
    out.append(dc.EpBroadcastTokens(prompt))
    out.append(dc.EpSyncVisionEmbeds(len(prompt)))


def first_token_query(request: Request, row: int) -> dc.DeviceCall:
    """Device argmax on the greedy fast path, else a host copy of the row (scheduler.md §5.11)."""
    if request.greedy:
        return dc.ArgmaxOnDevice(row=row, stream=0)
    pick = dc.HostPick(request.temperature, request.seed, request.min_tokens > 0, 0)
    return dc.CopyLogitsToHost(row=row, n=1, picks=(pick,))


def answered_token(event) -> int:
    return event.token if isinstance(event, TokenSampled) else event.tokens[0]


def become_active(state: SchedulerState, request: Request, seq_id: int, slot: int, token: int,
                  out: list) -> SchedulerState:
    """Turn a fully prefilled request into an active sequence whose first token is ``token``."""
    model, config = state.model, state.config
    seq = Sequence(
        seq_id=seq_id, request=request, slot=slot, seq_len=request.prompt_len,
        blocks=model.blocks_for(request.prompt_len), output=(token,),
        remaining=request.max_tokens - 1, last_token=token,
        has_cancel_flag=request.streaming, cancel_requested=request.id in state.cancels,
    )
    is_eos = token in config.eos_ids
    if not is_eos and request.max_tokens > 0 and request.streaming:
        out.append(TokenOut(request.id, token))
    if is_eos or request.max_tokens <= 1:
        finish_and_release(replace(seq, finished=True), config, out)
        return state
    return replace(state, active=state.active + (seq,))


# --- lane 1: whole-prompt prefill ----------------------------------------------------------------


@task_rule(StartRequests)
def _start_requests(state: SchedulerState, task, out: list) -> SchedulerState:
    new = state.new_requests
    state = replace(state, new_requests=())
    return push(state, *(StartRequest(r) for r in new))


@task_rule(StartRequest)
def _start_request(state: SchedulerState, task: StartRequest, out: list) -> SchedulerState:
    seq_id = state.next_seq_id
    state = replace(state, next_seq_id=seq_id + 1)
    return ask(state, out, dc.AllocSequence(seq_id, task.request.id), AwaitSlot(task.request, seq_id))


@answer_rule(AwaitSlot, SlotAllocated)
def _slot_allocated(state, waiting: AwaitSlot, event: SlotAllocated, out):
    req = waiting.request
    return ask(state, out, dc.AdapterIdFor((req.adapter_slot,)),
               AwaitLaneAdapter(req, waiting.seq_id, event.slot))


@answer_rule(AwaitLaneAdapter, AdapterIds)
def _lane_adapter(state, waiting: AwaitLaneAdapter, event, out):
    req, slot = waiting.request, waiting.slot
    out.append(dc.AcquireAdapterSlot(req.adapter_slot))
    if state.model.supports_beam and req.num_beams > 1:
        query = dc.GenerateBeamBatch((req.prompt,), (req.num_beams,))
        return ask(state, out, query, AwaitBeam(req, waiting.seq_id, slot))
    ep_prefill_preamble(slot, req.prompt_len, 0, req.prompt, out)
    out.append(dc.Prefill(waiting.seq_id, req.prompt, stream=0))
    return ask(state, out, first_token_query(req, 0), AwaitFirstToken(req, waiting.seq_id, slot))


@answer_rule(AwaitFirstToken, TokenSampled, TokensSampled)
def _first_token(state, waiting: AwaitFirstToken, event, out):
    return become_active(state, waiting.request, waiting.seq_id, waiting.slot, answered_token(event), out)


@answer_rule(AwaitBeam, BeamHypotheses)
def _beam_done(state, waiting: AwaitBeam, event: BeamHypotheses, out):
    """A beam request is answered by one call and released at once; nothing is prefilled."""
    req = waiting.request
    hyp = event.hypotheses[0] if event.hypotheses else ()
    seq = Sequence(seq_id=waiting.seq_id, request=req, slot=waiting.slot, seq_len=0, blocks=0,
                   output=hyp, remaining=0, last_token=hyp[-1] if hyp else 0, finished=True,
                   has_cancel_flag=False)
    finish_and_release(seq, state.config, out)
    return state


# --- lane 2 -------------------------------------------------------------------------------------


@task_rule(ContinuePrefills)
def _continue_prefills(state: SchedulerState, task, out: list) -> SchedulerState:
    return state
