"""Load Hugging Face checkpoints (config.json + safetensors shards) into the canonical layout.

Supported architectures (config.json `architectures[0]`), complete as transformers 5.23 defines them:

* Qwen3_5ForCausalLM / Qwen3_5ForConditionalGeneration (text model only; a nested `text_config` is
  used, `model.language_model.` names are accepted, `model.visual.*` tensors are skipped);
* Qwen3_5MoeForCausalLM / Qwen3_5MoeForConditionalGeneration (likewise);
* Qwen3NextForCausalLM; Qwen3ForCausalLM.

The loader's parts: hf_shards.py (the directory's files: JSON files, safetensors shards read
lazily), hf_model_config.py (config.json -> ModelConfig), hf_convert.py (the tensors converted
to the canonical names of weights.py) and its inverse, hf_export.py (a model written as a
checkpoint).

Expert shards (specs/expert-parallel.md §10.2): `load_pretrained(..., expert_shard=(rank, world))`
keeps of each MoE layer (decoder and MTP) only rank's contiguous range of experts (moe.expert_bounds)
in an `ExpertShard`, with `ShardedExperts` placeholders under the stacked names; every other tensor is
loaded whole. Only the rows of the range are read (a slice of a fused tensor, or the range's
per-expert tensors; the other experts' tensors are checked for shape, never read), so a rank's peak
memory is its share. `load_expert_shards(dir, rank, world)` reads nothing but that range (what an
expert-parallel worker holds).

Every defect raises ModelDirError naming the file: the directory, config.json, the index or a shard
(a tensor holding NaN or infinite values is one: it names the shard and the tensor).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import structlog
import torch

from .config import ModelConfig
from .errors import ConfigError, ModelDirError
from .hf_convert import _Converter
from .hf_model_config import _build_config, _family, _text_config
from .hf_shards import _read_json, _Shards
from .moe import ExpertShard, expert_bounds, moe_prefixes
from .weights import Weights, check_weights, torch_dtype

log = structlog.get_logger("fxsched.torch_model.hf_checkpoint")

DEFAULT_KV_CACHE_MEMORY = 4 * 1024 ** 3  # the KV budget without --kv-cache-memory (vLLM's CPU default too)


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


__all__ = ["load_expert_shards", "load_pretrained"]
