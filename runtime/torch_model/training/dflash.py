"""Training the default model's DFlash drafter on the target (specs/default-model.md §19.5).

The drafter is a block drafter in the public DFlash format (hf_dflash_dir.load_dflash_drafter reads
what `write_drafter_dir` writes): `num_layers` Qwen3-style layers at the target's hidden size,
context features from the target layers `target_layer_ids`, the target's embedding and head
(not trained, not stored). Its training data are the target's own greedy continuations
(distill.greedy_data): for K seeded anchors per sequence, each at a position n whose following
block_size - 1 tokens are all the target's greedy choices, the block [t_n, mask ...] is run against
the features of positions < n (`dflash_block_logits`, all K blocks in one forward) and row i is
trained to the token at n + i, with weight decay_base^(i-1) (early drafts matter most: a draft
counts only when every one before it was accepted, as in the DFlash paper's loss).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..hf_dflash_dir import dflash_param_shapes
from ..hf_drafters import DFlashSpec
from ..weights import Weights
from .distill import GreedyData
from .forward import dflash_block_logits, dflash_features, target_hidden
from .schedule import set_learning_rate


@dataclass(frozen=True)
class DFlashSettings:
    num_layers: int = 2
    block_size: int = 8
    target_layer_ids: tuple[int, ...] = (1, 3)
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 640
    rope_theta: float = 10000.0
    steps: int = 1200
    batch: int = 16  # sequences per step
    blocks: int = 8  # anchors per sequence
    lr: float = 3e-3
    warmup: int = 50
    decay_base: float = 0.8  # weight of draft i: decay_base^(i-1)
    seed: int = 2468
    threads: int = 2


@dataclass
class DFlashReport:
    settings: dict[str, Any]
    seconds: float = 0.0
    first_loss: float = math.nan
    final_loss: float = math.nan
    final_accuracy: list[float] = field(default_factory=list)  # per draft position, last 50 steps


def drafter_spec(cfg: ModelConfig, settings: DFlashSettings, mask_token_id: int) -> DFlashSpec:
    return DFlashSpec(num_layers=settings.num_layers, hidden_size=cfg.hidden_size, num_heads=settings.num_heads,
                      num_kv_heads=settings.num_kv_heads, head_dim=settings.head_dim,
                      intermediate_size=settings.intermediate_size, rms_norm_eps=cfg.rms_norm_eps,
                      rope_theta=settings.rope_theta, block_size=settings.block_size,
                      target_layer_ids=settings.target_layer_ids, mask_token_id=mask_token_id, causal=False,
                      attention_bias=False)


def initial_drafter(spec: DFlashSpec, num_layers_target: int, seed: int) -> Weights:
    """Seeded init: norms 1, matrices N(0, 1/fan_in), residual outputs scaled by 1/sqrt(2 layers)."""
    gen = torch.Generator().manual_seed(seed)
    out: Weights = {}
    for name, shape in dflash_param_shapes(spec, len(spec.target_layer_ids)).items():
        if len(shape) == 1:
            out[name] = torch.ones(shape)
            continue
        std = 1.0 / math.sqrt(shape[1])
        if name.endswith(("o_proj", "down_proj")):
            std /= math.sqrt(2.0 * spec.num_layers)
        out[name] = torch.randn(shape, generator=gen) * std
    return out


def _anchors(prompt_lens: torch.Tensor, length: int, block: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """[B, K] anchor positions n with prompt_len - 1 <= n <= length - block (drafts all greedy)."""
    low = (prompt_lens - 1).clamp(min=0)
    span = (length - block - low + 1).clamp(min=1)
    return low[:, None] + (torch.rand(len(low), k, generator=gen) * span[:, None]).long()


def train_drafter(cfg: ModelConfig, w: Weights, data: GreedyData, mask_token_id: int,
                  settings: DFlashSettings = DFlashSettings(),
                  say: Optional[Callable[[str], None]] = None) -> tuple[DFlashSpec, Weights, DFlashReport]:
    """(spec, the drafter's own tensors, report): a drafter for the target (cfg, w) trained on `data`."""
    from tqdm import tqdm

    threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        spec = drafter_spec(cfg, settings, mask_token_id)
        begin = time.perf_counter()
        with torch.no_grad():  # the target's layer outputs, once
            layers: dict[int, list[torch.Tensor]] = {i: [] for i in spec.target_layer_ids}
            for first in range(0, len(data.tokens), 64):
                _, kept = target_hidden(cfg, w, data.tokens[first:first + 64], spec.target_layer_ids)
                for i in spec.target_layer_ids:
                    layers[i].append(kept[i])
            outputs = {i: torch.cat(v) for i, v in layers.items()}
        params = {n: t.requires_grad_(True) for n, t in initial_drafter(spec, cfg.num_layers, settings.seed).items()}
        opt = torch.optim.AdamW(list(params.values()), lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0)
        gen = torch.Generator().manual_seed(settings.seed + 1)
        n, length = data.tokens.shape
        prompt_lens = torch.tensor(data.prompt_lens)
        weights_by_row = settings.decay_base ** torch.arange(spec.block_size - 1, dtype=torch.float32)
        report = DFlashReport(settings=asdict(settings))
        hits = torch.zeros(spec.block_size - 1)
        counts = 0
        tail = max(1, min(50, settings.steps))
        bar = tqdm(total=settings.steps, unit="step", desc="dflash", disable=say is None)
        for step in range(settings.steps):
            set_learning_rate(opt, step, settings.steps, settings.lr, settings.warmup)
            pick = torch.randint(0, n, (settings.batch,), generator=gen)
            anchors = _anchors(prompt_lens[pick], length, spec.block_size, settings.blocks, gen)
            dw = {**params, "embed": w["embed"], "lm_head": w["lm_head"]}
            feats = dflash_features(cfg, spec, w, dw, {i: o[pick] for i, o in outputs.items()})
            tokens = data.tokens[pick]
            logits = dflash_block_logits(spec, dw, feats, tokens, anchors)  # [B, K, T-1, V]
            at = anchors[:, :, None] + torch.arange(1, spec.block_size)
            labels = tokens.gather(1, at.flatten(1)).view_as(at)
            per_row = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view_as(labels)
            loss = (per_row * weights_by_row).mean() / weights_by_row.mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            value = float(loss.detach())
            report.first_loss = value if step == 0 else report.first_loss
            report.final_loss = value
            if step >= settings.steps - tail:
                hits += (logits.detach().argmax(-1) == labels).float().sum((0, 1))
                counts += labels.shape[0] * labels.shape[1]
            bar.update(1)
            bar.set_postfix(loss=f"{value:.3f}")
        bar.close()
        report.seconds = time.perf_counter() - begin
        report.final_accuracy = (hits / max(counts, 1)).tolist()
        if say is not None:
            say(f"dflash: loss {report.first_loss:.3f} -> {report.final_loss:.3f}, accuracy by position "
                + "/".join(f"{a:.2f}" for a in report.final_accuracy))
        return spec, {k: v.detach() for k, v in params.items()}, report
    finally:
        torch.set_num_threads(threads)


def write_drafter_dir(out: Path, spec: DFlashSpec, weights: Weights, vocab_size: int, num_target_layers: int) -> None:
    """config.json and model.safetensors of the drafter in the public DFlash format."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": spec.block_size,
        "dflash_config": {"mask_token_id": spec.mask_token_id, "target_layer_ids": list(spec.target_layer_ids)},
        "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "hidden_act": "silu",
        "attention_bias": False, "rms_norm_eps": spec.rms_norm_eps,
        "rope_parameters": {"rope_theta": spec.rope_theta, "rope_type": "default"},
        "vocab_size": vocab_size, "num_target_layers": num_target_layers, "tie_word_embeddings": False,
        "dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tensors = {f"{name}.weight": t.contiguous().float() for name, t in sorted(weights.items())}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
