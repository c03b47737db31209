"""Rules of lanes 1 and 2: starting new requests and continuing chunked prefills
(specs/scheduler.md §5.10–5.14).

Invariant kept: a request becomes an active sequence only once its whole prompt is in the KV and
its first token is known; that token is streamed when it becomes active.
"""

from __future__ import annotations

from fxsched.core import admission
from fxsched.core.agenda import ask, forward, push, put_seqs
from fxsched.core.chunking import beside_decodes, first_chunk, first_chunk_budget, mixed_prefill_bound, next_chunk
from fxsched.core.emit import plain_token
from fxsched.core.events import AdapterIds, BeamHypotheses, SlotAllocated, TokenSampled, TokensSampled
from fxsched.core.phases import (
    AskQuery,
    AwaitBeam,
    AwaitBeamGroup,
    AwaitFirstToken,
    AwaitLaneAdapter,
    AwaitMixedReadback,
    AwaitPrefillToken,
    AwaitSlot,
    Barrier,
    BeamGroup,
    Chunk0Done,
    ContinuePrefills,
    EmitEffects,
    MixedReadback,
    PickPrefillToken,
    Promote,
    StartRequest,
    StartRequests,
)
from fxsched.core.records import replace
from fxsched.core.request import Request
from fxsched.core.retire import finish_and_release, finish_reason
from fxsched.core.rows import (
    answered_token,
    by_slot,
    ep_prefill_preamble,
    first_token_query,
    greedy_row,
    grow,
    host_pick,
    prefill_barrier,
)
from fxsched.core.sequence import Sequence
from fxsched.core.state import PrefillEntry, SchedulerState
from fxsched.effects import device_calls as dc
from fxsched.effects.base import Effect
from fxsched.effects.client import ResponseOut, TokenOut


# --- shared pieces ----------------------------------------------------------------------------


def become_active(state: SchedulerState, request: Request, seq_id: int, slot: int, token: int,
                  out: list[Effect]) -> SchedulerState:
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
    is_eos = token in config.eos_set
    if not is_eos and request.max_tokens > 0 and request.streaming:
        out.append(TokenOut(request.id, token))
    if is_eos or request.max_tokens <= 1:
        finish_and_release(replace(seq, finished=True), config, out)
        return state
    return replace(state, active=state.active + (seq,))


# --- lane 1 -------------------------------------------------------------------------------------


def nothing_admitted(state: SchedulerState) -> bool:
    """Lane 1 has nothing to do: no request was admitted this tick."""
    return not state.new_requests


def start_requests(state: SchedulerState, task: StartRequests, out: list[Effect]) -> SchedulerState:
    if nothing_admitted(state):
        return state
    new = state.new_requests
    state = replace(state, new_requests=())
    groups = beam_groups(new) if state.model.supports_beam and not state.config.chunked_prefill else []
    grouped = {r.id for group in groups for r in group}
    rest = tuple(StartRequest(r) for r in new if r.id not in grouped)
    return push(state, *(BeamGroup(group) for group in groups), *rest)


MAX_BEAMS_PER_GROUP = 320


def beam_groups(requests: tuple[Request, ...]) -> list[tuple[Request, ...]]:
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


def beam_group(state: SchedulerState, task: BeamGroup, out: list[Effect]) -> SchedulerState:
    query = dc.GenerateBeamBatch(tuple(r.prompt for r in task.requests), tuple(r.num_beams for r in task.requests))
    return ask(state, out, query, AwaitBeamGroup(task.requests))


def beam_group_done(state: SchedulerState, waiting: AwaitBeamGroup, event: BeamHypotheses,
                    out: list[Effect]) -> SchedulerState:
    """Each request of the group is answered with its hypothesis; no slot was ever held."""
    for index, req in enumerate(waiting.requests):
        hyp = event.hypotheses[index] if index < len(event.hypotheses) else ()
        last = hyp[-1] if hyp else None
        reason = finish_reason(None, last, req.max_tokens - len(hyp), len(hyp), state.config)
        out.append(ResponseOut(req.id, hyp, reason, 0, 0, 0, 0))
    return state


def start_request(state: SchedulerState, task: StartRequest, out: list[Effect]) -> SchedulerState:
    req = task.request
    seq_id = state.next_seq_id
    state = replace(state, next_seq_id=seq_id + 1)
    query: dc.DeviceCall
    if state.config.chunked_prefill:
        query = dc.AllocSequenceFor(seq_id, req.id, req.prompt_len + req.max_tokens)
    else:
        query = dc.AllocSequence(seq_id, req.id)
    return ask(state, out, query, AwaitSlot(req, seq_id))


