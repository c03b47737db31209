"""Softmax attention: rotary embedding, masked GQA attention, and attention over a paged KV cache.

Invariant: `paged_attention` over a block cache gives the same result as dense causal attention
over the same keys/values laid out contiguously (tested in test_torch_model_paged.py), and so do
the Triton kernels `attention_layer` takes for uniform batches (see kernel_paths.py).

Building blocks (the drafters reuse them): `apply_rope` (partial RoPE: only the first rotary_dim
dims of a head rotate, with transformers' rotate_half convention over that sub-dimension),
`attention_qkv` (projections, per-head q/k RMSNorm, RoPE, and the output gate of gated attention)
and `attention_out` (gate * sigmoid, output projection). As in transformers, q/k norms come before
RoPE and the gate is applied to the attention output before o_proj. Scores and softmax run in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fxsched.kernels import cpu_amx, cpu_amx_attention, cpu_attention
from fxsched.kernels.paged_attention import paged_attention as paged_attention_kernel
from fxsched.kernels.paged_kv_append import paged_kv_append

from .attn_plan import AttnPlan
from . import fused as fused_ops
from .config import ModelConfig
from .kernel_paths import attention_kernels_apply
from .lora_rows import LoraRows, project
from .ops import rms_norm
from .paged_kv import PagedKVCache


@dataclass(frozen=True)
class RopeTables:
    """The rotary cos and sin tables [..., T, 1, rot] of one positions tensor [..., T] (fp32 angles,
    cast to the rows' dtype): computed once per forward from the forward's own positions and
    handed to every layer that ropes at them.

    Why not a cache keyed by the positions tensor: a forward replayed as a CUDA graph reads whatever
    its capture read. A cache hit during the capture (the warm-ups ran on the same input buffer)
    records no computation of the tables, so every replay would read the capture's tables, computed
    for the warm-up batch's positions, from memory a later capture may have freed (specs/async.md
    §16.4). Computing the tables inside the forward puts them in every capture.
    """

    cos: torch.Tensor
    sin: torch.Tensor

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of a head rotate."""
        return int(self.cos.shape[-1])


def rope_tables(positions: torch.Tensor, theta: float, rot: int, dtype: torch.dtype) -> RopeTables:
    """cos and sin [..., T, 1, rot] at integer `positions` [..., T] (fp32 angles, cast to dtype)."""
    inv_freq = theta ** (-torch.arange(0, rot, 2, device=positions.device, dtype=torch.float32) / rot)
    angles = positions.to(torch.float32)[..., None] * inv_freq  # [..., T, rot/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[..., None, :].to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1)[..., None, :].to(dtype)
    return RopeTables(cos, sin)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int | None = None,
               tables: RopeTables | None = None) -> torch.Tensor:
    """Rotate-half rotary embedding of x [..., T, H, D] at integer positions [..., T].

    Only the first `rotary_dim` (default: all D) dims rotate, pairing dim i with i + rotary_dim/2;
    the rest pass through. cos/sin are computed in fp32 and cast to x's dtype (as transformers);
    a caller that ropes several tensors at the same positions passes their `tables` (`rope_tables`,
    then positions, theta and rotary_dim are not read).
    """
    dim = x.shape[-1]
    if tables is None:
        tables = rope_tables(positions, theta, dim if rotary_dim is None else rotary_dim, x.dtype)
    cos, sin, rot = tables.cos, tables.sin, tables.rotary_dim
    half = rot // 2
    if rot == dim:
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], -1)
    return torch.cat([x_rot * cos + rotated * sin, x_pass], -1)


def model_rope_tables(positions: torch.Tensor, cfg: ModelConfig, dtype: torch.dtype) -> RopeTables:
    """The tables of `cfg`'s attention blocks (rope_theta, rotary_dim) at `positions`."""
    return rope_tables(positions, cfg.rope_theta, cfg.rotary_dim, dtype)


