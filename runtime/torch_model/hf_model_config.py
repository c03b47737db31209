"""A Hugging Face checkpoint's config.json (and generation_config.json) read into a ModelConfig,
for the architectures of ARCHITECTURES (hf_checkpoint.py's module docstring lists them); a
defect is a ModelDirError naming the file and the field.

Dense vs MoE feed-forward per layer: Qwen3.5-MoE all MoE; Qwen3-Next MoE unless the layer is in
`mlp_only_layers` or (i + 1) % decoder_sparse_step != 0 (or num_experts == 0); MTP layer j follows
the rule at index j (cfg.mlp_kind). Qwen3.5-MoE always renormalises its top-k weights.

RoPE: `rope_type` must be "default". Qwen3.5's interleaved M-RoPE, for text (the three position
components equal), is exactly plain RoPE over rotary_dim = head_dim * partial_rotary_factor.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import structlog

from .config import DTYPES, ModelConfig
from .errors import ConfigError, ModelDirError
from .hf_shards import _read_json, _Shards

log = structlog.get_logger("fxsched.torch_model.hf_checkpoint")  # the checkpoint loader's events

# architecture -> family
ARCHITECTURES: dict[str, str] = {
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3ForCausalLM": "qwen3",
}
HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")  # GDN + gated attention, zero-centred norms
DEFAULT_MAX_SEQ_LEN = 4096


def _text_config(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    text = raw.get("text_config")
    if text is None:
        return raw
    if not isinstance(text, dict):
        raise ModelDirError(path, f"field 'text_config': expected an object, got {text!r}")
    return text


def _family(raw: dict[str, Any], path: Path) -> str:
    archs = raw.get("architectures")
    supported = ", ".join(ARCHITECTURES)
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise ModelDirError(path, f"field 'architectures': expected a list naming one of: {supported}")
    if archs[0] not in ARCHITECTURES:
        raise ModelDirError(path, f"unknown architecture '{archs[0]}' (supported: {supported})")
    return ARCHITECTURES[archs[0]]


class _Fields:
    """Typed reads of config fields; a defect is a ModelDirError naming config.json and the field."""

    def __init__(self, text: dict[str, Any], outer: dict[str, Any], path: Path) -> None:
        self.text, self.outer, self.path = text, outer, path

    def get(self, name: str, default: Any = None) -> Any:
        if name in self.text and self.text[name] is not None:
            return self.text[name]
        if self.outer is not self.text and self.outer.get(name) is not None:
            return self.outer[name]
        return default

    def need(self, name: str, kind: type, default: Any = ...) -> Any:
        value = self.get(name, default)
        if value is ...:
            raise ModelDirError(self.path, f"missing field '{name}'")
        ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
        if kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            value = float(value) if ok else value
        if not ok:
            raise ModelDirError(self.path, f"field '{name}': expected {kind.__name__}, got {value!r}")
        return value


def _rope(fields: _Fields, family: str) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) from rope_parameters or the legacy top-level keys."""
    params = fields.get("rope_parameters") or fields.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ModelDirError(fields.path, f"field 'rope_parameters': expected an object, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ModelDirError(fields.path, f"rope_type '{rope_type}' is not supported (only 'default')")
    default_factor = 0.25 if family in HYBRID_FAMILIES else 1.0  # transformers' defaults
    theta = params.get("rope_theta", fields.get("rope_theta", 10000.0))
    factor = params.get("partial_rotary_factor", fields.get("partial_rotary_factor", default_factor))
    for name, value in (("rope_theta", theta), ("partial_rotary_factor", factor)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ModelDirError(fields.path, f"field '{name}': expected a number, got {value!r}")
    return float(theta), float(factor)


def _layer_kinds(fields: _Fields, family: str, num_layers: int) -> tuple[str, ...]:
    types = fields.get("layer_types")
    if types is None:
        if family == "qwen3":
            types = ["full_attention"] * num_layers
        else:
            interval = fields.need("full_attention_interval", int, 4)
            if interval < 1:
                raise ModelDirError(fields.path, f"field 'full_attention_interval': expected a positive integer, "
                                                 f"got {interval}")
            types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    mapping = {"linear_attention": "gdn", "full_attention": "attn"}
    if family == "qwen3":
        mapping.pop("linear_attention")
    if not isinstance(types, list) or len(types) != num_layers or any(t not in mapping for t in types):
        raise ModelDirError(fields.path, f"field 'layer_types': expected {num_layers} entries from "
                                         f"{sorted(mapping)}, got {types!r}")
    return tuple(mapping[t] for t in types)


def _mlp_pattern(fields: _Fields, family: str, num_layers: int) -> tuple[str, ...]:
    if family == "qwen3_5_moe":
        return ("moe",) * num_layers
    if family != "qwen3_next":
        return ()
    experts = fields.need("num_experts", int, 0)
    step = fields.need("decoder_sparse_step", int, 1)
    only = fields.get("mlp_only_layers", [])
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in only):
        raise ModelDirError(fields.path, f"field 'mlp_only_layers': expected a list of layer ids, got {only!r}")
    if step < 1:
        raise ModelDirError(fields.path, f"field 'decoder_sparse_step': expected a positive integer, got {step}")
    pattern = tuple("moe" if i not in only and experts > 0 and (i + 1) % step == 0 else "dense"
                    for i in range(num_layers))
    return pattern if "moe" in pattern else ()


def _eos(root: Path, fields: _Fields) -> tuple[int, tuple[int, ...]]:
    gen = _read_json(root / "generation_config.json", required=False) or {}
    value = gen.get("eos_token_id")
    source = root / "generation_config.json"
    if value is None:
        value, source = fields.get("eos_token_id"), fields.path
    ids = value if isinstance(value, list) else [value]
    if value is None or not ids or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise ModelDirError(source if value is not None else fields.path,
                            f"field 'eos_token_id': expected a token id or a list of them, got {value!r}"
                            if value is not None else
                            "no eos_token_id in generation_config.json or config.json")
    return ids[0], tuple(ids[1:])


def _build_config(raw: dict[str, Any], text: dict[str, Any], family: str, path: Path, root: Path,
                  shards: "_Shards", dtype: str | None, max_seq_len: int | None, num_blocks: int | None,
                  runtime: dict[str, int]) -> ModelConfig:
    f = _Fields(text, raw, path)
    if f.get("attention_bias", False):
        raise ModelDirError(path, "attention_bias: true is not supported (attention projections have no bias)")
    act = f.get("hidden_act", "silu")
    if act != "silu":
        raise ModelDirError(path, f"hidden_act '{act}' is not supported (only 'silu')")
    if family == "qwen3" and f.get("use_sliding_window", False):
        raise ModelDirError(path, "use_sliding_window: true is not supported (full attention only)")
    num_layers = f.need("num_hidden_layers", int)
    hidden, heads = f.need("hidden_size", int), f.need("num_attention_heads", int)
    theta, factor = _rope(f, family)
    kinds = _layer_kinds(f, family, num_layers)
    mlp_pattern = _mlp_pattern(f, family, num_layers)
    moe = family in ("qwen3_5_moe", "qwen3_next")
    values: dict[str, Any] = {
        "architecture": str(raw["architectures"][0]),
        "vocab_size": f.need("vocab_size", int), "hidden_size": hidden, "num_layers": num_layers,
        "layer_pattern": kinds, "num_attention_heads": heads,
        "num_kv_heads": f.need("num_key_value_heads", int, heads),
        "head_dim": f.need("head_dim", int, hidden // heads if heads else 0),
        "rope_theta": theta, "partial_rotary_factor": factor,
        "rms_norm_eps": f.need("rms_norm_eps", float, 1e-6),
        "tie_word_embeddings": f.need("tie_word_embeddings", bool, False),
        "attn_output_gate": family in HYBRID_FAMILIES, "qk_norm": True,
        "mlp_pattern": mlp_pattern, "mtp": False, "dflash_gamma": 0, "seed": 0,
    }
    if "tie_word_embeddings" in raw and raw is not text:  # the outer config governs a composite model
        values["tie_word_embeddings"] = _Fields(raw, raw, path).need("tie_word_embeddings", bool)
    if family in HYBRID_FAMILIES:
        values.update({
            "gdn_num_heads": f.need("linear_num_key_heads", int),
            "gdn_num_v_heads": f.need("linear_num_value_heads", int),
            "gdn_key_dim": f.need("linear_key_head_dim", int),
            "gdn_value_dim": f.need("linear_value_head_dim", int),
            "conv_width": f.need("linear_conv_kernel_dim", int, 4),
        })
    if moe:
        values.update({
            "num_experts": f.need("num_experts", int), "num_experts_per_tok": f.need("num_experts_per_tok", int),
            "moe_intermediate_size": f.need("moe_intermediate_size", int),
            "shared_expert_intermediate_size": f.need("shared_expert_intermediate_size", int, 0),
            "norm_topk_prob": True if family == "qwen3_5_moe" else f.need("norm_topk_prob", bool, True),
        })
    intermediate = f.get("intermediate_size")
    if intermediate is None and family == "qwen3_5_moe":  # no dense layer exists; any positive size
        intermediate = values["moe_intermediate_size"]
    values["intermediate_size"] = intermediate if intermediate is not None else f.need("intermediate_size", int)
    values["eos_id"], values["eos_ids"] = _eos(root, f)
    values["dtype"] = _dtype(dtype, f)
    values["mtp_layers"] = _mtp_layers(f, family, shards)
    max_pos = f.need("max_position_embeddings", int, DEFAULT_MAX_SEQ_LEN)
    values.update(_runtime_sizes(max_seq_len if max_seq_len is not None else min(max_pos, DEFAULT_MAX_SEQ_LEN),
                                 num_blocks, runtime))
    try:
        return ModelConfig.from_dict(values)
    except ConfigError as err:
        if err.field in ("max_seq_len", "max_slots", "block_size", "num_blocks"):
            raise  # an argument of load_pretrained, not the checkpoint, is wrong
        raise ModelDirError(path, f"unsupported or invalid model settings: {err}") from None


def _runtime_sizes(max_seq_len: int, num_blocks: int | None, runtime: dict[str, int]) -> dict[str, int]:
    """The cache geometry from load_pretrained's arguments (ConfigError naming a bad one)."""
    sizes = {"max_seq_len": max_seq_len, **runtime}
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(name, "a positive integer", value)
    per_seq = -(-max_seq_len // sizes["block_size"])
    sizes["num_blocks"] = sizes["max_slots"] * per_seq if num_blocks is None else num_blocks
    return sizes


def _dtype(requested: str | None, f: _Fields) -> str:
    if requested is not None:
        if requested not in DTYPES:
            raise ConfigError("dtype", f"one of {DTYPES}", requested)
        return requested
    value = f.get("dtype", f.get("torch_dtype"))
    if value is None:
        return "float32"
    if value not in DTYPES:
        raise ModelDirError(f.path, f"field 'dtype': {value!r} is not supported (one of {DTYPES}); pass dtype=")
    return str(value)


def _mtp_layers(f: _Fields, family: str, shards: "_Shards") -> int:
    present = {int(m.group(1)) for name in shards.names if (m := re.match(r"mtp\.layers\.(\d+)\.", name))}
    has_mtp = any(name.startswith("mtp.") for name in shards.names)
    declared = f.get("mtp_num_hidden_layers", f.get("num_nextn_predict_layers"))
    if family not in HYBRID_FAMILIES or not has_mtp:
        if declared:
            log.info("mtp_tensors_absent", declared=declared, note="checkpoint has no mtp.* tensors; mtp_layers=0")
        return 0
    if declared is None:
        return max(present) + 1 if present else 0
    if isinstance(declared, bool) or not isinstance(declared, int) or declared < 0:
        raise ModelDirError(f.path, f"field 'mtp_num_hidden_layers': expected a non-negative integer, got {declared!r}")
    return declared


__all__ = ["ARCHITECTURES"]
