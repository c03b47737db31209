"""Paged attention for decode (K = 1) and K-row speculative verify.

* ``query``: ``[B, K, Hq, D]``, the K new rows of each sequence;
* ``k_cache``, ``v_cache``: ``[num_blocks, block_size, Hkv, D]``, already holding
  the K new rows (run ``paged_kv_append`` first); ``Hq % Hkv == 0`` (GQA: query
  head ``h`` reads kv head ``h // (Hq // Hkv)``);
* ``block_tables``: int32 ``[B, max_blocks]``, logical -> physical block; entries
  for blocks past ``ceil(context_lens[b] / block_size)`` are never read;
* ``context_lens``: int32 ``[B]``, tokens in the cache *including* the K new rows;
* ``scale``: softmax scale (usually ``D ** -0.5``).

Output ``[B, K, Hq, D]`` in ``query``'s dtype::

    out[b, j, h] = softmax_p(scale * <query[b, j, h], key_p>) @ value_p
    over cache positions p < context_lens[b] - K + j + 1      (causal rows)

Scores, softmax and the weighted sum accumulate in fp32. A row that sees no
position (``context_lens[b] - K + j + 1 <= 0``) outputs zeros.
"""

from __future__ import annotations

import torch

from ._triton import HAVE_TRITON, cdiv, next_power_of_2, use_triton

__all__ = ["paged_attention", "paged_attention_reference", "paged_attention_triton"]

def _check(query, k_cache, v_cache, block_tables, context_lens) -> None:
    if query.dim() != 4:
        raise ValueError("query must be [B, K, Hq, D]")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must both be [num_blocks, block_size, Hkv, D]")
    batch, _, q_heads, dim = query.shape
    kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != dim:
        raise ValueError("query and cache head dims differ")
    if kv_heads == 0 or q_heads % kv_heads != 0:
        raise ValueError("Hq must be a multiple of Hkv")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError("block_tables must be [B, max_blocks]")
    if context_lens.shape != (batch,):
        raise ValueError("context_lens must be [B]")


