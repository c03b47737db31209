"""``amx_linear``: bf16 products on Intel AMX over weights repacked once, at load, into tile order.

Why: at a decode or verify batch of 4-16 rows the bf16 products are bound neither by memory nor by
the AMX units but by how the weights are read. PyTorch's bf16 GEMM (oneDNN) reorders a weight on
every call or reads it at about half the memory speed, and an AMX kernel reading the natural
[N, K] layout issues 16 strided row streams per tile, which the prefetcher does not follow. With
the weight stored as its 1 KB B-tiles in the order the product uses them (kernels/cpu_amx.c) each
block of 16 outputs is one forward stream: measured at Qwen3-0.6B's shapes on one core, 8 rows
take about half F.linear's time and one row about the AVX512 GEMV's (kernels/cpu_gemv.py).

The packed tensor *replaces* the weight (no second copy): `pack(w)` is a 5-D bf16 tensor
[N/16, K/32, 16, 16, 2] -- block of 16 outputs, block of 32 inputs, input pair, output, pair
member -- so `is_packed` needs no side table, `unpack` gives w back exactly, and `rows` reads
embedding rows out of it (a tied embedding shares the packed tensor with the output head).

`ready()` is False (and callers keep unpacked weights and F.linear) unless the CPU has AMX-BF16,
the kernel compiles (kernels/_cpu.py), the OS grants the tile state, and a self-check against
F.linear passes. ``FXSCHED_KERNELS=torch`` turns it off with the other CPU kernels. The rules:
cpu-kernels.md §15.2–3.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Callable, Iterable

import structlog
import torch
import torch.nn.functional as F

from ._cpu import amx_allowed, load, split

__all__ = ["amx_linear", "check_packed_kernel", "is_packed", "pack", "packable", "packed_product", "ready", "rows",
           "unpack"]

log = structlog.get_logger("fxsched.kernels")

_FLAGS = ("-mamx-tile", "-mamx-bf16")
_BLOCKS_PER_THREAD = 16  # 256 outputs: below this a thread's share costs more to hand out than to compute


def has_amx() -> bool:
    """Whether the kernels may use AMX: /proc/cpuinfo names AMX tiles and AMX-BF16 and
    ``FXSCHED_CPU_ISA`` does not lower the level below ``amx`` (_cpu.amx_allowed; the OS must still
    grant the tile state)."""
    return amx_allowed()


@functools.cache
def _library() -> ctypes.CDLL | None:
    if not has_amx():
        return None
    symbols = {"fx_amx_init": [], "fx_amx_linear": [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5,
               "fx_amx_run": [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4}
    # threads by OpenMP (the runtime torch's CPU operators share); a compiler without it: one thread a call
    lib = (load("cpu_amx", symbols, extra_flags=(*_FLAGS, "-fopenmp"), isas=("avx512",))
           or load("cpu_amx", symbols, extra_flags=_FLAGS, isas=("avx512",)))
    if lib is None:
        return None
    if lib.fx_amx_init() != 0:
        log.warning("cpu_kernel_unavailable", kernel="cpu_amx", reason="the OS refused the AMX tile state")
        return None
    if not _self_check(lib):
        log.warning("cpu_kernel_unavailable", kernel="cpu_amx", reason="self-check against F.linear failed")
        return None
    return lib


def _self_check(lib: ctypes.CDLL) -> bool:
    return check_packed_kernel(lib.fx_amx_linear, ((1, 64, 80), (7, 96, 16), (16, 32, 48), (37, 64, 32), (33, 32, 112)))


def check_packed_kernel(kernel: Callable[..., int], shapes: Iterable[tuple[int, int, int]]) -> bool:
    """Whether a kernel over packed weights (``kernel(x, p, y, m, k, n, nb0, nb1)``, 0 on success)
    gives x @ w.T within bf16 noise at each (m, k, n) of ``shapes``."""
    gen = torch.Generator().manual_seed(0)
    for m, k, n in shapes:
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
        y, packed = torch.empty(m, n, dtype=torch.bfloat16), pack(w)  # held: the call reads its memory
        if kernel(x.data_ptr(), packed.data_ptr(), y.data_ptr(), m, k, n, 0, n // 16) != 0:
            return False
        if not torch.allclose(y.float(), x.float() @ w.float().T, rtol=1e-2, atol=1e-2):
            return False
    return True


def ready() -> bool:
    """Whether AMX products are in use on this host (compiles and checks the kernel on first call)."""
    return _library() is not None


def packable(w: torch.Tensor) -> bool:
    """Whether w is a weight `pack` takes: a contiguous 2-D bf16 CPU tensor with N % 16 == 0 and
    K % 32 == 0 (every projection of the supported families at real sizes)."""
    return (w.dim() == 2 and w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.is_contiguous()
            and w.shape[0] % 16 == 0 and w.shape[1] % 32 == 0 and w.numel() > 0 and not w.requires_grad)


def tile_order(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] viewed in tile order (not copied): [N/16, K/32, 16, 16, 2], element [nb, kb, i, c, j]
    = w[16nb + c, 32kb + 2i + j]."""
    n, k = w.shape
    return w.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4)


