"""Admission: which pending requests start this tick, the policies and the KV reservation
(specs/scheduler.md §5.4–5.5). Pure functions."""

from __future__ import annotations

from typing import Optional

from fxsched.core.config import ModelInfo, SchedulerConfig
from fxsched.core.request import Request
from fxsched.core.state import SchedulerState
from fxsched.effects.base import Effect
from fxsched.effects.client import ErrorOut


def select_fifo(pending: tuple[Request, ...], cap: int) -> tuple[Request, ...]:
    """FIFO: the first ``cap`` pending requests."""
    return pending[: max(cap, 0)]


def select_slai(pending: tuple[Request, ...], cap: int) -> tuple[Request, ...]:
    """SLAI: seat 0 is the front of the queue (no starvation); the other seats go to the rest of
    the queue stably sorted by ascending prompt length."""
    if cap <= 0 or not pending:
        return ()
    rest = sorted(pending[1:], key=lambda r: r.prompt_len)
    return (pending[0],) + tuple(rest[: cap - 1])


SLAI_STARVATION_FRACTION = 0.8


def slai_declines(now_ms: float, last_decode_ms: float, deadline_ms: float, anything_active: bool) -> bool:
    """SLAI holds prefills back while the running sequences' time between tokens nears its deadline.

    Every active sequence gets a token at each decode (or mixed) step, so the time since the last
    such step is how long each of them has waited for its next token.
    """
    return anything_active and now_ms - last_decode_ms >= SLAI_STARVATION_FRACTION * deadline_ms


def select_requests(config: SchedulerConfig, pending: tuple[Request, ...], cap: int) -> tuple[Request, ...]:
    if config.policy == "slai":
        return select_slai(pending, cap)
    return select_fifo(pending, cap)


def without(pending: tuple[Request, ...], taken: tuple[Request, ...]) -> tuple[Request, ...]:
    """``pending`` less the ``taken`` requests (by identity of id), order kept."""
    ids = {r.id for r in taken}
    return tuple(r for r in pending if r.id not in ids)


def commitment(model: ModelInfo, config: SchedulerConfig, current: int, budget: int) -> int:
    """KV blocks a sequence may still need: ``blocks_for(min(current + min(budget, W), max(W, current)))``."""
    watermark = config.admission_watermark
    return model.blocks_for(min(current + min(budget, watermark), max(watermark, current)))


def reserve_kv(
    model: ModelInfo, config: SchedulerConfig, committed: int, new: tuple[Request, ...]
) -> tuple[tuple[Request, ...], tuple[Request, ...]]:
    """Split ``new`` into (admitted, deferred) by the KV reservation; no overtaking.

    Admit while ``committed + need <= total_blocks``; the first request that does not fit stops
    the walk, except that a first request is admitted anyway when nothing at all is committed.
    """
    if model.total_blocks == 0:
        return new, ()
    admitted = []
    for index, request in enumerate(new):
        need = commitment(model, config, request.prompt_len, request.max_tokens)
        if committed + need <= model.total_blocks or (index == 0 and committed == 0):
            committed += need
            admitted.append(request)
        else:
            return tuple(admitted), new[index:]
    return tuple(admitted), ()


UNKNOWN_ADAPTER = -1


def impossible(model: ModelInfo, config: SchedulerConfig, request: Request, adapter_id: int = 0) -> Optional[str]:
    """Why no amount of waiting could serve ``request`` (an adapter the device does not know, a
    prompt past the context, or needing more KV blocks than the device has), or ``None``."""
    if adapter_id == UNKNOWN_ADAPTER:
        return f"request {request.id}: unknown adapter slot {request.adapter_slot}"
    if request.prompt_len >= config.max_seq_len:
        return (f"request {request.id}: the prompt has {request.prompt_len} tokens, the context holds "
                f"{config.max_seq_len}")
    if model.total_blocks and model.blocks_for(request.prompt_len) > model.total_blocks:
        return (f"request {request.id}: the prompt needs {model.blocks_for(request.prompt_len)} KV blocks, "
                f"the device has {model.total_blocks}")
    return None


def cohort_split(cohort_id: int, new: tuple[Request, ...],
                 ids: tuple[int, ...]) -> tuple[tuple[Request, ...], tuple[Request, ...]]:
    """Split ``new`` into (same adapter cohort, deferred): a request joins only with the cohort's id."""
    same = tuple(r for r, i in zip(new, ids, strict=True) if i == cohort_id)
    other = tuple(r for r, i in zip(new, ids, strict=True) if i != cohort_id)
    return same, other


def policy_declines(state: SchedulerState) -> bool:
    """The admission policy's word on prefilling now (FIFO is always willing)."""
    config = state.config
    if config.policy != "slai":
        return False
    return slai_declines(state.now_ms, state.last_decode_ms, config.slai_deadline_ms, bool(state.rows))


def committed_blocks(state: SchedulerState) -> int:
    """KV blocks committed to everything in flight (specs/scheduler.md §5.5)."""
    model, config = state.model, state.config
    total = 0
    for s in state.active:
        total += commitment(model, config, s.seq_len + 1, s.remaining)
    for p in state.prefilling:
        total += commitment(model, config, p.request.prompt_len, p.request.max_tokens)
    for w in state.swapped:
        total += commitment(model, config, w.sequence.seq_len + 1, w.sequence.remaining)
    for q in state.preempted:
        total += commitment(model, config, len(q.tokens) + 1, q.sequence.remaining)
    return total


def refuse_impossible(state: SchedulerState, new: tuple[Request, ...], ids: tuple[int, ...],
                      out: list[Effect]) -> tuple[tuple[Request, ...], tuple[int, ...]]:
    """Fail at once the requests no device state could ever serve; keep the others (and their ids)."""
    keep, keep_ids = [], []
    for request, adapter_id in zip(new, ids, strict=True):
        problem = impossible(state.model, state.config, request, adapter_id)
        if problem is None:
            keep.append(request)
            keep_ids.append(adapter_id)
        else:
            out.append(ErrorOut(request.id, problem, request.streaming))
    return tuple(keep), tuple(keep_ids)
