"""Softmax attention: rotary embedding, masked GQA attention, and attention over a paged KV cache.

Invariant: `paged_attention` over a block cache gives the same result as dense causal attention
over the same keys/values laid out contiguously (tested in test_torch_model_paged.py), and so do
the Triton kernels `attention_layer` takes for uniform batches (see kernel_paths.py).
"""

from __future__ import annotations

import math

import torch

from fxsched.kernels.paged_attention import paged_attention as paged_attention_kernel
from fxsched.kernels.paged_kv_append import paged_kv_append

from .kernel_paths import attention_kernels_apply
from .ops import linear
from .paged_kv import PagedKVCache


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half rotary embedding of x [..., T, H, D] at integer positions [..., T]."""
    dim = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    angles = positions.to(torch.float32)[..., None] * inv_freq  # [..., T, D/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[..., None, :]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[..., None, :]
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Softmax attention with grouped KV heads.

    q [B, T, Hq, D], k/v [B, S, Hkv, D], allowed [B, T, S] (True = may attend; every row needs
    at least one True). Returns [B, T, Hq, D].
    """
    b, t, hq, d = q.shape
    group = hq // k.shape[2]
    kh = k.repeat_interleave(group, dim=2).transpose(1, 2)  # [B, Hq, S, D]
    vh = v.repeat_interleave(group, dim=2).transpose(1, 2)
    scores = torch.matmul(q.transpose(1, 2), kh.transpose(-1, -2)) / math.sqrt(d)  # [B, Hq, T, S]
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), vh).transpose(1, 2)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, q_positions: torch.Tensor) -> torch.Tensor:
    """Causal attention of queries over a paged cache.

    q [B, T, Hq, D] at absolute positions q_positions [B, T]; k_cache/v_cache
    [num_blocks, block_size, Hkv, D]; block_tables [B, nb] (padding entries may be any valid id).
    Query (b, t) attends keys at positions 0..q_positions[b, t] of sequence b, which must already
    be written. Returns [B, T, Hq, D].
    """
    b, nb = block_tables.shape
    bs = k_cache.shape[1]
    keys = k_cache[block_tables].reshape(b, nb * bs, *k_cache.shape[2:])
    values = v_cache[block_tables].reshape(b, nb * bs, *v_cache.shape[2:])
    key_pos = torch.arange(nb * bs, device=q.device)
    allowed = key_pos[None, None, :] <= q_positions[:, :, None]
    return masked_attention(q, keys, values, allowed)


def attention_layer(x: torch.Tensor, w: dict[str, torch.Tensor], prefix: str, *, num_heads: int,
                    num_kv_heads: int, head_dim: int, rope_theta: float, cache: PagedKVCache,
                    cache_layer: int, positions: torch.Tensor, valid: torch.Tensor,
                    write_index: torch.Tensor, block_tables: torch.Tensor, uniform: bool = False) -> torch.Tensor:
    """One target attention layer over a right-padded batch x [B, T, D].

    Writes K/V of the valid rows (valid [B, T]) at flat cache indices write_index [N] (row-major
    order of the valid rows), then attends causally over the paged cache. Padded rows produce
    garbage outputs that callers must ignore.

    `uniform` promises that every row is valid (each sequence has T new rows at consecutive
    positions): then, where kernel_paths allows Triton, the rows go through the `paged_kv_append`
    and `paged_attention` kernels (start = positions[:, 0], context = start + T, so row j sees
    positions <= positions[:, j]; query head h reads kv head h // (Hq // Hkv), as in
    `masked_attention`). Ragged batches, and uniform ones without Triton, take the torch path.
    """
    b, t, _ = x.shape
    q = linear(x, w[f"{prefix}.q_proj"]).view(b, t, num_heads, head_dim)
    k = linear(x, w[f"{prefix}.k_proj"]).view(b, t, num_kv_heads, head_dim)
    v = linear(x, w[f"{prefix}.v_proj"]).view(b, t, num_kv_heads, head_dim)
    q = apply_rope(q, positions, rope_theta)
    k = apply_rope(k, positions, rope_theta)
    k_cache, v_cache = cache.k[cache_layer], cache.v[cache_layer]
    if uniform and attention_kernels_apply(q, k, v, k_cache, v_cache, block_tables, positions):
        start = positions[:, 0]
        paged_kv_append(k, v, k_cache, v_cache, block_tables, start)
        out = paged_attention_kernel(q, k_cache, v_cache, block_tables, start + t, head_dim ** -0.5)
    else:
        cache.write(cache_layer, write_index, k[valid], v[valid])
        out = paged_attention(q, k_cache, v_cache, block_tables,
                              torch.where(valid, positions, torch.zeros_like(positions)))
    return linear(out.reshape(b, t, num_heads * head_dim), w[f"{prefix}.o_proj"])
