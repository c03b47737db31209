"""``rms_norm_bf16`` and ``silu_mul_bf16``: the elementwise steps of a CPU bf16 forward as one pass
each (kernels/cpu_pointwise.c).

PyTorch runs ``rms_norm`` as five ops with fp32 temporaries (upcast, square, mean, scale, weight,
downcast) and SwiGLU's ``silu(a) * b`` as two, each a pass over memory; at prefill sizes on one
core these passes cost a quarter of a Qwen3-0.6B-like forward. Here each is one pass: fp32
arithmetic on bf16 loads and one rounding to bf16 (the norm exactly as ops.rms_norm: mean of
squares, 1 / sqrt(mean + eps), times the weight; the SwiGLU product rounds once where PyTorch's two
bf16 ops round twice).

Compiled on first use and checked against the torch references once (see ``_cpu.load``); where it
is not ready, ``ready()`` is False and callers keep the torch ops.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Callable

import structlog
import torch
import torch.nn.functional as F

from ._cpu import load, split

__all__ = ["ready", "rms_norm_bf16", "rms_norm_reference", "silu_mul_bf16", "silu_mul_reference", "takes",
           "takes_norm"]

log = structlog.get_logger("fxsched.kernels")

_MIN_ELEMENTS_PER_THREAD = 1 << 16


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last dim in fp32, rounded once to x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def silu_mul_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """silu(a) * b in fp32, rounded once to a's dtype."""
    return (F.silu(a.float()) * b.float()).to(a.dtype)


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = load("cpu_pointwise", {
        "fx_rms_norm_bf16": [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_float, ctypes.c_int64, ctypes.c_int64],
        "fx_silu_mul_bf16": [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2,
    })
    if lib is not None and not _self_check(lib):
        log.warning("cpu_kernel_unavailable", kernel="cpu_pointwise", reason="self-check against torch failed")
        return None
    return lib


def _self_check(lib: ctypes.CDLL) -> bool:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 48, generator=gen) * 3).to(torch.bfloat16)
    w = torch.randn(48, generator=gen)
    y = torch.empty_like(x)
    if lib.fx_rms_norm_bf16(x.data_ptr(), w.data_ptr(), y.data_ptr(), 48, 1e-6, 0, 3) != 0:
        return False
    if not torch.allclose(y.float(), rms_norm_reference(x, w, 1e-6).float(), rtol=1e-2, atol=1e-2):
        return False
    a, b = x.flatten()[:37].contiguous(), x.flatten()[50:87].contiguous()
    z = torch.empty_like(a)
    lib.fx_silu_mul_bf16(a.data_ptr(), b.data_ptr(), z.data_ptr(), 0, 37)
    return torch.allclose(z.float(), silu_mul_reference(a, b).float(), rtol=1e-2, atol=1e-2)


def ready() -> bool:
    """Whether the compiled kernels are in use on this host (compiles them on the first call)."""
    return _library() is not None


def takes(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these operands: contiguous bf16 CPU tensors, outside tracing."""
    return (all(t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.is_contiguous() and not t.requires_grad
                for t in tensors) and not torch.compiler.is_compiling() and ready())


def takes_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether rms_norm_bf16 takes x (as `takes`, last dim a multiple of 16) and weight (one dim, on
    the CPU; fp32 as the loader keeps norm weights, or bf16)."""
    return (weight.dim() == 1 and weight.shape[0] == x.shape[-1] and x.shape[-1] % 16 == 0
            and weight.dtype in (torch.float32, torch.bfloat16) and weight.device.type == "cpu"
            and not weight.requires_grad and takes(x))


def _split(n: int, per_item: int, run: Callable[[int, int], int]) -> None:
    rc = split(run, n, min(torch.get_num_threads(), n * per_item // _MIN_ELEMENTS_PER_THREAD))
    if rc != 0:
        raise RuntimeError(f"cpu_pointwise kernel failed (code {rc})")


def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm_reference(x, weight, eps) in one pass (callers check `takes_norm`)."""
    lib = _library()
    assert lib is not None
    d = x.shape[-1]
    weight = weight.float().contiguous()
    y = torch.empty_like(x)
    rows = x.numel() // d
    _split(rows, d, lambda lo, hi: lib.fx_rms_norm_bf16(x.data_ptr(), weight.data_ptr(), y.data_ptr(), d, eps, lo, hi))
    return y


def silu_mul_bf16(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """silu_mul_reference(a, b) in one pass (callers check `takes`; a and b of one shape)."""
    lib = _library()
    assert lib is not None
    y = torch.empty_like(a)
    _split(a.numel(), 1, lambda lo, hi: lib.fx_silu_mul_bf16(a.data_ptr(), b.data_ptr(), y.data_ptr(), lo, hi))
    return y
