"""Lanes 1 and 2: starting new requests and continuing chunked prefills (scheduler.md §5.10–5.14).

Invariant kept: a request becomes an active sequence only once its whole prompt is in the KV and
its first token is known; that token is streamed when it becomes active.
"""

from __future__ import annotations

import attrs

from fxsched.core.records import replace

from fxsched.core.chunking import first_chunk, first_chunk_budget, next_chunk
from fxsched.core.flow import AskQuery, EmitEffects, forward
from fxsched.core.events import AdapterIds, BeamHypotheses, SlotAllocated, TokenSampled, TokensSampled
from fxsched.core.machine import answer_rule, ask, push, put_seqs, task_rule
from fxsched.core.request import Request
from fxsched.core.retire import finish_and_release, finish_reason
from fxsched.core.sequence import Sequence
from fxsched.core.state import PrefillEntry, SchedulerState
from fxsched.effects import device_calls as dc
from fxsched.effects.client import ResponseOut, TokenOut

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
    cached = next((n for s, n in state.prefix_hits if s == seq_id), 0)
    if cached:
        state = replace(state, prefix_hits=tuple(h for h in state.prefix_hits if h[0] != seq_id))
    cancelled = request.id in state.cancels
    if cancelled:
        state = replace(state, cancels=state.cancels - {request.id})
    seq = Sequence(
        seq_id=seq_id, request=request, slot=slot, seq_len=request.prompt_len,
        blocks=model.blocks_for(request.prompt_len), output=(token,),
        remaining=request.max_tokens - 1, last_token=token,
        has_cancel_flag=request.streaming, cancel_requested=cancelled, cached=cached,
    )
    is_eos = token in config.eos_ids
    if not is_eos and request.max_tokens > 0 and request.streaming:
        out.append(TokenOut(request.id, token))
    if is_eos or request.max_tokens <= 1:
        finish_and_release(replace(seq, finished=True), config, out)
        return state
    return replace(state, active=state.active + (seq,))


# --- lane 1 -------------------------------------------------------------------------------------


@task_rule(StartRequests)
def _start_requests(state: SchedulerState, task, out: list) -> SchedulerState:
    new = state.new_requests
    state = replace(state, new_requests=())
    groups = beam_groups(new) if state.model.supports_beam and not state.config.chunked_prefill else []
    grouped = {r.id for group in groups for r in group}
    rest = tuple(StartRequest(r) for r in new if r.id not in grouped)
    return push(state, *(BeamGroup(group) for group in groups), *rest)


MAX_BEAMS_PER_GROUP = 320


def beam_groups(requests) -> list[tuple[Request, ...]]:
    """Blocking beam requests grouped by adapter and packed up to 320 beams; only groups of two or
    more requests are co-dispatched (a lone beam request takes the per-request path)."""
    by_adapter: dict[int, list[list[Request]]] = {}
    for r in requests:
        if r.streaming or r.num_beams <= 1:
            continue
        packs = by_adapter.setdefault(r.adapter_slot, [[]])
        if sum(x.num_beams for x in packs[-1]) + r.num_beams > MAX_BEAMS_PER_GROUP:
            packs.append([])
        packs[-1].append(r)
    return [tuple(pack) for packs in by_adapter.values() for pack in packs if len(pack) >= 2]


@attrs.frozen
class BeamGroup:
    requests: tuple[Request, ...]


@attrs.frozen
class AwaitBeamGroup:
    requests: tuple[Request, ...]


@task_rule(BeamGroup)
def _beam_group(state: SchedulerState, task: BeamGroup, out: list) -> SchedulerState:
    query = dc.GenerateBeamBatch(tuple(r.prompt for r in task.requests), tuple(r.num_beams for r in task.requests))
    return ask(state, out, query, AwaitBeamGroup(task.requests))


@answer_rule(AwaitBeamGroup, BeamHypotheses)
def _beam_group_done(state, waiting: AwaitBeamGroup, event: BeamHypotheses, out):
    """Each request of the group is answered with its hypothesis; no slot was ever held."""
    for index, req in enumerate(waiting.requests):
        hyp = event.hypotheses[index] if index < len(event.hypotheses) else ()
        last = hyp[-1] if hyp else None
        reason = finish_reason(None, last, req.max_tokens - len(hyp), len(hyp), state.config)
        out.append(ResponseOut(req.id, hyp, reason, 0, 0, 0, 0))
    return state


@task_rule(StartRequest)
def _start_request(state: SchedulerState, task: StartRequest, out: list) -> SchedulerState:
    req = task.request
    seq_id = state.next_seq_id
    state = replace(state, next_seq_id=seq_id + 1)
    if state.config.chunked_prefill:
        query = dc.AllocSequenceFor(seq_id, req.id, req.prompt_len + req.max_tokens)
    else:
        query = dc.AllocSequence(seq_id, req.id)
    return ask(state, out, query, AwaitSlot(req, seq_id))


@answer_rule(AwaitSlot, SlotAllocated)
def _slot_allocated(state, waiting: AwaitSlot, event: SlotAllocated, out):
    req = waiting.request
    return ask(state, out, dc.AdapterIdFor((req.adapter_slot,)),
               AwaitLaneAdapter(req, waiting.seq_id, event.slot))


