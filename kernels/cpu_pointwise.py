"""``rms_norm_bf16`` and ``silu_mul_bf16``: the elementwise steps of a CPU bf16 forward as one pass
each (kernels/cpu_pointwise.c); and the fused steps of a layer whose projections are fused
(specs/cpu-kernels.md §15.10): ``add_rms_norm_bf16`` (a residual add and the next norm),
``silu_mul_rows_bf16`` (SwiGLU over a fused gate-up output), ``qk_norm_rope_bf16`` (the q/k norms
and rotary embedding of a fused q/k/v output) and ``kv_scatter_bf16`` (the paged K/V write).

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
from typing import Any

import structlog
import torch
import torch.nn.functional as F

from ._cpu import load

__all__ = ["add_rms_norm_bf16", "kv_scatter_bf16", "qk_norm_rope_bf16", "ready", "rms_norm_bf16",
           "rms_norm_reference", "silu_mul_bf16", "silu_mul_reference", "silu_mul_rows_bf16", "takes", "takes_norm"]

log = structlog.get_logger("fxsched.kernels")

_MIN_ELEMENTS_PER_THREAD = 1 << 16
_RUNS = {"fx_rms_norm_bf16": "fx_rms_norm_run", "fx_silu_mul_bf16": "fx_silu_mul_run",
         "fx_silu_mul_rows_bf16": "fx_silu_mul_rows_run", "fx_add_rms_norm_bf16": "fx_add_rms_norm_run",
         "fx_qk_norm_rope_bf16": "fx_qk_norm_rope_run"}


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last dim in fp32, rounded once to x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def silu_mul_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """silu(a) * b in fp32, rounded once to a's dtype."""
    return (F.silu(a.float()) * b.float()).to(a.dtype)


