"""Load Hugging Face checkpoints (config.json + safetensors shards) into the canonical layout.

Supported architectures (config.json `architectures[0]`), complete as transformers 5.23 defines them:

* Qwen3_5ForCausalLM / Qwen3_5ForConditionalGeneration (text model only; a nested `text_config` is
  used, `model.language_model.` names are accepted, `model.visual.*` tensors are skipped);
* Qwen3_5MoeForCausalLM / Qwen3_5MoeForConditionalGeneration (likewise);
* Qwen3NextForCausalLM; Qwen3ForCausalLM.

Conversion to the canonical names of weights.py (the forward only knows those):

* zero-centred RMSNorms (`(1 + w) * x_hat`: every norm of the Qwen3.5 / Qwen3-Next families except
  the GDN output norm, whose weight is plain) become plain weights `1 + w`, added in fp32;
* gated attention: HF's q_proj [Hq * 2 * Dh, D] holds, per head, Dh query rows then Dh gate rows;
  they split into `attn.q_proj` and `attn.gate_proj`;
* GDN: Qwen3.5's in_proj_qkv rows split into q / k / v (conv channel order), in_proj_z -> g_proj;
  Qwen3-Next's in_proj_qkvz is laid out per key head as [q (Dk), k (Dk), v (r*Dv), z (r*Dv)] and
  in_proj_ba as [b (r), a (r)] with r = Hv / Hk; they are un-interleaved so that value head
  j = key head * r + i, the order transformers' fix_query_key_value_ordering produces;
  `conv1d.weight` [C, 1, W] -> `conv` [C, W];
* MoE: per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight` (what save_pretrained writes and real
  checkpoints ship) or transformers' fused in-memory `mlp.experts.gate_up_proj` [E, 2I, D] /
  `mlp.experts.down_proj` [E, D, I] are stacked into [E, ...] tensors; `mlp.gate` -> `moe.router`;
* published MTP tensors (`mtp.*`, dropped by transformers) map to `mtp.*` canonical names; if a
  checkpoint has none, the model gets mtp_layers = 0.

Expert shards (specs/expert-parallel.md §10.2): `load_pretrained(..., expert_shard=(rank, world))`
keeps of each MoE layer (decoder and MTP) only rank's contiguous range of experts (moe.expert_bounds)
in an `ExpertShard`, with `ShardedExperts` placeholders under the stacked names; every other tensor is
loaded whole. Only the rows of the range are read (a slice of a fused tensor, or the range's
per-expert tensors; the other experts' tensors are checked for shape, never read), so a rank's peak
memory is its share. `load_expert_shards(dir, rank, world)` reads nothing but that range (what an
expert-parallel worker holds).

Dense vs MoE feed-forward per layer: Qwen3.5-MoE all MoE; Qwen3-Next MoE unless the layer is in
`mlp_only_layers` or (i + 1) % decoder_sparse_step != 0 (or num_experts == 0); MTP layer j follows
the rule at index j (cfg.mlp_kind). Qwen3.5-MoE always renormalises its top-k weights.

RoPE: `rope_type` must be "default". Qwen3.5's interleaved M-RoPE, for text (the three position
components equal), is exactly plain RoPE over rotary_dim = head_dim * partial_rotary_factor.

Every defect raises ModelDirError naming the file: the directory, config.json, the index or a shard
(a tensor holding NaN or infinite values is one: it names the shard and the tensor).

Export (`save_pretrained_dir`, `hf_config`, `hf_tensors`): the inverse of the conversion, kept here so
this module stays the one place that knows checkpoint names; Qwen3_5ForCausalLM (dense) only, which
is what the embedded default model (default_model.py) ships. load_pretrained of an export gives the
same config (up to runtime sizes) and bit-identical weights.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import torch
from safetensors import SafetensorError, safe_open

from .config import DTYPES, ModelConfig
from .errors import ConfigError, ModelDirError, read_json_object
from .moe import ExpertShard, expert_bounds, moe_prefixes
from .weights import Weights, check_weights, param_dtype, param_shapes, torch_dtype
from .st_read import read_whole

log = structlog.get_logger("fxsched.torch_model.hf_checkpoint")

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
DEFAULT_KV_CACHE_MEMORY = 4 * 1024 ** 3  # the KV budget without --kv-cache-memory (vLLM's CPU default too)
INDEX_FILE = "model.safetensors.index.json"
_VISION_PREFIXES = ("model.visual.", "visual.")  # a Qwen3.5 composite checkpoint's vision tower: skipped


def load_pretrained(model_dir: str | Path, *, device: str | torch.device = "cpu", dtype: str | None = None,
                    max_seq_len: int | None = None, max_slots: int = 16, num_blocks: int | None = None,
                    block_size: int = 16, expert_shard: tuple[int, int] | None = None,
                    kv_cache_memory: int | None = None) -> tuple[ModelConfig, Weights]:
    """(config, canonical weights on `device`) of the checkpoint in `model_dir`.

    dtype: "float32" / "bfloat16" / "float16" (default: the checkpoint's `dtype` / `torch_dtype`, else
    float32). Runtime sizes: max_seq_len (default min(max_position_embeddings, 4096)), max_slots,
    block_size, and the KV cache's blocks: num_blocks, or as many as kv_cache_memory bytes hold
    (`cache_sizes`, which also lowers max_slots to what the budget holds; default: enough for every
    slot at max_seq_len, within DEFAULT_KV_CACHE_MEMORY).
    expert_shard: (rank, world) keeps only rank's experts of each MoE layer (see the module
    docstring; a model without MoE layers, or world 1, loads whole). More ranks than experts per
    layer raise ConfigError (field 'expert_shard').
    """
    root, cfg, family, shards = _open(model_dir, dtype, max_seq_len, max_slots, num_blocks, block_size)
    if num_blocks is None:
        slots, blocks = cache_sizes(cfg, kv_cache_memory)
        if slots < cfg.max_slots:
            log.info("slots_fit_the_kv_budget", max_slots=cfg.max_slots, slots=slots, kv_cache_memory=kv_cache_memory)
        cfg = dataclasses.replace(cfg, max_slots=slots, num_blocks=blocks)
    elif kv_cache_memory is not None:
        raise ConfigError("kv_cache_memory", "no value when num_blocks is given", kv_cache_memory)
    converter = _Converter(cfg, family, shards, _bounds(cfg, expert_shard), device)
    weights = converter.convert()
    check_weights(weights, cfg, str(root))  # the converter's output is complete by construction
    moved = {n: t.to(device) for n, t in weights.items()}  # (a shard's placeholders are on `device` already)
    if cfg.tie_word_embeddings:
        moved["lm_head"] = moved["embed"]
    log.debug("loaded_checkpoint", path=str(root), architecture=cfg.architecture, dtype=cfg.dtype,
              tensors=len(moved), mtp_layers=cfg.mtp_layers, expert_shard=expert_shard)
    return cfg, moved


def pretrained_config(model_dir: str | Path, *, dtype: str | None = None, max_seq_len: int | None = None,
                      max_slots: int = 16, num_blocks: int | None = None, block_size: int = 16) -> ModelConfig:
    """The ModelConfig `load_pretrained` would build for `model_dir` (same arguments; num_blocks
    None: every slot at max_seq_len), without reading a weight: e.g. to allocate a model of the
    checkpoint's shapes on the meta device (tests/test_qwen3_next_80b_meta.py)."""
    return _open(model_dir, dtype, max_seq_len, max_slots, num_blocks, block_size)[1]