@answer_rule(AwaitLaneAdapter, AdapterIds)
def _lane_adapter(state, waiting: AwaitLaneAdapter, event, out):
    req, slot = waiting.request, waiting.slot
    out.append(dc.AcquireAdapterSlot(req.adapter_slot))
    if state.config.chunked_prefill:
        return start_chunk0(state, req, waiting.seq_id, slot, out)
    if state.model.supports_beam and req.num_beams > 1:
        query = dc.GenerateBeamBatch((req.prompt,), (req.num_beams,))
        return ask(state, out, query, AwaitBeam(req, waiting.seq_id, slot))
    ep_prefill_preamble(slot, req.prompt_len, 0, req.prompt, out)
    then = AskQuery(first_token_query(req, 0), AwaitFirstToken(req, waiting.seq_id, slot))
    return forward(state, out, dc.Prefill(waiting.seq_id, req.prompt, stream=0), (waiting.seq_id,), then,
                   request=req, slot=slot)


def start_chunk0(state: SchedulerState, req: Request, seq_id: int, slot: int, out: list) -> SchedulerState:
    """Chunk 0 on the prefill stream: the whole batch budget when nothing else is in flight."""
    budget = first_chunk_budget(state.config, bool(state.active or state.prefilling))
    chunk, last = first_chunk(req.prompt_len, budget)
    ep_prefill_preamble(slot, chunk, 0, req.prompt, out)
    query = dc.PrefillChunk(seq_id, req.prompt, 0, chunk, last, state.prefill_stream)
    return forward(state, out, query, (seq_id,), Chunk0Done(req, seq_id, slot, chunk, last), request=req, slot=slot)


@attrs.frozen
class Chunk0Done:
    request: Request
    seq_id: int
    slot: int
    chunk: int
    last: bool


@task_rule(Chunk0Done)
def _chunk0_done(state: SchedulerState, task: Chunk0Done, out: list) -> SchedulerState:
    """Chunk 0 ran: read the first token of a whole prompt, or keep prefilling the rest."""
    prefill_barrier(state, out)
    if task.last:
        return ask(state, out, first_token_query(task.request, 0),
                   AwaitFirstToken(task.request, task.seq_id, task.slot))
    entry = PrefillEntry(task.seq_id, task.request, task.slot, task.chunk)
    return replace(state, prefilling=state.prefilling + (entry,))


def prefill_barrier(state: SchedulerState, out: list) -> None:
    """The decode stream waits for the prefill stream's work so far."""
    out.append(dc.RecordEvent(state.prefill_event, state.prefill_stream))
    out.append(dc.StreamWaitEvent(0, state.prefill_event))


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


@attrs.frozen
class PickPrefillToken:
    """Read the first token of a prompt whose last chunk ran, from ``row`` of the last forward."""

    seq_id: int
    row: int


@attrs.frozen
class AwaitPrefillToken:
    seq_id: int


@attrs.frozen
class Barrier:
    pass


@attrs.frozen
class MixedReadback:
    """Read the decode rows of a mixed step and hand each token to the plain path."""

    seq_ids: tuple[int, ...]


@attrs.frozen
class AwaitMixedReadback:
    seq_ids: tuple[int, ...]


@attrs.frozen
class Promote:
    pass


def entry_chunk(entry: PrefillEntry, max_prefill_tokens: int) -> tuple[int, bool]:
    return next_chunk(entry.request.prompt_len, entry.offset, max_prefill_tokens)


def single_active_with_speculation(state: SchedulerState) -> bool:
    config = state.config
    return len(state.active) == 1 and config.base_draft_count(state.model) > 0


def _slice(entry: PrefillEntry, chunk: int, last: bool) -> dc.PrefillSlice:
    return dc.PrefillSlice(entry.seq_id, entry.request.prompt, entry.offset, chunk, last)


def _advance(entry: PrefillEntry, chunk: int) -> PrefillEntry:
    return replace(entry, offset=entry.offset + chunk)


def _decode_rows(state: SchedulerState) -> tuple[SchedulerState, tuple[int, ...], tuple[int, ...]]:
    """Sort active by slot and feed every last token: (state, tokens, seq ids); seq_len + 1 each."""
    from fxsched.core.decode import by_slot, grow

    active = by_slot(state.active)
    tokens = tuple(s.last_token for s in active)
    ids = tuple(s.seq_id for s in active)
    block_size = state.model.block_size
    active = tuple(grow(s, s.seq_len + 1, block_size) for s in active)
    return replace(state, active=active), tokens, ids


