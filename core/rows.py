"""Rows of a decode or verify: slot order, the greedy test, host picks, KV growth, and the EP
words and stream barrier that go with feeding the device (specs/scheduler.md §5.11, §5.16)."""

from __future__ import annotations

from functools import lru_cache
from operator import lt

from fxsched.core.events import TokenSampled, TokensSampled
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
    return pick_for(seq.request, len(seq.output))


def pick_for(req: Request, produced: int) -> dc.HostPick:
    """The pick of a decode row of ``req`` that fills output position ``produced``."""
    return dc.HostPick(req.temperature, req.seed + produced, produced < req.min_tokens, req.top_logprobs,
                       top_p=req.top_p, top_k=req.top_k, min_p=req.min_p)


def row_picks(request: Request, produced: int, k: int) -> tuple[dc.HostPick, ...]:
    """The picks of a ``k``-row verify of a sequence with ``produced`` output tokens: row ``i``
    fills output position ``produced + i``, so its seed is the request's + that position and EOS
    is masked while the position is below ``min_tokens`` (specs/speculation.md §6.16)."""
    req = request
    return tuple([dc.HostPick(req.temperature, req.seed + produced + i, produced + i < req.min_tokens,
                              req.top_logprobs, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p)
                  for i in range(k)])


def verify_picks(seq: Sequence, k: int) -> tuple[dc.HostPick, ...]:
    """A serial verify's picks: none when every row is greedy (the greedy verify's rows), else one
    per row (``row_picks``)."""
    produced = len(seq.output)
    return () if greedy_request(seq.request, produced) else row_picks(seq.request, produced, k)


def batch_picks(requests: tuple[Request, ...] | list[Request], produced: tuple[int, ...] | list[int],
                ks: tuple[int, ...]) -> tuple[dc.HostPick, ...]:
    """A batched verify's picks, sequence-major: none when every row of every sequence is greedy."""
    if all(greedy_request(r, n) for r, n in zip(requests, produced, strict=True)):
        return ()
    return tuple(p for r, n, k in zip(requests, produced, ks, strict=True) for p in row_picks(r, n, k))


def answered_token(event: TokenSampled | TokensSampled) -> int:
    """The token of a one-row read: the device argmax's, or the first host pick's."""
    return event.token if isinstance(event, TokenSampled) else event.tokens[0]


def row_query(seq: Sequence, row: int = 0) -> dc.DeviceCall:
    """The read of a decoded row's token inside a speculative step: the device argmax for a greedy
    row, else a host pick (seed + output length, the request's filters)."""
    if greedy_row(seq):
        return dc.ArgmaxOnDevice(row=row, stream=0)
    return dc.CopyLogitsToHost(row=row, n=1, picks=(host_pick(seq),))


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
