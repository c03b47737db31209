"""Pretraining the default model's target with its MTP module (specs/default-model.md §19.3).

The usual next-token loss on windows of the training text, plus the usual MTP loss: the MTP module
at depth 1 reads the target's hidden row h_i and the embedding of t_{i+1} and predicts t_{i+2}
(`mtp_chain_logits`), weighted by `mtp_weight`, its gradient flowing into the target as in
DeepSeek-V3's and Qwen3-Next's training. AdamW, linear warm-up then cosine decay to a tenth;
windows drawn by a seeded generator; a fixed number of steps (not a time budget), so a rerun on
another machine takes other time but the same steps. Progress: a tqdm bar on stderr.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..weights import Weights, init_weights
from .forward import mtp_chain_logits, target_hidden, target_logits
from .schedule import set_learning_rate


@dataclass(frozen=True)
class PretrainSettings:
    seq_len: int = 256
    batch: int = 16
    steps: int = 2000
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.1
    mtp_weight: float = 0.3
    embed_std: float = 0.02
    seed: int = 1234
    threads: int = 2
    eval_every: int = 250
    eval_windows: int = 64


@dataclass
class PretrainReport:
    settings: dict[str, Any]
    seconds: float = 0.0
    tokens_seen: int = 0
    curve: list[dict[str, float]] = field(default_factory=list)  # step, train loss, held-out loss


def initial_weights(cfg: ModelConfig, settings: PretrainSettings) -> Weights:
    """weights.init_weights of cfg (fan-in projections, residual branches / sqrt(2L), GDN decay
    parameters), the embedding table (tied to the head) redrawn at std embed_std."""
    w = init_weights(cfg)
    gen = torch.Generator().manual_seed(cfg.seed + 7)
    w["embed"] = torch.randn(w["embed"].shape, generator=gen) * settings.embed_std
    if cfg.tie_word_embeddings:
        w["lm_head"] = w["embed"]
    return w


def _windows(stream: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    return stream[starts[:, None] + torch.arange(length)[None, :]]


def losses(cfg: ModelConfig, w: Weights, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(next-token loss, MTP depth-1 loss) of token windows [B, T + 2]."""
    t = window.shape[1] - 2
    hidden, _ = target_hidden(cfg, w, window[:, :t])
    main = F.cross_entropy(target_logits(cfg, w, hidden).flatten(0, 1), window[:, 1:t + 1].flatten())
    (mtp,) = mtp_chain_logits(cfg, w, window[:, 1:t + 1], hidden)
    return main, F.cross_entropy(mtp.flatten(0, 1), window[:, 2:t + 2].flatten())


@torch.no_grad()
def held_out_loss(cfg: ModelConfig, w: Weights, stream: torch.Tensor, seq_len: int, windows: int) -> float:
    """Mean next-token loss (nats) over the first `windows` non-overlapping windows of a stream."""
    n = min(windows, (len(stream) - 1) // seq_len)
    starts = torch.arange(n) * seq_len
    total = 0.0
    for first in range(0, n, 16):
        chunk = _windows(stream, starts[first:first + 16], seq_len + 1)
        hidden, _ = target_hidden(cfg, w, chunk[:, :-1])
        logits = target_logits(cfg, w, hidden)
        total += float(F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum"))
    return total / (n * seq_len)


def pretrain(cfg: ModelConfig, train_stream: torch.Tensor, eval_stream: torch.Tensor,
             settings: PretrainSettings = PretrainSettings(), show: bool = True,
             say: Optional[Callable[[str], None]] = None) -> tuple[Weights, PretrainReport]:
    """Train every target and MTP tensor from `initial_weights`; returns the weights and a report."""
    from tqdm import tqdm

    threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        start_w = initial_weights(cfg, settings)
        params = {n: t.detach().clone().float().requires_grad_(True) for n, t in start_w.items()
                  if not (cfg.tie_word_embeddings and n == "lm_head")}

        def weights() -> Weights:
            return {**params, "lm_head": params["embed"]} if cfg.tie_word_embeddings else dict(params)

        decay = [p for n, p in params.items() if p.dim() >= 2]
        no_decay = [p for n, p in params.items() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": settings.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=settings.lr, betas=(0.9, 0.95))
        gen = torch.Generator().manual_seed(settings.seed)
        report = PretrainReport(settings=asdict(settings))
        begin = time.perf_counter()
        bar = tqdm(total=settings.steps, unit="step", desc="pretrain", disable=not show)
        span = settings.seq_len + 2
        for step in range(settings.steps):
            set_learning_rate(opt, step, settings.steps, settings.lr, settings.warmup)
            starts = torch.randint(0, len(train_stream) - span, (settings.batch,), generator=gen)
            main, mtp = losses(cfg, weights(), _windows(train_stream, starts, span))
            loss = main + settings.mtp_weight * mtp
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
            opt.step()
            report.tokens_seen += settings.batch * settings.seq_len
            bar.update(1)
            bar.set_postfix(loss=f"{float(main.detach()):.3f}", mtp=f"{float(mtp.detach()):.3f}")
            if (step + 1) % settings.eval_every == 0 or step + 1 == settings.steps:
                held = held_out_loss(cfg, weights(), eval_stream, settings.seq_len, settings.eval_windows)
                report.curve.append({"step": step + 1, "train_loss": float(main.detach()), "mtp_loss": float(mtp.detach()),
                                     "held_out_loss": held, "seconds": time.perf_counter() - begin})
                if say is not None:
                    say(f"step {step + 1}: loss {float(main.detach()):.3f}, mtp {float(mtp.detach()):.3f}, held-out {held:.3f} "
                        f"(ppl {math.exp(held):.1f})")
        bar.close()
        report.seconds = time.perf_counter() - begin
        return {n: t.detach().clone() for n, t in weights().items()}, report
    finally:
        torch.set_num_threads(threads)
