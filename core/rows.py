"""Rows of a decode or verify: slot order, the greedy test, host picks, KV growth, and the EP
words and stream barrier that go with feeding the device (specs/scheduler.md §5.11, §5.16)."""

from __future__ import annotations

from functools import lru_cache
from operator import lt

from fxsched.core.kv import blocks_for
from fxsched.core.records import with_fields
from fxsched.core.request import Request
from fxsched.core.sequence import Sequence
from fxsched.core.state import SchedulerState
from fxsched.effects import device_calls as dc
from fxsched.effects.base import Effect
from fxsched.effects.ep_words import PREFILL_CMD


def may_speculate(seq: Sequence) -> bool:
    """Not thinking and no guard set."""
    return seq.guard is None


def by_slot(active: tuple[Sequence, ...]) -> tuple[Sequence, ...]:
    return tuple(sorted(active, key=lambda s: s.slot)) if len(active) > 1 else active


@lru_cache(maxsize=8)
def row_numbers(n: int) -> tuple[int, ...]:
    """``0, 1, ..., n - 1``: the rows of an ``n``-row batch. The same tuple for the same ``n``, so a
    wide batch's every tick shares one instead of making ``n`` new ints for each call that names
    its rows (a cache of a pure function: nothing a caller can observe changes)."""
    return tuple(range(n))


def slots_increasing(slots: tuple[int, ...]) -> bool:
    """Whether ``by_slot`` would leave the sequences of these slots in their order."""
    return all(map(lt, slots, slots[1:]))


def greedy_request(req: Request, produced: int) -> bool:
    """A row whose pick is the device argmax, with ``produced`` output tokens (specs/scheduler.md §5.16)."""
    return req.temperature == 0 and req.top_logprobs == 0 and req.min_tokens <= produced


def greedy_row(seq: Sequence) -> bool:
    """A row whose pick is the device argmax (specs/scheduler.md §5.16)."""
    return greedy_request(seq.request, len(seq.output))


def host_pick(seq: Sequence) -> dc.HostPick:
    """A decode row's pick: seed + output length, EOS masked below ``min_tokens``, the request's filters."""
    req = seq.request
    return dc.HostPick(req.temperature, req.seed + len(seq.output), len(seq.output) < req.min_tokens,
                       req.top_logprobs, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p)


def grow(seq: Sequence, seq_len: int, block_size: int) -> Sequence:
    """New KV length; the block table grows to cover it and never shrinks."""
    blocks = max(seq.blocks, blocks_for(seq_len, block_size))
    return with_fields(seq, {"seq_len": seq_len, "blocks": blocks})  # (ints: nothing to convert)


def first_token_query(request: Request, row: int) -> dc.DeviceCall:
    """Device argmax on the greedy fast path, else a host copy of the row (specs/scheduler.md §5.11)."""
    if request.greedy:
        return dc.ArgmaxOnDevice(row=row, stream=0)
    pick = dc.HostPick(request.temperature, request.seed, request.min_tokens > 0, 0,
                       top_p=request.top_p, top_k=request.top_k, min_p=request.min_p)
    return dc.CopyLogitsToHost(row=row, n=1, picks=(pick,))


def ep_prefill_preamble(slot: int, chunk: int, start: int, prompt: tuple[int, ...], out: list[Effect]) -> None:
    """The EP words announcing a prefill chunk; tokens and vision sync always cover the whole prompt."""
    out.append(dc.EpBroadcastCmdForSeq(slot, PREFILL_CMD))
    out.append(dc.EpBroadcastCmd(chunk))
    out.append(dc.EpBroadcastCmd(start))
    out.append(dc.EpBroadcastCmd(len(prompt)))
    out.append(dc.EpBroadcastTokens(prompt))
    out.append(dc.EpSyncVisionEmbeds(len(prompt)))


def prefill_barrier(state: SchedulerState, out: list[Effect]) -> None:
    """The decode stream waits for the prefill stream's work so far."""
    out.append(dc.RecordEvent(state.prefill_event, state.prefill_stream))
    out.append(dc.StreamWaitEvent(0, state.prefill_event))
