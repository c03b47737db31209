"""Weight layout, deterministic seeded init, and safetensors save/load.

Invariant: `param_shapes(cfg)` is the single source of truth for tensor names and shapes;
`init_weights(cfg)` is a pure function of cfg (bit-identical across calls and processes), and
`load_weights` accepts a file only if it holds exactly those tensors with those shapes and dtypes,
all of them finite (`check_finite`: a NaN or infinite weight is refused, naming the tensor).

Canonical names (every checkpoint format is converted to these by hf_convert.py):

* `embed` [V, D], `final_norm` [D], `lm_head` [V, D] (tied embeddings: the same tensor as `embed`);
* per decoder layer i: `layers.{i}.input_norm`, `layers.{i}.post_norm` [D] and
  - GDN `layers.{i}.gdn.`: q_proj/k_proj [Hk*Dk, D], v_proj/g_proj [Hv*Dv, D], a_proj/b_proj [Hv, D],
    conv [2*Hk*Dk + Hv*Dv, W] (channels q, k, v), A_log/dt_bias [Hv], o_norm [Dv], o_proj [D, Hv*Dv];
  - attention `layers.{i}.attn.`: q_proj [Hq*Dh, D], k_proj/v_proj [Hkv*Dh, D], o_proj [D, Hq*Dh],
    gate_proj [Hq*Dh, D] if attn_output_gate, q_norm/k_norm [Dh] if qk_norm;
  - feed-forward: dense `layers.{i}.mlp.{gate_proj,up_proj,down_proj}`, or MoE `layers.{i}.moe.`:
    router [E, D], gate_proj/up_proj [E, I, D], down_proj [E, D, I] (experts stacked on dim 0), and with
    a shared expert `shared.{gate_proj,up_proj,down_proj}` and shared_gate [1, D];
* internal toy drafters: `mtp.*` (cfg.mtp) and `dflash.*` (cfg.dflash_gamma > 0);
* published MTP layers (cfg.mtp_layers > 0): `mtp.fc` [D, 2D] (input: [norm(embedding); norm(hidden)]),
  `mtp.embed_norm`, `mtp.hidden_norm` [D], per MTP layer j `mtp.layers.{j}.` with the names of a full
  attention decoder layer (`input_norm`, `attn.*`, `post_norm`, `mlp.*` or `moe.*` by cfg.mlp_kind(j)),
  and `mtp.final_norm` [D].

Every norm weight is a plain multiplicative RMSNorm weight (zero-centred checkpoint norms get +1 at
load). Dtypes (`param_dtype`): norm weights, A_log and dt_bias are kept in float32 -- a bf16 `1 + w`
would lose the offset's low bits, and transformers computes these in fp32 anyway -- every other
tensor is in cfg.dtype.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from fxsched.kernels import cpu_amx

from .config import ModelConfig
from .errors import ConfigError, WeightsError

Weights = dict[str, torch.Tensor]
CONFIG_METADATA_KEY = "fxsched_model_config"
# Std of the logits of the random model (after the final RMSNorm): large enough that greedy
# decoding is not dominated by ties and produces varied tokens.
LOGIT_STD = 4.0
TORCH_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                        "float16": torch.float16}


def torch_dtype(cfg: ModelConfig) -> torch.dtype:
    """The torch dtype of cfg.dtype (matrices, activations and caches)."""
    return TORCH_DTYPES[cfg.dtype]


FP32_LEAVES = ("A_log", "dt_bias")


def param_dtype(name: str, cfg: ModelConfig) -> torch.dtype:
    """Storage dtype of tensor `name`: float32 for norm weights, A_log and dt_bias, cfg.dtype otherwise."""
    leaf = name.rsplit(".", 1)[-1]
    return torch.float32 if leaf.endswith("norm") or leaf in FP32_LEAVES else torch_dtype(cfg)


def _mlp_shapes(prefix: str, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, i = cfg.hidden_size, cfg.intermediate_size
    return {f"{prefix}.gate_proj": (i, d), f"{prefix}.up_proj": (i, d), f"{prefix}.down_proj": (d, i)}


def _moe_shapes(prefix: str, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, e, i, s = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {f"{prefix}.router": (e, d), f"{prefix}.gate_proj": (e, i, d),
                                          f"{prefix}.up_proj": (e, i, d), f"{prefix}.down_proj": (e, d, i)}
    if s:
        shapes.update({f"{prefix}.shared.gate_proj": (s, d), f"{prefix}.shared.up_proj": (s, d),
                       f"{prefix}.shared.down_proj": (d, s), f"{prefix}.shared_gate": (1, d)})
    return shapes


def _ffn_shapes(layer_prefix: str, cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Feed-forward tensors of decoder (or MTP) layer `layer` under `layer_prefix`."""
    if cfg.mlp_kind(layer) == "moe":
        return _moe_shapes(f"{layer_prefix}.moe", cfg)
    return _mlp_shapes(f"{layer_prefix}.mlp", cfg)


