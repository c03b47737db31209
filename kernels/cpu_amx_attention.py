"""``prefill_attention``: causal attention of a prompt's rows over their keys on Intel AMX.

Why: a prompt's attention on a CPU ran through PyTorch's fused SDPA, which at Qwen3-0.6B's shapes (16
query / 8 kv heads of 128, 512 causal rows, bf16, one core) takes about 4 ms a layer: a fifth of the
prefill. Its two products run on AMX here (``kernels/cpu_amx_attention.c``): the keys and values of
each kv head are repacked once per call into tile order, then each block of 16 query rows takes its
scores, softmax and output over the keys its rows see.

The semantics of record is ``prefill_attention_reference`` (SDPA in fp32 with the bottom-right causal
mask of a chunk after its sequence's earlier positions); the kernel rounds the softmax weights to bf16
before the second product (as PyTorch's bf16 CPU flash attention does) and the output once.
``ready()`` is False (and callers keep SDPA) unless the CPU has AMX-BF16, the kernel compiles
(kernels/_cpu.py), the OS grants the tile state and a self-check against the reference passes;
``FXSCHED_KERNELS=torch`` turns it off with the other CPU kernels. The rules: cpu-kernels.md §15.9.
"""

from __future__ import annotations

import ctypes
import functools

import structlog
import torch
import torch.nn.functional as F

from ._cpu import load
from .cpu_amx import has_amx

__all__ = ["compiled", "fits", "prefill_attention", "prefill_attention_reference", "ready"]

log = structlog.get_logger("fxsched.kernels")

_FLAGS = ("-mamx-tile", "-mamx-bf16")


def prefill_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The semantics of record. q [n, Hq, D], k and v [ctx, Hkv, D] (ctx >= n): query row i sits at
    position ctx - n + i and attends keys 0 .. ctx - n + i; query head h reads kv head h // (Hq / Hkv).
    Returns [n, Hq, D] in q's dtype (computed in fp32)."""
    n, ctx = q.shape[0], k.shape[0]
    allowed = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
    o = F.scaled_dot_product_attention(q.transpose(0, 1).float(), k.transpose(0, 1).float(),
                                       v.transpose(0, 1).float(), attn_mask=allowed, enable_gqa=True)
    return o.transpose(0, 1).to(q.dtype)


@functools.cache
def compiled() -> ctypes.CDLL | None:
    """The kernel compiled and loaded, with the OS's tile state granted (not yet checked), or None."""
    if not has_amx():
        return None
    args = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 9 + [ctypes.c_float, ctypes.c_int64]
    symbols = {"fx_amx_attention_init": [], "fx_amx_prefill_attention": args}
    # threads by OpenMP (the runtime the packed products' teams use); a compiler without it: one thread a call
    lib = (load("cpu_amx_attention", symbols, extra_flags=(*_FLAGS, "-fopenmp"), isas=("avx512",))
           or load("cpu_amx_attention", symbols, extra_flags=_FLAGS, isas=("avx512",)))
    if lib is None:
        return None
    if lib.fx_amx_attention_init() != 0:
        log.warning("cpu_kernel_unavailable", kernel="cpu_amx_attention", reason="the OS refused the AMX tile state")
        return None
    return lib


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = compiled()
    if lib is not None and not _self_check(lib):
        log.warning("cpu_kernel_unavailable", kernel="cpu_amx_attention", reason="self-check against SDPA failed")
        return None
    return lib


def _run(lib: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, threads: int) -> int:
    n, hq, d = q.shape
    ctx, hkv = k.shape[0], k.shape[1]
    rc: int = lib.fx_amx_prefill_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), n, ctx, hq, hkv,
                                           d, q.stride(0), k.stride(0), v.stride(0), out.stride(0), d ** -0.5,
                                           threads)
    return rc


def _self_check(lib: ctypes.CDLL) -> bool:
    gen = torch.Generator().manual_seed(0)
    for n, ctx, hq, hkv, d in ((1, 1, 2, 1, 64), (37, 37, 4, 2, 128), (20, 53, 2, 2, 64), (16, 16, 3, 1, 256)):
        q = torch.randn(n, hq, d, generator=gen).to(torch.bfloat16)
        k = torch.randn(ctx, hkv, d, generator=gen).to(torch.bfloat16)
        v = torch.randn(ctx, hkv, d, generator=gen).to(torch.bfloat16)
        out = torch.empty_like(q)
        if _run(lib, q, k, v, out, 1) != 0:
            return False
        if not torch.allclose(out.float(), prefill_attention_reference(q, k, v).float(), rtol=2e-2, atol=2e-2):
            return False
    return True


def ready() -> bool:
    """Whether the kernel is in use on this host (compiles and checks it on the first call)."""
    return _library() is not None


def _rows_ok(t: torch.Tensor) -> bool:
    """[rows, heads, d] with each row's heads contiguous and an even row stride (keys are read in
    32-bit pairs)."""
    return t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2] and t.stride(0) % 2 == 0


def fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel takes these operands: bf16 CPU tensors q [n, Hq, D], k and v [ctx, Hkv, D]
    with n <= ctx, each row's heads contiguous (rows an even number of values apart), D a multiple
    of 64 up to 256, Hq a multiple of Hkv."""
    n, hq, d = q.shape if q.dim() == 3 else (0, 0, 0)
    return (q.dtype == k.dtype == v.dtype == torch.bfloat16 and q.device.type == "cpu" and _rows_ok(q) and _rows_ok(k)
            and _rows_ok(v) and k.shape == v.shape and 0 < n <= k.shape[0] and k.shape[2] == d and d % 64 == 0
            and d <= 256 and hq % k.shape[1] == 0 and ready())


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``prefill_attention_reference``'s result through the AMX kernel, written into ``out`` (rows
    strided as ``fits`` asks; a fresh [n, Hq, D] tensor when None). Callers check ``fits`` first."""
    lib = _library()
    assert lib is not None, "prefill_attention called where fits() is False"
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if _run(lib, q, k, v, out, torch.get_num_threads()) != 0:
        raise RuntimeError("cpu_amx_attention kernel failed")
    return out
