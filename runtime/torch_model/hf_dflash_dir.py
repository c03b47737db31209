"""A DFlash drafter directory (the public DFlash format): its config.json validated against the
target model into a `DFlashSpec`, its safetensors read and checked against the drafter's shapes, and
the drafter (hf_drafters.PublishedDFlash, whose module docstring describes it) built over them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch

from .config import ModelConfig
from .errors import ModelDirError
from .hf_drafters import DFlashSpec, PublishedDFlash, Weights

DFLASH_ARCHITECTURES = ("DFlashDraftModel",)
DEFAULT_BLOCK_SIZE = 16  # z-lab's default when neither dflash_config nor the top level name one
DEFAULT_DRAFT_ROPE_THETA = 1_000_000.0  # vLLM's default for DFlash drafters without a rope theta


def _bad(path: Path, problem: str) -> ModelDirError:
    return ModelDirError(str(path), problem)


def _read_config(draft_dir: Path) -> dict[str, Any]:
    if not draft_dir.is_dir():
        raise _bad(draft_dir, "not a directory (expected a DFlash drafter directory with config.json)")
    path = draft_dir / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise _bad(draft_dir, "no config.json (expected a DFlash drafter directory)") from None
    except (OSError, UnicodeDecodeError) as err:
        raise _bad(path, f"unreadable ({err.__class__.__name__}: {err})") from None
    except json.JSONDecodeError as err:
        raise _bad(path, f"not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise _bad(path, "expected a JSON object")
    return data


def _int(path: Path, data: Mapping[str, Any], name: str, default: int | None = None, minimum: int = 1) -> int:
    value = data.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _bad(path, f"field '{name}': expected an integer >= {minimum}, got {value!r}")
    return value


def _float(path: Path, data: Mapping[str, Any], name: str, default: float) -> float:
    value = data.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise _bad(path, f"field '{name}': expected a positive number, got {value!r}")
    return float(value)


def parse_dflash_config(draft_dir: Path, data: Mapping[str, Any], target_num_layers: int,
                        target_hidden: int, target_vocab: int) -> DFlashSpec:
    """Validate a drafter config.json (public DFlash format) against the target model."""
    path = draft_dir / "config.json"
    archs = data.get("architectures")
    if archs is not None and (not isinstance(archs, list) or not any(a in DFLASH_ARCHITECTURES for a in archs)):
        raise _bad(path, f"architectures {archs!r} is not a DFlash drafter (expected one of {list(DFLASH_ARCHITECTURES)})")
    extra = data.get("dflash_config", {})
    if not isinstance(extra, dict):
        raise _bad(path, f"field 'dflash_config': expected an object, got {extra!r}")
    merged = {**data, **extra}  # z-lab reads dflash_config first, then the top level
    for name in ("conv_kernel_size", "selector_rank", "selector_top_k"):
        if name in merged:
            raise _bad(path, f"field '{name}': DFlash2 drafters (dynamic convolutions, candidate selector) "
                             f"are not supported")
    layer_types = data.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        raise _bad(path, f"field 'layer_types': only full_attention drafter layers are supported, got {layer_types!r}")
    if merged.get("use_swa"):
        raise _bad(path, "field 'use_swa': sliding-window drafter layers are not supported")
    act = data.get("hidden_act", "silu")
    if act != "silu":
        raise _bad(path, f"field 'hidden_act': only 'silu' is supported, got {act!r}")
    rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise _bad(path, f"field 'rope_parameters': expected an object, got {rope!r}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in (None, "default"):
        raise _bad(path, f"field 'rope_parameters': rope type {rope_type!r} is not supported (only 'default')")
    theta = rope.get("rope_theta", data.get("rope_theta", DEFAULT_DRAFT_ROPE_THETA))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise _bad(path, f"field 'rope_theta': expected a positive number, got {theta!r}")
    if "target_layer_ids" not in merged:
        raise _bad(path, "no dflash_config.target_layer_ids (which target layers feed the drafter)")
    ids = merged["target_layer_ids"]
    if (not isinstance(ids, list) or not ids
            or any(isinstance(i, bool) or not isinstance(i, int) for i in ids)):
        raise _bad(path, f"field 'target_layer_ids': expected a non-empty list of integers, got {ids!r}")
    outside = [i for i in ids if not 0 <= i < target_num_layers]
    if outside:
        raise _bad(path, f"field 'target_layer_ids': layers {outside} are outside the target's "
                         f"{target_num_layers} layers [0, {target_num_layers})")
    if "mask_token_id" not in merged:
        raise _bad(path, "no dflash_config.mask_token_id (the token of the block's masked rows)")
    mask = merged["mask_token_id"]
    if isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask < target_vocab:
        raise _bad(path, f"field 'mask_token_id': expected a token id in [0, {target_vocab}), got {mask!r}")
    hidden = _int(path, data, "hidden_size")
    if hidden != target_hidden:
        raise _bad(path, f"field 'hidden_size': the drafter's {hidden} differs from the target's {target_hidden}")
    target_hidden_decl = data.get("target_hidden_size", target_hidden)
    if target_hidden_decl != target_hidden:
        raise _bad(path, f"field 'target_hidden_size': {target_hidden_decl!r} differs from the target's {target_hidden}")
    vocab = data.get("vocab_size", target_vocab)
    if vocab != target_vocab:
        raise _bad(path, f"field 'vocab_size': the drafter's {vocab!r} differs from the target's {target_vocab}")
    heads = _int(path, data, "num_attention_heads")
    kv_heads = _int(path, data, "num_key_value_heads", heads)
    if heads % kv_heads:
        raise _bad(path, f"field 'num_key_value_heads': {kv_heads} does not divide num_attention_heads={heads}")
    head_dim = data.get("head_dim") or hidden // heads
    head_dim = _int(path, {"head_dim": head_dim}, "head_dim")
    if head_dim % 2:
        raise _bad(path, f"field 'head_dim': expected an even integer (rotary pairs), got {head_dim}")
    causal = data.get("is_causal")  # vLLM's order: is_causal, then dflash_config.causal, else non-causal
    if causal is None:
        causal = extra.get("causal", False)
    if not isinstance(causal, bool):
        raise _bad(path, f"field 'causal': expected a boolean, got {causal!r}")
    bias = data.get("attention_bias", False)
    if not isinstance(bias, bool):
        raise _bad(path, f"field 'attention_bias': expected a boolean, got {bias!r}")
    return DFlashSpec(
        num_layers=_int(path, data, "num_hidden_layers"), hidden_size=hidden, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=_int(path, data, "intermediate_size"),
        rms_norm_eps=_float(path, data, "rms_norm_eps", 1e-6), rope_theta=float(theta),
        block_size=_int(path, merged, "block_size", DEFAULT_BLOCK_SIZE, minimum=2),
        target_layer_ids=tuple(ids), mask_token_id=mask, causal=causal, attention_bias=bias,
        input_embedding_scale=_float(path, merged, "input_embedding_scale", 1.0),
    )


def dflash_param_shapes(spec: DFlashSpec, num_target_features: int) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the drafter's own tensors (Qwen3 layer names, without the `.weight` suffix)."""
    d, hq, hkv, dh, inter = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"fc": (d, num_target_features * d), "hidden_norm": (d,)}
    for j in range(spec.num_layers):
        p = f"layers.{j}"
        shapes.update({
            f"{p}.input_layernorm": (d,), f"{p}.post_attention_layernorm": (d,),
            f"{p}.self_attn.q_proj": (hq * dh, d), f"{p}.self_attn.k_proj": (hkv * dh, d),
            f"{p}.self_attn.v_proj": (hkv * dh, d), f"{p}.self_attn.o_proj": (d, hq * dh),
            f"{p}.self_attn.q_norm": (dh,), f"{p}.self_attn.k_norm": (dh,),
            f"{p}.mlp.gate_proj": (inter, d), f"{p}.mlp.up_proj": (inter, d), f"{p}.mlp.down_proj": (d, inter),
        })
        if spec.attention_bias:
            shapes.update({f"{p}.self_attn.q_proj.bias": (hq * dh,), f"{p}.self_attn.k_proj.bias": (hkv * dh,),
                           f"{p}.self_attn.v_proj.bias": (hkv * dh,), f"{p}.self_attn.o_proj.bias": (d,)})
    shapes["norm"] = (d,)
    return shapes