def slot_allocated(state: SchedulerState, waiting: AwaitSlot, event: SlotAllocated, out: list[Effect]) -> SchedulerState:
    req = waiting.request
    return ask(state, out, dc.AdapterIdFor((req.adapter_slot,)),
               AwaitLaneAdapter(req, waiting.seq_id, event.slot))


def lane_adapter(state: SchedulerState, waiting: AwaitLaneAdapter, event: AdapterIds, out: list[Effect]) -> SchedulerState:
    req, slot = waiting.request, waiting.slot
    out.append(dc.AcquireAdapterSlot(req.adapter_slot))
    if state.config.chunked_prefill:
        if state.config.prefill_new_together:  # lane 2 prefills it with the others that arrived
            entry = PrefillEntry(waiting.seq_id, req, slot, 0)
            return replace(state, prefilling=state.prefilling + (entry,))
        return start_chunk0(state, req, waiting.seq_id, slot, out)
    if state.model.supports_beam and req.num_beams > 1:
        query = dc.GenerateBeamBatch((req.prompt,), (req.num_beams,))
        return ask(state, out, query, AwaitBeam(req, waiting.seq_id, slot))
    ep_prefill_preamble(slot, req.prompt_len, 0, req.prompt, out)
    then = AskQuery(first_token_query(req, 0), AwaitFirstToken(req, waiting.seq_id, slot))
    return forward(state, out, dc.Prefill(waiting.seq_id, req.prompt, stream=0), (waiting.seq_id,), then,
                   request=req, slot=slot)


def start_chunk0(state: SchedulerState, req: Request, seq_id: int, slot: int, out: list[Effect]) -> SchedulerState:
    """Chunk 0 on the prefill stream: the whole batch budget when nothing else is in flight."""
    budget = first_chunk_budget(state.config, bool(state.rows or state.prefilling), len(state.rows))
    chunk, last = first_chunk(req.prompt_len, budget)
    ep_prefill_preamble(slot, chunk, 0, req.prompt, out)
    query = dc.PrefillChunk(seq_id, req.prompt, 0, chunk, last, state.prefill_stream)
    return forward(state, out, query, (seq_id,), Chunk0Done(req, seq_id, slot, chunk, last), request=req, slot=slot)


def chunk0_done(state: SchedulerState, task: Chunk0Done, out: list[Effect]) -> SchedulerState:
    """Chunk 0 ran: read the first token of a whole prompt, or keep prefilling the rest."""
    prefill_barrier(state, out)
    if task.last:
        return ask(state, out, first_token_query(task.request, 0),
                   AwaitFirstToken(task.request, task.seq_id, task.slot))
    entry = PrefillEntry(task.seq_id, task.request, task.slot, task.chunk)
    return replace(state, prefilling=state.prefilling + (entry,))


def first_token(state: SchedulerState, waiting: AwaitFirstToken, event: TokenSampled | TokensSampled,
                out: list[Effect]) -> SchedulerState:
    return become_active(state, waiting.request, waiting.seq_id, waiting.slot, answered_token(event), out)


def beam_done(state: SchedulerState, waiting: AwaitBeam, event: BeamHypotheses, out: list[Effect]) -> SchedulerState:
    """A beam request is answered by one call and released at once; nothing is prefilled."""
    req = waiting.request
    hyp = event.hypotheses[0] if event.hypotheses else ()
    seq = Sequence(seq_id=waiting.seq_id, request=req, slot=waiting.slot, seq_len=0, blocks=0,
                   output=hyp, remaining=0, last_token=hyp[-1] if hyp else 0, finished=True,
                   has_cancel_flag=False)
    finish_and_release(seq, state.config, out)
    return state


# --- lane 2 -------------------------------------------------------------------------------------


def entry_chunk(entry: PrefillEntry, max_prefill_tokens: int) -> tuple[int, bool]:
    return next_chunk(entry.request.prompt_len, entry.offset, max_prefill_tokens)


def single_active_with_speculation(state: SchedulerState) -> bool:
    config = state.config
    return len(state.rows) == 1 and config.base_draft_count(state.model) > 0


def _slice(entry: PrefillEntry, chunk: int, last: bool) -> dc.PrefillSlice:
    return dc.PrefillSlice(entry.seq_id, entry.request.prompt, entry.offset, chunk, last)


