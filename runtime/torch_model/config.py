"""Model configuration: a frozen, validated dataclass loaded from TOML (or built from a Hugging Face
config.json by hf_model_config.py).

Invariant: every ModelConfig instance that exists has passed `_validate`, so code
downstream may rely on the documented ranges (e.g. eos_id < vocab_size).

One dataclass describes both the internal toy model (architecture "fxsched-hybrid") and the Hugging
Face families hf_checkpoint.py loads; every field added for the latter defaults to the internal
model's behaviour, so an internal config (and its TOML) is unchanged by their existence:

* gdn_num_v_heads: value heads of the GDN layers (0 = gdn_num_heads, which counts the key heads);
  value head j reads key/query head j // (gdn_v_heads / gdn_num_heads), as transformers does;
* attn_output_gate / qk_norm / partial_rotary_factor: gated attention output, per-head q/k RMSNorm,
  RoPE on the first `rotary_dim` dims of each head only;
* num_experts, num_experts_per_tok, moe_intermediate_size, shared_expert_intermediate_size (0 = no
  shared expert), norm_topk_prob, mlp_pattern (per layer "dense" or "moe"; empty = all dense);
* tie_word_embeddings; dtype (storage and compute dtype of matrices and caches, see weights.py);
* mtp_layers: published-structure MTP layers of an HF checkpoint (the `mtp` flag keeps meaning the
  internal toy MTP head; the two exclude each other); eos_ids: extra end-of-sequence ids.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .errors import ConfigError

LAYER_KINDS = ("gdn", "attn")
MLP_KINDS = ("dense", "moe")
DTYPES = ("float32", "bfloat16", "float16")
INTERNAL_ARCHITECTURE = "fxsched-hybrid"
DEFAULT_CONFIG_RESOURCE = ("fxsched.specs", "models/default.toml")


def _alternating(num_layers: int) -> tuple[str, ...]:
    return tuple(LAYER_KINDS[i % 2] for i in range(num_layers))


@dataclass(frozen=True)
class ModelConfig:
    """Shape and behaviour of the hybrid model; all sizes in tokens/elements (see the module docstring)."""

    vocab_size: int = 64
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 4
    layer_pattern: tuple[str, ...] = ()  # empty: alternate "gdn", "attn", ... over num_layers
    # softmax attention
    num_attention_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10000.0
    # gated DeltaNet
    gdn_num_heads: int = 4
    gdn_key_dim: int = 16
    gdn_value_dim: int = 16
    conv_width: int = 4
    # paged KV cache and slots
    block_size: int = 16
    num_blocks: int = 256
    max_slots: int = 16
    max_seq_len: int = 512
    gdn_snapshot_every: int = 0  # blocks between prefix-cache GDN snapshots; 0: gdn_snapshot_blocks decides
    # misc
    rms_norm_eps: float = 1e-6
    seed: int = 0
    mtp: bool = True
    dflash_gamma: int = 5
    dflash_layers: int = 1
    eos_id: int = 63
    # Hugging Face families (defaults = the internal model)
    architecture: str = INTERNAL_ARCHITECTURE
    gdn_num_v_heads: int = 0  # 0: same as gdn_num_heads (the key heads)
    attn_output_gate: bool = False
    qk_norm: bool = False
    partial_rotary_factor: float = 1.0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    norm_topk_prob: bool = True
    mlp_pattern: tuple[str, ...] = ()  # per layer "dense" / "moe"; empty: all dense
    tie_word_embeddings: bool = False
    dtype: str = "float32"
    mtp_layers: int = 0
    eos_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        pattern = tuple(self.layer_pattern)
        if not pattern and isinstance(self.num_layers, int):
            pattern = _alternating(self.num_layers)
        object.__setattr__(self, "layer_pattern", pattern)
        object.__setattr__(self, "mlp_pattern", tuple(self.mlp_pattern))
        object.__setattr__(self, "eos_ids", tuple(self.eos_ids))
        _validate(self)

    # ---- derived sizes -------------------------------------------------
    @property
    def gdn_layers(self) -> tuple[int, ...]:
        """Indices (into all layers) of the gated-DeltaNet layers, in order."""
        return tuple(i for i, kind in enumerate(self.layer_pattern) if kind == "gdn")

    @property
    def attn_layers(self) -> tuple[int, ...]:
        """Indices (into all layers) of the softmax-attention layers, in order."""
        return tuple(i for i, kind in enumerate(self.layer_pattern) if kind == "attn")

    @property
    def gdn_v_heads(self) -> int:
        """GDN value heads (the heads of the recurrent state): gdn_num_v_heads, or gdn_num_heads if 0."""
        return self.gdn_num_v_heads or self.gdn_num_heads

    @property
    def gdn_conv_channels(self) -> int:
        """Channels of the GDN short conv: q, k (key heads) and v (value heads) projections concatenated."""
        return 2 * self.gdn_num_heads * self.gdn_key_dim + self.gdn_v_heads * self.gdn_value_dim

    @property
    def rotary_dim(self) -> int:
        """Leading dims of each attention head that RoPE rotates: int(head_dim * partial_rotary_factor)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def mlp_kind(self, layer: int) -> str:
        """The feed-forward kind ("dense" or "moe") of decoder layer `layer`; MTP layer j uses
        mlp_kind(j), the same per-index rule the checkpoints' families (and vLLM) apply to it."""
        return self.mlp_pattern[layer] if self.mlp_pattern else "dense"

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """eos_id followed by the extra eos_ids (duplicates removed, order kept)."""
        return tuple(dict.fromkeys((self.eos_id, *self.eos_ids)))

    @property
    def gdn_snapshot_blocks(self) -> int:
        """Every how many KV blocks a sequence keeps a GDN state snapshot for the prefix cache.

        A snapshot (every GDN layer's recurrent and conv state) is per sequence, not per position:
        at real sizes one outweighs dozens of KV blocks (Qwen3.5 0.6B-like: 9.4 MB against 0.2 MB a
        block), and snapshotting every block cost more memory than the KV cache and much of a
        prompt's prefill time. So snapshots are taken every N blocks, N making them cost about as
        much memory as the blocks they cover; a cache hit then resumes from the last snapshotted
        block. 1 for models without GDN layers or with small states (under 1 MiB); gdn_snapshot_every
        sets N outright.
        """
        if self.gdn_snapshot_every > 0:
            return self.gdn_snapshot_every
        itemsize = 4 if self.dtype == "float32" else 2
        state = self.gdn_state_bytes
        block = max(1, len(self.attn_layers) * 2 * self.block_size * self.num_kv_heads * self.head_dim * itemsize)
        return 1 if state < 2 ** 20 else max(1, -(-state // block))

    @property
    def gdn_state_bytes(self) -> int:
        """Bytes of one sequence's GDN state, recurrent and conv, over every GDN layer (in the
        model's dtype, as the state cache keeps it); 0 without GDN layers."""
        itemsize = 4 if self.dtype == "float32" else 2
        return len(self.gdn_layers) * (self.gdn_v_heads * self.gdn_key_dim * self.gdn_value_dim
                                       + self.gdn_conv_channels * (self.conv_width - 1)) * itemsize

    @property
    def max_blocks_per_seq(self) -> int:
        """Block-table width: blocks needed to hold max_seq_len positions."""
        return -(-self.max_seq_len // self.block_size)

    def to_dict(self) -> dict[str, Any]:
        """Plain TOML/JSON-able dict; ModelConfig.from_dict(cfg.to_dict()) == cfg."""
        out = dataclasses.asdict(self)
        for name in ("layer_pattern", "mlp_pattern", "eos_ids"):
            out[name] = list(getattr(self, name))
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str | None = None) -> "ModelConfig":
        """Build from a mapping; unknown or ill-typed fields raise ConfigError naming `source`."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for name, value in data.items():
            if name not in known:
                raise ConfigError(name, f"a known field name (one of: {', '.join(sorted(known))})",
                                  value, source)
            kwargs[name] = _check_type(name, value, source)
        try:
            return cls(**kwargs)
        except ConfigError as err:
            if not source:
                raise
            raise err.with_source(source) from None  # the same error, now naming its source


# Field -> kind for `_check_type` (fields not listed are integers). A kind is a Python type, or a
# tuple (list, element type) for list-valued fields.
_FIELD_TYPES: dict[str, Any] = {
    "rope_theta": float, "rms_norm_eps": float, "partial_rotary_factor": float,
    "mtp": bool, "attn_output_gate": bool, "qk_norm": bool, "norm_topk_prob": bool, "tie_word_embeddings": bool,
    "architecture": str, "dtype": str,
    "layer_pattern": (list, str), "mlp_pattern": (list, str), "eos_ids": (list, int),
}
_LIST_EXPECTED = {"layer_pattern": f"a list of layer kinds from {LAYER_KINDS}",
                  "mlp_pattern": f"a list of MLP kinds from {MLP_KINDS}",
                  "eos_ids": "a list of token ids (integers)"}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_type(name: str, value: Any, source: str | None) -> Any:
    kind = _FIELD_TYPES.get(name, int)
    if kind is bool:
        ok = isinstance(value, bool)
        expected = "a boolean (true/false)"
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        expected = "a number"
        value = float(value) if ok else value
    elif kind is str:
        ok = isinstance(value, str)
        expected = "a string"
    elif isinstance(kind, tuple):
        element = _is_int if kind[1] is int else (lambda v: isinstance(v, str))
        ok = isinstance(value, (list, tuple)) and all(element(v) for v in value)
        expected = _LIST_EXPECTED[name]
    else:
        ok = _is_int(value)
        expected = "an integer"
    if not ok:
        raise ConfigError(name, expected, value, source)
    return value


def _validate(cfg: ModelConfig) -> None:
    positive = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_attention_heads",
                "num_kv_heads", "head_dim", "gdn_num_heads", "gdn_key_dim", "gdn_value_dim",
                "block_size", "num_blocks", "max_slots", "max_seq_len", "dflash_layers")
    for name in positive:
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(name, "a positive integer", value)
    if isinstance(cfg.seed, bool) or not isinstance(cfg.seed, int) or cfg.seed < 0:
        raise ConfigError("seed", "a non-negative integer", cfg.seed)
    every = cfg.gdn_snapshot_every
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise ConfigError("gdn_snapshot_every", "a non-negative integer (0: by the state's size)", every)
    if not isinstance(cfg.mtp, bool):
        raise ConfigError("mtp", "a boolean (true/false)", cfg.mtp)
    if isinstance(cfg.conv_width, bool) or not isinstance(cfg.conv_width, int) or cfg.conv_width < 2:
        raise ConfigError("conv_width", "an integer >= 2", cfg.conv_width)
    if isinstance(cfg.dflash_gamma, bool) or not isinstance(cfg.dflash_gamma, int) or cfg.dflash_gamma < 0:
        raise ConfigError("dflash_gamma", "a non-negative integer (0 disables the DFlash drafter)",
                          cfg.dflash_gamma)
    if len(cfg.layer_pattern) != cfg.num_layers:
        raise ConfigError("layer_pattern", f"a list of num_layers={cfg.num_layers} layer kinds",
                          list(cfg.layer_pattern))
    for kind in cfg.layer_pattern:
        if kind not in LAYER_KINDS:
            raise ConfigError("layer_pattern", f"only layer kinds from {LAYER_KINDS}", list(cfg.layer_pattern))
    if cfg.num_attention_heads % cfg.num_kv_heads:
        raise ConfigError("num_kv_heads", f"a divisor of num_attention_heads={cfg.num_attention_heads}",
                          cfg.num_kv_heads)
    if cfg.head_dim % 2:
        raise ConfigError("head_dim", "an even integer (rotary embedding pairs dimensions)", cfg.head_dim)
    if not 0 <= cfg.eos_id < cfg.vocab_size:
        raise ConfigError("eos_id", f"a token id in [0, vocab_size={cfg.vocab_size})", cfg.eos_id)
    if cfg.max_blocks_per_seq > cfg.num_blocks:
        raise ConfigError("num_blocks", f"at least max_seq_len / block_size = {cfg.max_blocks_per_seq}",
                          cfg.num_blocks)
    if not cfg.rope_theta > 0:
        raise ConfigError("rope_theta", "a positive number", cfg.rope_theta)
    if not 0 < cfg.rms_norm_eps < 1:
        raise ConfigError("rms_norm_eps", "a number in (0, 1)", cfg.rms_norm_eps)
    _validate_hf_fields(cfg)


def _validate_hf_fields(cfg: ModelConfig) -> None:
    """The fields added for the Hugging Face families (see the module docstring)."""
    if not isinstance(cfg.architecture, str) or not cfg.architecture:
        raise ConfigError("architecture", "a non-empty string", cfg.architecture)
    if cfg.dtype not in DTYPES:
        raise ConfigError("dtype", f"one of {DTYPES}", cfg.dtype)
    for name in ("gdn_num_v_heads", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                 "shared_expert_intermediate_size", "mtp_layers"):
        value = getattr(cfg, name)
        if not _is_int(value) or value < 0:
            raise ConfigError(name, "a non-negative integer", value)
    for name in ("attn_output_gate", "qk_norm", "norm_topk_prob", "tie_word_embeddings"):
        if not isinstance(getattr(cfg, name), bool):
            raise ConfigError(name, "a boolean (true/false)", getattr(cfg, name))
    if cfg.gdn_v_heads % cfg.gdn_num_heads:
        raise ConfigError("gdn_num_v_heads", f"a multiple of gdn_num_heads={cfg.gdn_num_heads} (or 0)",
                          cfg.gdn_num_v_heads)
    if not 0 < cfg.partial_rotary_factor <= 1:
        raise ConfigError("partial_rotary_factor", "a number in (0, 1]", cfg.partial_rotary_factor)
    if cfg.rotary_dim < 2 or cfg.rotary_dim % 2:
        raise ConfigError("partial_rotary_factor", f"a factor giving an even rotary_dim >= 2 for head_dim="
                          f"{cfg.head_dim} (got rotary_dim {cfg.rotary_dim})", cfg.partial_rotary_factor)
    if cfg.mlp_pattern and len(cfg.mlp_pattern) != cfg.num_layers:
        raise ConfigError("mlp_pattern", f"empty or a list of num_layers={cfg.num_layers} MLP kinds",
                          list(cfg.mlp_pattern))
    if any(kind not in MLP_KINDS for kind in cfg.mlp_pattern):
        raise ConfigError("mlp_pattern", f"only MLP kinds from {MLP_KINDS}", list(cfg.mlp_pattern))
    if "moe" in cfg.mlp_pattern:
        if cfg.num_experts < 1:
            raise ConfigError("num_experts", "a positive integer (mlp_pattern has MoE layers)", cfg.num_experts)
        if not 1 <= cfg.num_experts_per_tok <= cfg.num_experts:
            raise ConfigError("num_experts_per_tok", f"an integer in [1, num_experts={cfg.num_experts}]",
                              cfg.num_experts_per_tok)
        if cfg.moe_intermediate_size < 1:
            raise ConfigError("moe_intermediate_size", "a positive integer (mlp_pattern has MoE layers)",
                              cfg.moe_intermediate_size)
    if cfg.mtp_layers and cfg.mtp:
        raise ConfigError("mtp", "false when mtp_layers > 0 (published MTP layers replace the internal head)",
                          cfg.mtp)
    if cfg.mtp_layers > cfg.num_layers:
        raise ConfigError("mtp_layers", f"at most num_layers={cfg.num_layers}", cfg.mtp_layers)
    bad = [t for t in cfg.eos_ids if not 0 <= t < cfg.vocab_size]
    if bad:
        raise ConfigError("eos_ids", f"token ids in [0, vocab_size={cfg.vocab_size})", list(cfg.eos_ids))


def load_config(path: str | Path) -> ModelConfig:
    """Read a ModelConfig from a TOML file; any defect raises ConfigError naming the file and field.

    Fields absent from the file take the dataclass defaults. A top-level [model] table is accepted
    as an alternative to top-level keys.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError("<file>", "a readable TOML file", f"{err.__class__.__name__}: {err}", str(path)) from err
    return _parse(text, str(path))


def default_config() -> ModelConfig:
    """The embedded default config (fxsched/specs/models/default.toml)."""
    package, name = DEFAULT_CONFIG_RESOURCE
    resource = importlib.resources.files(package).joinpath(name)
    return _parse(resource.read_text(encoding="utf-8"), str(resource))


def _parse(text: str, source: str) -> ModelConfig:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError("<file>", "valid TOML", str(err), source) from None
    if set(data) == {"model"} and isinstance(data["model"], dict):
        data = data["model"]
    return ModelConfig.from_dict(data, source)
