"""Model configuration: a frozen, validated dataclass loaded from TOML.

Invariant: every ModelConfig instance that exists has passed `_validate`, so code
downstream may rely on the documented ranges (e.g. eos_id < vocab_size).
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
DEFAULT_CONFIG_RESOURCE = ("fxsched.specs", "models/default.toml")


def _alternating(num_layers: int) -> tuple[str, ...]:
    return tuple(LAYER_KINDS[i % 2] for i in range(num_layers))


@dataclass(frozen=True)
class ModelConfig:
    """Shape and behaviour of the hybrid model; all sizes in tokens/elements, fp32 everywhere."""

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
    # misc
    rms_norm_eps: float = 1e-6
    seed: int = 0
    mtp: bool = True
    dflash_gamma: int = 5
    dflash_layers: int = 1
    eos_id: int = 63

    def __post_init__(self) -> None:
        pattern = tuple(self.layer_pattern)
        if not pattern and isinstance(self.num_layers, int):
            pattern = _alternating(self.num_layers)
        object.__setattr__(self, "layer_pattern", pattern)
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
    def gdn_conv_channels(self) -> int:
        """Channels of the GDN short conv: q, k and v projections concatenated."""
        return self.gdn_num_heads * (2 * self.gdn_key_dim + self.gdn_value_dim)

    @property
    def max_blocks_per_seq(self) -> int:
        """Block-table width: blocks needed to hold max_seq_len positions."""
        return -(-self.max_seq_len // self.block_size)

    def to_dict(self) -> dict[str, Any]:
        """Plain TOML/JSON-able dict; ModelConfig.from_dict(cfg.to_dict()) == cfg."""
        out = dataclasses.asdict(self)
        out["layer_pattern"] = list(self.layer_pattern)
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


_FIELD_TYPES: dict[str, type] = {
    "rope_theta": float, "rms_norm_eps": float, "mtp": bool, "layer_pattern": list,
}


def _check_type(name: str, value: Any, source: str | None) -> Any:
    kind = _FIELD_TYPES.get(name, int)
    if kind is bool:
        ok = isinstance(value, bool)
        expected = "a boolean (true/false)"
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        expected = "a number"
        value = float(value) if ok else value
    elif kind is list:
        ok = isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)
        expected = f"a list of layer kinds from {LAYER_KINDS}"
    else:
        ok = isinstance(value, int) and not isinstance(value, bool)
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