def kv_block_bytes(cfg: ModelConfig) -> int:
    """Bytes of one KV block: keys and values of block_size positions in every attention layer."""
    itemsize = torch.empty(0, dtype=torch_dtype(cfg)).element_size()
    return len(cfg.attn_layers) * 2 * cfg.block_size * cfg.num_kv_heads * cfg.head_dim * itemsize


def cache_sizes(cfg: ModelConfig, kv_cache_memory: int | None) -> tuple[int, int]:
    """(slots, KV blocks) for a cache budget in bytes (as vLLM's kv_cache_memory_bytes).

    The budget holds everything a sequence keeps on the device: its KV blocks and, in a model with
    GDN layers, its recurrent and conv state (cfg.gdn_state_bytes a slot, as vLLM counts a Mamba
    layer's state in its KV cache). Slots: cfg.max_slots, or fewer where the budget cannot give each
    one its state and a sequence of max_seq_len; the blocks are the rest of the budget, at least one
    sequence of max_seq_len (ConfigError 'kv_cache_memory' otherwise). Without a budget: every slot
    and every slot's blocks at max_seq_len, but no more blocks than DEFAULT_KV_CACHE_MEMORY holds (a
    reservation for the worst case would be 7 GiB for a 1 GiB model at 16 slots x 4096 tokens; the
    scheduler queues or preempts when the blocks run out, as in vLLM)."""
    per_block = kv_block_bytes(cfg)
    one_sequence = -(-cfg.max_seq_len // cfg.block_size)
    if kv_cache_memory is None:
        if per_block == 0:  # no attention layer: the pool only counts positions
            return cfg.max_slots, cfg.max_slots * one_sequence
        return cfg.max_slots, max(one_sequence, min(cfg.max_slots * one_sequence, DEFAULT_KV_CACHE_MEMORY // per_block))
    if isinstance(kv_cache_memory, bool) or not isinstance(kv_cache_memory, int) or kv_cache_memory < 1:
        raise ConfigError("kv_cache_memory", "a positive number of bytes", kv_cache_memory)
    state = cfg.gdn_state_bytes
    need = state + one_sequence * per_block
    if kv_cache_memory < need:
        held = f"{one_sequence} blocks of {per_block} bytes" + (f" and {state} bytes of GDN state" if state else "")
        raise ConfigError("kv_cache_memory", f"at least {need} bytes ({held}: one sequence of max_seq_len "
                                             f"{cfg.max_seq_len})", kv_cache_memory)
    slots = min(cfg.max_slots, kv_cache_memory // need) if state else cfg.max_slots
    rest = kv_cache_memory - slots * state
    return slots, (rest // per_block if per_block else slots * one_sequence)


def load_expert_shards(model_dir: str | Path, rank: int, world: int, *, device: str | torch.device = "cpu",
                       dtype: str | None = None) -> tuple[ModelConfig, list[ExpertShard]]:
    """(config, rank's `ExpertShard` of every MoE layer in moe_prefixes order) of the checkpoint in
    `model_dir`, reading no other tensor (an expert-parallel worker's share). Raises ModelDirError
    for a bad directory, ConfigError (field 'expert_shard') for a bad (rank, world) or a model
    without MoE layers."""
    _, cfg, family, shards = _open(model_dir, dtype, None, 1, None, 16)
    bounds = _bounds(cfg, (rank, world))
    if bounds is None:
        raise ConfigError("expert_shard", "a model with MoE layers and world > 1", (rank, world))
    return cfg, _Converter(cfg, family, shards, bounds, device).expert_layers()


def _bounds(cfg: ModelConfig, expert_shard: tuple[int, int] | None) -> tuple[int, int, int, int] | None:
    """(rank, world, first expert, count) of a shard request; None: load every expert."""
    if expert_shard is None:
        return None
    ok = (isinstance(expert_shard, tuple) and len(expert_shard) == 2
          and all(isinstance(v, int) and not isinstance(v, bool) for v in expert_shard))
    if not ok or not 0 <= expert_shard[0] < expert_shard[1]:
        raise ConfigError("expert_shard", "(rank, world) with 0 <= rank < world", expert_shard)
    rank, world = expert_shard
    if world == 1 or not moe_prefixes(cfg):
        return None
    if world > cfg.num_experts:
        raise ConfigError("expert_shard", f"at most {cfg.num_experts} ranks ({cfg.num_experts} experts per MoE layer, "
                                          f"at least one per rank)", expert_shard)
    first, count = expert_bounds(cfg.num_experts, world)[rank]
    return rank, world, first, count


def _open(model_dir: str | Path, dtype: str | None, max_seq_len: int | None, max_slots: int,
          num_blocks: int | None, block_size: int) -> tuple[Path, ModelConfig, str, "_Shards"]:
    """(root, config, family, shards) of a checkpoint directory (ModelDirError for a defect)."""
    root = Path(model_dir)
    if not root.exists():
        raise ModelDirError(root, "no such model directory")
    if not root.is_dir():
        raise ModelDirError(root, "not a directory (expected a checkpoint directory holding config.json)")
    config_path = root / "config.json"
    raw = _read_json(config_path, required=True)
    assert raw is not None  # required=True raises instead
    text = _text_config(raw, config_path)
    family = _family(raw, config_path)
    shards = _Shards.open(root)
    runtime = {"max_slots": max_slots, "block_size": block_size}
    cfg = _build_config(raw, text, family, config_path, root, shards, dtype, max_seq_len, num_blocks, runtime)
    return root, cfg, family, shards


# ---- config ------------------------------------------------------------------------------------

def _read_json(path: Path, required: bool) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise ModelDirError(path, "missing (a checkpoint directory needs config.json)")
        return None
    return read_json_object(path, ModelDirError)


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


# ---- shards ------------------------------------------------------------------------------------

@dataclass
class _Shards:
    """The checkpoint's tensors by name (lazily read), and which file holds each."""

    root: Path
    files: dict[str, Path]  # tensor name -> shard path
    handles: dict[Path, Any] = field(default_factory=dict)
    listing: Path | None = None  # the file that lists the tensors (index), for "missing" errors

    @property
    def names(self) -> list[str]:
        return list(self.files)

    @classmethod
    def open(cls, root: Path) -> "_Shards":
        index_path = root / INDEX_FILE
        index = _read_json(index_path, required=False)
        weight_map: dict[str, str] = {}
        if index is not None:
            weight_map = index.get("weight_map")  # type: ignore[assignment]  # checked just below
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ModelDirError(index_path, "field 'weight_map': expected an object of tensor name -> shard file")
            paths = sorted({root / v for v in weight_map.values()})
            for p in paths:
                if not p.is_file():
                    raise ModelDirError(p, f"missing shard (listed in {INDEX_FILE})")
        else:
            paths = sorted(root.glob("*.safetensors"))
            if not paths:
                raise ModelDirError(root, "no *.safetensors weight files")
        shards = cls(root, {}, listing=index_path if index is not None else
                     (paths[0] if len(paths) == 1 else root))
        for p in paths:
            try:
                handle = safe_open(str(p), framework="pt")
                keys = list(handle.keys())
            except (SafetensorError, OSError, ValueError, RuntimeError) as err:
                raise ModelDirError(p, f"unreadable safetensors shard ({err})") from None
            shards.handles[p] = handle
            for k in keys:
                if k in shards.files:
                    raise ModelDirError(p, f"tensor '{k}' also stored in {shards.files[k].name}")
                shards.files[k] = p
        for name, shard in weight_map.items():
            if name not in shards.files:
                raise ModelDirError(root / shard, f"missing tensor '{name}' (listed in {INDEX_FILE})")
        return shards

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.handles[self.files[name]].get_slice(name).get_shape())

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor `name`, or with rows=(first, count) only those rows of its first dimension."""
        try:
            handle = self.handles[self.files[name]]
            whole = read_whole(self.files[name], name) if rows is None else None  # no mapped pages held
            if whole is not None:
                tensor = whole
            elif rows is None:
                tensor = handle.get_tensor(name)
            else:
                tensor = handle.get_slice(name)[rows[0]:rows[0] + rows[1]]
        except (SafetensorError, OSError, ValueError, RuntimeError) as err:
            raise ModelDirError(self.files[name], f"tensor '{name}' unreadable ({err})") from None
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):  # silent garbage otherwise
            raise ModelDirError(self.files[name], f"tensor '{name}' holds NaN or infinite values")
        return tensor


# ---- conversion --------------------------------------------------------------------------------

class _Converter:
    """Builds the canonical weights of `cfg` from the checkpoint, tracking which tensors it used."""

    def __init__(self, cfg: ModelConfig, family: str, shards: _Shards,
                 bounds: tuple[int, int, int, int] | None = None, device: str | torch.device = "cpu") -> None:
        self.cfg, self.family, self.shards = cfg, family, shards
        self.zero_centred = family in HYBRID_FAMILIES
        self.used: set[str] = set()
        self.alias = self._aliases()
        self.out: Weights = {}
        self.expected = param_shapes(cfg)
        self.bounds = bounds  # (rank, world, first expert, count) of an expert shard, else None
        self.device = device
        self.layer_ids = {prefix: i for i, prefix in enumerate(moe_prefixes(cfg))}
        self.expert_shards: list[ExpertShard] = []

    def _aliases(self) -> dict[str, str]:
        """Checkpoint-name -> stored-name for text models saved under model.language_model."""
        alias: dict[str, str] = {}
        prefix = "model.language_model."
        for name in self.shards.names:
            if name.startswith(prefix):
                alias["model." + name[len(prefix):]] = name
        return alias

    # -- reading --
    def has(self, name: str) -> bool:
        return name in self.shards.files or name in self.alias

    def take(self, name: str, shape: tuple[int, ...], rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor `name` of `shape` (only `rows` = (first, count) of its first dimension, if given)."""
        stored = self._check(name, shape)
        return self.shards.read(stored, rows)

    def skip(self, name: str, shape: tuple[int, ...]) -> None:
        """Tensor `name` is there with `shape` and belongs to the model, but is not read."""
        self._check(name, shape)

    def _check(self, name: str, shape: tuple[int, ...]) -> str:
        stored = name if name in self.shards.files else self.alias.get(name)
        if stored is None:
            raise ModelDirError(self.shards.listing or self.shards.root, f"missing tensor '{name}'")
        got = self.shards.shape(stored)
        if got != tuple(shape):
            raise ModelDirError(self.shards.files[stored],
                                f"tensor '{stored}' has shape {list(got)}, expected {list(shape)}")
        self.used.add(stored)
        return stored

    def put(self, name: str, tensor: torch.Tensor) -> None:
        shape = self.expected[name]
        self.out[name] = tensor.reshape(shape).to(param_dtype(name, self.cfg)).contiguous()

    def norm(self, canonical: str, name: str, size: int, zero_centred: bool | None = None) -> None:
        t = self.take(name, (size,)).float()
        if self.zero_centred if zero_centred is None else zero_centred:
            t = t + 1.0  # (1 + w) * x_hat -> a plain multiplicative weight, in fp32
        self.put(canonical, t)

    def copy(self, canonical: str, name: str) -> None:
        self.put(canonical, self.take(name, self.expected[canonical]))

    # -- whole model --
    def convert(self) -> Weights:
        cfg, d = self.cfg, self.cfg.hidden_size
        self.copy("embed", "model.embed_tokens.weight")
        for i, kind in enumerate(cfg.layer_pattern):
            src, dst = f"model.layers.{i}", f"layers.{i}"
            self.norm(f"{dst}.input_norm", f"{src}.input_layernorm.weight", d)
            if kind == "gdn":
                self.gdn(f"{dst}.gdn", f"{src}.linear_attn")
            else:
                self.attention(f"{dst}.attn", f"{src}.self_attn")
            self.norm(f"{dst}.post_norm", f"{src}.post_attention_layernorm.weight", d)
            self.ffn(dst, f"{src}.mlp", i)
        self.norm("final_norm", "model.norm.weight", d)
        if cfg.tie_word_embeddings:
            if self.has("lm_head.weight"):  # some tied checkpoints still ship a copy: accept it
                self.take("lm_head.weight", (cfg.vocab_size, d))
            self.out["lm_head"] = self.out["embed"]
        else:
            self.copy("lm_head", "lm_head.weight")
        if cfg.mtp_layers:
            self.mtp()
        self._reject_unused()
        return self.out

    def _reject_unused(self) -> None:
        for name in self.shards.names:
            if name in self.used or (self.family in ("qwen3_5", "qwen3_5_moe") and name.startswith(_VISION_PREFIXES)):
                continue
            if name.startswith("mtp.") and not self.cfg.mtp_layers:
                continue
            raise ModelDirError(self.shards.files[name],
                                f"unexpected tensor '{name}' (not part of {self.cfg.architecture} as configured)")

    def attention(self, dst: str, src: str) -> None:
        cfg, d = self.cfg, self.cfg.hidden_size
        hq, dh = cfg.num_attention_heads, cfg.head_dim
        if cfg.attn_output_gate:  # per head: Dh query rows, then Dh gate rows
            q = self.take(f"{src}.q_proj.weight", (hq * 2 * dh, d)).view(hq, 2, dh, d)
            self.put(f"{dst}.q_proj", q[:, 0])
            self.put(f"{dst}.gate_proj", q[:, 1])
        else:
            self.copy(f"{dst}.q_proj", f"{src}.q_proj.weight")
        for proj in ("k_proj", "v_proj", "o_proj"):
            self.copy(f"{dst}.{proj}", f"{src}.{proj}.weight")
        if cfg.qk_norm:
            self.norm(f"{dst}.q_norm", f"{src}.q_norm.weight", dh)
            self.norm(f"{dst}.k_norm", f"{src}.k_norm.weight", dh)

    def gdn(self, dst: str, src: str) -> None:
        cfg, d = self.cfg, self.cfg.hidden_size
        hk, hv, dk, dv = cfg.gdn_num_heads, cfg.gdn_v_heads, cfg.gdn_key_dim, cfg.gdn_value_dim
        if self.family == "qwen3_next":
            r = hv // hk
            qkvz = self.take(f"{src}.in_proj_qkvz.weight", (2 * hk * dk + 2 * hv * dv, d))
            q, k, v, z = torch.split(qkvz.view(hk, 2 * dk + 2 * r * dv, d), [dk, dk, r * dv, r * dv], dim=1)
            ba = self.take(f"{src}.in_proj_ba.weight", (2 * hv, d))
            b, a = torch.split(ba.view(hk, 2 * r, d), [r, r], dim=1)
            for name, t in (("q_proj", q), ("k_proj", k), ("v_proj", v), ("g_proj", z), ("b_proj", b), ("a_proj", a)):
                self.put(f"{dst}.{name}", t)
        else:
            qkv = self.take(f"{src}.in_proj_qkv.weight", (2 * hk * dk + hv * dv, d))
            q, k, v = torch.split(qkv, [hk * dk, hk * dk, hv * dv], dim=0)
            self.put(f"{dst}.q_proj", q)
            self.put(f"{dst}.k_proj", k)
            self.put(f"{dst}.v_proj", v)
            self.copy(f"{dst}.g_proj", f"{src}.in_proj_z.weight")
            self.copy(f"{dst}.b_proj", f"{src}.in_proj_b.weight")
            self.copy(f"{dst}.a_proj", f"{src}.in_proj_a.weight")
        self.put(f"{dst}.conv", self.take(f"{src}.conv1d.weight", (cfg.gdn_conv_channels, 1, cfg.conv_width))[:, 0, :])
        self.put(f"{dst}.A_log", self.take(f"{src}.A_log", (hv,)).float())
        self.put(f"{dst}.dt_bias", self.take(f"{src}.dt_bias", (hv,)).float())
        self.norm(f"{dst}.o_norm", f"{src}.norm.weight", dv, zero_centred=False)  # gated norm: plain weight
        self.copy(f"{dst}.o_proj", f"{src}.out_proj.weight")

    def ffn(self, dst: str, src: str, layer: int) -> None:
        if self.cfg.mlp_kind(layer) == "dense":
            for proj in ("gate_proj", "up_proj", "down_proj"):
                self.copy(f"{dst}.mlp.{proj}", f"{src}.{proj}.weight")
            return
        cfg = self.cfg
        dst = f"{dst}.moe"
        self.copy(f"{dst}.router", f"{src}.gate.weight")
        self.experts(dst, src)
        if cfg.shared_expert_intermediate_size:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                self.copy(f"{dst}.shared.{proj}", f"{src}.shared_expert.{proj}.weight")
            self.copy(f"{dst}.shared_gate", f"{src}.shared_expert_gate.weight")

    def experts(self, dst: str, src: str) -> None:
        """The stacked experts of MoE layer `dst` ("....moe") from the checkpoint's `src` ("....mlp"):
        every expert, or with a shard only its range (see the module docstring)."""
        cfg, d = self.cfg, self.cfg.hidden_size
        e, i = cfg.num_experts, cfg.moe_intermediate_size
        first, count = (0, e) if self.bounds is None else self.bounds[2:]
        rows = None if self.bounds is None else (first, count)
        parts: dict[str, torch.Tensor] = {}
        if self.has(f"{src}.experts.gate_up_proj"):  # transformers' fused in-memory layout
            gate_up = self.take(f"{src}.experts.gate_up_proj", (e, 2 * i, d), rows)
            parts = {"gate_proj": gate_up[:, :i], "up_proj": gate_up[:, i:],
                     "down_proj": self.take(f"{src}.experts.down_proj", (e, d, i), rows)}
        else:
            shapes: dict[str, tuple[int, ...]] = {"gate_proj": (i, d), "up_proj": (i, d), "down_proj": (d, i)}
            for proj, shape in shapes.items():
                names = [f"{src}.experts.{x}.{proj}.weight" for x in range(e)]
                for x, name in enumerate(names):
                    if not first <= x < first + count:
                        self.skip(name, shape)
                parts[proj] = torch.stack([self.take(name, shape) for name in names[first:first + count]])
        if self.bounds is None:
            for proj, t in parts.items():
                self.put(f"{dst}.{proj}", t)
            return
        local = {proj: t.to(param_dtype(f"{dst}.{proj}", cfg)).contiguous().to(self.device)
                 for proj, t in parts.items()}
        rank, world = self.bounds[:2]
        shard = ExpertShard(dst, self.layer_ids[dst], first, e, rank, world, local["gate_proj"], local["up_proj"],
                            local["down_proj"])
        self.expert_shards.append(shard)
        self.out.update(shard.placeholders())

    def expert_layers(self) -> list[ExpertShard]:
        """This shard of every MoE layer, nothing else read (load_expert_shards)."""
        for prefix in self.layer_ids:
            layer = prefix[: -len(".moe")]
            self.experts(prefix, f"{layer}.mlp" if layer.startswith("mtp.") else f"model.{layer}.mlp")
        return self.expert_shards

    def mtp(self) -> None:
        d = self.cfg.hidden_size
        self.copy("mtp.fc", "mtp.fc.weight")
        self.norm("mtp.embed_norm", "mtp.pre_fc_norm_embedding.weight", d)
        self.norm("mtp.hidden_norm", "mtp.pre_fc_norm_hidden.weight", d)
        for j in range(self.cfg.mtp_layers):
            src, dst = f"mtp.layers.{j}", f"mtp.layers.{j}"
            self.norm(f"{dst}.input_norm", f"{src}.input_layernorm.weight", d)
            self.attention(f"{dst}.attn", f"{src}.self_attn")
            self.norm(f"{dst}.post_norm", f"{src}.post_attention_layernorm.weight", d)
            self.ffn(dst, f"{src}.mlp", j)
        self.norm("mtp.final_norm", "mtp.norm.weight", d)


# ---- export (the inverse of the conversion, for the families the project writes) ------------------

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
    """The inverse of _Converter for Qwen3.5 dense (names and layouts as documented at the top)."""

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


__all__ = ["ARCHITECTURES", "EXPORT_ARCHITECTURES", "hf_config", "hf_tensors", "load_expert_shards",
           "load_pretrained", "save_pretrained_dir"]
