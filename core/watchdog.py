"""Watchdogs, the SSM snapshot ring and rollback to a boundary (specs/watchdog.md §7.1–7.6). Pure functions.

Invariants kept: a ring holds at most ``ring_slots`` entries, one per slot; a rollback keeps the
output up to and including a boundary token that has a snapshot right after it, and rewinds the
KV, the budget and the content count by exactly the dropped tokens.
"""

from __future__ import annotations

from operator import ne

from typing import Optional

from fxsched.core.config import ModelInfo, SchedulerConfig
from fxsched.core.records import replace
from fxsched.core.sequence import Guard, Sequence
from fxsched.core.token_log import TokenLog
from fxsched.effects import device_calls as dc
from fxsched.effects.base import Effect
from fxsched.effects.lifecycle import SsmSnapshotRestore, SsmSnapshotSave

CONTENT_LOOP_MIN = 48
CONTENT_LOOP_EVERY = 16
CONTENT_LOOP_PERIODS = range(2, 65)
CONTENT_LOOP_SPAN = 64
FUZZY_MIN_OUTPUT = 90
FUZZY_WINDOWS = range(40, 14, -1)


def content_loop_due(content_count: int) -> bool:
    return content_count >= CONTENT_LOOP_MIN and content_count % CONTENT_LOOP_EVERY == 0


def content_loop(out: tuple[int, ...]) -> bool:
    """Three consecutive copies of the last p tokens, for some period p = 2 .. 64."""
    n = len(out)
    for p in CONTENT_LOOP_PERIODS:
        if 3 * p > n:
            break
        if all(out[n - o] == out[n - o - p] == out[n - o - 2 * p] for o in range(1, p + 1)):
            return True
    return False


def fuzzy_repetition(out: tuple[int, ...]) -> Optional[int]:
    """The largest window P (40 .. 15) whose last three copies differ by at most max(P // 12, 1)
    tokens pairwise; ``None`` below 90 tokens or without a hit."""
    n = len(out)
    if n < FUZZY_MIN_OUTPUT:
        return None
    for p in FUZZY_WINDOWS:
        if 3 * p > n:
            continue
        base = n - 3 * p
        tolerance = max(p // 12, 1)
        mis_a = sum(map(ne, out[base:base + p], out[base + p:base + 2 * p]))
        if mis_a > tolerance:
            continue
        mis_b = sum(map(ne, out[base + p:base + 2 * p], out[base + 2 * p:base + 3 * p]))
        if mis_b <= tolerance:
            return p
    return None


def ring_save(ring: tuple[tuple[int, int], ...], cursor: int, capacity: int,
              position: int) -> tuple[tuple[tuple[int, int], ...], int, int]:
    """Save a snapshot at ``position`` in slot ``cursor``: returns (ring, cursor, slot)."""
    slot = cursor
    kept = tuple(e for e in ring if e[0] != slot)
    return kept + ((slot, position),), (cursor + 1) % capacity, slot


def ring_truncate(ring: tuple[tuple[int, int], ...], after: int,
                  capacity: int) -> tuple[tuple[tuple[int, int], ...], int]:
    """Keep the entries at positions <= ``after``; the cursor follows the newest survivor."""
    kept = tuple(e for e in ring if e[1] <= after)
    if not kept:
        return kept, 0
    newest = max(kept, key=lambda e: e[1])
    return kept, (newest[0] + 1) % capacity


def snapshots_possible(config: SchedulerConfig, model: ModelInfo) -> bool:
    """Whether any token can take an SSM snapshot (a ring, and boundary tokens to save at)."""
    return model.has_ssm_layers and model.ring_slots > 0 and bool(config.boundary_tokens)


def snapshot_wanted(seq: Sequence, token: int, config: SchedulerConfig, model: ModelInfo) -> bool:
    return snapshots_possible(config, model) and token in config.boundary_tokens


def save_snapshot(seq: Sequence, model: ModelInfo, out: list[Effect]) -> Sequence:
    """Snapshot the SSM state at a boundary token just appended (before its checkpoint)."""
    ring, cursor, slot = ring_save(seq.ring, seq.ring_cursor, model.ring_slots, len(seq.output))
    out.append(SsmSnapshotSave(seq.seq_id, slot))
    return replace(seq, ring=ring, ring_cursor=cursor)


def rollback_boundary(seq: Sequence, span: int, config: SchedulerConfig, model: ModelInfo) -> Optional[tuple[int, int]]:
    """(boundary index, ring slot) a rollback of at least ``span`` tokens would go back to, or
    ``None`` when the rollback is declined (specs/watchdog.md §7.5, in that order)."""
    # a stream's client has seen the tokens: a swapped-in stream lost its cancel flag, not its client
    if not config.rollback_resteer or seq.has_cancel_flag or seq.request.streaming or not model.supports_rollback:
        return None
    if seq.rollbacks >= config.max_rollbacks or not config.boundary_tokens:
        return None
    if model.has_ssm_layers and model.ring_slots == 0:
        return None
    out = seq.output.tokens()
    positions = {pos: slot for slot, pos in seq.ring}
    for i in range(len(out) - 1 - span, -1, -1):
        if out[i] in config.boundary_tokens:
            if not model.has_ssm_layers:
                return i, -1
            if i + 1 in positions:
                return i, positions[i + 1]
    return None


def roll_back(seq: Sequence, index: int, slot: int, model: ModelInfo, out: list[Effect]) -> Sequence:
    """Restore the snapshot after boundary ``index`` and cut everything after it."""
    if slot >= 0:
        out.append(SsmSnapshotRestore(seq.seq_id, slot))
    ring, cursor = ring_truncate(seq.ring, index + 1, max(model.ring_slots, 1))
    tokens = seq.output.tokens()
    kept = index + 1
    dropped = len(tokens) - kept
    # The KV keeps the prompt and the kept output but its last token (the boundary, fed next):
    # ``prompt_len + kept - 1``. Rewinding by ``dropped`` alone is one too long when the sink runs
    # before the new token is appended (the plain content-loop check, specs/watchdog.md §7.5).
    seq_len = seq.request.prompt_len + kept - 1
    out.append(dc.TruncateSequence(seq.seq_id, seq_len))
    return replace(seq, output=TokenLog(tokens[:kept]), seq_len=seq_len, remaining=seq.remaining + dropped,
                   content_count=seq.content_count - dropped, last_token=tokens[kept - 1],
                   rollbacks=seq.rollbacks + 1, ring=ring, ring_cursor=cursor)


def rollback_or_guard(seq: Sequence, span: int, guard: Guard, config: SchedulerConfig, model: ModelInfo,
                      out: list[Effect]) -> Sequence:
    """Roll back at least ``span`` tokens, or finish the sequence with ``guard`` when declined."""
    target = rollback_boundary(seq, span, config, model)
    if target is None:
        return replace(seq, guard=guard, finished=True)
    return roll_back(seq, target[0], target[1], model, out)
