"""``pairs_linear``: bf16 products with AVX512-BF16 over weights packed once, at load, in tile order.

Why: on a CPU with AVX512-BF16 but no AMX (Zen 4 and later, Cooper Lake), PyTorch's bf16 GEMM
(oneDNN through ``F.linear``) re-reads a weight in its natural [N, K] layout on every call and
reaches about 35-40 GFLOP/s on one core at 8 rows, and the row kernel (cpu_gemv) is bound by its
dot-product throughput beyond 4 rows. vLLM's CPU build prepacks its weights for oneDNN, which is
what made its decode at batch 8 about 1.5x fxsched's on such a host (issue 51's measurements).

The packing is cpu_amx's tile order ([N/16, K/32, 16, 16, 2], `cpu_amx.pack`): read 64 bytes at a
time it is, for one pair of k, the two weights of each of 16 output columns, which is the operand
AVX512-BF16's VDPBF16PS takes against a broadcast pair of x. So one packed weight serves every batch
size (kernels/cpu_pairs.c): an outer product over 32 columns and up to 12 rows at a time, the weight
read from memory once whatever the rows, no second copy, and a tied embedding still read from the
packing (`cpu_amx.rows`).

`ready()` is False (and callers keep unpacked weights) unless the host's kernel level is AVX512
(_cpu.host_isa), the host has no AMX kernel ready (AMX takes packed weights there, cpu_amx), the
kernel compiles, and a self-check against F.linear passes. ``FXSCHED_KERNELS=torch`` turns it off
with the other CPU kernels. The rules: cpu-kernels.md §15.2, §15.8.
"""

from __future__ import annotations

import ctypes
import functools

import structlog
import torch
import torch.nn.functional as F

from . import cpu_amx
from ._cpu import load, split

__all__ = ["pairs_linear", "ready"]

log = structlog.get_logger("fxsched.kernels")

_BLOCKS_PER_THREAD = 16  # 256 outputs: below this a thread's share costs more to hand out than to compute


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = load("cpu_pairs", {"fx_pairs_linear": [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5}, isas=("avx512",))
    if lib is None:
        return None
    if not _self_check(lib):
        log.warning("cpu_kernel_unavailable", kernel="cpu_pairs", reason="self-check against F.linear failed")
        return None
    return lib


def _self_check(lib: ctypes.CDLL) -> bool:
    gen = torch.Generator().manual_seed(0)
    for m, k, n in ((1, 64, 80), (7, 96, 16), (12, 32, 48), (13, 64, 32), (40, 32, 112)):
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
        y, packed = torch.empty(m, n, dtype=torch.bfloat16), cpu_amx.pack(w)  # held: the call reads its memory
        if lib.fx_pairs_linear(x.data_ptr(), packed.data_ptr(), y.data_ptr(), m, k, n, 0, n // 16) != 0:
            return False
        if not torch.allclose(y.float(), x.float() @ w.float().T, rtol=1e-2, atol=1e-2):
            return False
    return True


def ready() -> bool:
    """Whether packed AVX512-BF16 products are in use on this host: never where AMX's are (compiles
    and checks the kernel on first call)."""
    return not cpu_amx.ready() and _library() is not None


def pairs_linear(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w.T for the packed weight p of w [N, K]: [..., N] in bf16. Outside the kernel's
    reach (not ready, not bf16 CPU, traced by torch.compile) it is F.linear on `cpu_amx.unpack(p)`:
    the same product, slower (the unpacked copy is made per call)."""
    n, k = p.shape[0] * 16, p.shape[1] * 32
    lib = _library()
    if (lib is None or x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.shape[-1] != k
            or x.requires_grad or torch.compiler.is_compiling()):
        return F.linear(x, cpu_amx.unpack(p))
    lead = x.shape[:-1]
    flat = x.reshape(-1, k).contiguous()
    m = flat.shape[0]
    y = torch.empty(*lead, n, dtype=torch.bfloat16)
    if m == 0:
        return y
    args = (flat.data_ptr(), p.data_ptr(), y.data_ptr(), m, k, n)
    blocks = n // 16
    threads = min(torch.get_num_threads(), max(1, blocks // _BLOCKS_PER_THREAD))
    if split(lambda lo, hi: lib.fx_pairs_linear(*args, lo, hi), blocks, threads, align=2) != 0:
        raise RuntimeError(f"pairs_linear: the kernel refused a [{m}, {k}] x [{n}, {k}] product")
    return y