@functools.cache
def _library() -> ctypes.CDLL | None:
    ranges: dict[str, list[Any]] = {  # each kernel over rows (elements) [lo, hi)
        "fx_rms_norm_bf16": [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_float, ctypes.c_int64, ctypes.c_int64],
        "fx_silu_mul_bf16": [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2,
        "fx_silu_mul_rows_bf16": [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3,
        "fx_add_rms_norm_bf16": [ctypes.c_void_p] * 5 + [ctypes.c_int64, ctypes.c_float, ctypes.c_int64, ctypes.c_int64],
        "fx_qk_norm_rope_bf16": [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                 ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64],
    }
    # the same arguments, (lo, hi) replaced by (n, threads): one OpenMP team over [0, n)
    symbols = {**ranges, **{_RUNS[name]: args for name, args in ranges.items()}}
    symbols["fx_kv_scatter_bf16"] = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                     ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                     ctypes.c_void_p, ctypes.c_int64]
    lib = load("cpu_pointwise", symbols, extra_flags=("-fopenmp",)) or load("cpu_pointwise", symbols)
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


def _run(lib: ctypes.CDLL, kernel: str, n: int, per_item: int, *args: object) -> None:
    """``kernel(*args, 0, n)``, or its OpenMP form over the threads the size earns."""
    threads = min(torch.get_num_threads(), n * per_item // _MIN_ELEMENTS_PER_THREAD)
    rc = getattr(lib, _RUNS[kernel])(*args, n, threads) if threads > 1 else getattr(lib, kernel)(*args, 0, n)
    if rc != 0:
        raise RuntimeError(f"cpu_pointwise kernel {kernel} failed (code {rc})")


def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm_reference(x, weight, eps) in one pass (callers check `takes_norm`)."""
    lib = _library()
    assert lib is not None
    d = x.shape[-1]
    weight = weight.float().contiguous()
    y = torch.empty_like(x)
    rows = x.numel() // d
    _run(lib, "fx_rms_norm_bf16", rows, d, x.data_ptr(), weight.data_ptr(), y.data_ptr(), d, eps)
    return y


def silu_mul_bf16(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """silu_mul_reference(a, b) in one pass (callers check `takes`; a and b of one shape)."""
    lib = _library()
    assert lib is not None
    y = torch.empty_like(a)
    _run(lib, "fx_silu_mul_bf16", a.numel(), 1, a.data_ptr(), b.data_ptr(), y.data_ptr())
    return y


def add_rms_norm_bf16(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, rms_norm(h + delta)) in one pass, each as the separate steps give it (the sum
    rounded to bf16 as PyTorch's bf16 add, the norm as ``rms_norm_bf16``); callers check
    ``takes_norm(h, weight)`` and ``takes(delta)`` with delta of h's shape."""
    lib = _library()
    assert lib is not None
    d = h.shape[-1]
    weight = weight.float().contiguous()
    out, y = torch.empty_like(h), torch.empty_like(h)
    _run(lib, "fx_add_rms_norm_bf16", h.numel() // d, d, h.data_ptr(), delta.data_ptr(), weight.data_ptr(),
         out.data_ptr(), y.data_ptr(), d, eps)
    return out, y


def silu_mul_rows_bf16(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for a fused gate-up output gate_up [..., 2n] (gate the first n columns of each
    row, up the last n): [..., n], as ``silu_mul_bf16`` of the halves (callers check ``takes``)."""
    lib = _library()
    assert lib is not None
    n = gate_up.shape[-1] // 2
    y = torch.empty(*gate_up.shape[:-1], n, dtype=gate_up.dtype)
    _run(lib, "fx_silu_mul_rows_bf16", y.numel() // n if n else 0, n, gate_up.data_ptr(), y.data_ptr(), n)
    return y


def takes_rope(d: int, rot: int) -> bool:
    """Whether ``qk_norm_rope_bf16`` takes heads of d dims rotated over their first rot."""
    return 0 < d <= 1024 and d % 16 == 0 and 0 < rot <= d and rot % 2 == 0


def qk_norm_rope_bf16(qkv: torch.Tensor, hq: int, hkv: int, d: int, q_norm: torch.Tensor | None,
                      k_norm: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries [R, hq, d] and keys [R, hkv, d] of a fused projection output qkv [R, C] (row-contiguous:
    q's hq heads of d from column 0, k's hkv heads after them; C may hold more, v and a gate), each
    head normed by q_norm / k_norm (None: not normed) as ``rms_norm_bf16``, then rotated over the
    tables' rot dims at each row's cos / sin [R, rot] (bf16) as attention.apply_rope rotates in bf16
    (callers check ``takes(qkv, cos, sin)`` and ``takes_rope``)."""
    lib = _library()
    assert lib is not None
    rows, rot = qkv.shape[0], cos.shape[-1]
    q, k = torch.empty(rows, hq, d, dtype=qkv.dtype), torch.empty(rows, hkv, d, dtype=qkv.dtype)
    qn = None if q_norm is None else q_norm.float().contiguous()
    kn = None if k_norm is None else k_norm.float().contiguous()
    _run(lib, "fx_qk_norm_rope_bf16", rows, (hq + hkv) * d, qkv.data_ptr(), qkv.stride(0), hq, hkv, d,
         None if qn is None else qn.data_ptr(), None if kn is None else kn.data_ptr(), eps, cos.data_ptr(),
         sin.data_ptr(), rot, q.data_ptr(), k.data_ptr())
    return q, k


def kv_scatter_bf16(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    src: torch.Tensor | None, dst: torch.Tensor) -> None:
    """k_cache rows dst[j] = k rows src[j] (rows j where src is None), v likewise: k and v [R, W] with
    unit inner stride (v may be a column slice of a wider row), the caches contiguous bf16 [., W];
    src and dst int64 CPU tensors of one length."""
    lib = _library()
    assert lib is not None
    rc = lib.fx_kv_scatter_bf16(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(),
                                v_cache.data_ptr(), k.shape[1], None if src is None else src.data_ptr(),
                                dst.data_ptr(), dst.shape[0])
    if rc != 0:
        raise RuntimeError(f"cpu_pointwise kv_scatter failed (code {rc})")
