"""The hybrid target model: embedding, GDN / paged-attention layers with SwiGLU MLPs, RMSNorm, LM head.

Invariant: `HybridModel.forward` writes K/V for the valid rows of the batch into the paged cache
but never touches the GDN state cache; it returns per-row GDN states for the caller to commit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import attention_layer
from .config import ModelConfig
from .gdn import GdnRows, GdnStateCache, gdn_layer
from .ops import linear, rms_norm, swiglu_mlp
from .paged_kv import PagedKVCache
from .weights import Weights, check_weights


@dataclass
class RowBatch:
    """A right-padded batch of rows for B sequences: row (b, t) is token tokens[b, t] at positions[b, t].

    valid [B, T] marks real rows; write_index [N] holds the flat KV-cache index of each valid row in
    row-major order; block_tables [B, nb] map positions to blocks; slots [B] pick GDN state rows.
    uniform promises that every row is valid (all B sequences have T rows): attention may then take
    the paged Triton kernels (see kernel_paths.py).
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    write_index: torch.Tensor
    block_tables: torch.Tensor
    slots: torch.Tensor
    uniform: bool = False


@dataclass
class ForwardOutput:
    """hidden [B, T, D] (pre final norm), logits [B, T, V], and per GDN layer the per-row states."""

    hidden: torch.Tensor
    logits: torch.Tensor
    gdn_rows: list[GdnRows]


class HybridModel:
    """Weights plus the forward pass; holds no per-sequence state."""

    def __init__(self, cfg: ModelConfig, weights: Weights) -> None:
        check_weights(weights, cfg)
        self.cfg = cfg
        self.w = weights

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings [..., D] of token ids [...]."""
        return self.w["embed"][tokens]

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [..., V] of pre-norm hidden states [..., D] (final RMSNorm then LM head)."""
        return linear(rms_norm(hidden, self.w["final_norm"], self.cfg.rms_norm_eps), self.w["lm_head"])

    def forward(self, batch: RowBatch, kv: PagedKVCache, gdn: GdnStateCache) -> ForwardOutput:
        """Run all layers over `batch`; K/V of valid rows land in `kv`, GDN states are only returned."""
        cfg, w = self.cfg, self.w
        h = self.embed(batch.tokens)
        gdn_rows: list[GdnRows] = []
        gdn_index = attn_index = 0
        for i, kind in enumerate(cfg.layer_pattern):
            x = rms_norm(h, w[f"layers.{i}.input_norm"], cfg.rms_norm_eps)
            if kind == "gdn":
                out, rows = gdn_layer(x, w, f"layers.{i}.gdn", cfg,
                                      gdn.recurrent[gdn_index].index_select(0, batch.slots),
                                      gdn.conv[gdn_index].index_select(0, batch.slots))
                gdn_rows.append(rows)
                gdn_index += 1
            else:
                out = attention_layer(x, w, f"layers.{i}.attn", num_heads=cfg.num_attention_heads,
                                      num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                      rope_theta=cfg.rope_theta, cache=kv, cache_layer=attn_index,
                                      positions=batch.positions, valid=batch.valid,
                                      write_index=batch.write_index, block_tables=batch.block_tables,
                                      uniform=batch.uniform)
                attn_index += 1
            h = h + out
            h = h + swiglu_mlp(rms_norm(h, w[f"layers.{i}.post_norm"], cfg.rms_norm_eps), w, f"layers.{i}.mlp")
        return ForwardOutput(hidden=h, logits=self.lm_head(h), gdn_rows=gdn_rows)
