"""A small hybrid model in torch (GDN + paged softmax attention) with MTP and DFlash drafters.

Entry point: HybridEngine (engine.py), which owns the model, the paged KV cache, per-slot GDN
state, drafter state and the prefix cache, and exposes per-sequence operations for a
speculative-decoding scheduler. Everything runs in fp32; nothing here touches global RNG state.
"""

from .config import ModelConfig, default_config, load_config
from .engine import HybridEngine
from .errors import ConfigError, OutOfBlocksError, SlotError, SpillError, TorchModelError, WeightsError
from .weights import init_weights, load_weights, save_weights

__all__ = [
    "ConfigError", "HybridEngine", "ModelConfig", "OutOfBlocksError", "SlotError", "SpillError", "TorchModelError",
    "WeightsError", "default_config", "init_weights", "load_config", "load_weights", "save_weights",
]
