"""Sparse mixture-of-experts feed-forward (Qwen3-Next / Qwen3.5-MoE style), plain torch.

Per token x: router logits r = x W_router^T [E]; p = softmax(r) in fp32; the top-k experts by p
(ties broken by torch.topk, as transformers) get weights p_top, renormalised to sum 1 when
cfg.norm_topk_prob; the output is sum_e p_e * SwiGLU_e(x) over the chosen experts, plus, with a
shared expert, sigmoid(x W_shared_gate^T) * SwiGLU_shared(x).

Weights (canonical names, see weights.py) under `prefix` (e.g. "layers.3.moe"): router [E, D],
gate_proj / up_proj [E, I, D], down_proj [E, D, I] (experts stacked on dim 0 so an expert-parallel
runtime can slice them), and when cfg.shared_expert_intermediate_size > 0: shared.gate_proj,
shared.up_proj, shared.down_proj and shared_gate [1, D].

The implementation loops over the experts that received at least one token, in increasing expert
order, gathering their tokens and scattering the weighted outputs back with index_add_ (the same
accumulation order as transformers' eager experts). Rows are independent: a token's output depends
only on that token, so padded rows never affect valid ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import ModelConfig
from .ops import linear, swiglu_mlp


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of tokens x [N, D]: (weights [N, k] in x's dtype, expert ids [N, k])."""
    probs = torch.softmax(linear(x, router).float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), experts


def sparse_moe(x: torch.Tensor, w: dict[str, torch.Tensor], prefix: str, cfg: ModelConfig) -> torch.Tensor:
    """MoE feed-forward of x [..., D] with the weights under `prefix`; returns [..., D]."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    weights, experts = route(flat, w[f"{prefix}.router"], cfg.num_experts_per_tok, cfg.norm_topk_prob)
    gate_w, up_w, down_w = w[f"{prefix}.gate_proj"], w[f"{prefix}.up_proj"], w[f"{prefix}.down_proj"]
    out = torch.zeros_like(flat)
    for e in torch.unique(experts).tolist():
        token, slot = torch.nonzero(experts == e, as_tuple=True)
        h = flat[token]
        y = linear(F.silu(linear(h, gate_w[e])) * linear(h, up_w[e]), down_w[e])
        out.index_add_(0, token, y * weights[token, slot, None])
    if cfg.shared_expert_intermediate_size:
        shared = swiglu_mlp(flat, w, f"{prefix}.shared")
        out = out + torch.sigmoid(linear(flat, w[f"{prefix}.shared_gate"])) * shared
    return out.reshape(shape)
