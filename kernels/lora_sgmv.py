"""Segmented LoRA products over a batch's adapted rows (punica's SGMV shrink and expand).

A forward's adapted rows are ``rows`` (int, ``[M]``: indices into the projection's input and output
rows, sorted by adapter slot) with ``slots`` (int32 ``[M]``: each row's adapter slot, non-decreasing).
Per adapted projection, with the pool's ``a`` ``[S, R, in]`` and ``b`` ``[S, out, R]`` (the scale
already in ``b``, specs/lora.md §18.1):

* ``lora_shrink(x, rows, slots, a)`` -> ``h`` fp32 ``[M, R]``: ``h[i] = x[rows[i]] @ a[slots[i]]^T``;
* ``lora_expand_(h, rows, slots, b, y)``: ``y[rows[i]] += h[i] @ b[slots[i]]^T`` in place (``y``
  ``[N, out]``, any row stride, unit column stride; rows are distinct, so no two programs write
  one element).

The Triton kernels (specs/gpu-kernels.md §17.6) take ``BLOCK_M`` consecutive rows per program;
because rows are sorted by slot, a block spans a short run of slots, and the program loops over
that run, each slot's rows masked in (so no host-built segment table, nothing read back, and a
block that straddles two slots is right). Products accumulate in fp32 (``tl.dot``, IEEE for fp32
inputs); ``h`` is rounded to ``b``'s dtype before the expand, as a bf16 grouped product rounds it;
``y`` gets ``y + delta`` rounded once. The references are plain torch, the semantics of record.
"""

from __future__ import annotations

import torch

from ._triton import HAVE_TRITON, cdiv, next_power_of_2, use_triton

__all__ = ["expand_config", "lora_expand_", "lora_expand_reference", "lora_expand_triton", "lora_shrink",
           "lora_shrink_reference", "lora_shrink_triton", "shrink_config"]

BLOCK_ROWS = 16  # rows per program: tl.dot's smallest tile; a decode batch is one or two blocks
_SHRINK_K = 64  # input columns per step of the shrink
_EXPAND_N = 64  # output columns per expand program


def _check(rows: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor, what: str) -> None:
    if rows.dim() != 1 or slots.shape != rows.shape:
        raise ValueError(f"rows and slots must be [M] alike, got {tuple(rows.shape)} and {tuple(slots.shape)}")
    if pool.dim() != 3:
        raise ValueError(f"{what} must be [S, ., .], got {tuple(pool.shape)}")


