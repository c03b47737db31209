"""Stateless tensor building blocks shared by the target model and the drafters (fp32)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last dim; shape preserved."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T for weight [out, in] (no bias anywhere in this model)."""
    return F.linear(x, weight)


def swiglu_mlp(x: torch.Tensor, w: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) with weights `{prefix}.gate_proj/up_proj/down_proj`."""
    return linear(F.silu(linear(x, w[f"{prefix}.gate_proj"])) * linear(x, w[f"{prefix}.up_proj"]),
                  w[f"{prefix}.down_proj"])


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x scaled to unit L2 norm over the last dim."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)
