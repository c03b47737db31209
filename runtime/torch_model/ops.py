"""Stateless tensor building blocks shared by the target model and the drafters.

Dtype rule: matrices and activations are in cfg.dtype (float32 for the internal model); the
normalisations compute in fp32 and cast back to the input's dtype, as transformers does. For
float32 inputs every function here is exactly the plain fp32 formula (the casts are no-ops).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from fxsched.kernels import cpu_amx, cpu_gemv, cpu_pairs, cpu_pointwise, cpu_widen

if TYPE_CHECKING:
    from .lora_rows import LoraRows


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last dim, computed in fp32 and cast back to x's dtype.

    `weight` is a plain multiplicative weight (zero-centred checkpoint norms were converted to
    1 + w at load, see hf_convert.py), so this is the only RMSNorm the forward needs.
    """
    if cpu_pointwise.takes_norm(x, weight):
        return cpu_pointwise.rms_norm_bf16(x, weight, eps)  # the same arithmetic, one pass (CPU bf16)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T for weight [out, in] (no bias anywhere in this model).

    The order of cpu-kernels.md §15.1: a weight packed at load (`pack_for_cpu`) goes to
    kernels/cpu_amx.py on an AMX host, else to kernels/cpu_pairs.py (AVX512-BF16); otherwise a bf16 product of at most `cpu_gemv.max_rows()` rows on the CPU
    (decode and verify) takes the row kernel where it is ready (kernels/cpu_gemv.py: about twice
    F.linear's speed on AVX512-BF16, ten times on AVX2); on a CPU without bf16 arithmetic a larger
    bf16 product is taken in fp32 over widened weight panels (kernels/cpu_widen.py, §15.6);
    everything else, and anything traced by torch.compile, is F.linear.
    """
    if cpu_amx.is_packed(weight):  # AMX where it runs, else AVX512-BF16 over the same packing
        return cpu_amx.amx_linear(x, weight) if cpu_amx.ready() else cpu_pairs.pairs_linear(x, weight)
    if (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.device.type == "cpu"
            and x.dim() >= 1 and x.numel() > 0 and weight.dim() == 2 and weight.is_contiguous()
            and not torch.compiler.is_compiling()):
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] <= cpu_gemv.max_rows() and cpu_gemv.ready():
            return cpu_gemv.gemv_bf16(flat, weight).view(*x.shape[:-1], weight.shape[0])
        if cpu_widen.wanted() and not x.requires_grad and not weight.requires_grad:
            return cpu_widen.widened_linear(flat, weight).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight)


def embed_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ids [...] of an embedding table [V, D]: [..., D] (the table may be packed for AMX, when
    it is tied to the output head)."""
    return cpu_amx.rows(table, ids) if cpu_amx.is_packed(table) else table[ids]


def swiglu_mlp(x: torch.Tensor, w: dict[str, torch.Tensor], prefix: str, lora: "LoraRows | None" = None) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) with weights `{prefix}.gate_proj/up_proj/down_proj` (on a CPU bf16
    forward the product is one pass rounding once, kernels/cpu_pointwise.py); `lora`: the batch's
    adapters, added to each projection (specs/lora.md §18.2)."""
    gate, up = linear(x, w[f"{prefix}.gate_proj"]), linear(x, w[f"{prefix}.up_proj"])
    if lora is not None:
        gate, up = lora.add(f"{prefix}.gate_proj", x, gate), lora.add(f"{prefix}.up_proj", x, up)
    act = cpu_pointwise.silu_mul_bf16(gate, up) if cpu_pointwise.takes(gate, up) else F.silu(gate) * up
    out = linear(act, w[f"{prefix}.down_proj"])
    return out if lora is None else lora.add(f"{prefix}.down_proj", act, out)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x scaled to unit L2 norm over the last dim (x * rsqrt(sum(x^2) + eps), as fla/transformers)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)