def lora_shrink_reference(x: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """fp32 ``[M, R]``: row i is ``x[rows[i]] @ a[slots[i]]^T``."""
    _check(rows, slots, a, "a")
    xs = x.index_select(0, rows.long()).float()
    return torch.einsum("mk,mrk->mr", xs, a.index_select(0, slots.long()).float())


def lora_expand_reference(h: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, b: torch.Tensor,
                          y: torch.Tensor) -> torch.Tensor:
    """``y[rows[i]] += h[i] @ b[slots[i]]^T`` in place (h rounded to b's dtype first); returns y."""
    _check(rows, slots, b, "b")
    hs = h.to(b.dtype).float()
    delta = torch.einsum("mr,mnr->mn", hs, b.index_select(0, slots.long()).float())
    index = rows.long()
    y.index_copy_(0, index, (y.index_select(0, index).float() + delta).to(y.dtype))
    return y


def shrink_config(rank: int, dtype: torch.dtype) -> dict:
    """The shrink's constexprs, warps and stages: 16 rows, the rank padded to a power of two >= 16,
    64 input columns a step (pipelined, 3 stages); IEEE dots for fp32."""
    return {"BLOCK_M": BLOCK_ROWS, "BLOCK_R": max(16, next_power_of_2(rank)), "BLOCK_K": _SHRINK_K,
            "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32", "num_warps": 4, "num_stages": 3}


def expand_config(rank: int, dtype: torch.dtype) -> dict:
    """The expand's constexprs, warps and stages: 16 rows, the padded rank, 64 output columns a
    program; 2 stages (its loop is over the block's one or two slots; 3 spill at rank 64 in bf16
    under Triton 3.6's ptxas, gpu-kernels.md §17.7)."""
    return {"BLOCK_M": BLOCK_ROWS, "BLOCK_R": max(16, next_power_of_2(rank)), "BLOCK_N": _EXPAND_N,
            "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32", "num_warps": 4, "num_stages": 2}


if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _row_block(rows_ptr, slots_ptr, m, BLOCK_M: tl.constexpr):
        """This program's BLOCK_M rows: offsets, in range, row indices, slots, and the first and last
        slot among them (the run of slots the sorted rows span)."""
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        valid = offs_m < m
        rows = tl.load(rows_ptr + offs_m, mask=valid, other=0).to(tl.int64)
        slots = tl.load(slots_ptr + offs_m, mask=valid, other=0)
        first = tl.min(tl.where(valid, slots, 2147483647), axis=0)
        last = tl.max(tl.where(valid, slots, -1), axis=0)
        return offs_m, valid, rows, slots, first, last

    @triton.jit
    def _lora_shrink_kernel(x_ptr, rows_ptr, slots_ptr, a_ptr, h_ptr, m, in_dim, rank,
                            x_stride_row, a_stride_slot, a_stride_rank, h_stride_row,
                            BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                            DOT_PRECISION: tl.constexpr):
        offs_m, valid, rows, slots, first, last = _row_block(rows_ptr, slots_ptr, m, BLOCK_M)
        offs_r = tl.arange(0, BLOCK_R)
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for s in range(first, last + 1):  # the run of slots this block's sorted rows span
            mine = valid & (slots == s)
            a_base = a_ptr + s * a_stride_slot  # < 2**31 elements per projection's pool
            for k0 in range(0, in_dim, BLOCK_K):
                cols = k0 + offs_k
                x = tl.load(x_ptr + rows[:, None] * x_stride_row + cols[None, :],
                            mask=mine[:, None] & (cols[None, :] < in_dim), other=0.0)
                a = tl.load(a_base + offs_r[None, :] * a_stride_rank + cols[:, None],
                            mask=(offs_r[None, :] < rank) & (cols[:, None] < in_dim), other=0.0)
                acc += tl.dot(x, a.to(x.dtype), input_precision=DOT_PRECISION)
        tl.store(h_ptr + offs_m[:, None] * h_stride_row + offs_r[None, :], acc,
                 mask=valid[:, None] & (offs_r[None, :] < rank))

    @triton.jit
    def _lora_expand_kernel(h_ptr, rows_ptr, slots_ptr, b_ptr, y_ptr, m, out_dim, rank,
                            h_stride_row, b_stride_slot, b_stride_out, y_stride_row,
                            BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                            DOT_PRECISION: tl.constexpr):
        offs_m, valid, rows, slots, first, last = _row_block(rows_ptr, slots_ptr, m, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_r = tl.arange(0, BLOCK_R)
        in_rank = offs_r < rank
        h = tl.load(h_ptr + offs_m[:, None] * h_stride_row + offs_r[None, :], mask=valid[:, None] & in_rank[None, :],
                    other=0.0)
        in_out = offs_n < out_dim
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in range(first, last + 1):
            b = tl.load(b_ptr + s * b_stride_slot + offs_n[None, :] * b_stride_out + offs_r[:, None],
                        mask=in_rank[:, None] & in_out[None, :], other=0.0)
            hs = tl.where((valid & (slots == s))[:, None], h, 0.0).to(b.dtype)
            acc += tl.dot(hs, b, input_precision=DOT_PRECISION)
        y_ptrs = y_ptr + rows[:, None] * y_stride_row + offs_n[None, :]
        keep = valid[:, None] & in_out[None, :]
        y = tl.load(y_ptrs, mask=keep, other=0.0).to(tl.float32)
        tl.store(y_ptrs, (y + acc).to(y_ptr.dtype.element_ty), mask=keep)
else:  # pragma: no cover
    _lora_shrink_kernel = None
    _lora_expand_kernel = None


def _launch_options(config: dict) -> tuple[dict, dict]:
    """(constexprs, launch options) of a config."""
    constexprs = dict(config)
    return constexprs, {"num_warps": constexprs.pop("num_warps"), "num_stages": constexprs.pop("num_stages")}


def lora_shrink_triton(x: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """The Triton shrink (x: ``[N, in]`` with unit column stride)."""
    _check(rows, slots, a, "a")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if a.stride(-1) != 1:
        a = a.contiguous()
    m, rank, in_dim = rows.shape[0], a.shape[1], a.shape[2]
    h = torch.empty(m, rank, dtype=torch.float32, device=x.device)
    if m == 0:
        return h
    config, options = _launch_options(shrink_config(rank, a.dtype))
    _lora_shrink_kernel[(cdiv(m, config["BLOCK_M"]),)](
        x, rows, slots, a, h, m, in_dim, rank, x.stride(0), a.stride(0), a.stride(1), h.stride(0),
        **options, **config)
    return h


def lora_expand_triton(h: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, b: torch.Tensor,
                       y: torch.Tensor) -> torch.Tensor:
    """The Triton expand, adding into y ``[N, out]`` (unit column stride) in place; returns y."""
    _check(rows, slots, b, "b")
    if y.stride(-1) != 1:
        raise ValueError("y must have a unit column stride (it is updated in place)")
    if b.stride(-1) != 1:
        b = b.contiguous()
    m, out_dim, rank = rows.shape[0], b.shape[1], b.shape[2]
    if m == 0:
        return y
    config, options = _launch_options(expand_config(rank, b.dtype))
    grid = (cdiv(m, config["BLOCK_M"]), cdiv(out_dim, config["BLOCK_N"]))
    _lora_expand_kernel[grid](h, rows, slots, b, y, m, out_dim, rank, h.stride(0), b.stride(0), b.stride(1),
                              y.stride(0), **options, **config)
    return y


def lora_shrink(x: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """The shrink: Triton when it can run for these tensors, else the reference."""
    if use_triton(x, rows, slots, a, kernel=_lora_shrink_kernel):
        return lora_shrink_triton(x, rows, slots, a)
    return lora_shrink_reference(x, rows, slots, a)


def lora_expand_(h: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, b: torch.Tensor,
                 y: torch.Tensor) -> torch.Tensor:
    """The expand, in place: Triton when it can run for these tensors (and y's columns are
    contiguous), else the reference."""
    if y.stride(-1) == 1 and use_triton(h, rows, slots, b, y, kernel=_lora_expand_kernel):
        return lora_expand_triton(h, rows, slots, b, y)
    return lora_expand_reference(h, rows, slots, b, y)
