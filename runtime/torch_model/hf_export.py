"""Export (`save_pretrained_dir`, `hf_config`, `hf_tensors`): the inverse of the conversion of
hf_convert.py, kept beside it so that the checkpoint modules stay the one place that knows
checkpoint names; Qwen3_5ForCausalLM (dense) only, which is what the embedded default model
(default_model.py) ships. load_pretrained of an export gives the same config (up to runtime
sizes) and bit-identical weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .config import ModelConfig
from .weights import Weights, check_weights

EXPORT_ARCHITECTURES = ("Qwen3_5ForCausalLM",)
SAFETENSORS_FILE = "model.safetensors"


def hf_config(cfg: ModelConfig, *, max_position_embeddings: int | None = None) -> dict[str, Any]:
    """config.json of `cfg` as a Hugging Face checkpoint (the fields `load_pretrained` reads back
    into an equal config; runtime sizes are not part of it). Only EXPORT_ARCHITECTURES."""
    _check_exportable(cfg)
    half = cfg.rotary_dim // 2  # M-RoPE sections (t, h, w) split the rotary pairs as Qwen3.5's do
    section = [-(-half // 3), -(-half // 3), half - 2 * -(-half // 3)]
    kinds = {"gdn": "linear_attention", "attn": "full_attention"}
    return {
        "architectures": [cfg.architecture], "model_type": "qwen3_5_text",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "layer_types": [kinds[k] for k in cfg.layer_pattern],
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "attention_bias": False, "attention_dropout": 0.0, "hidden_act": "silu",
        "linear_num_key_heads": cfg.gdn_num_heads, "linear_num_value_heads": cfg.gdn_v_heads,
        "linear_key_head_dim": cfg.gdn_key_dim, "linear_value_head_dim": cfg.gdn_value_dim,
        "linear_conv_kernel_dim": cfg.conv_width, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                            "partial_rotary_factor": cfg.partial_rotary_factor,
                            "mrope_interleaved": True, "mrope_section": section},
        "max_position_embeddings": max_position_embeddings or cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_word_embeddings, "dtype": cfg.dtype,
        "bos_token_id": None, "eos_token_id": list(cfg.stop_ids) if cfg.eos_ids else cfg.eos_id, "pad_token_id": None,
        "mtp_num_hidden_layers": cfg.mtp_layers, "use_cache": True,
    }


def hf_tensors(cfg: ModelConfig, weights: Weights) -> dict[str, torch.Tensor]:
    """The checkpoint tensors (HF names, contiguous CPU copies) of canonical `weights`: the exact
    inverse of the conversion, so `load_pretrained` of them gives `weights` back bit for bit
    (norm weights c become c - 1, exact for c in [0.5, 2]). Only EXPORT_ARCHITECTURES."""
    _check_exportable(cfg)
    check_weights(weights, cfg)
    return _Exporter(cfg, weights).export()


def save_pretrained_dir(cfg: ModelConfig, weights: Weights, out_dir: str | Path, *,
                        max_position_embeddings: int | None = None) -> Path:
    """Write config.json and model.safetensors of `cfg` / `weights` into `out_dir` (created).

    Deterministic: the same inputs give byte-identical files (sorted JSON keys, fixed metadata).
    Tokenizer and generation_config.json are the caller's."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = hf_config(cfg, max_position_embeddings=max_position_embeddings)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    from safetensors.torch import save_file

    save_file(hf_tensors(cfg, weights), str(out / SAFETENSORS_FILE), metadata={"format": "pt"})
    return out


def _check_exportable(cfg: ModelConfig) -> None:
    if cfg.architecture not in EXPORT_ARCHITECTURES:
        raise ValueError(f"cannot export architecture {cfg.architecture!r} (supported: {', '.join(EXPORT_ARCHITECTURES)})")
    if cfg.mlp_pattern and "moe" in cfg.mlp_pattern:
        raise ValueError("cannot export MoE layers for Qwen3_5ForCausalLM (a dense family)")
    if not (cfg.attn_output_gate and cfg.qk_norm) or cfg.mtp or cfg.dflash_gamma:
        raise ValueError("a Qwen3.5 export needs gated attention, q/k norms and no internal drafters")


