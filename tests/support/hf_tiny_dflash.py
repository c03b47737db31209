"""Tiny DFlash drafter directories in the public format (z-lab/dflash, vLLM's qwen3_dflash), random weights.

A directory holds config.json (a Qwen3 config plus `block_size` and `dflash_config:
{target_layer_ids, mask_token_id}`) and model.safetensors with `fc.weight` [D, len(ids) * D],
`hidden_norm.weight`, `layers.{j}.*` in Qwen3 decoder-layer names and `norm.weight`; embeddings
and lm_head are the target's. `write_tiny_dflash_for` sizes one for a target checkpoint directory.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors.torch import save_file


def dflash_config(*, hidden_size: int, vocab_size: int, num_target_layers: int,
                  target_layer_ids: Sequence[int] = (1, 2), block_size: int = 4, num_layers: int = 1,
                  num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16, intermediate_size: int = 96,
                  mask_token_id: int | None = None, rope_theta: float = 1_000_000.0,
                  causal: bool | None = None) -> dict[str, Any]:
    """The config.json of a tiny drafter (mask token: the last id of the vocabulary by default;
    causal: dflash_config.causal, absent by default, i.e. a non-causal block as published)."""
    config: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": block_size,
        "dflash_config": {"mask_token_id": vocab_size - 1 if mask_token_id is None else mask_token_id,
                          "target_layer_ids": list(target_layer_ids)},
        "hidden_size": hidden_size, "intermediate_size": intermediate_size, "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads, "head_dim": head_dim,
        "hidden_act": "silu", "attention_bias": False, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": rope_theta, "rope_type": "default"},
        "vocab_size": vocab_size, "num_target_layers": num_target_layers, "max_position_embeddings": 4096,
        "tie_word_embeddings": False, "dtype": "float32",
    }
    if causal is not None:
        config["dflash_config"]["causal"] = causal
    return config


def dflash_tensors(config: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights (seeded) for a drafter config, in the checkpoint's tensor names."""
    gen = torch.Generator().manual_seed(seed)
    d, inter = config["hidden_size"], config["intermediate_size"]
    hq, hkv, dh = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    n_feat = len(config["dflash_config"]["target_layer_ids"])

    def mat(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) / math.sqrt(cols)

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=gen)

    out = {"fc.weight": mat(d, n_feat * d), "hidden_norm.weight": norm(d)}
    for j in range(config["num_hidden_layers"]):
        p = f"layers.{j}"
        out.update({
            f"{p}.input_layernorm.weight": norm(d), f"{p}.post_attention_layernorm.weight": norm(d),
            f"{p}.self_attn.q_proj.weight": mat(hq * dh, d), f"{p}.self_attn.k_proj.weight": mat(hkv * dh, d),
            f"{p}.self_attn.v_proj.weight": mat(hkv * dh, d), f"{p}.self_attn.o_proj.weight": mat(d, hq * dh),
            f"{p}.self_attn.q_norm.weight": norm(dh), f"{p}.self_attn.k_norm.weight": norm(dh),
            f"{p}.mlp.gate_proj.weight": mat(inter, d), f"{p}.mlp.up_proj.weight": mat(inter, d),
            f"{p}.mlp.down_proj.weight": mat(d, inter),
        })
    out["norm.weight"] = norm(d)
    return out


def write_tiny_dflash(path: str | Path, config: dict[str, Any], seed: int = 0,
                      tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """Write config.json and model.safetensors (random weights unless `tensors` is given)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    weights = dflash_tensors(config, seed) if tensors is None else tensors
    save_file({n: t.contiguous() for n, t in weights.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    return path


def target_sizes(target_dir: str | Path) -> dict[str, Any]:
    """hidden_size, vocab_size and num_target_layers of an HF checkpoint dir (text_config if nested)."""
    data = json.loads((Path(target_dir) / "config.json").read_text(encoding="utf-8"))
    text = data.get("text_config", data)
    return {"hidden_size": text["hidden_size"], "vocab_size": text["vocab_size"],
            "num_target_layers": text["num_hidden_layers"]}


def write_tiny_dflash_for(path: str | Path, target_dir: str | Path, seed: int = 0, **kwargs: Any) -> Path:
    """A tiny drafter directory sized for the target checkpoint in `target_dir`."""
    return write_tiny_dflash(path, dflash_config(**target_sizes(target_dir), **kwargs), seed)
