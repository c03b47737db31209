"""The hybrid target model: embedding, GDN / paged-attention layers with dense or MoE feed-forwards,
RMSNorm, LM head.

Decoder layer i (pre-norm residual, as every supported family): h += mixer(norm(h)), then
h += ffn(norm(h)), where mixer is GDN or attention by cfg.layer_pattern and ffn is a SwiGLU MLP or a
sparse MoE by cfg.mlp_kind(i) (`mlp_block`). Logits = lm_head(final_norm(h)).

Invariant: `HybridModel.forward` writes K/V for the valid rows of the batch into the paged cache
but never touches the GDN state cache; it returns per-row GDN states for the caller to commit --
except for a batch marked gdn_in_place (a decode, whose single row is committed at once), whose GDN
layers update the slots' states in place and return `GdnRows.committed()`.

Captured layers: `forward(..., capture_layers=(l, ...))` returns in ForwardOutput.layer_hidden[l]
the residual stream right after decoder layer l (0-based; pre final norm), [B, T, D]. In
transformers' `output_hidden_states` terms that is hidden_states[l + 1] (hidden_states[0] is the
embedding output) -- except for the last layer, whose HF entry is already final-normed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .attention import attention_layer, model_rope_tables
from .attn_plan import AttnPlan
from .config import ModelConfig
from .decode_layers import LayerStack
from .fused import add_norm, fuse_projections, swiglu
from .gdn import GdnRows, GdnStateCache, gdn_layer
from .gdn_chunked import KeepIndex, KeepPlan
from .lora_rows import LoraRows
from .moe import fuse_shared_experts, sparse_moe
from .ops import embed_rows, linear, rms_norm, swiglu_mlp
from .packing import pack_for_cpu
from .paged_kv import PagedKVCache
from .weights import Weights, check_weights


def mlp_block(x: torch.Tensor, w: Weights, layer_prefix: str, cfg: ModelConfig, layer_index: int,
              lora: LoraRows | None = None, fused: torch.Tensor | None = None) -> torch.Tensor:
    """Feed-forward of the layer under `layer_prefix` (e.g. "layers.3" or "mtp.layers.0") on x [..., D]:
    `{layer_prefix}.mlp` SwiGLU or `{layer_prefix}.moe` sparse MoE, by cfg.mlp_kind(layer_index), with
    the batch's adapters (`lora`, specs/lora.md §18.2); `fused`: a dense MLP's fused gate/up
    packing (fused.py), taken when the batch has no adapters."""
    if cfg.mlp_kind(layer_index) == "moe":
        return sparse_moe(x, w, f"{layer_prefix}.moe", cfg, lora)
    if fused is not None and lora is None:
        return swiglu(x, fused, w[f"{layer_prefix}.mlp.down_proj"])
    return swiglu_mlp(x, w, f"{layer_prefix}.mlp", lora)


@dataclass
class RowBatch:
    """A right-padded batch of rows for B sequences: row (b, t) is token tokens[b, t] at positions[b, t].

    valid [B, T] marks real rows; write_index [N] holds the flat KV-cache index of each valid row in
    row-major order; block_tables [B, nb] map positions to blocks; slots [B] pick GDN state rows.
    uniform promises that every row is valid (all B sequences have T rows): attention may then take
    the paged Triton kernels (see kernel_paths.py). gdn_keep_rows None asks the GDN layers for the
    state after every row (a verify); a sorted tuple of rows asks for those states only (a forward
    whose rows are all committed: gdn_layer then takes the chunked form).

    Optional host-built extras (the engine fills them; a batch without them takes the shape-static
    paths): valid_rows [N] the flat indices b * T + t of the valid rows (the K/V write then needs no
    boolean mask); attn the per-entry key plan (attn_plan.py: attention reads each sequence's keys
    where they lie instead of a padded gather); logit_rows [R] the flat indices of the only rows
    whose logits are wanted (a prefill reads one row of hundreds: the LM head is the largest
    matrix of a small model). gdn_in_place (one row per sequence, all committed: a decode) makes the
    GDN layers update the slots' states in the state cache as they run (gdn_layer's in_place), the
    one exception to the invariant below. gdn_keep: gdn_keep_rows' plan with its index tensors,
    sent with the batch's other inputs in its one copy (gdn_chunked.KeepIndex; a batch without it
    gets one per forward, specs/async.md §16.2). lora: the adapted rows of a batch where a sequence
    has a LoRA adapter (None otherwise: the forward is the base model's, specs/lora.md §18.2).
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    write_index: torch.Tensor
    block_tables: torch.Tensor
    slots: torch.Tensor
    uniform: bool = False
    gdn_keep_rows: tuple[int, ...] | None = None
    valid_rows: torch.Tensor | None = None
    attn: AttnPlan | None = None
    logit_rows: torch.Tensor | None = None
    gdn_in_place: bool = False
    gdn_keep: KeepIndex | None = None
    lora: LoraRows | None = None


@dataclass
class ForwardOutput:
    """hidden [B, T, D] (pre final norm), logits [B, T, V] (or [R, V] for the batch's logit_rows), per
    GDN layer the per-row states, and the residual stream after each requested decoder layer (see
    the module docstring)."""

    hidden: torch.Tensor
    logits: torch.Tensor
    gdn_rows: list[GdnRows]
    layer_hidden: dict[int, torch.Tensor] = field(default_factory=dict)


class HybridModel:
    """Weights plus the forward pass; holds no per-sequence state."""

    def __init__(self, cfg: ModelConfig, weights: Weights) -> None:
        check_weights(weights, cfg)
        self.cfg = cfg
        # same names and shapes (moe.fuse_shared_experts); projections packed for AMX on a bf16 CPU
        self.w = pack_for_cpu(fuse_shared_experts(weights, cfg), cfg)
        # q/k/v(/gate) and gate/up packings fused per block, self.w's entries views of them (fused.py)
        self.fused = fuse_projections(self.w, cfg)
        # a dense model's decode layers in one C call where every kernel is loaded (decode_layers.py)
        self.stack = LayerStack(cfg, self.w, self.fused)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings [..., D] of token ids [...]."""
        return embed_rows(self.w["embed"], tokens)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [..., V] of pre-norm hidden states [..., D] (final RMSNorm then LM head)."""
        return linear(rms_norm(hidden, self.w["final_norm"], self.cfg.rms_norm_eps), self.w["lm_head"])

    def forward(self, batch: RowBatch, kv: PagedKVCache, gdn: GdnStateCache,
                capture_layers: tuple[int, ...] = ()) -> ForwardOutput:
        """Run all layers over `batch`; K/V of valid rows land in `kv`, GDN states are only returned.

        capture_layers: decoder layer ids (0-based) whose output hidden states to return in
        ForwardOutput.layer_hidden; each must be in [0, num_layers).
        """
        cfg, w = self.cfg, self.w
        bad = [i for i in capture_layers if not 0 <= i < cfg.num_layers]
        if bad:
            raise ValueError(f"capture_layers {bad} outside [0, num_layers={cfg.num_layers})")
        h = self.embed(batch.tokens)
        # every attention layer ropes at the batch's positions: the tables once, inside the forward
        # (a captured forward must compute them itself, specs/async.md §16.4)
        rope = model_rope_tables(batch.positions, cfg, h.dtype) if cfg.attn_layers else None
        keep = batch.gdn_keep
        if keep is None and batch.gdn_keep_rows is not None:  # the states' indices, once for every GDN layer
            keep = KeepPlan.of(batch.gdn_keep_rows, batch.tokens.shape[1]).send(batch.tokens.device)
        gdn_rows: list[GdnRows] = []
        layer_hidden: dict[int, torch.Tensor] = {}
        gdn_index = attn_index = 0
        lora = batch.lora
        fused = self.fused
        last = cfg.num_layers - 1
        x = rms_norm(h, w["layers.0.input_norm"], cfg.rms_norm_eps) if cfg.num_layers else h
        whole = rope is not None and self.stack.takes(batch, kv, h, capture_layers)
        if whole:
            assert rope is not None
            h = self.stack.run(batch, kv, h, x, rope)
        for i, kind in enumerate(() if whole else cfg.layer_pattern):
            if kind == "gdn":
                if batch.gdn_in_place:
                    out, rows = gdn_layer(x, w, f"layers.{i}.gdn", cfg, None, None,
                                          in_place=(gdn.recurrent[gdn_index], gdn.conv[gdn_index], batch.slots),
                                          lora=lora)
                else:
                    out, rows = gdn_layer(x, w, f"layers.{i}.gdn", cfg,
                                          gdn.recurrent[gdn_index].index_select(0, batch.slots),
                                          gdn.conv[gdn_index].index_select(0, batch.slots), batch.gdn_keep_rows,
                                          keep_index=keep, lora=lora)
                gdn_rows.append(rows)
                gdn_index += 1
            else:
                out = attention_layer(x, w, f"layers.{i}.attn", cfg=cfg, cache=kv, cache_layer=attn_index,
                                      positions=batch.positions, valid=batch.valid,
                                      write_index=batch.write_index, block_tables=batch.block_tables,
                                      uniform=batch.uniform, valid_rows=batch.valid_rows, plan=batch.attn,
                                      rope=rope, lora=lora, fused=fused.get(f"layers.{i}.attn"))
                attn_index += 1
            # each residual add and the norm after it in one pass (fused.add_norm: the same bits)
            h, x = add_norm(h, out, w[f"layers.{i}.post_norm"], cfg.rms_norm_eps)
            out = mlp_block(x, w, f"layers.{i}", cfg, i, lora, fused.get(f"layers.{i}.mlp"))
            if i == last:
                h = h + out
            else:
                h, x = add_norm(h, out, w[f"layers.{i + 1}.input_norm"], cfg.rms_norm_eps)
            if i in capture_layers:
                layer_hidden[i] = h
        read = h if batch.logit_rows is None else h.reshape(-1, h.shape[-1]).index_select(0, batch.logit_rows)
        return ForwardOutput(hidden=h, logits=self.lm_head(read), gdn_rows=gdn_rows, layer_hidden=layer_hidden)