def _advance(entry: PrefillEntry, chunk: int) -> PrefillEntry:
    return replace(entry, offset=entry.offset + chunk)


def _decode_rows(state: SchedulerState) -> tuple[SchedulerState, tuple[int, ...], tuple[int, ...]]:
    """Sort active by slot and feed every last token: (state, tokens, seq ids); seq_len + 1 each."""
    active = by_slot(state.active)
    tokens = tuple(s.last_token for s in active)
    ids = tuple(s.seq_id for s in active)
    block_size = state.model.block_size
    active = tuple(grow(s, s.seq_len + 1, block_size) for s in active)
    return replace(state, active=active), tokens, ids


def nothing_prefilling(state: SchedulerState) -> bool:
    """Lane 2 has nothing to do: no prompt is being prefilled."""
    return not state.prefilling


def chunk_limit(state: SchedulerState) -> int:
    """The most tokens of one prompt a lane-2 forward takes: max_prefill_tokens (less beside
    decoding sequences under the mixed-prefill bound), or the whole max_batch_tokens under
    idle_prefill_fills_budget while no sequence is decoding (§5.13)."""
    config = state.config
    if config.idle_prefill_fills_budget and config.prefill_new_together and not state.rows:
        return max(config.max_prefill_tokens, config.max_batch_tokens)
    return beside_decodes(config, len(state.rows))


def _step_rows(state: SchedulerState, mixed: bool) -> int:
    """The prompt rows a batched forward's chunks may take together: max_batch_tokens less a mixed
    step's decode rows, and beside decoding streams under idle_prefill_fills_budget one chunk's
    max_prefill_tokens (streams wait on one chunk's rows, whatever the queue)."""
    config = state.config
    budget = config.max_batch_tokens - (len(state.rows) if mixed else 0)
    if mixed and config.idle_prefill_fills_budget:
        budget = min(budget, config.max_prefill_tokens)
    return budget


def _wave(state: SchedulerState, mixed: bool, limit: int) -> tuple[PrefillEntry, ...]:
    """The prefilling entries one batched forward takes under prefill_new_together: from the front,
    while their chunks fit `_step_rows` (§5.13 A); the first always."""
    budget = _step_rows(state, mixed)
    taken = 0
    for i, entry in enumerate(state.prefilling):
        chunk, _ = entry_chunk(entry, limit)
        if i and taken + chunk > budget:
            return state.prefilling[:i]
        taken += chunk
    return state.prefilling


def _filled(state: SchedulerState, limit: int, bound: int) -> tuple[tuple[PrefillEntry, ...], list[tuple[int, bool]]]:
    """Under the mixed-prefill bound (§5.13 C): the entries from the front of ``prefilling`` and
    their (chunk, last), the first's chunk within ``limit``, each next one's cut to the rows left
    of min(``bound``, `_step_rows`), until none are left."""
    left = min(bound, _step_rows(state, True))
    group: list[PrefillEntry] = []
    chunks: list[tuple[int, bool]] = []
    for entry in state.prefilling:
        cap = min(limit, left) if group else limit
        if cap < 1:
            break
        chunk, last = entry_chunk(entry, cap)
        group.append(entry)
        chunks.append((chunk, last))
        left -= chunk
    return tuple(group), chunks


