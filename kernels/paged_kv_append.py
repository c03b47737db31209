"""Paged KV append: write K new rows per sequence into a block-paged cache.

* ``k_new``, ``v_new``: ``[B, K, H, D]``, the keys/values of the K new tokens
  of each sequence (decode: K = 1; verify: K = drafts + 1);
* ``k_cache``, ``v_cache``: ``[num_blocks, block_size, H, D]``, updated in place;
* ``block_tables``: int32 ``[B, max_blocks]``, logical block -> physical block;
* ``start_positions``: int32 ``[B]``, cache position of each sequence's first new row.

Effect, for every ``b`` and ``j < K`` with ``p = start_positions[b] + j``,
``n = p // block_size``::

    blk = block_tables[b, n]
    k_cache[blk, p % block_size] = k_new[b, j]
    v_cache[blk, p % block_size] = v_new[b, j]

Rows whose position is negative, whose logical block ``n`` is ``>= max_blocks``,
or whose table entry is negative are dropped (padding rows of a padded batch).
Live rows must not collide on one cache slot. Values are cast to the cache dtype.
"""

from __future__ import annotations

import torch

from ._triton import HAVE_TRITON, cdiv, next_power_of_2, use_triton

__all__ = ["paged_kv_append", "paged_kv_append_reference", "paged_kv_append_triton"]

_MAX_HEAD_BLOCK = 1024


def _check(k_new, v_new, k_cache, v_cache, block_tables, start_positions) -> None:
    if k_new.dim() != 4 or k_new.shape != v_new.shape:
        raise ValueError("k_new and v_new must both be [B, K, H, D]")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must both be [num_blocks, block_size, H, D]")
    if k_new.shape[2:] != k_cache.shape[2:]:
        raise ValueError("new rows and cache disagree on [H, D]")
    batch = k_new.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError("block_tables must be [B, max_blocks]")
    if start_positions.shape != (batch,):
        raise ValueError("start_positions must be [B]")


def paged_kv_append_reference(
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    start_positions: torch.Tensor,
) -> None:
    """Plain-torch append; writes ``k_cache`` and ``v_cache`` in place."""
    _check(k_new, v_new, k_cache, v_cache, block_tables, start_positions)
    batch, rows = k_new.shape[:2]
    block_size = k_cache.shape[1]
    max_blocks = block_tables.shape[1]
    device = k_new.device
    positions = start_positions.to(torch.int64)[:, None] + torch.arange(rows, device=device)
    logical = torch.div(positions, block_size, rounding_mode="floor")
    table_ok = (positions >= 0) & (logical < max_blocks)
    physical = block_tables.to(torch.int64).gather(1, logical.clamp(0, max(max_blocks - 1, 0)))
    live = table_ok & (physical >= 0)
    blocks = physical[live]
    offsets = (positions % block_size)[live]
    k_cache[blocks, offsets] = k_new[live].to(k_cache.dtype)
    v_cache[blocks, offsets] = v_new[live].to(v_cache.dtype)


if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _paged_kv_append_kernel(
        k_new_ptr,
        v_new_ptr,
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr,
        start_positions_ptr,
        rows_per_seq,
        block_size,
        max_blocks,
        head_numel,
        new_stride_b,
        new_stride_row,
        cache_stride_block,
        cache_stride_slot,
        table_stride_b,
        HEAD_BLOCK: tl.constexpr,
    ):
        # Program (flat row b*K + j, chunk) copies one chunk of the H*D row.
        flat_row = tl.program_id(0)
        chunk = tl.program_id(1)
        seq = flat_row // rows_per_seq
        row = flat_row % rows_per_seq
        position = tl.load(start_positions_ptr + seq).to(tl.int64) + row
        logical = position // block_size
        if (position >= 0) & (logical < max_blocks):
            physical = tl.load(block_tables_ptr + seq.to(tl.int64) * table_stride_b + logical).to(tl.int64)
            if physical >= 0:
                offsets = chunk.to(tl.int64) * HEAD_BLOCK + tl.arange(0, HEAD_BLOCK)
                in_range = offsets < head_numel
                src = seq.to(tl.int64) * new_stride_b + row.to(tl.int64) * new_stride_row + offsets
                dst = physical * cache_stride_block + (position % block_size) * cache_stride_slot + offsets
                k_values = tl.load(k_new_ptr + src, mask=in_range)
                v_values = tl.load(v_new_ptr + src, mask=in_range)
                tl.store(k_cache_ptr + dst, k_values.to(k_cache_ptr.dtype.element_ty), mask=in_range)
                tl.store(v_cache_ptr + dst, v_values.to(v_cache_ptr.dtype.element_ty), mask=in_range)
else:  # pragma: no cover
    _paged_kv_append_kernel = None


def _cache_layout_ok(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    heads, dim = k_cache.shape[2:]
    inner_ok = all(c.stride(3) == 1 and c.stride(2) == dim for c in (k_cache, v_cache))
    return inner_ok and k_cache.stride()[:2] == v_cache.stride()[:2]


def paged_kv_append_triton(
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    start_positions: torch.Tensor,
) -> None:
    """Triton append; caches need contiguous ``[H, D]`` slots and equal strides."""
    _check(k_new, v_new, k_cache, v_cache, block_tables, start_positions)
    if not _cache_layout_ok(k_cache, v_cache):
        raise ValueError("paged_kv_append_triton needs [H, D]-contiguous caches with equal strides")
    batch, rows, heads, dim = k_new.shape
    if batch * rows == 0 or heads * dim == 0:
        return
    k_new = k_new.contiguous()
    v_new = v_new.contiguous()
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    head_numel = heads * dim
    head_block = min(_MAX_HEAD_BLOCK, next_power_of_2(head_numel))
    grid = (batch * rows, cdiv(head_numel, head_block))
    _paged_kv_append_kernel[grid](
        k_new,
        v_new,
        k_cache,
        v_cache,
        block_tables,
        start_positions.contiguous(),
        rows,
        k_cache.shape[1],
        block_tables.shape[1],
        head_numel,
        k_new.stride(0),
        k_new.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        block_tables.stride(0),
        HEAD_BLOCK=head_block,
    )


def paged_kv_append(
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    start_positions: torch.Tensor,
) -> None:
    """In-place append: Triton when it can run for these tensors, else the reference."""
    tensors = (k_new, v_new, k_cache, v_cache, block_tables, start_positions)
    if use_triton(*tensors, kernel=_paged_kv_append_kernel) and _cache_layout_ok(k_cache, v_cache):
        paged_kv_append_triton(*tensors)
    else:
        paged_kv_append_reference(*tensors)
