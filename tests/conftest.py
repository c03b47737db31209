"""Fixtures shared by the torch tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch CPU thread for a whole module: the model is tiny, and two threads on this 2-core
    machine make every step far slower. The previous count is restored afterwards."""
    from support.torch_testing import single_thread

    with single_thread():
        yield
