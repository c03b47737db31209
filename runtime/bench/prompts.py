"""Deterministic random prompts for the benchmarks (and the tests of the torch model): torch only."""

from __future__ import annotations

import torch


def random_prompts(seed: int, count: int, vocab_size: int, min_len: int = 1, max_len: int = 40) -> list[list[int]]:
    """`count` distinct prompts of random length in [min_len, max_len], drawn from a seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    prompts: list[list[int]] = []
    while len(prompts) < count:
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
        prompt = torch.randint(0, vocab_size, (length,), generator=gen).tolist()
        if prompt not in prompts:
            prompts.append(prompt)
    return prompts
