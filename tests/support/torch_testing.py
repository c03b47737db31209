"""Helpers for tests of the torch model: deterministic prompts and a single-thread guard.

Tiny tensors are dominated by OpenMP synchronisation; on a shared 2-core machine two intra-op
threads can be 50x slower than one, so tests run the model with one thread.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Run the body with torch intra-op threads set to 1, restoring the previous count afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


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