def pack(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] in tile order, contiguous (`tile_order`'s layout)."""
    return tile_order(w).contiguous()


def is_packed(t: torch.Tensor) -> bool:
    """Whether t is a `pack` result (the only 5-D weights with these trailing dimensions)."""
    return t.dim() == 5 and tuple(t.shape[2:]) == (16, 16, 2)


def unpack(p: torch.Tensor) -> torch.Tensor:
    """The [N, K] weight p was packed from (exactly)."""
    nb, kb = p.shape[0], p.shape[1]
    return p.permute(0, 3, 1, 2, 4).reshape(nb * 16, kb * 32)


def rows(p: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ids (any shape) of the [N, K] weight p was packed from: [*ids.shape, K] (an embedding
    lookup into a packed tied table)."""
    flat = ids.reshape(-1)
    picked = p[flat // 16, :, :, flat % 16, :]  # [T, K/32, 16, 2]
    return picked.reshape(*ids.shape, p.shape[1] * 32)


def amx_linear(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w.T for the packed weight p of w [N, K]: [..., N] in bf16. Outside the kernel's
    reach (not ready, not bf16 CPU, traced by torch.compile) it is F.linear on `unpack(p)`: the same
    product, slower (the unpacked copy is made per call)."""
    lib = _library()
    if lib is None:
        return packed_product(None, x, p, align=4, name="amx_linear")
    return packed_product(lib.fx_amx_linear, x, p, align=4, name="amx_linear", threaded=lib.fx_amx_run)


def packed_product(kernel: Callable[..., int] | None, x: torch.Tensor, p: torch.Tensor, align: int,
                   name: str, threaded: Callable[..., int] | None = None) -> torch.Tensor:
    """x [..., K] @ w.T by ``kernel`` over the packed weight p of w [N, K] (threads split the output
    blocks in multiples of ``align``, at least 16 each; ``threaded(x, p, y, m, k, n, threads)``, where
    given, runs the whole product on that many threads itself); F.linear on `unpack(p)` where the
    kernel is None or the call is not its (not bf16 CPU, traced by torch.compile)."""
    n, k = p.shape[0] * 16, p.shape[1] * 32
    if (kernel is None or x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.shape[-1] != k
            or x.requires_grad or torch.compiler.is_compiling()):
        return F.linear(x, unpack(p))
    lead = x.shape[:-1]
    flat = x.reshape(-1, k).contiguous()
    m = flat.shape[0]
    y = torch.empty(*lead, n, dtype=torch.bfloat16)
    if m == 0:
        return y
    args = (flat.data_ptr(), p.data_ptr(), y.data_ptr(), m, k, n)
    blocks = n // 16
    threads = min(torch.get_num_threads(), max(1, blocks // _BLOCKS_PER_THREAD))
    if threaded is not None and threads > 1:
        code = threaded(*args, threads)
    else:
        code = split(lambda lo, hi: kernel(*args, lo, hi), blocks, threads, align=align)
    if code != 0:
        raise RuntimeError(f"{name}: the kernel refused a [{m}, {k}] x [{n}, {k}] product")
    return y
