"""``gemv_bf16``: the bf16 matrix-vector product of CPU decoding, as a small C kernel.

y = x @ w.T for bf16 x [M, K] (M <= 8 rows: a decode or verify batch) and w [N, K]. At these shapes
the product only streams w from memory; PyTorch's general bf16 GEMM reaches about half of one
core's memory speed on it (measured on AVX512-BF16 hosts: 2.7-3.5 GB/s against 5.4 for this kernel,
28 layers of Qwen3-0.6B's matrices, cold caches), and decoding at batch 1 is this product almost
entirely. `kernels/cpu_gemv.c` uses AVX512-BF16's dot-product instruction (fp32 accumulation, one
rounding to bf16 at the end, as F.linear). Its AVX2 build widens to fp32 and multiplies with FMA:
on a CPU without bf16 arithmetic PyTorch's bf16 product runs a generic path (~9 GFLOP/s on one
Zen 3 core, for any M: 9 GB/s of weights at one row, 1.2 at eight), where this one streams the
weights at memory speed up to 8 rows.

The C file is compiled on first use (`_cpu.load`: about a second, cached), called through ctypes
(``torch.get_num_threads()`` threads of one OpenMP team split the rows of w), and checked
once against the reference on a small product before it is used. Where it cannot be (see
`_cpu.load`) or that check fails, ``ready()`` is False and callers use ``gemv_bf16_reference``
(F.linear): same semantics, only slower.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Callable

import structlog
import torch
import torch.nn.functional as F

from ._cpu import host_isa, load

__all__ = ["MAX_ROWS", "gemv_bf16", "max_rows", "gemv_bf16_reference", "moe_gemv_bf16", "moe_gemv_bf16_reference", "ready"]

log = structlog.get_logger("fxsched.kernels")

# Rows of x this kernel takes (the C code takes up to 8). On AVX512-BF16 hosts, beyond 4 the
# dot-product instruction's throughput, not memory, bounds it (36 GFLOP/s with the weights in L2,
# where oneDNN's AMX path reaches 52 at 8 rows), so F.linear serves larger batches there. On AVX2
# hosts PyTorch's bf16 product runs at ~9 GFLOP/s for any M (no bf16 arithmetic), so the kernel
# takes all 8 (cpu-kernels.md §15.6).
MAX_ROWS = 8


@functools.cache  # fixed per process, like the build it describes (read on every linear)
def max_rows() -> int:
    """The most rows of x `gemv_bf16` is the fastest product for, on this host's build."""
    return 4 if host_isa() == "avx512" else MAX_ROWS
_MIN_ROWS_PER_THREAD = 256  # below this a thread's share costs more to hand out than to compute


