"""The chunk planner of chunked prefill (specs/scheduler.md §5.10, §5.13). Pure functions.

Invariant: the chunks of a prompt cover it exactly once, in order, each within the budget that
applied to it, and every chunk makes progress (a non-last chunk of 4+ tokens is cut down to a
multiple of 4, never to zero).
"""

from __future__ import annotations

from typing import Optional

from fxsched.core.config import SchedulerConfig


def mixed_prefill_bound(config: SchedulerConfig, decoding: int) -> Optional[int]:
    """The mixed-prefill bound on a step's prompt rows beside ``decoding`` decoding sequences:
    max(``mixed_prefill_floor``, ``mixed_prefill_per_decode`` * decoding), at least 1; ``None`` when
    the option is off, prompts are not chunked, or nothing decodes (specs/scheduler.md §5.13 C)."""
    if not decoding or not config.chunked_prefill or not (config.mixed_prefill_floor or config.mixed_prefill_per_decode):
        return None
    return max(config.mixed_prefill_floor, config.mixed_prefill_per_decode * decoding)


def beside_decodes(config: SchedulerConfig, decoding: int) -> int:
    """The most tokens of one prompt a chunk takes beside ``decoding`` decoding sequences:
    max_prefill_tokens, or the mixed-prefill bound where that is less."""
    bound = mixed_prefill_bound(config, decoding)
    return config.max_prefill_tokens if bound is None else min(config.max_prefill_tokens, bound)


def first_chunk_budget(config: SchedulerConfig, anything_in_flight: bool, decoding: int = 0) -> int:
    """Chunk 0 gets the whole batch budget when nothing is active or prefilling, else one chunk
    (bounded beside ``decoding`` decoding sequences, `beside_decodes`)."""
    return beside_decodes(config, decoding) if anything_in_flight else config.max_batch_tokens


def first_chunk(prompt_len: int, budget: int) -> tuple[int, bool]:
    """(length, last) of chunk 0."""
    chunk = min(prompt_len, budget)
    return chunk, chunk == prompt_len


def next_chunk(prompt_len: int, offset: int, max_prefill_tokens: int) -> tuple[int, bool]:
    """(length, last) of the chunk after ``offset`` tokens are in the KV."""
    chunk = min(prompt_len - offset, max_prefill_tokens)
    last = offset + chunk >= prompt_len
    if not last and chunk >= 4:
        chunk -= chunk % 4
    return chunk, last


def plan_chunks(prompt_len: int, first_budget: int, max_prefill_tokens: int) -> list[tuple[int, int, bool]]:
    """Every chunk ``(start, length, last)`` of one prompt, from chunk 0 on."""
    if prompt_len <= 0 or first_budget <= 0 or max_prefill_tokens <= 0:
        raise ValueError("prompt length and budgets must be positive")
    chunk, last = first_chunk(prompt_len, first_budget)
    plan = [(0, chunk, last)]
    offset = chunk
    while not last:
        chunk, last = next_chunk(prompt_len, offset, max_prefill_tokens)
        plan.append((offset, chunk, last))
        offset += chunk
    return plan
