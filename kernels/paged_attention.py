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

Ragged rows (a prefill or mixed batch, gpu-kernels.md §17.5): with ``query_lens``
(int ``[B]``, 1 <= ``query_lens[b]`` <= K) sequence b's new rows are its first
``query_lens[b]`` rows, right-padded to K, and row j sees positions
``p < context_lens[b] - query_lens[b] + j + 1``; a padding row
(``j >= query_lens[b]``) sees the whole context, and its output is to be ignored.

On Triton, one launch sweeps each sequence's whole context per (sequence, kv
head, chunk of query rows) (gpu-kernels.md §17.1), unless that grid would leave
most SMs idle on a long block table: then the context is split into partitions
whose partial softmax states a second launch merges (split-KV, §17.2). Both give
the result above up to fp32 rounding. This module is the host side (checks, the
reference, the launch rule, the launches, dispatch); the Triton kernels it
launches are ``paged_attention_jit``'s.
"""

from __future__ import annotations

import functools

import torch

from ._triton import cdiv, next_power_of_2, use_triton
from .paged_attention_jit import _paged_attention_kernel, _paged_attention_reduce_kernel, _paged_attention_split_kernel

__all__ = [
    "DEFAULT_SM_COUNT",
    "device_sm_count",
    "launch_config",
    "paged_attention",
    "paged_attention_reference",
    "paged_attention_triton",
    "split_count",
]


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
    query_lens: torch.Tensor | None = None,
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
    new_rows = rows if query_lens is None else query_lens.to(torch.int64)[:, None]
    limit = lens[:, None] - new_rows + torch.arange(rows, device=device)[None, :] + 1  # [B, K]
    visible = (positions[None, None, :] < limit[:, :, None]) & in_context[:, None, :]  # [B, K, L]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(nan=0.0)
    out = torch.einsum("bhjl,blhd->bjhd", probs, values)
    return out.to(query.dtype)


def _cache_layout_ok(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()


def launch_config(rows: int, group_size: int, head_dim: int, dtype: torch.dtype, kv_tile: int | None = None) -> dict:
    """Constexprs, warps and stages for one launch (the grid's third axis is ``cdiv(K * group, BLOCK_M)``).

    The sm_90 launch rule (gpu-kernels.md §17.1), spill-free at head dims up to 256 under the
    ptxas of Triton 3.6 and 3.9 (§17.3): 8 warps; 16-bit caches take 32-token KV tiles, 3 stages
    and 16 query rows per program when ``K * group <= 16``, else 64 (32 sits on ptxas' 128-register
    edge at D = 256 and spills there); fp32 (FMA dots) takes 16-token tiles, 16 rows and no
    pipelining. ``kv_tile`` overrides the tile (rounded up to a power of two >= 16).
    """
    wide = dtype != torch.float32
    block_m = 64 if wide and rows * group_size > 16 else 16
    if kv_tile is None:
        kv_tile = 32 if wide else 16
    return {
        "BLOCK_M": block_m,
        "BLOCK_N": max(16, next_power_of_2(kv_tile)),
        "BLOCK_D": max(16, next_power_of_2(head_dim)),
        "DOT_PRECISION": "tf32" if wide else "ieee",
        "num_warps": 8,
        "num_stages": 3 if wide else 1,
    }


# Split-KV (flash-decoding) rule, gpu-kernels.md §17.2.
DEFAULT_SM_COUNT = 132  # an H100 SXM; the device's own count is read on CUDA
SPLIT_MIN_CONTEXT = 512  # tokens the block table can address before a launch may split
MAX_SPLITS = 256
REDUCE_CONFIG = {"SPLIT_BLOCK": 16, "num_warps": 4}


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def device_sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device``; ``DEFAULT_SM_COUNT`` for any other device."""
    if device.type != "cuda":
        return DEFAULT_SM_COUNT
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


def split_count(programs: int, context_bound: int, block_n: int, sm_count: int = DEFAULT_SM_COUNT) -> int:
    """Partitions per (sequence, kv head, m chunk) for a launch of ``programs`` such programs.

    1 (one pass) unless the launch would fill at most half of the ``sm_count`` SMs and the block
    table addresses at least ``SPLIT_MIN_CONTEXT`` tokens (``context_bound``, known on the host
    without reading ``context_lens``); then ``cdiv(sm_count, programs)``, so that at least
    ``sm_count`` programs run, capped at one ``block_n``-token tile per partition and ``MAX_SPLITS``.
    """
    if programs <= 0 or 2 * programs > sm_count or context_bound < SPLIT_MIN_CONTEXT:
        return 1
    return max(1, min(cdiv(sm_count, programs), cdiv(context_bound, block_n), MAX_SPLITS))


def paged_attention_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    kv_tile: int | None = None,
    num_splits: int | None = None,
    sm_count: int | None = None,
    query_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton paged attention; one program per (sequence, kv head, chunk of query rows[, partition]).

    Needs caches with unit stride on D and equal strides; ``kv_tile`` is the number of context
    tokens per inner step (rounded up to a power of two >= 16). ``num_splits`` partitions each
    sequence's context (split-KV, then a reduce launch); ``None`` picks it with ``split_count``
    for ``sm_count`` SMs (default: the device's), 1 is the one-pass kernel. ``query_lens``: ragged
    rows (see the module docstring).
    """
    _check(query, k_cache, v_cache, block_tables, context_lens)
    ragged = query_lens is not None
    if query_lens is not None and query_lens.shape != context_lens.shape:
        raise ValueError("query_lens must be [B]")
    if not _cache_layout_ok(k_cache, v_cache):
        raise ValueError("paged_attention_triton needs D-contiguous caches with equal strides")
    batch, rows, q_heads, dim = query.shape
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group_size = q_heads // kv_heads
    query = query.contiguous()
    out = torch.empty_like(query)
    if out.numel() == 0:
        return out
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    context_lens = context_lens.contiguous()
    config = launch_config(rows, group_size, dim, query.dtype, kv_tile)
    m_chunks = cdiv(rows * group_size, config["BLOCK_M"])
    if num_splits is None:
        sms = sm_count if sm_count is not None else device_sm_count(query.device)
        context_bound = block_tables.shape[1] * block_size
        num_splits = split_count(batch * kv_heads * m_chunks, context_bound, config["BLOCK_N"], sms)
    strides = (
        query.stride(0),
        query.stride(1),
        query.stride(2),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
    )
    lens = query_lens.contiguous() if query_lens is not None else context_lens  # (not read unless ragged)
    if num_splits <= 1:
        _paged_attention_kernel[(batch, kv_heads, m_chunks)](
            query, k_cache, v_cache, block_tables, context_lens, lens, out,
            float(scale), rows, group_size, dim, block_size, *strides, RAGGED=ragged, **config,
        )
        return out
    parts = batch * rows * q_heads * num_splits
    part_max = torch.empty(parts, dtype=torch.float32, device=query.device)
    part_sum = torch.empty(parts, dtype=torch.float32, device=query.device)
    part_acc = torch.empty(parts, dim, dtype=torch.float32, device=query.device)
    _paged_attention_split_kernel[(batch * num_splits, kv_heads, m_chunks)](
        query, k_cache, v_cache, block_tables, context_lens, lens, part_max, part_sum, part_acc,
        float(scale), rows, group_size, dim, block_size, num_splits, *strides, RAGGED=ragged, **config,
    )
    _paged_attention_reduce_kernel[(batch * rows * q_heads,)](
        part_max, part_sum, part_acc, out, num_splits, dim, BLOCK_D=config["BLOCK_D"], **REDUCE_CONFIG
    )
    return out


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    query_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged attention: Triton when it can run for these tensors (one pass or split-KV, as
    ``split_count`` decides for the device's SMs), else the reference. ``query_lens``: ragged rows."""
    tensors = (query, k_cache, v_cache, block_tables, context_lens)
    if use_triton(*tensors, kernel=_paged_attention_kernel) and _cache_layout_ok(k_cache, v_cache):
        return paged_attention_triton(*tensors, scale, query_lens=query_lens)
    return paged_attention_reference(*tensors, scale, query_lens)
