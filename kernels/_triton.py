"""Shared helpers: can Triton run here, and should a given call use it.

Triton runs in two ways:

* compiled, on CUDA tensors, when ``triton`` imports and a CUDA device exists;
* interpreted, on CPU tensors, when ``TRITON_INTERPRET=1`` was set *before* the
  kernel modules were imported (``triton.jit`` picks interpreter or compiler at
  decoration time, so flipping the variable afterwards changes nothing).

``use_triton`` folds both rules into one decision per call; every public kernel
entry point dispatches on it and falls back to its plain-torch reference.
Setting ``FXSCHED_KERNELS=torch`` forces the references everywhere (debugging,
A/B checks).

Where neither way is open (no CUDA, no interpreter asked for) triton is not even
imported, unless the process imported it already (a script compiling the kernels
ahead of time for a GPU target): on a CPU engine it would only cost ~70 MB of
resident memory and a fifth of a second of start-up.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

import torch

__all__ = [
    "HAVE_TRITON",
    "cdiv",
    "forced_reference",
    "interpret_requested",
    "kernel_is_interpreted",
    "next_power_of_2",
    "triton_runnable",
    "use_triton",
]


def interpret_requested() -> bool:
    """True when the environment asks for the Triton interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def _interpreter_usable() -> bool:
    # The interpreter executes kernels through numpy (not a torch dependency).
    try:
        import numpy  # noqa: F401
    except Exception:
        return False
    return True


def _triton_wanted() -> bool:
    return "triton" in sys.modules or interpret_requested() or torch.cuda.is_available()


try:  # Triton is an optional (gpu extra) dependency.
    if not _triton_wanted():
        raise ImportError("no way to run Triton in this process")
    import triton  # noqa: F401

    # HAVE_TRITON means "kernel modules define their @triton.jit kernels".
    # Under TRITON_INTERPRET=1, @triton.jit imports numpy at decoration time:
    # without numpy, define no kernels at all and use the references.
    HAVE_TRITON = not interpret_requested() or _interpreter_usable()
except Exception:  # pragma: no cover - depends on the install
    HAVE_TRITON = False


def forced_reference() -> bool:
    """True when ``FXSCHED_KERNELS=torch`` disables every Triton path."""
    return os.environ.get("FXSCHED_KERNELS", "").strip().lower() == "torch"


@functools.lru_cache(maxsize=1)
def _cuda_available() -> bool:
    return torch.cuda.is_available()


def triton_runnable() -> bool:
    """Whether Triton can run at all in this process (CUDA or interpreter)."""
    if not HAVE_TRITON or forced_reference():
        return False
    return _cuda_available() or (interpret_requested() and _interpreter_usable())


def kernel_is_interpreted(kernel: Any) -> bool:
    """Whether a ``@triton.jit`` object was built for the interpreter."""
    if not HAVE_TRITON:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def use_triton(tensor: torch.Tensor, *more: torch.Tensor, kernel: Any = None) -> bool:
    """Decide whether a call on these tensors should take the Triton path.

    All tensors must live on one device. CUDA tensors take Triton unless the
    kernel was built for the interpreter; CPU tensors take Triton only under the
    interpreter (checked on ``kernel`` when given, else on the environment).
    Any other device, or a missing Triton, means the torch reference.
    """
    if not HAVE_TRITON or forced_reference():
        return False
    device = tensor.device
    if any(t.device != device for t in more):
        return False
    interpreted = kernel_is_interpreted(kernel) if kernel is not None else interpret_requested()
    if device.type == "cuda":
        return not interpreted or _interpreter_usable()
    if device.type == "cpu":
        return interpreted and _interpreter_usable()
    return False


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    n = max(int(n), 1)
    return 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints."""
    return -(-a // b)
