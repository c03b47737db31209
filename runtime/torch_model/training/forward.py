"""Differentiable full-sequence forwards of the target, its MTP module and a DFlash drafter.

The engine's forward (model.py) runs over paged caches and slot states; training needs the same
arithmetic over whole sequences with gradients. These forwards are built from the engine's own
blocks (the GDN projections and output of gdn.py, the chunked gated delta rule of gdn_chunked.py,
attention_qkv / attention_out / masked_attention, mlp_block and ops), so a trained weight means in
the engine exactly what it meant here; tests/test_training.py checks the logits of each against
the engine (HybridEngine prefill, PublishedMtp, PublishedDFlash) on the same weights.

Every sequence starts from zero GDN and conv states at position 0 (a fresh slot).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..attention import attention_out, attention_qkv, masked_attention, model_rope_tables, rope_tables, apply_rope
from ..config import ModelConfig
from ..gdn import _output as gdn_output
from ..gdn import _project as gdn_project
from ..gdn_chunked import chunked_gated_delta
from ..hf_drafters import DFlashSpec
from ..model import mlp_block
from ..ops import embed_rows, linear, rms_norm, swiglu_mlp

Weights = dict[str, torch.Tensor]


def target_hidden(cfg: ModelConfig, w: Weights, tokens: torch.Tensor,
                  capture: Sequence[int] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """(hidden [B, T, D] after the last layer, pre final norm; {layer: its output [B, T, D]} for
    the layers in `capture`) of token rows [B, T] at positions 0..T-1."""
    b, t = tokens.shape
    positions = torch.arange(t, device=tokens.device)[None].expand(b, t)
    rope = model_rope_tables(positions, cfg, torch.float32) if cfg.attn_layers else None
    causal = torch.tril(torch.ones(t, t, dtype=torch.bool, device=tokens.device))[None].expand(b, t, t)
    conv_channels = 2 * cfg.gdn_num_heads * cfg.gdn_key_dim + cfg.gdn_v_heads * cfg.gdn_value_dim
    h = embed_rows(w["embed"], tokens)
    kept: dict[int, torch.Tensor] = {}
    for i, kind in enumerate(cfg.layer_pattern):
        p = f"layers.{i}"
        x = rms_norm(h, w[f"{p}.input_norm"], cfg.rms_norm_eps)
        if kind == "gdn":
            conv0 = x.new_zeros(b, conv_channels, cfg.conv_width - 1)
            q, k, v, log_decay, beta, _ = gdn_project(x, w, f"{p}.gdn", cfg, conv0)
            state0 = x.new_zeros(b, cfg.gdn_v_heads, cfg.gdn_key_dim, cfg.gdn_value_dim)
            o, _, _ = chunked_gated_delta(q, k, v, log_decay, beta, state0)
            out = gdn_output(o, x, w, f"{p}.gdn", cfg)
        else:
            q, k, v, gate = attention_qkv(x, w, f"{p}.attn", cfg, positions, rope)
            out = attention_out(masked_attention(q, k, v, causal), gate, w, f"{p}.attn")
        h = h + out
        h = h + mlp_block(rms_norm(h, w[f"{p}.post_norm"], cfg.rms_norm_eps), w, p, cfg, i)
        if i in capture:
            kept[i] = h
    return h, kept


def target_logits(cfg: ModelConfig, w: Weights, hidden: torch.Tensor) -> torch.Tensor:
    """Logits [..., V] of pre-norm hidden rows (the engine's HybridModel.lm_head)."""
    return linear(rms_norm(hidden, w["final_norm"], cfg.rms_norm_eps), w["lm_head"])


def mtp_chain_logits(cfg: ModelConfig, w: Weights, next_tokens: torch.Tensor, hidden: torch.Tensor,
                     chain_tokens: Sequence[torch.Tensor] = ()) -> list[torch.Tensor]:
    """Logits [B, T, V] of the published MTP module at depths 1..1+len(chain_tokens).

    Row i (position i) at depth 1 reads the target's hidden row hidden[:, i] (pre final norm, as
    engine.hidden_history) and the token next_tokens[:, i] = t_{i+1}; at depth k >= 2 it reads its
    own depth k-1 output and chain_tokens[k-2][:, i] at position i+k-1. Attention: depth-1 rows are
    causal among themselves; a depth-k row i also sees the depth 2..k rows of the same i: exactly
    the cache rows PublishedMtp's chain sees when drafts 1..k-1 were right. PublishedMtp's
    propose_logits at an anchor row n-1 with drafts d equals row n-1 here with
    chain_tokens[k-2][:, n-1] = d_{k-1}.
    """
    eps, p = cfg.rms_norm_eps, "mtp.layers.0"
    b, t = next_tokens.shape
    device = next_tokens.device
    rows = torch.arange(t, device=device)
    causal = rows[None, :] <= rows[:, None]  # [T, T]: depth-1 keys of query row i
    same = torch.eye(t, dtype=torch.bool, device=device)  # deeper keys: the query's own row i
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    cond = rms_norm(hidden, w["final_norm"], eps)
    out: list[torch.Tensor] = []
    for depth, tokens in enumerate([next_tokens, *chain_tokens]):
        positions = (rows + depth)[None, :].expand(b, t)
        z = linear(torch.cat([rms_norm(embed_rows(w["embed"], tokens), w["mtp.embed_norm"], eps),
                              rms_norm(cond, w["mtp.hidden_norm"], eps)], dim=-1), w["mtp.fc"])
        q, k, v, gate = attention_qkv(rms_norm(z, w[f"{p}.input_norm"], eps), w, f"{p}.attn", cfg, positions)
        keys.append(k)
        values.append(v)
        allowed = torch.cat([causal] + [same] * depth, dim=1)[None].expand(b, t, t * (depth + 1))
        attn = masked_attention(q, torch.cat(keys, dim=1), torch.cat(values, dim=1), allowed)
        h = z + attention_out(attn, gate, w, f"{p}.attn")
        h = h + mlp_block(rms_norm(h, w[f"{p}.post_norm"], eps), w, p, cfg, 0)
        cond = rms_norm(h, w["mtp.final_norm"], eps)
        out.append(linear(cond, w["lm_head"]))
    return out


def dflash_features(cfg: ModelConfig, spec: DFlashSpec, w_target: Weights, dw: Weights,
                    layer_outputs: dict[int, torch.Tensor]) -> torch.Tensor:
    """Context features [B, T, D] (PublishedDFlash.features of the engine's captured rows: the last
    target layer's output through final_norm, the others as they are)."""
    last = cfg.num_layers - 1
    rows = [rms_norm(layer_outputs[i], w_target["final_norm"], cfg.rms_norm_eps) if i == last else layer_outputs[i]
            for i in spec.target_layer_ids]
    return rms_norm(linear(torch.cat(rows, dim=-1), dw["fc"]), dw["hidden_norm"], spec.rms_norm_eps)


def _heads(x: torch.Tensor, n: int, d: int) -> torch.Tensor:
    return x.view(*x.shape[:-1], n, d)


def dflash_block_logits(spec: DFlashSpec, dw: Weights, feats: torch.Tensor, tokens: torch.Tensor,
                        anchors: torch.Tensor) -> torch.Tensor:
    """Draft logits [B, K, block_size - 1, V] of K blocks per sequence, all in one forward.

    feats [B, L, D]: the context features of positions 0..L-1; tokens [B, L]; anchors [B, K]: the
    position n of each block's anchor token t_n. Block k runs [t_n, mask x (block_size - 1)] at
    positions n.. against the context rows < n (PublishedDFlash.propose_logits with ctx_len n):
    its rows see the context and the rows of their own block (causally if spec.causal), never
    another block's. Row i >= 1 predicts the token at position n + i.
    """
    s, eps = spec, spec.rms_norm_eps
    b, length, _ = feats.shape
    k_blocks, t = anchors.shape[1], s.block_size
    device = feats.device
    ids = torch.full((b, k_blocks, t), s.mask_token_id, dtype=torch.long, device=device)
    ids[:, :, 0] = tokens.gather(1, anchors)
    x = embed_rows(dw["embed"], ids.reshape(b, k_blocks * t)) * s.input_embedding_scale  # [B, K*T, D]
    block_pos = (anchors[:, :, None] + torch.arange(t, device=device)).reshape(b, k_blocks * t)
    ctx_pos = torch.arange(length, device=device)[None].expand(b, length)
    ctx_ok = torch.arange(length, device=device)[None, None, :] < anchors[:, :, None]  # [B, K, L]
    ctx_ok = ctx_ok[:, :, None, :].expand(b, k_blocks, t, length).reshape(b, k_blocks * t, length)
    inner = torch.ones(t, t, dtype=torch.bool, device=device)
    if s.causal:
        inner = torch.tril(inner)
    same = torch.eye(k_blocks, dtype=torch.bool, device=device)
    block_ok = (same[:, None, :, None] & inner[None, :, None, :]).reshape(k_blocks * t, k_blocks * t)
    allowed = torch.cat([ctx_ok, block_ok[None].expand(b, -1, -1)], dim=2)
    ctx_rope = rope_tables(ctx_pos, s.rope_theta, s.head_dim, feats.dtype)
    block_rope = rope_tables(block_pos, s.rope_theta, s.head_dim, x.dtype)

    def proj(v: torch.Tensor, name: str) -> torch.Tensor:
        out = linear(v, dw[name])
        bias = dw.get(f"{name}.bias")
        return out + bias if bias is not None else out

    def kv(v: torch.Tensor, j: int, pos: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
        p = f"layers.{j}.self_attn"
        k = rms_norm(_heads(proj(v, f"{p}.k_proj"), s.num_kv_heads, s.head_dim), dw[f"{p}.k_norm"], eps)
        return apply_rope(k, pos, s.rope_theta, tables=rope), _heads(proj(v, f"{p}.v_proj"), s.num_kv_heads, s.head_dim)

    for j in range(s.num_layers):
        p = f"layers.{j}"
        ck, cv = kv(feats, j, ctx_pos, ctx_rope)
        r = rms_norm(x, dw[f"{p}.input_layernorm"], eps)
        q = rms_norm(_heads(proj(r, f"{p}.self_attn.q_proj"), s.num_heads, s.head_dim), dw[f"{p}.self_attn.q_norm"], eps)
        q = apply_rope(q, block_pos, s.rope_theta, tables=block_rope)
        bk, bv = kv(r, j, block_pos, block_rope)
        attn = masked_attention(q, torch.cat([ck, bk], dim=1), torch.cat([cv, bv], dim=1), allowed)
        x = x + proj(attn.reshape(b, k_blocks * t, -1), f"{p}.self_attn.o_proj")
        x = x + swiglu_mlp(rms_norm(x, dw[f"{p}.post_attention_layernorm"], eps), dw, f"{p}.mlp")
    x = x.view(b, k_blocks, t, -1)[:, :, 1:]
    return linear(rms_norm(x, dw["norm"], eps), dw["lm_head"])