class _Exporter:
    """The inverse of _Converter for Qwen3.5 dense (names and layouts as hf_convert.py documents them)."""

    def __init__(self, cfg: ModelConfig, weights: Weights) -> None:
        self.cfg, self.w = cfg, weights
        self.out: dict[str, torch.Tensor] = {}

    def put(self, name: str, tensor: torch.Tensor) -> None:
        self.out[name] = tensor.detach().to("cpu").contiguous().clone()

    def norm(self, name: str, canonical: str, zero_centred: bool = True) -> None:
        t = self.w[canonical].float()
        self.put(name, t - 1.0 if zero_centred else t)

    def export(self) -> dict[str, torch.Tensor]:
        cfg = self.cfg
        self.put("model.embed_tokens.weight", self.w["embed"])
        for i, kind in enumerate(cfg.layer_pattern):
            src, dst = f"layers.{i}", f"model.layers.{i}"
            self.norm(f"{dst}.input_layernorm.weight", f"{src}.input_norm")
            if kind == "gdn":
                self.gdn(f"{dst}.linear_attn", f"{src}.gdn")
            else:
                self.attention(f"{dst}.self_attn", f"{src}.attn")
            self.norm(f"{dst}.post_attention_layernorm.weight", f"{src}.post_norm")
            self.mlp(f"{dst}.mlp", f"{src}.mlp")
        self.norm("model.norm.weight", "final_norm")
        if not cfg.tie_word_embeddings:
            self.put("lm_head.weight", self.w["lm_head"])
        if cfg.mtp_layers:
            self.put("mtp.fc.weight", self.w["mtp.fc"])
            self.norm("mtp.pre_fc_norm_embedding.weight", "mtp.embed_norm")
            self.norm("mtp.pre_fc_norm_hidden.weight", "mtp.hidden_norm")
            for j in range(cfg.mtp_layers):
                src = dst = f"mtp.layers.{j}"
                self.norm(f"{dst}.input_layernorm.weight", f"{src}.input_norm")
                self.attention(f"{dst}.self_attn", f"{src}.attn")
                self.norm(f"{dst}.post_attention_layernorm.weight", f"{src}.post_norm")
                self.mlp(f"{dst}.mlp", f"{src}.mlp")
            self.norm("mtp.norm.weight", "mtp.final_norm")
        return self.out

    def attention(self, dst: str, src: str) -> None:
        hq, dh, d = self.cfg.num_attention_heads, self.cfg.head_dim, self.cfg.hidden_size
        q = self.w[f"{src}.q_proj"].view(hq, 1, dh, d)
        gate = self.w[f"{src}.gate_proj"].view(hq, 1, dh, d)
        self.put(f"{dst}.q_proj.weight", torch.cat([q, gate], dim=1).reshape(hq * 2 * dh, d))
        for proj in ("k_proj", "v_proj", "o_proj"):
            self.put(f"{dst}.{proj}.weight", self.w[f"{src}.{proj}"])
        self.norm(f"{dst}.q_norm.weight", f"{src}.q_norm")
        self.norm(f"{dst}.k_norm.weight", f"{src}.k_norm")

    def gdn(self, dst: str, src: str) -> None:
        w = self.w
        self.put(f"{dst}.in_proj_qkv.weight", torch.cat([w[f"{src}.q_proj"], w[f"{src}.k_proj"], w[f"{src}.v_proj"]]))
        self.put(f"{dst}.in_proj_z.weight", w[f"{src}.g_proj"])
        self.put(f"{dst}.in_proj_b.weight", w[f"{src}.b_proj"])
        self.put(f"{dst}.in_proj_a.weight", w[f"{src}.a_proj"])
        self.put(f"{dst}.conv1d.weight", w[f"{src}.conv"][:, None, :])
        self.put(f"{dst}.A_log", w[f"{src}.A_log"])
        self.put(f"{dst}.dt_bias", w[f"{src}.dt_bias"])
        self.norm(f"{dst}.norm.weight", f"{src}.o_norm", zero_centred=False)  # the gated norm: plain weight
        self.put(f"{dst}.out_proj.weight", w[f"{src}.o_proj"])

    def mlp(self, dst: str, src: str) -> None:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            self.put(f"{dst}.{proj}.weight", self.w[f"{src}.{proj}"])


__all__ = ["EXPORT_ARCHITECTURES", "hf_config", "hf_tensors", "save_pretrained_dir"]
