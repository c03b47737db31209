"""Finishing a request, releasing its sequence and compacting the survivors
(specs/scheduler.md §5.19–5.20). Pure functions."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Optional

from fxsched.core.config import SchedulerConfig
from fxsched.core.records import replace
from fxsched.core.sequence import Guard, Sequence
from fxsched.effects.base import Effect
from fxsched.effects.client import DoneOut, FinishReason, ResponseOut
from fxsched.effects.lifecycle import CompactSlot, ReleaseReason, ReleaseSeq


def finish_reason(
    guard: Optional[str],
    last_token: Optional[int],
    remaining: int,
    seq_len: int,
    config: SchedulerConfig,
    tool_call_end: Optional[int] = None,
) -> FinishReason:
    """The finish reason; the first matching rule wins (specs/scheduler.md §5.19).

    timeout guard > EOS (``stop``) > tool-call end (``tool_calls``) > any other guard (``length``) >
    budget or context ceiling (``length``) > ``stop`` (e.g. a cancelled stream).
    """
    if guard == Guard.REQUEST_TIMEOUT:
        return FinishReason.TIMEOUT
    if last_token is not None and last_token in config.eos_set:
        return FinishReason.STOP
    if tool_call_end is not None and last_token == tool_call_end:
        return FinishReason.TOOL_CALLS
    if guard is not None:
        return FinishReason.LENGTH
    if remaining <= 0 or seq_len + 1 >= config.max_seq_len:
        return FinishReason.LENGTH
    return FinishReason.STOP


def reported_acc(acc: int, completion_tokens: int) -> int:
    """``acc`` as the client sees it: never more than the tokens that could have been drafted.

    The KV may keep accepted drafts past the point where the budget or EOS ended the output
    (specs/speculation.md §6.13 counts them); the first token comes from the prefill and is never
    a draft, so a client is told at most ``completion_tokens - 1`` accepted tokens.
    """
    return min(acc, max(completion_tokens - 1, 0))


def finish_frame(seq: Sequence, config: SchedulerConfig) -> DoneOut | ResponseOut:
    """The client's final frame for a finished sequence."""
    last = seq.output.last
    reason = finish_reason(seq.guard, last, seq.remaining, seq.seq_len, config)
    req = seq.request
    n = len(seq.output)
    acc = reported_acc(seq.acc, n)
    if req.streaming:
        return DoneOut(req.id, reason, n, 0, seq.cached, acc, seq.guard)
    return ResponseOut(req.id, seq.output.tokens(), reason, 0, seq.cached, acc, seq.logprob_records)


def finish_and_release(seq: Sequence, config: SchedulerConfig, out: list[Effect]) -> None:
    """Send the final frame and give the sequence's slot and blocks back (into the prefix cache)."""
    out.append(finish_frame(seq, config))
    out.append(ReleaseSeq(seq.seq_id, seq.slot, cache=True, reason=ReleaseReason.FINISH_SEQUENCE))


def compaction_moves(survivor_slots: Seq[int], pinned_slots: tuple[int, ...] = ()) -> list[tuple[int, int]]:
    """Moves ``(index, target)`` that pack survivors into slots ``[0, n)``.

    n counts the survivors and the sequences that hold a slot without moving (prompts still
    prefilling). Each survivor (in active order) whose slot is >= n takes the largest free target
    left, where the free targets are the slots below n that nobody holds. The active order is
    unchanged, and no target is ever a held slot.
    """
    n = len(survivor_slots) + len(pinned_slots)
    if not survivor_slots or max(survivor_slots) < n:  # packed already (most ticks)
        return []
    held = set(survivor_slots) | set(pinned_slots)
    free = [t for t in range(n) if t not in held]
    moves = []
    for index, slot in enumerate(survivor_slots):
        if slot >= n:
            moves.append((index, free.pop()))
    return moves


def compact(active: tuple[Sequence, ...], out: list[Effect], pinned_slots: tuple[int, ...] = ()) -> tuple[Sequence, ...]:
    """Apply ``compaction_moves`` to ``active``, emitting one ``CompactSlot`` per move."""
    moves = compaction_moves([s.slot for s in active], pinned_slots)
    if not moves:
        return active
    seqs = list(active)
    for index, target in moves:
        seq = seqs[index]
        out.append(CompactSlot(seq.seq_id, target))
        seqs[index] = replace(seq, slot=target)
    return tuple(seqs)