def _attn_shapes(prefix: str, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, hq, hkv, dh = cfg.hidden_size, cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        f"{prefix}.q_proj": (hq * dh, d), f"{prefix}.k_proj": (hkv * dh, d),
        f"{prefix}.v_proj": (hkv * dh, d), f"{prefix}.o_proj": (d, hq * dh)}
    if cfg.attn_output_gate:
        shapes[f"{prefix}.gate_proj"] = (hq * dh, d)
    if cfg.qk_norm:
        shapes.update({f"{prefix}.q_norm": (dh,), f"{prefix}.k_norm": (dh,)})
    return shapes


def _plain_attn_shapes(prefix: str, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """q/k/v/o of an attention block without gate or q/k norms (the internal DFlash drafter's)."""
    d, hq, hkv, dh = cfg.hidden_size, cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim
    return {f"{prefix}.q_proj": (hq * dh, d), f"{prefix}.k_proj": (hkv * dh, d),
            f"{prefix}.v_proj": (hkv * dh, d), f"{prefix}.o_proj": (d, hq * dh)}


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of the model (target, MTP head, DFlash drafter), in init order."""
    d, v = cfg.hidden_size, cfg.vocab_size
    hk, hv, dk, dv = cfg.gdn_num_heads, cfg.gdn_v_heads, cfg.gdn_key_dim, cfg.gdn_value_dim
    shapes: dict[str, tuple[int, ...]] = {"embed": (v, d)}
    for i, kind in enumerate(cfg.layer_pattern):
        p = f"layers.{i}"
        shapes[f"{p}.input_norm"] = (d,)
        if kind == "gdn":
            shapes.update({
                f"{p}.gdn.q_proj": (hk * dk, d), f"{p}.gdn.k_proj": (hk * dk, d),
                f"{p}.gdn.v_proj": (hv * dv, d), f"{p}.gdn.a_proj": (hv, d), f"{p}.gdn.b_proj": (hv, d),
                f"{p}.gdn.g_proj": (hv * dv, d), f"{p}.gdn.conv": (cfg.gdn_conv_channels, cfg.conv_width),
                f"{p}.gdn.A_log": (hv,), f"{p}.gdn.dt_bias": (hv,), f"{p}.gdn.o_norm": (dv,),
                f"{p}.gdn.o_proj": (d, hv * dv),
            })
        else:
            shapes.update(_attn_shapes(f"{p}.attn", cfg))
        shapes[f"{p}.post_norm"] = (d,)
        shapes.update(_ffn_shapes(p, cfg, i))
    shapes["final_norm"] = (d,)
    shapes["lm_head"] = (v, d)
    if cfg.mtp:
        shapes.update({"mtp.hidden_norm": (d,), "mtp.embed_norm": (d,), "mtp.in_proj": (d, 2 * d),
                       "mtp.mlp_norm": (d,), **_mlp_shapes("mtp.mlp", cfg), "mtp.final_norm": (d,)})
    if cfg.mtp_layers:
        shapes.update({"mtp.fc": (d, 2 * d), "mtp.embed_norm": (d,), "mtp.hidden_norm": (d,)})
        for j in range(cfg.mtp_layers):
            p = f"mtp.layers.{j}"
            shapes[f"{p}.input_norm"] = (d,)
            shapes.update(_attn_shapes(f"{p}.attn", cfg))
            shapes[f"{p}.post_norm"] = (d,)
            shapes.update(_ffn_shapes(p, cfg, j))
        shapes["mtp.final_norm"] = (d,)
    if cfg.dflash_gamma > 0:
        shapes.update({"dflash.ctx_proj": (d, d), "dflash.ctx_norm": (d,), "dflash.mask_embed": (d,)})
        for j in range(cfg.dflash_layers):
            p = f"dflash.layers.{j}"
            shapes[f"{p}.attn_norm"] = (d,)
            shapes.update(_plain_attn_shapes(f"{p}.attn", cfg))
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
    std = 1.0 / math.sqrt(shape[-1])  # fan-in (the last dim, also for stacked experts [E, out, in])
    if leaf in ("o_proj", "down_proj"):  # residual branches: keep the stream's scale bounded
        std /= math.sqrt(2.0 * cfg.num_layers)
    return torch.randn(shape, generator=gen) * std


def init_weights(cfg: ModelConfig, device: str | torch.device = "cpu") -> Weights:
    """Seeded init: a CPU torch.Generator seeded with cfg.seed draws every tensor in param_shapes order.

    Invariant: same cfg -> bit-identical weights (drawn in fp32 on CPU, then cast to param_dtype and
    moved to `device`). Tied embeddings: `lm_head` is drawn (keeping the order) but then replaced by
    `embed` itself.
    """
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
    weights = {name: _init_tensor(name, shape, cfg, gen).to(torch.float32).to(param_dtype(name, cfg))
               for name, shape in param_shapes(cfg).items()}
    out = {name: t.to(device) for name, t in weights.items()}
    if cfg.tie_word_embeddings:
        out["lm_head"] = out["embed"]
    return out


def logical_shape(t: torch.Tensor) -> tuple[int, ...]:
    """The [N, K] shape of the matrix a tensor holds: its own shape, or for an AMX-packed weight
    (kernels/cpu_amx.py, packed at load by ops.pack_for_cpu) the matrix it was packed from."""
    if cpu_amx.is_packed(t):
        return (t.shape[0] * 16, t.shape[1] * 32)
    return tuple(t.shape)


def check_weights(weights: Weights, cfg: ModelConfig, source: str = "<weights>") -> None:
    """Raise WeightsError unless `weights` holds exactly the tensors of param_shapes(cfg) in param_dtype."""
    expected = param_shapes(cfg)
    missing = [n for n in expected if n not in weights]
    if missing:
        raise WeightsError(f"{source}: missing tensors {missing}")
    extra = sorted(set(weights) - set(expected))
    if extra:
        raise WeightsError(f"{source}: unexpected tensors {extra} (not part of the model for this config)")
    for name, shape in expected.items():
        got = logical_shape(weights[name])
        if got != shape:
            raise WeightsError(f"{source}: tensor '{name}' has shape {list(got)}, expected {list(shape)}")
        want = param_dtype(name, cfg)
        if weights[name].dtype != want:
            raise WeightsError(f"{source}: tensor '{name}' has dtype {weights[name].dtype}, expected {want}")


def check_finite(weights: Weights, source: str = "<weights>") -> None:
    """Raise WeightsError naming the first floating-point tensor that holds a NaN or an infinity
    (loaded weights only: such a model would answer garbage without a word)."""
    for name, tensor in weights.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise WeightsError(f"{source}: tensor '{name}' holds NaN or infinite values")


def save_weights(path: str | Path, weights: Weights, cfg: ModelConfig) -> None:
    """Write `weights` (checked against cfg) and cfg itself (JSON in the metadata) as safetensors."""
    check_weights(weights, cfg)
    tensors = {n: t.detach().to("cpu").contiguous() for n, t in weights.items()}
    if cfg.tie_word_embeddings:  # safetensors refuses aliased tensors; load_weights re-ties them
        tensors["lm_head"] = tensors["lm_head"].clone()
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
    check_finite(tensors, str(path))
    out = {n: t.to(device) for n, t in tensors.items()}
    if cfg.tie_word_embeddings:
        out["lm_head"] = out["embed"]
    return out, cfg
