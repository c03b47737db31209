"""Fixtures shared by the torch tests."""

from __future__ import annotations

import os

import pytest
import torch

# Without CUDA the Triton kernels can only run interpreted, and the interpreter must be chosen
# before anything imports triton (flash-linear-attention and transformers import it too): set it
# here, before any test module is collected, so the order of test files does not matter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch CPU thread for a whole module: the model is tiny, and two threads on this 2-core
    machine make every step far slower. The previous count is restored afterwards."""
    from support.torch_testing import single_thread

    with single_thread():
        yield