def gemv_bf16_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K].T (the semantics of record)."""
    return F.linear(x, w)


@functools.cache
def _library() -> ctypes.CDLL | None:
    symbols = {"fx_gemv_bf16": [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5,
               "fx_moe_gemv_bf16": [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 6}
    symbols.update(fx_gemv_run=symbols["fx_gemv_bf16"], fx_moe_gemv_run=symbols["fx_moe_gemv_bf16"])
    # threads by OpenMP, as every CPU kernel's (cpu_simd.h); a compiler without it: one thread a call
    lib = load("cpu_gemv", symbols, extra_flags=("-fopenmp",)) or load("cpu_gemv", symbols)
    if lib is not None and not _self_check(lib):
        log.warning("cpu_kernel_unavailable", kernel="cpu_gemv", reason="self-check against F.linear failed")
        return None
    return lib


def _self_check(lib: ctypes.CDLL) -> bool:
    gen = torch.Generator().manual_seed(0)
    for m, k, n in ((1, 70, 9), (5, 96, 13), (8, 33, 4)):
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
        y = torch.empty(m, n, dtype=torch.bfloat16)
        if lib.fx_gemv_bf16(x.data_ptr(), w.data_ptr(), y.data_ptr(), m, k, n, 0, n) != 0:
            return False
        ref = x.float() @ w.float().T
        if not torch.allclose(y.float(), ref, rtol=1e-2, atol=1e-2):
            return False
    x = torch.randn(3, 40, generator=gen).to(torch.bfloat16)
    w = torch.randn(2, 6, 40, generator=gen).to(torch.bfloat16)
    ids = torch.tensor([1, 2, 0])  # 2: outside the 2 experts -> a zero row
    y = torch.empty(3, 6, dtype=torch.bfloat16)
    if lib.fx_moe_gemv_bf16(x.data_ptr(), w.data_ptr(), ids.data_ptr(), y.data_ptr(), 3, 40, 6, 2, 0, 6) != 0:
        return False
    return torch.allclose(y.float(), moe_gemv_bf16_reference(x, w, ids).float(), rtol=1e-2, atol=1e-2)


def _threads(n: int) -> int:
    """Threads for a product of n weight rows (blocks of 4 rows, at least _MIN_ROWS_PER_THREAD each)."""
    return min(torch.get_num_threads(), n // _MIN_ROWS_PER_THREAD)


def _run(kernel: Callable[..., int], team: Callable[..., int], args: tuple[int, ...], n: int) -> None:
    """kernel(*args, 0, n), or its OpenMP form over the threads n output rows earn."""
    threads = _threads(n)
    rc = team(*args, n, threads) if threads > 1 else kernel(*args, 0, n)
    if rc != 0:
        raise RuntimeError(f"cpu_gemv kernel failed (code {rc})")


def ready() -> bool:
    """Whether the compiled kernel is in use on this host (compiles it on the first call)."""
    return _library() is not None


def gemv_bf16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K].T in bf16 (M <= MAX_ROWS; CPU tensors); the reference where the kernel
    is not ready or the operands do not fit it (other dtypes, devices, strides)."""
    lib = _library()
    if (lib is None or x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or x.device.type != "cpu"
            or w.device.type != "cpu" or x.dim() != 2 or w.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS
            or x.shape[1] != w.shape[1] or not w.is_contiguous() or x.requires_grad or w.requires_grad):
        return gemv_bf16_reference(x, w)
    x = x.contiguous()
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=torch.bfloat16)
    args = (x.data_ptr(), w.data_ptr(), y.data_ptr(), m, k, n)
    _run(lib.fx_gemv_bf16, lib.fx_gemv_run, args, n)
    return y


def moe_gemv_bf16_reference(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Row a of x [A, K] against expert ids[a] of w [E, N, K]: [A, N]; a row whose id is outside
    [0, E) is zero (an expert of another shard)."""
    inside = (ids >= 0) & (ids < w.shape[0])
    picked = w.index_select(0, ids.clamp(0, w.shape[0] - 1))
    y = torch.bmm(x[:, None, :], picked.transpose(1, 2))[:, 0]
    return torch.where(inside[:, None], y, torch.zeros((), dtype=y.dtype))


def moe_gemv_bf16(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[A, N]: row a of bf16 x [A, K] times expert ids[a] of w [E, N, K] (transposed), zero where
    ids[a] is outside [0, E). The one-row-per-assignment product of a MoE decode: each assignment
    streams its expert's rows once, with no gather of the weights and no host read of the ids (the
    C code reads them in memory). The reference where the kernel is not ready or the operands do
    not fit it."""
    lib = _library()
    if (lib is None or x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or x.device.type != "cpu"
            or w.device.type != "cpu" or ids.device.type != "cpu" or x.dim() != 2 or w.dim() != 3
            or ids.dim() != 1 or ids.shape[0] != x.shape[0] or x.shape[1] != w.shape[2]
            or not w.is_contiguous() or x.requires_grad or w.requires_grad):
        return moe_gemv_bf16_reference(x, w, ids)
    x, ids = x.contiguous(), ids.to(torch.int64).contiguous()
    a, k = x.shape
    e, n = w.shape[0], w.shape[1]
    y = torch.empty(a, n, dtype=torch.bfloat16)
    args = (x.data_ptr(), w.data_ptr(), ids.data_ptr(), y.data_ptr(), a, k, n, e)
    _run(lib.fx_moe_gemv_bf16, lib.fx_moe_gemv_run, args, n)
    return y