def _read_safetensors(draft_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    index = draft_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise _bad(index, f"not a safetensors index ({err.__class__.__name__}: {err})") from None
        files = [draft_dir / s for s in shards]
    else:
        files = sorted(draft_dir.glob("*.safetensors"))
    if not files:
        raise _bad(draft_dir, "no *.safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except (OSError, SafetensorError, ValueError) as err:
            raise _bad(f, f"unreadable safetensors file ({err.__class__.__name__}: {err})") from None
    return tensors


def _canonical_drafter_names(raw: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the `.weight` suffix (biases keep `.bias`) and a leading `model.`; skip rotary buffers."""
    out: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name.startswith("model."):
            name = name[len("model."):]
        if name.endswith(".weight"):
            name = name[:-len(".weight")]
        out[name] = t
    return out


def load_dflash_drafter(draft_dir: str | Path, target_cfg: ModelConfig, target_weights: Weights,
                        device: str | torch.device = "cpu") -> "PublishedDFlash":
    """The drafter of a DFlash directory for the given target (its config and canonical weights).

    The directory holds config.json (a Qwen3 config with `block_size`, `dflash_config:
    {target_layer_ids, mask_token_id}`) and safetensors with `fc`, `hidden_norm`, `layers.*` (Qwen3
    layer names) and `norm`; `embed_tokens` / `lm_head`, when present, replace the target's. Any
    defect raises ModelDirError naming the directory (or file) and the problem.
    """
    draft_dir = Path(draft_dir)
    data = _read_config(draft_dir)
    spec = parse_dflash_config(draft_dir, data, target_cfg.num_layers, target_cfg.hidden_size, target_cfg.vocab_size)
    tensors = _canonical_drafter_names(_read_safetensors(draft_dir))
    own_embed = tensors.pop("embed_tokens", None)
    own_head = tensors.pop("lm_head", None)
    expected = dflash_param_shapes(spec, len(spec.target_layer_ids))
    missing = sorted(set(expected) - set(tensors))
    if missing:
        shown = ", ".join(missing[:4]) + (f" (+{len(missing) - 4} more)" if len(missing) > 4 else "")
        raise _bad(draft_dir, f"missing drafter tensors: {shown}")
    extra = sorted(set(tensors) - set(expected))
    if extra:
        shown = ", ".join(extra[:4]) + (f" (+{len(extra) - 4} more)" if len(extra) > 4 else "")
        raise _bad(draft_dir, f"unexpected tensors for a DFlash drafter: {shown}")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            got = tuple(tensors[name].shape)
            if name == "fc":
                raise _bad(draft_dir, f"tensor 'fc' has shape {list(got)}, expected {list(shape)} "
                                      f"({len(spec.target_layer_ids)} target layers x hidden size {spec.hidden_size})")
            raise _bad(draft_dir, f"tensor '{name}' has shape {list(got)}, expected {list(shape)}")
    vd = (target_cfg.vocab_size, spec.hidden_size)
    for name, t in (("embed_tokens", own_embed), ("lm_head", own_head)):
        if t is not None and tuple(t.shape) != vd:
            raise _bad(draft_dir, f"tensor '{name}' has shape {list(t.shape)}, expected {list(vd)}")
    dtype = target_weights["embed"].dtype  # as the target's weights: 1-D tensors float32, matrices its dtype
    w = {n: t.to(device=device, dtype=torch.float32 if t.dim() == 1 else dtype) for n, t in tensors.items()}
    w["embed"] = own_embed.to(device=device, dtype=dtype) if own_embed is not None else target_weights["embed"]
    w["lm_head"] = own_head.to(device=device, dtype=dtype) if own_head is not None else target_weights["lm_head"]
    return PublishedDFlash(spec, w, target_cfg.max_slots, target_cfg.max_seq_len, device)
