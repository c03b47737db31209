"""Weight layout, deterministic seeded init, and safetensors save/load.

Invariant: `param_shapes(cfg)` is the single source of truth for tensor names and shapes;
`init_weights(cfg)` is a pure function of cfg (bit-identical across calls and processes), and
`load_weights` accepts a file only if it holds exactly those tensors with those shapes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from .config import ModelConfig
from .errors import ConfigError, WeightsError

Weights = dict[str, torch.Tensor]
CONFIG_METADATA_KEY = "fxsched_model_config"
# Std of the logits of the random model (after the final RMSNorm): large enough that greedy
# decoding is not dominated by ties and produces varied tokens.
LOGIT_STD = 4.0


def _mlp_shapes(prefix: str, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, i = cfg.hidden_size, cfg.intermediate_size
    return {f"{prefix}.gate_proj": (i, d), f"{prefix}.up_proj": (i, d), f"{prefix}.down_proj": (d, i)}


def _attn_shapes(prefix: str, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, hq, hkv, dh = cfg.hidden_size, cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim
    return {f"{prefix}.q_proj": (hq * dh, d), f"{prefix}.k_proj": (hkv * dh, d),
            f"{prefix}.v_proj": (hkv * dh, d), f"{prefix}.o_proj": (d, hq * dh)}


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of the model (target, MTP head, DFlash drafter), in init order."""
    d, v = cfg.hidden_size, cfg.vocab_size
    h, dk, dv = cfg.gdn_num_heads, cfg.gdn_key_dim, cfg.gdn_value_dim
    shapes: dict[str, tuple[int, ...]] = {"embed": (v, d)}
    for i, kind in enumerate(cfg.layer_pattern):
        p = f"layers.{i}"
        shapes[f"{p}.input_norm"] = (d,)
        if kind == "gdn":
            shapes.update({
                f"{p}.gdn.q_proj": (h * dk, d), f"{p}.gdn.k_proj": (h * dk, d),
                f"{p}.gdn.v_proj": (h * dv, d), f"{p}.gdn.a_proj": (h, d), f"{p}.gdn.b_proj": (h, d),
                f"{p}.gdn.g_proj": (h * dv, d), f"{p}.gdn.conv": (cfg.gdn_conv_channels, cfg.conv_width),
                f"{p}.gdn.A_log": (h,), f"{p}.gdn.dt_bias": (h,), f"{p}.gdn.o_norm": (dv,),
                f"{p}.gdn.o_proj": (d, h * dv),
            })
        else:
            shapes.update(_attn_shapes(f"{p}.attn", cfg))
        shapes[f"{p}.post_norm"] = (d,)
        shapes.update(_mlp_shapes(f"{p}.mlp", cfg))
    shapes["final_norm"] = (d,)
    shapes["lm_head"] = (v, d)
    if cfg.mtp:
        shapes.update({"mtp.hidden_norm": (d,), "mtp.embed_norm": (d,), "mtp.in_proj": (d, 2 * d),
                       "mtp.mlp_norm": (d,), **_mlp_shapes("mtp.mlp", cfg), "mtp.final_norm": (d,)})
    if cfg.dflash_gamma > 0:
        shapes.update({"dflash.ctx_proj": (d, d), "dflash.ctx_norm": (d,), "dflash.mask_embed": (d,)})
        for j in range(cfg.dflash_layers):
            p = f"dflash.layers.{j}"
            shapes[f"{p}.attn_norm"] = (d,)
            shapes.update(_attn_shapes(f"{p}.attn", cfg))
            shapes[f"{p}.mlp_norm"] = (d,)
            shapes.update(_mlp_shapes(f"{p}.mlp", cfg))
        shapes["dflash.final_norm"] = (d,)
    return shapes


