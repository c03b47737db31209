"""A hybrid model in torch (GDN + paged softmax attention, dense or MoE feed-forwards) with drafters.

Entry point: HybridEngine (engine.py), which owns the model, the paged KV cache, per-slot GDN
state, drafter state and the prefix cache, and exposes per-sequence operations for a
speculative-decoding scheduler. It runs the small internal model (fp32) or a Hugging Face
checkpoint of a supported architecture (HybridEngine.from_pretrained, hf_checkpoint.py) in
cfg.dtype; nothing here touches global RNG state.
"""

from .config import ModelConfig, default_config, load_config
from .engine import HybridEngine
from .errors import (ConfigError, ModelDirError, OutOfBlocksError, SlotError, SpillError, TorchModelError,
                     WeightsError)
from .hf_checkpoint import load_pretrained
from .weights import init_weights, load_weights, save_weights

__all__ = [
    "ConfigError", "HybridEngine", "ModelConfig", "ModelDirError", "OutOfBlocksError", "SlotError", "SpillError",
    "TorchModelError", "WeightsError", "default_config", "init_weights", "load_config", "load_pretrained",
    "load_weights", "save_weights",
]
