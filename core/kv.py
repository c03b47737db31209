"""KV block arithmetic: the one place that says how many blocks a number of tokens holds.

A sequence of ``tokens`` tokens always has room for its next token, so it holds
``tokens // block_size + 1`` blocks (specs/scheduler.md §5.5).
"""

from __future__ import annotations


def blocks_for(tokens: int, block_size: int) -> int:
    """KV blocks a sequence of ``tokens`` tokens holds (room for the next token included)."""
    return tokens // block_size + 1
