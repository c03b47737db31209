"""Helpers for tests of the torch model: thread-count guards. (Their deterministic prompts are
``fxsched.runtime.bench.prompts.random_prompts``, which the benchmarks use too.)

Tiny tensors are dominated by OpenMP synchronisation; on a shared 2-core machine two intra-op
threads can be 50x slower than one, so tests run the model with one thread.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the body with n torch intra-op threads, restoring the previous count afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def single_thread() -> contextlib.AbstractContextManager[None]:
    """Run the body with torch intra-op threads set to 1, restoring the previous count afterwards."""
    return torch_threads(1)
