"""A decoder layer in few calls on a bf16 CPU model (specs/cpu-kernels.md §15.10).

At decode a layer's products are short (one row reads each weight once) and the steps between them
were each a dispatch or several: three projections for q, k and v, the q and k norms and two
rotations of about a dozen torch ops, the K/V write, two residual adds, two norms. Here, where the
projections are packed (packing.py):

- `pack_fused` (packing.pack_for_cpu's, at load) packs each attention block's q/k/v(/gate) and
  each dense MLP's gate/up into one buffer (the packing's first dimension is the output's, so the
  stacked packings are the packing of the stacked weights) and puts views of it back under the
  original names: memory holds each weight once, every other reader sees the same tensors, and
  the product of the fused matrix gives each output column the same bits as its own matrix did
  (a column's sum never depends on the columns beside it). `fuse_projections` finds these
  buffers for the forward.
- `attention_inputs` takes q, k and v from one product and the norms and rotations from one kernel
  call (kernels/cpu_pointwise.py), bit for bit what attention.attention_qkv gives.
- `swiglu` runs the MLP as two products and one SwiGLU call.
- `add_norm` is the residual add and the next norm in one pass (the same bits as the two steps).

Everything here falls back to the step-by-step forms where a kernel does not take the operands
(LoRA adapters in the batch, another device, fp32, traced); callers check `attention_takes`.
"""

from __future__ import annotations

import torch

from fxsched.kernels import cpu_amx, cpu_pointwise

from .config import ModelConfig
from .ops import linear, rms_norm

__all__ = ["add_norm", "attention_inputs", "attention_takes", "fuse_projections", "fusion_groups", "pack_fused",
           "swiglu", "write_kv"]

_ATTN_PARTS = ("q_proj", "k_proj", "v_proj", "gate_proj")
_MLP_PARTS = ("gate_proj", "up_proj")


def fusion_groups(cfg: ModelConfig) -> dict[str, list[str]]:
    """The weights each fused matrix stacks, by block prefix: an attention block's q/k/v(/gate)
    projections, a dense MLP's gate/up."""
    groups: dict[str, list[str]] = {}
    for i, kind in enumerate(cfg.layer_pattern):
        if kind == "attn":
            prefix = f"layers.{i}.attn"
            groups[prefix] = [f"{prefix}.{p}" for p in _ATTN_PARTS if p != "gate_proj" or cfg.attn_output_gate]
        if cfg.mlp_kind(i) == "dense":
            groups[f"layers.{i}.mlp"] = [f"layers.{i}.mlp.{p}" for p in _MLP_PARTS]
    return groups


