"""The learning-rate schedule every training phase uses: linear warm-up, then cosine decay to a tenth."""

from __future__ import annotations

import math

import torch


def set_learning_rate(opt: torch.optim.Optimizer, step: int, steps: int, peak: float, warmup: int) -> float:
    """Set (and return) the learning rate of step `step` of `steps`: peak x min(1, (step + 1) / warmup)
    x (0.1 + 0.9 x (1 + cos(pi step / steps)) / 2)."""
    lr = peak * min(1.0, (step + 1) / warmup)
    lr *= 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps))
    for group in opt.param_groups:
        group["lr"] = lr
    return lr