def attention_qkv(x: torch.Tensor, w: dict[str, torch.Tensor], prefix: str, cfg: ModelConfig,
                  positions: torch.Tensor, rope: RopeTables | None = None, lora: LoraRows | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Queries, keys, values and output gate of attention block `prefix` over x [..., T, D].

    Returns q [..., T, Hq, Dh], k and v [..., T, Hkv, Dh] (q and k normed if cfg.qk_norm, then roped
    over cfg.rotary_dim at positions [..., T], by `rope` when the caller computed the tables once
    for several blocks) and the pre-sigmoid gate [..., T, Hq, Dh] when cfg.attn_output_gate, else None.
    lora: the batch's adapters, added to each projection (specs/lora.md §18.2).
    """
    lead = x.shape[:-1]
    hq, hkv, dh = cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim
    q = project(x, w, f"{prefix}.q_proj", lora).view(*lead, hq, dh)
    k = project(x, w, f"{prefix}.k_proj", lora).view(*lead, hkv, dh)
    v = project(x, w, f"{prefix}.v_proj", lora).view(*lead, hkv, dh)
    gate = project(x, w, f"{prefix}.gate_proj", lora).view(*lead, hq, dh) if cfg.attn_output_gate else None
    if cfg.qk_norm:
        q = rms_norm(q, w[f"{prefix}.q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, w[f"{prefix}.k_norm"], cfg.rms_norm_eps)
    if rope is None:
        rope = model_rope_tables(positions, cfg, q.dtype)
    q = apply_rope(q, positions, cfg.rope_theta, tables=rope)
    k = apply_rope(k, positions, cfg.rope_theta, tables=rope)
    return q, k, v, gate


def attention_out(attn: torch.Tensor, gate: torch.Tensor | None, w: dict[str, torch.Tensor],
                  prefix: str, lora: LoraRows | None = None) -> torch.Tensor:
    """Output of attention block `prefix`: o_proj(attn * sigmoid(gate)) for attn [..., T, Hq, Dh]."""
    if gate is not None:
        attn = attn * torch.sigmoid(gate)
    return project(attn.reshape(*attn.shape[:-2], -1), w, f"{prefix}.o_proj", lora)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Softmax attention with grouped KV heads.

    q [B, T, Hq, D], k/v [B, S, Hkv, D], allowed [B, T, S] (True = may attend; every row needs
    at least one True). Returns [B, T, Hq, D]. Query head h reads kv head h // (Hq / Hkv), without
    repeating the kv heads (PyTorch's fused SDPA, fp32 accumulation inside).
    """
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=allowed[:, None], enable_gqa=True)
    return out.transpose(1, 2)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, q_positions: torch.Tensor) -> torch.Tensor:
    """Causal attention of queries over a paged cache (the path without a host plan: every shape
    is static, so a decode or verify forward through it traces whole, e.g. for a CUDA graph).

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


def _sdpa_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype a prompt's attention runs in (specs/cpu-kernels.md §15.9): fp32 for bf16 rows on a
    CPU without AMX, where PyTorch's CPU flash attention runs fp32 at about 1.75x its bf16 rate (62
    against 36 GFLOP/s on one core, 512 causal rows; its sums are fp32 either way); else q's own."""
    if q.device.type == "cpu" and q.dtype == torch.bfloat16 and not cpu_amx.ready():
        return torch.float32
    return q.dtype


def planned_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, plan: AttnPlan) -> torch.Tensor:
    """Causal attention of each batch entry's new rows over its keys, where `plan` says they are
    (attn_plan.py: the new rows themselves, a view of the cache, or a gather of the entry's own
    blocks; the decode and verify rows of a CPU bf16 forward in one call of the row kernel).
    q [B, T, Hq, D], the new k/v [B, T, Hkv, D] (already written to the cache),
    k_cache/v_cache [num_blocks, block_size, Hkv, D]; an entry's rows are the flat rows from its
    `SeqKeys.offset` (b * T, or in a packed [1, N] forward the rows before it). Padding rows of the
    output are zero."""
    rows = plan.rows if plan.rows is not None and cpu_attention.fits(q, k_cache) else None
    if rows is not None:
        b_, t_ = q.shape[:2]
        out = cpu_attention.paged_attention_bf16(q.reshape(b_ * t_, *q.shape[2:]), k_cache, v_cache, rows.q_rows,
                                                 rows.ctx, rows.tables).view(q.shape)
        if len(rows.entries) == len(plan.seqs):
            return out
    elif sum(seq.rows for seq in plan.seqs) == q.shape[0] * q.shape[1]:  # every row written below
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    else:  # padding rows stay zero
        out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    q_rows, k_rows, v_rows = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
    out_rows = out.view(-1, *out.shape[2:])
    for b, seq in enumerate(plan.seqs):
        if rows is not None and b in rows.entries:
            continue
        n = seq.rows
        first = seq.offset
        qb = q_rows[first:first + n].transpose(0, 1)[None]
        if seq.source == "fresh":
            kb, vb = k_rows[first:first + n].to(k_cache.dtype), v_rows[first:first + n].to(v_cache.dtype)
        elif seq.source == "run":
            kb = flat_k[seq.flat_start:seq.flat_start + seq.ctx]
            vb = flat_v[seq.flat_start:seq.flat_start + seq.ctx]
        else:
            assert seq.blocks is not None  # a gather entry carries its block ids
            kb = k_cache.index_select(0, seq.blocks).view(-1, *k_cache.shape[2:])[:seq.ctx]
            vb = v_cache.index_select(0, seq.blocks).view(-1, *v_cache.shape[2:])[:seq.ctx]
        if cpu_amx_attention.fits(q_rows[first:first + n], kb, vb):  # (the plan's masks are its causal rule)
            cpu_amx_attention.prefill_attention(q_rows[first:first + n], kb, vb, out=out_rows[first:first + n])
            continue
        work = _sdpa_dtype(q)
        o = F.scaled_dot_product_attention(qb.to(work), kb.transpose(0, 1)[None].to(work),
                                           vb.transpose(0, 1)[None].to(work), attn_mask=seq.mask,
                                           is_causal=seq.source == "fresh" and n > 1, enable_gqa=True)
        out_rows[first:first + n] = o[0].transpose(0, 1)
    return out


