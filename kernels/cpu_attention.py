"""``paged_attention_bf16``: attention of single query rows over the paged bf16 KV cache, as a small C
kernel (the CPU decode and verify path).

Each query row attends its own sequence's first ``ctx`` positions, read in place through the
sequence's block table: no gather of the context, no repeated KV heads, and the keys and values of
a kv head are read once for every query head that shares them. PyTorch's fused SDPA, called per
sequence on a view of the cache, costs about 1 ms per layer and sequence for one query row at a
context of 512 on one core (Qwen3-0.6B's 16 q / 8 kv heads x 128), several times what reading
those 256 KB takes; one call of this kernel does every row of the forward. The C code
(``kernels/cpu_attention.c``) takes the dot products with AVX512-BF16 (exact products, fp32 sums),
the softmax in fp32 and rounds the output once to bf16; on an AMX host its scores are AMX tile
products (``build()`` says which build is in use).

The kernel's structure: cpu-kernels.md §15.4. Compiled on first use and checked against ``paged_attention_reference`` once (see ``_cpu.load``);
where it is not ready ``ready()`` is False and callers keep their torch path.
"""

from __future__ import annotations

import ctypes
import functools

import structlog
import torch
import torch.nn.functional as F

from ._cpu import host_isa, load
from .cpu_amx import has_amx

__all__ = ["build", "fits", "paged_attention_bf16", "paged_attention_reference", "ready", "work_units"]

log = structlog.get_logger("fxsched.kernels")