@task_rule(ContinuePrefills)
def _continue_prefills(state: SchedulerState, task, out: list) -> SchedulerState:
    if not state.prefilling:
        return state
    from fxsched.core.tick import policy_declines

    if state.active and policy_declines(state):
        return state
    config = state.config
    limit = config.max_prefill_tokens
    mixed = bool(state.active) and not single_active_with_speculation(state)
    if mixed:
        state = replace(state, last_decode_ms=state.now_ms)
    if len(state.prefilling) >= 2 and (mixed or not state.active):
        if mixed:
            out.append(dc.PollInnerq())
        chunks = [entry_chunk(e, limit) for e in state.prefilling]
        slices = tuple(_slice(e, c, last) for e, (c, last) in zip(state.prefilling, chunks))
        n, ids = 0, ()
        if mixed:
            state, tokens, ids = _decode_rows(state)
            n = len(ids)
            query = dc.MixedForwardBatch(tokens, ids, slices, state.prefill_stream)
        else:
            query = dc.PrefillBatchChunk(slices, state.prefill_stream)
        prefilling = tuple(_advance(e, c) for e, (c, _) in zip(state.prefilling, chunks))
        state = replace(state, prefilling=prefilling, mixed_step_ran=mixed)
        picks = [PickPrefillToken(e.seq_id, n + r) for r, (e, (_, last)) in enumerate(zip(prefilling, chunks)) if last]
        tail = (MixedReadback(ids),) if mixed else ()
        in_flight = ids + tuple(e.seq_id for e in prefilling)
        return forward(state, out, query, in_flight, Barrier(), *picks, *tail, Promote())
    head = state.prefilling[0]
    chunk, last = entry_chunk(head, limit)
    out.append(dc.PollInnerq())
    rest = state.prefilling[1:]
    if mixed:
        state, tokens, ids = _decode_rows(state)
        query = dc.MixedForward(tokens, ids, _slice(head, chunk, last), state.prefill_stream)
        state = replace(state, prefilling=(_advance(head, chunk),) + rest, mixed_step_ran=True)
        picks = (PickPrefillToken(head.seq_id, len(ids)), Barrier()) if last else ()
        return forward(state, out, query, ids + (head.seq_id,), Barrier(), *picks, MixedReadback(ids), Promote())
    req = head.request
    ep_prefill_preamble(head.slot, chunk, head.offset, req.prompt, out)
    query = dc.PrefillChunk(head.seq_id, req.prompt, head.offset, chunk, last, state.prefill_stream)
    state = replace(state, prefilling=(_advance(head, chunk),) + rest)
    normalize = EmitEffects((dc.NormalizeSsmStates(head.seq_id, state.prefill_stream),))
    then = (Barrier(), PickPrefillToken(head.seq_id, 0)) if last else ()
    return forward(state, out, query, (head.seq_id,), normalize, *then, Promote())


@task_rule(PickPrefillToken)
def _pick_prefill_token(state: SchedulerState, task: PickPrefillToken, out: list) -> SchedulerState:
    entry = next((e for e in state.prefilling if e.seq_id == task.seq_id), None)
    if entry is None:
        return state
    return ask(state, out, first_token_query(entry.request, task.row), AwaitPrefillToken(task.seq_id))


@answer_rule(AwaitPrefillToken, TokenSampled, TokensSampled)
def _prefill_token(state, waiting: AwaitPrefillToken, event, out):
    token = answered_token(event)
    prefilling = tuple(replace(e, first_token=token) if e.seq_id == waiting.seq_id else e for e in state.prefilling)
    return replace(state, prefilling=prefilling)


@task_rule(Barrier)
def _barrier(state: SchedulerState, task, out: list) -> SchedulerState:
    prefill_barrier(state, out)
    return state


@task_rule(MixedReadback)
def _mixed_readback(state: SchedulerState, task: MixedReadback, out: list) -> SchedulerState:
    from fxsched.core.decode import greedy_row, host_pick

    by_id = {s.seq_id: s for s in state.active}
    rows = [by_id[i] for i in task.seq_ids if i in by_id]
    if len(rows) < len(task.seq_ids):  # a fault failed the step's rows: there is nothing to read
        return state
    if all(greedy_row(s) for s in rows):
        query = dc.ArgmaxBatch(row=0, n=len(rows), stream=0)
    else:
        query = dc.CopyLogitsToHost(row=0, n=len(rows), picks=tuple(host_pick(s) for s in rows))
    return ask(state, out, query, AwaitMixedReadback(task.seq_ids))


@answer_rule(AwaitMixedReadback, TokensSampled)
def _mixed_read(state, waiting: AwaitMixedReadback, event: TokensSampled, out):
    from fxsched.core.emit import plain_token

    logprobs = event.logprobs or (0,) * len(event.tokens)
    by_id = {s.seq_id: s for s in state.active}
    updated = {i: plain_token(by_id[i], t, state.config, out, lp, state.model)
               for i, t, lp in zip(waiting.seq_ids, event.tokens, logprobs)}
    return put_seqs(state, updated)


@task_rule(Promote)
def _promote(state: SchedulerState, task, out: list) -> SchedulerState:
    """Walk the prefilling list from last to first; every finished prompt becomes active."""
    for entry in reversed(state.prefilling):
        if entry.first_token is None:
            continue
        state = replace(state, prefilling=tuple(e for e in state.prefilling if e.seq_id != entry.seq_id))
        state = become_active(state, entry.request, entry.seq_id, entry.slot, entry.first_token, out)
    return state