def paged_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Plain-torch paged attention: gather the context densely, mask, softmax."""
    _check(query, k_cache, v_cache, block_tables, context_lens)
    batch, rows, q_heads, dim = query.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    device = query.device
    lens = context_lens.to(torch.int64)
    longest = int(lens.max().item()) if batch else 0
    positions = torch.arange(longest, device=device)
    in_context = positions[None, :] < lens[:, None]  # [B, L]
    logical = torch.div(positions, block_size, rounding_mode="floor").clamp(max=max(block_tables.shape[1] - 1, 0))
    physical = block_tables.to(torch.int64)[:, logical]  # [B, L]
    physical = torch.where(in_context, physical, torch.zeros_like(physical))
    slot = positions % block_size
    keys = k_cache[physical, slot].float().repeat_interleave(q_heads // kv_heads, dim=2)  # [B, L, Hq, D]
    values = v_cache[physical, slot].float().repeat_interleave(q_heads // kv_heads, dim=2)
    scores = torch.einsum("bjhd,blhd->bhjl", query.float(), keys) * scale
    limit = lens[:, None] - rows + torch.arange(rows, device=device)[None, :] + 1  # [B, K]
    visible = (positions[None, None, :] < limit[:, :, None]) & in_context[:, None, :]  # [B, K, L]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(nan=0.0)
    out = torch.einsum("bhjl,blhd->bjhd", probs, values)
    return out.to(query.dtype)


if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _paged_attention_kernel(
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr,
        context_lens_ptr,
        out_ptr,
        scale,
        rows_per_seq,
        group_size,
        head_dim,
        block_size,
        q_stride_b,
        q_stride_row,
        q_stride_head,
        cache_stride_block,
        cache_stride_slot,
        cache_stride_head,
        table_stride_b,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        # Program (b, kv head, m chunk) handles BLOCK_M of the K rows x group
        # query heads sharing this kv head as one [BLOCK_M, BLOCK_D] tile (tile
        # row r = row j * group + head g) and sweeps the context in BLOCK_N-token
        # tiles with an online softmax.
        # Invariant: m_i = running max score, l_i = sum exp(score - m_i),
        # acc = sum exp(score - m_i) * value, over the tokens seen so far.
        seq = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1)
        m_chunk = tl.program_id(2)
        context_len = tl.load(context_lens_ptr + seq).to(tl.int64)

        tile_row = m_chunk * BLOCK_M + tl.arange(0, BLOCK_M)
        query_row = tile_row // group_size
        q_head = kv_head * group_size + tile_row % group_size
        row_ok = tile_row < rows_per_seq * group_size
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < head_dim
        q_offsets = seq * q_stride_b + query_row.to(tl.int64)[:, None] * q_stride_row
        q_offsets += q_head.to(tl.int64)[:, None] * q_stride_head + dims[None, :]
        q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        visible_len = context_len - rows_per_seq + query_row + 1  # [BLOCK_M]

        m_i = tl.full((BLOCK_M,), -float("inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        for tile_start in range(0, context_len, BLOCK_N):
            pos = tile_start + tl.arange(0, BLOCK_N).to(tl.int64)
            pos_ok = pos < context_len
            physical = tl.load(
                block_tables_ptr + seq * table_stride_b + pos // block_size, mask=pos_ok, other=0
            ).to(tl.int64)
            kv_offsets = physical * cache_stride_block + (pos % block_size) * cache_stride_slot
            kv_offsets += kv_head * cache_stride_head
            kv_mask = pos_ok[:, None] & dim_ok[None, :]
            keys = tl.load(k_cache_ptr + kv_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
            values = tl.load(v_cache_ptr + kv_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)

            scores = tl.dot(q, tl.trans(keys.to(q.dtype)), input_precision=DOT_PRECISION) * scale
            visible = (pos[None, :] < visible_len[:, None]) & pos_ok[None, :]
            scores = tl.where(visible, scores, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            probs = tl.exp(scores - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(probs, axis=1)
            acc = acc * alpha[:, None] + tl.dot(probs.to(values.dtype), values, input_precision=DOT_PRECISION)
            m_i = m_new

        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        out_offsets = seq * q_stride_b + query_row.to(tl.int64)[:, None] * q_stride_row
        out_offsets += q_head.to(tl.int64)[:, None] * q_stride_head + dims[None, :]
        tl.store(
            out_ptr + out_offsets,
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )
else:  # pragma: no cover
    _paged_attention_kernel = None


def _cache_layout_ok(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()


def launch_config(rows: int, group_size: int, head_dim: int, dtype: torch.dtype, kv_tile: int | None = None) -> dict:
    """Constexprs and warps for one launch (the grid's third axis is ``cdiv(K * group, BLOCK_M)``).

    Chosen from sm_90 compiles at D = 128 to stay spill-free: 8 warps, 32-token
    KV tiles, and at most 64 (16-bit) or 32 (fp32) query rows per program.
    """
    max_block_m = 32 if dtype == torch.float32 else 64
    block_m = min(max_block_m, max(16, next_power_of_2(rows * group_size)))
    if kv_tile is None:
        kv_tile = 32
    return {
        "BLOCK_M": block_m,
        "BLOCK_N": max(16, next_power_of_2(kv_tile)),
        "BLOCK_D": max(16, next_power_of_2(head_dim)),
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "num_warps": 8,
    }


def paged_attention_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    kv_tile: int | None = None,
) -> torch.Tensor:
    """Triton paged attention; one program per (sequence, kv head, chunk of query rows).

    Needs caches with unit stride on D and equal strides; ``kv_tile`` is the
    number of context tokens per inner step (rounded up to a power of two >= 16).
    """
    _check(query, k_cache, v_cache, block_tables, context_lens)
    if not _cache_layout_ok(k_cache, v_cache):
        raise ValueError("paged_attention_triton needs D-contiguous caches with equal strides")
    batch, rows, q_heads, dim = query.shape
    kv_heads = k_cache.shape[2]
    group_size = q_heads // kv_heads
    query = query.contiguous()
    out = torch.empty_like(query)
    if out.numel() == 0:
        return out
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    config = launch_config(rows, group_size, dim, query.dtype, kv_tile)
    grid = (batch, kv_heads, cdiv(rows * group_size, config["BLOCK_M"]))
    _paged_attention_kernel[grid](
        query,
        k_cache,
        v_cache,
        block_tables,
        context_lens.contiguous(),
        out,
        float(scale),
        rows,
        group_size,
        dim,
        k_cache.shape[1],
        query.stride(0),
        query.stride(1),
        query.stride(2),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        **config,
    )
    return out


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Paged attention: Triton when it can run for these tensors, else the reference."""
    tensors = (query, k_cache, v_cache, block_tables, context_lens)
    if use_triton(*tensors, kernel=_paged_attention_kernel) and _cache_layout_ok(k_cache, v_cache):
        return paged_attention_triton(*tensors, scale)
    return paged_attention_reference(*tensors, scale)