def pack_fused(w: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor | None:
    """The named [N, K] weights packed (cpu_amx.pack's order) into one buffer, stacked in order, w's
    entries replaced by views of it (in place: each original is released as it is packed where w
    held the last reference); None, w untouched, where one is not `cpu_amx.packable` or the K differ."""
    parts = [w[n] for n in names if n in w]
    if len(parts) != len(names) or not all(cpu_amx.packable(t) for t in parts) or len({t.shape[1] for t in parts}) != 1:
        return None
    k = parts[0].shape[1]
    fused = torch.empty(sum(t.shape[0] for t in parts) // 16, k // 32, 16, 16, 2, dtype=parts[0].dtype)
    start = 0
    del parts
    for n in names:
        blocks = w[n].shape[0] // 16
        fused[start:start + blocks].copy_(cpu_amx.tile_order(w[n]))
        w[n] = fused[start:start + blocks]
        start += blocks
    return fused


def _stacked(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The packed buffer the parts are consecutive views of, whole (`pack_fused`'s), or None."""
    base = parts[0]._base
    if base is None or any(t._base is not base for t in parts) or parts[0].storage_offset() != base.storage_offset():
        return None
    offset = base.storage_offset()
    for t in parts:
        if t.storage_offset() != offset or not t.is_contiguous():
            return None
        offset += t.numel()
    return base if offset == base.storage_offset() + base.numel() and base.is_contiguous() else None


def fuse_projections(w: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Per `fusion_groups` block whose projections `pack_fused` stacked (packing.pack_for_cpu does
    at load): the buffer they are views of. Blocks packed otherwise are left out (their products
    run one by one)."""
    fused: dict[str, torch.Tensor] = {}
    for prefix, names in fusion_groups(cfg).items():
        parts = [w[n] for n in names if n in w]
        if len(parts) == len(names) and all(cpu_amx.is_packed(t) for t in parts):
            whole = _stacked(parts)
            if whole is not None:
                fused[prefix] = whole
    return fused


def add_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, rms_norm(h + delta, weight)): one pass where the kernel takes them."""
    if delta.shape == h.shape and cpu_pointwise.takes_norm(h, weight) and cpu_pointwise.takes(delta):
        return cpu_pointwise.add_rms_norm_bf16(h, delta, weight, eps)
    h = h + delta
    return h, rms_norm(h, weight, eps)


def attention_takes(x: torch.Tensor, fused: torch.Tensor | None, k_cache: torch.Tensor, cfg: ModelConfig,
                    rope_cos: torch.Tensor | None) -> bool:
    """Whether `attention_inputs` takes this block: its projections fused, a bf16 CPU forward and
    cache (no LoRA rows: the caller checks), tables computed for the batch, heads the kernel takes."""
    return (fused is not None and rope_cos is not None and rope_cos.dtype == torch.bfloat16
            and k_cache.dtype == torch.bfloat16 and k_cache.device.type == "cpu" and k_cache.is_contiguous()
            and cpu_pointwise.takes(x) and cpu_pointwise.takes_rope(cfg.head_dim, cfg.rotary_dim))


def attention_inputs(x: torch.Tensor, fused: torch.Tensor, w: dict[str, torch.Tensor], prefix: str,
                     cfg: ModelConfig, cos: torch.Tensor, sin: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """q [B, T, Hq, Dh], k and v [B, T, Hkv, Dh] and the gate (or None) of block `prefix` over
    x [B, T, D], as attention.attention_qkv gives them, from the fused matrix (one product) and one
    norm-and-rotate call; cos/sin: the forward's tables [B, T, 1, rot]. v and the gate are views of
    the product's output."""
    lead = x.shape[:-1]
    hq, hkv, d = cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim
    out = linear(x, fused).reshape(-1, fused.shape[0] * 16)
    qn = w[f"{prefix}.q_norm"] if cfg.qk_norm else None
    kn = w[f"{prefix}.k_norm"] if cfg.qk_norm else None
    rot = cos.shape[-1]
    q, k = cpu_pointwise.qk_norm_rope_bf16(out, hq, hkv, d, qn, kn, cfg.rms_norm_eps,
                                           cos.reshape(-1, rot).contiguous(), sin.reshape(-1, rot).contiguous())
    v0 = (hq + hkv) * d
    v = out[:, v0:v0 + hkv * d].view(*lead, hkv, d)
    gate = out[:, v0 + hkv * d:v0 + (hkv + hq) * d].view(*lead, hq, d) if cfg.attn_output_gate else None
    return q.view(*lead, hq, d), k.view(*lead, hkv, d), v, gate


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             valid_rows: torch.Tensor | None, write_index: torch.Tensor) -> None:
    """The paged K/V write of `attention_inputs`' k and v [B, T, Hkv, Dh]: flat row valid_rows[j]
    (row j where None: every row valid) to cache row write_index[j] (attention_layer's write)."""
    width = k.shape[-2] * k.shape[-1]
    cpu_pointwise.kv_scatter_bf16(k.reshape(-1, width), v.reshape(-1, width), k_cache, v_cache,
                                  None if valid_rows is None else valid_rows.to(torch.int64).contiguous(),
                                  write_index.to(torch.int64).contiguous())


def swiglu(x: torch.Tensor, fused: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) from the fused gate/up matrix: one product and one SwiGLU pass
    (the same bits as ops.swiglu_mlp)."""
    gate_up = linear(x, fused)
    if cpu_pointwise.takes(gate_up):
        act = cpu_pointwise.silu_mul_rows_bf16(gate_up)
    else:
        n = gate_up.shape[-1] // 2
        act = cpu_pointwise.silu_mul_reference(gate_up[..., :n], gate_up[..., n:])
    return linear(act, down)
