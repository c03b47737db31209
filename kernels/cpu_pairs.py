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

Two arithmetics over the same packing (`arithmetic()`, cpu-kernels.md §15.8): ``bf16`` issues one
VDPBF16PS per k pair and 16 columns; ``fp32`` widens each 64-byte vector to the two k's fp32 columns
(a shift and a mask, exact) and issues fp32 FMAs against x converted once to fp32. Which is faster
is the core's: on AMD's cores (Zen 4 and later) VDPBF16PS does twice the work of an fp32 FMA per
cycle; on Intel's AVX512-BF16 cores without AMX it issues at a quarter of the FMAs' rate (measured
on one: 84 against 169 GFLOP/s per core), so the fp32 form runs at about twice the rate. The choice
is made from the CPU's vendor, not timed, so every run on a host sums in the same order;
``FXSCHED_PAIRS_ARITH=bf16|fp32`` overrides it.

`ready()` is False (and callers keep unpacked weights) unless the host's kernel level is AVX512
(_cpu.host_isa), the host has no AMX kernel ready (AMX takes packed weights there, cpu_amx), the
kernel compiles, and a self-check against F.linear passes. ``FXSCHED_KERNELS=torch`` turns it off
with the other CPU kernels. The rules: cpu-kernels.md §15.2, §15.8.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path
from typing import Callable

import structlog
import torch

from . import cpu_amx
from ._cpu import load

__all__ = ["ARITHMETICS", "arithmetic", "kernel", "pairs_linear", "peak_flops", "ready"]

log = structlog.get_logger("fxsched.kernels")

ARITHMETICS = ("bf16", "fp32")
_SYMBOLS = {"bf16": "fx_pairs_linear", "fp32": "fx_pairs_linear_fma"}


def arithmetic() -> str:
    """The packed product's arithmetic on this host: ``FXSCHED_PAIRS_ARITH`` if it names one, else
    ``fp32`` on Intel CPUs and ``bf16`` on the others (see the module docstring)."""
    asked = os.environ.get("FXSCHED_PAIRS_ARITH", "").strip().lower()
    if asked in ARITHMETICS:
        return asked
    return "fp32" if _vendor() == "GenuineIntel" else "bf16"


@functools.cache
def _vendor() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    line = next((ln for ln in text.splitlines() if ln.startswith("vendor_id")), "")
    return line.partition(":")[2].strip()


@functools.cache
def _library() -> ctypes.CDLL | None:
    symbols = {name: [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5 for name in _SYMBOLS.values()}
    symbols.update(fx_pairs_peak=[ctypes.c_int64] * 2, fx_pairs_run=[ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5,
                   fx_pairs_run_bf16=[ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4,
                   fx_pairs_run_fp32=[ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4)
    # threads by OpenMP (the runtime torch's CPU operators share); a compiler without it: one thread a call
    lib = load("cpu_pairs", symbols, extra_flags=("-fopenmp",), isas=("avx512",)) or load("cpu_pairs", symbols,
                                                                                           isas=("avx512",))
    if lib is None:
        return None
    shapes = ((1, 64, 80), (7, 96, 16), (12, 32, 48), (13, 64, 32), (40, 32, 112))  # one and two blocks, row blocks
    if not all(cpu_amx.check_packed_kernel(kernel(lib, a), shapes) for a in ARITHMETICS):
        log.warning("cpu_kernel_unavailable", kernel="cpu_pairs", reason="self-check against F.linear failed")
        return None
    return lib


def peak_flops(arith: str, seconds: float = 0.2) -> float | None:
    """FLOP/s of one core issuing ``arith``'s instruction (VDPBF16PS: 64 FLOP, an fp32 FMA over 16
    lanes: 32) back to back on registers, best of 3 (None where the kernel is not loaded)."""
    import time

    lib = _library()
    if lib is None:
        return None
    code, flop = (0, 64) if arith == "bf16" else (1, 32)
    iters = 1 << 16
    best = 0.0
    while True:  # grow the count until a run takes a tenth of `seconds`
        start = time.perf_counter()
        lib.fx_pairs_peak(code, iters)
        took = time.perf_counter() - start
        if took >= seconds / 10:
            break
        iters *= 4
    for _ in range(3):
        start = time.perf_counter()
        lib.fx_pairs_peak(code, iters)
        best = max(best, 24 * flop * iters / (time.perf_counter() - start))
    return best


def kernel(lib: ctypes.CDLL, arith: str) -> Callable[..., int]:
    """The C entry point of ``arith`` (one of ARITHMETICS) in the loaded library."""
    return getattr(lib, _SYMBOLS[arith])


def ready() -> bool:
    """Whether packed AVX512-BF16 products are in use on this host: never where AMX's are (compiles
    and checks the kernel on first call)."""
    return not cpu_amx.ready() and loads()


def loads() -> bool:
    """Whether the kernel compiles and passes its self-check here (an AMX host too, where it is not
    used: its tests still run there)."""
    return _library() is not None


def pairs_linear(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w.T for the packed weight p of w [N, K]: [..., N] in bf16. Outside the kernel's
    reach (not ready, not bf16 CPU, traced by torch.compile) it is F.linear on `cpu_amx.unpack(p)`:
    the same product, slower (the unpacked copy is made per call)."""
    lib = _library()
    if lib is None:
        return cpu_amx.packed_product(None, x, p, align=2, name="pairs_linear")
    arith = arithmetic()
    code = ARITHMETICS.index(arith)
    return cpu_amx.packed_product(kernel(lib, arith), x, p, align=2, name="pairs_linear",
                                  threaded=lambda *args: lib.fx_pairs_run(*args[:6], code, args[6]))