_AMX_FLAGS = ("-mamx-tile", "-mamx-bf16")


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              q_rows: torch.Tensor, ctx: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """The semantics of record. q [N, Hq, D]; k_cache/v_cache [num_blocks, block_size, Hkv, D];
    row r of q_rows/ctx/tables: query q[q_rows[r]] attends positions 0 .. ctx[r] - 1 of the
    sequence whose block table is tables[r] (position s at block tables[r, s // block_size], offset
    s % block_size). Returns [N, Hq, D] with the rows not named left zero."""
    out = torch.zeros_like(q)
    bs = k_cache.shape[1]
    for qrow, c, table in zip(q_rows.tolist(), ctx.tolist(), tables.tolist(), strict=True):
        blocks = torch.tensor(table[: -(-c // bs)], dtype=torch.long)
        k = k_cache.index_select(0, blocks).flatten(0, 1)[:c]
        v = v_cache.index_select(0, blocks).flatten(0, 1)[:c]
        o = F.scaled_dot_product_attention(q[qrow][:, None].float(), k.transpose(0, 1).float(),
                                           v.transpose(0, 1).float(), enable_gqa=True)
        out[qrow] = o[:, 0].to(q.dtype)
    return out


@functools.cache
def _chosen() -> tuple[ctypes.CDLL | None, str | None]:
    args = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 5 + [ctypes.c_float] + [ctypes.c_int64] * 3
    symbols = {"fx_paged_attention_bf16": args, "fx_paged_attention_run": args}
    if has_amx():  # the AVX512 build with its scores as AMX tile products (cpu-kernels.md §15.4)
        lib = _checked(symbols, _AMX_FLAGS)
        if lib is not None:
            return lib, "amx"
    lib = _checked(symbols, ())
    return lib, None if lib is None else host_isa()


def _library() -> ctypes.CDLL | None:
    return _chosen()[0]


def build() -> str | None:
    """The build in use: "amx" (the AVX512 build taking its scores on AMX tiles), "avx512", "avx2",
    or None where the kernel is not ready."""
    return _chosen()[1]


def _checked(symbols: dict, flags: tuple[str, ...]) -> ctypes.CDLL | None:
    """The kernel built with ``flags`` and past its self-check, or None."""
    # threads by OpenMP (the runtime the packed products' teams use); a compiler without it: one thread a call
    if flags:
        symbols = {**symbols, "fx_attention_amx_init": []}
        lib = (load("cpu_attention", symbols, extra_flags=("-fopenmp", *flags), isas=("avx512",))
               or load("cpu_attention", symbols, extra_flags=flags, isas=("avx512",)))
        if lib is not None and lib.fx_attention_amx_init() != 0:
            log.warning("cpu_kernel_unavailable", kernel="cpu_attention", reason="the OS refused the AMX tile state")
            return None
    else:
        lib = load("cpu_attention", symbols, extra_flags=("-fopenmp",)) or load("cpu_attention", symbols)
    if lib is not None and not _self_check(lib):
        log.warning("cpu_kernel_unavailable", kernel="cpu_attention", reason="self-check against SDPA failed",
                    build=" ".join(flags) or "plain")
        return None
    return lib


def _call(lib: ctypes.CDLL, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
          q_rows: torch.Tensor, ctx: torch.Tensor, tables: torch.Tensor, splits: int, lo: int, hi: int) -> int:
    _, bs, hkv, d = k_cache.shape
    rc: int = lib.fx_paged_attention_bf16(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                                          q_rows.data_ptr(), ctx.data_ptr(), tables.data_ptr(), tables.shape[1],
                                          bs, q.shape[1], hkv, d, d ** -0.5, splits, lo, hi)
    return rc


def _self_check(lib: ctypes.CDLL) -> bool:
    gen = torch.Generator().manual_seed(0)
    for hq, hkv, d, bs in ((4, 2, 64, 4), (6, 3, 32, 8), (2, 2, 128, 16), (8, 2, 64, 32)):
        k_cache = torch.randn(9, bs, hkv, d, generator=gen).to(torch.bfloat16)
        v_cache = torch.randn(9, bs, hkv, d, generator=gen).to(torch.bfloat16)
        q = torch.randn(3, hq, d, generator=gen).to(torch.bfloat16)
        q_rows = torch.tensor([0, 2], dtype=torch.int32)
        ctx = torch.tensor([bs * 3 - 1, 1], dtype=torch.int32)
        tables = torch.tensor([[4, 1, 7], [8, 0, 0]], dtype=torch.int32)
        out = torch.zeros_like(q)
        if _call(lib, q, k_cache, v_cache, out, q_rows, ctx, tables, hkv, 0, 2 * hkv) != 0:
            return False
        ref = paged_attention_reference(q, k_cache, v_cache, q_rows, ctx, tables)
        if not torch.allclose(out.float(), ref.float(), rtol=2e-2, atol=2e-2):
            return False
    return True


def ready() -> bool:
    """Whether the compiled kernel is in use on this host (compiles it on the first call)."""
    return _library() is not None


def fits(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel takes these operands: bf16 CPU tensors, head dim a multiple of 32 up to
    512, at most 128 query heads."""
    d, hkv = k_cache.shape[-1], k_cache.shape[-2]
    return (q.dtype == torch.bfloat16 and k_cache.dtype == torch.bfloat16 and q.device.type == "cpu"
            and k_cache.device.type == "cpu" and d % 32 == 0 and d <= 512 and q.shape[-2] % hkv == 0
            and q.shape[-2] <= 128 and ready())


def work_units(rows: int, hkv: int, threads: int) -> tuple[int, int]:
    """(splits, units) of a call over `rows` query rows: each row whole where there are rows enough
    for the threads, else its kv heads split in `splits` parts; units = rows * splits."""
    splits = 1 if rows >= threads else min(hkv, -(-threads // rows))
    return splits, rows * splits


def paged_attention_bf16(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_rows: torch.Tensor,
                         ctx: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """paged_attention_reference's result through the C kernel. Callers check `fits` first; q,
    k_cache, v_cache contiguous; q_rows, ctx int32 [R]; tables int32 [R, nb] contiguous."""
    lib = _library()
    assert lib is not None, "paged_attention_bf16 called where fits() is False"
    q = q.contiguous()
    out = torch.zeros_like(q)
    threads = torch.get_num_threads()
    hkv = k_cache.shape[2]
    splits, units = work_units(q_rows.shape[0], hkv, threads)
    if threads > 1:  # one OpenMP team (a Python pool would wait on the products' spinning workers)
        _, bs, _, d = k_cache.shape
        rc = lib.fx_paged_attention_run(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                                        q_rows.data_ptr(), ctx.data_ptr(), tables.data_ptr(), tables.shape[1], bs,
                                        q.shape[1], hkv, d, d ** -0.5, splits, units, min(threads, units))
    else:
        rc = _call(lib, q, k_cache, v_cache, out, q_rows, ctx, tables, splits, 0, units)
    if rc != 0:
        raise RuntimeError(f"cpu_attention kernel failed (code {rc})")
    return out