def attention_layer(x: torch.Tensor, w: dict[str, torch.Tensor], prefix: str, *, cache: PagedKVCache,
                    cache_layer: int, positions: torch.Tensor, valid: torch.Tensor, write_index: torch.Tensor,
                    block_tables: torch.Tensor, uniform: bool = False, cfg: ModelConfig | None = None,
                    num_heads: int = 0, num_kv_heads: int = 0, head_dim: int = 0,
                    rope_theta: float = 0.0, valid_rows: torch.Tensor | None = None,
                    plan: AttnPlan | None = None, rope: RopeTables | None = None,
                    lora: LoraRows | None = None, fused: torch.Tensor | None = None) -> torch.Tensor:
    """One target attention layer over a right-padded batch x [B, T, D].

    The block's shape and options come from `cfg` (`attention_qkv`); without cfg, from num_heads,
    num_kv_heads, head_dim and rope_theta (a plain block: no gate, no q/k norm, full RoPE).

    Writes K/V of the valid rows (valid [B, T]) at flat cache indices write_index [N] (row-major
    order of the valid rows), then attends causally over the paged cache. Padded rows produce
    garbage outputs that callers must ignore.

    `uniform` promises that every row is valid (each sequence has T new rows at consecutive
    positions): then, where kernel_paths allows Triton, the rows go through the `paged_kv_append`
    and `paged_attention` kernels (start = positions[:, 0], context = start + T, so row j sees
    positions <= positions[:, j]; query head h reads kv head h // (Hq // Hkv), as in
    `masked_attention`). Ragged batches take the same kernel with each sequence's number of new rows
    (its K/V written by the torch cache write). Without Triton, the torch path: with a host `plan`
    (attn_plan.py) each entry attends over its own keys where they lie (`planned_attention`); without
    one, over the batch's gathered blocks (`paged_attention`, the shape-static form).
    valid_rows [N]: the flat indices (b * T + t) of the valid rows, so the cache write needs no
    boolean mask (None: every row is valid when uniform, else `valid` is used).
    rope: the forward's rotary tables at `positions` (computed here when None).
    lora: the batch's adapters (specs/lora.md §18.2).
    fused: the block's fused q/k/v(/gate) packing (fused.py): on a bf16 CPU forward without adapters,
    with a host plan and the rows' cache indices, the inputs come from one product and one norm and
    rotation call and the K/V write is one call (specs/cpu-kernels.md §15.10); the same bits.
    """
    if cfg is None:
        cfg = ModelConfig(num_attention_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                          rope_theta=rope_theta, mtp=False, dflash_gamma=0)
    t = x.shape[1]
    k_cache, v_cache = cache.k[cache_layer], cache.v[cache_layer]
    if (lora is None and plan is not None and (uniform or valid_rows is not None)
            and fused_ops.attention_takes(x, fused, k_cache, cfg, None if rope is None else rope.cos)):
        assert fused is not None and rope is not None  # attention_takes checked both
        q, k, v, gate = fused_ops.attention_inputs(x, fused, w, prefix, cfg, rope.cos, rope.sin)
        fused_ops.write_kv(k, v, k_cache, v_cache, valid_rows, write_index)
        return attention_out(planned_attention(q, k, v, k_cache, v_cache, plan), gate, w, prefix)
    q, k, v, gate = attention_qkv(x, w, prefix, cfg, positions, rope, lora)
    kernels = attention_kernels_apply(q, k, v, k_cache, v_cache, block_tables, positions)
    if uniform and kernels:
        start = positions[:, 0]
        paged_kv_append(k, v, k_cache, v_cache, block_tables, start)
        out = paged_attention_kernel(q, k_cache, v_cache, block_tables, start + t, cfg.head_dim ** -0.5)
    else:
        k_rows, v_rows = k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:])
        if valid_rows is not None:
            k_rows, v_rows = k_rows.index_select(0, valid_rows), v_rows.index_select(0, valid_rows)
        elif not uniform:
            k_rows, v_rows = k[valid], v[valid]
        cache.write(cache_layer, write_index, k_rows.to(k_cache.dtype), v_rows.to(v_cache.dtype))
        if kernels:  # ragged rows in one launch (gpu-kernels.md §17.5): each sequence's first row is valid
            new_rows = valid.sum(1)
            out = paged_attention_kernel(q, k_cache, v_cache, block_tables, positions[:, 0] + new_rows,
                                         cfg.head_dim ** -0.5, query_lens=new_rows)
        elif plan is not None:
            out = planned_attention(q, k, v, k_cache, v_cache, plan)
        else:
            out = paged_attention(q, k_cache, v_cache, block_tables,
                                  torch.where(valid, positions, torch.zeros_like(positions)))
    return attention_out(out, gate, w, prefix, lora)