def continue_prefills(state: SchedulerState, task: ContinuePrefills, out: list[Effect]) -> SchedulerState:
    if nothing_prefilling(state):
        return state
    if state.rows and admission.policy_declines(state):
        return state
    config = state.config
    limit = chunk_limit(state)
    mixed = bool(state.rows) and not single_active_with_speculation(state)
    if mixed:
        state = replace(state, last_decode_ms=state.now_ms)
    bound = mixed_prefill_bound(config, len(state.rows)) if mixed else None
    if bound is not None:
        group, chunks = _filled(state, limit, bound)
    else:
        group = _wave(state, mixed, limit) if config.prefill_new_together else state.prefilling
        chunks = [entry_chunk(e, limit) for e in group]
    if len(group) >= 2 and (mixed or not state.rows):
        if mixed:
            out.append(dc.PollInnerq())
        slices = tuple(_slice(e, c, last) for e, (c, last) in zip(group, chunks, strict=True))
        n = 0
        ids: tuple[int, ...] = ()
        query: dc.DeviceCall
        if mixed:
            state, tokens, ids = _decode_rows(state)
            n = len(ids)
            query = dc.MixedForwardBatch(tokens, ids, slices, state.prefill_stream)
        else:
            query = dc.PrefillBatchChunk(slices, state.prefill_stream)
        advanced = tuple(_advance(e, c) for e, (c, _) in zip(group, chunks, strict=True))
        state = replace(state, prefilling=advanced + state.prefilling[len(group):], mixed_step_ran=mixed)
        picks = [PickPrefillToken(e.seq_id, n + r)
                 for r, (e, (_, last)) in enumerate(zip(advanced, chunks, strict=True)) if last]
        tail = (MixedReadback(ids),) if mixed else ()
        in_flight = ids + tuple(e.seq_id for e in advanced)
        return forward(state, out, query, in_flight, Barrier(), *picks, *tail, Promote())
    head = state.prefilling[0]
    chunk, last = entry_chunk(head, limit)
    out.append(dc.PollInnerq())
    rest = state.prefilling[1:]
    if mixed:
        state, tokens, ids = _decode_rows(state)
        query = dc.MixedForward(tokens, ids, _slice(head, chunk, last), state.prefill_stream)
        state = replace(state, prefilling=(_advance(head, chunk),) + rest, mixed_step_ran=True)
        pick = (PickPrefillToken(head.seq_id, len(ids)), Barrier()) if last else ()
        return forward(state, out, query, ids + (head.seq_id,), Barrier(), *pick, MixedReadback(ids), Promote())
    req = head.request
    ep_prefill_preamble(head.slot, chunk, head.offset, req.prompt, out)
    query = dc.PrefillChunk(head.seq_id, req.prompt, head.offset, chunk, last, state.prefill_stream)
    state = replace(state, prefilling=(_advance(head, chunk),) + rest)
    normalize = EmitEffects((dc.NormalizeSsmStates(head.seq_id, state.prefill_stream),))
    then = (Barrier(), PickPrefillToken(head.seq_id, 0)) if last else ()
    return forward(state, out, query, (head.seq_id,), normalize, *then, Promote())


def pick_prefill_token(state: SchedulerState, task: PickPrefillToken, out: list[Effect]) -> SchedulerState:
    entry = next((e for e in state.prefilling if e.seq_id == task.seq_id), None)
    if entry is None:
        return state
    return ask(state, out, first_token_query(entry.request, task.row), AwaitPrefillToken(task.seq_id))


def prefill_token(state: SchedulerState, waiting: AwaitPrefillToken, event: TokenSampled | TokensSampled,
                  out: list[Effect]) -> SchedulerState:
    token = answered_token(event)
    prefilling = tuple(replace(e, first_token=token) if e.seq_id == waiting.seq_id else e for e in state.prefilling)
    return replace(state, prefilling=prefilling)


def barrier(state: SchedulerState, task: Barrier, out: list[Effect]) -> SchedulerState:
    prefill_barrier(state, out)
    return state


def mixed_readback(state: SchedulerState, task: MixedReadback, out: list[Effect]) -> SchedulerState:
    by_id = {s.seq_id: s for s in state.active}
    rows = [by_id[i] for i in task.seq_ids if i in by_id]
    if len(rows) < len(task.seq_ids):  # a fault failed the step's rows: there is nothing to read
        return state
    query: dc.DeviceCall
    if all(greedy_row(s) for s in rows):
        query = dc.ArgmaxBatch(row=0, n=len(rows), stream=0)
    else:
        query = dc.CopyLogitsToHost(row=0, n=len(rows), picks=tuple(host_pick(s) for s in rows))
    return ask(state, out, query, AwaitMixedReadback(task.seq_ids))


def mixed_read(state: SchedulerState, waiting: AwaitMixedReadback, event: TokensSampled,
               out: list[Effect]) -> SchedulerState:
    logprobs = event.logprobs or (0,) * len(event.tokens)
    by_id = {s.seq_id: s for s in state.active}
    updated = {i: plain_token(by_id[i], t, state.config, out, lp, state.model)
               for i, t, lp in zip(waiting.seq_ids, event.tokens, logprobs, strict=True)}
    return put_seqs(state, updated)


def promote(state: SchedulerState, task: Promote, out: list[Effect]) -> SchedulerState:
    """Walk the prefilling list from last to first; every finished prompt becomes active."""
    for entry in reversed(state.prefilling):
        if entry.first_token is None:
            continue
        state = replace(state, prefilling=tuple(e for e in state.prefilling if e.seq_id != entry.seq_id))
        state = become_active(state, entry.request, entry.seq_id, entry.slot, entry.first_token, out)
    return state