def _init_tensor(name: str, shape: tuple[int, ...], cfg: ModelConfig, gen: torch.Generator) -> torch.Tensor:
    leaf = name.rsplit(".", 1)[-1]
    if leaf.endswith("norm"):
        return torch.ones(shape)
    if leaf in ("embed", "mask_embed"):
        return torch.randn(shape, generator=gen)
    if leaf == "lm_head":
        return torch.randn(shape, generator=gen) * (LOGIT_STD / math.sqrt(shape[1]))
    if leaf == "A_log":
        return torch.log(torch.empty(shape).uniform_(1.0, 16.0, generator=gen))
    if leaf == "dt_bias":
        dt = torch.exp(torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
        return dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    if leaf == "conv":
        return torch.randn(shape, generator=gen) / math.sqrt(shape[1])
    std = 1.0 / math.sqrt(shape[1])
    if leaf in ("o_proj", "down_proj"):  # residual branches: keep the stream's scale bounded
        std /= math.sqrt(2.0 * cfg.num_layers)
    return torch.randn(shape, generator=gen) * std


def init_weights(cfg: ModelConfig, device: str | torch.device = "cpu") -> Weights:
    """Seeded init: a CPU torch.Generator seeded with cfg.seed draws every tensor in param_shapes order.

    Invariant: same cfg -> bit-identical weights (drawn on CPU, then moved to `device`).
    """
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
    weights = {name: _init_tensor(name, shape, cfg, gen).to(torch.float32)
               for name, shape in param_shapes(cfg).items()}
    return {name: t.to(device) for name, t in weights.items()}


def check_weights(weights: Weights, cfg: ModelConfig, source: str = "<weights>") -> None:
    """Raise WeightsError unless `weights` holds exactly the tensors of param_shapes(cfg), fp32."""
    expected = param_shapes(cfg)
    missing = [n for n in expected if n not in weights]
    if missing:
        raise WeightsError(f"{source}: missing tensors {missing}")
    extra = sorted(set(weights) - set(expected))
    if extra:
        raise WeightsError(f"{source}: unexpected tensors {extra} (not part of the model for this config)")
    for name, shape in expected.items():
        got = tuple(weights[name].shape)
        if got != shape:
            raise WeightsError(f"{source}: tensor '{name}' has shape {list(got)}, expected {list(shape)}")
        if weights[name].dtype != torch.float32:
            raise WeightsError(f"{source}: tensor '{name}' has dtype {weights[name].dtype}, expected float32")


def save_weights(path: str | Path, weights: Weights, cfg: ModelConfig) -> None:
    """Write `weights` (checked against cfg) and cfg itself (JSON in the metadata) as safetensors."""
    check_weights(weights, cfg)
    tensors = {n: t.detach().to("cpu").contiguous() for n, t in weights.items()}
    save_file(tensors, str(path), metadata={CONFIG_METADATA_KEY: json.dumps(cfg.to_dict())})


def load_weights(path: str | Path, cfg: ModelConfig | None = None,
                 device: str | torch.device = "cpu") -> tuple[Weights, ModelConfig]:
    """Read a safetensors file written by save_weights; return (weights on device, config).

    The config comes from the file's metadata; if `cfg` is also given it must be equal. Missing,
    unexpected or mis-shaped tensors raise WeightsError naming the file and the tensor.
    """
    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"{path}: weights file not found")
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise WeightsError(f"{path}: not a readable safetensors file ({err})") from None
    file_cfg = None
    if CONFIG_METADATA_KEY in metadata:
        try:
            file_cfg = ModelConfig.from_dict(json.loads(metadata[CONFIG_METADATA_KEY]),
                                             source=f"{path} (metadata '{CONFIG_METADATA_KEY}')")
        except json.JSONDecodeError as err:
            raise WeightsError(f"{path}: metadata '{CONFIG_METADATA_KEY}' is not valid JSON ({err})") from None
        except ConfigError as err:
            raise WeightsError(str(err)) from None
    if cfg is None and file_cfg is None:
        raise WeightsError(f"{path}: no '{CONFIG_METADATA_KEY}' metadata and no config given")
    if cfg is not None and file_cfg is not None and cfg != file_cfg:
        diff = [k for k, v in cfg.to_dict().items() if file_cfg.to_dict()[k] != v]
        raise WeightsError(f"{path}: config in file differs from the given config in fields {diff}")
    cfg = cfg or file_cfg
    assert cfg is not None
    check_weights(tensors, cfg, str(path))
    return {n: t.to(device) for n, t in tensors.items()}, cfg
