"""MTP self-distillation: the MTP chain trained on the target's own greedy continuations
(specs/default-model.md §19.4).

After pretraining, the MTP module predicts the *text's* token two ahead; speculation is judged
against the *target's* choice. So the target continues seeded prompts (windows of the training
text) greedily through HybridEngine, batched over its slots, giving per position i the target's
hidden row h_i, the next token t_{i+1}, and the target's greedy token g_j after every prefix with
its distribution there. Only the MTP tensors (`mtp.fc`, its norms, its decoder layer) are trained,
with AdamW, on the whole draft chain the scheduler uses (`mtp_chain_logits`, depth MTP_DRAFTS):
depth 1 reads (h_i, t_{i+1}) and predicts g_{i+1}; depth k >= 2 reads (its own previous output,
g_{i+k-1}) at position i+k-1 and predicts g_{i+k}, where the sequence did continue greedily
(elsewhere the row is masked out). The loss is cross-entropy against the greedy token, mixed with
cross-entropy against the target's distribution (`soft`; it generalises better to unseen text).
The same greedy continuations are the DFlash drafter's training data (dflash.py).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..ops import linear, rms_norm
from ..weights import Weights, param_shapes
from .forward import mtp_chain_logits
from .schedule import set_learning_rate

MTP_DRAFTS = 3  # drafts per MTP proposal (runtime/generate.py's MTP_DRAFTS): the chain depth trained
MTP_PREFIX = "mtp."


def mtp_parameter_names(cfg: ModelConfig) -> list[str]:
    """The canonical tensors distillation trains: every `mtp.*` tensor (fc, its norms, its layer)."""
    return [n for n in param_shapes(cfg) if n.startswith(MTP_PREFIX)]


@dataclass(frozen=True)
class DistillSettings:
    """The budget and seeds of the MTP self-distillation (defaults: what the shipped model used)."""

    sequences: int = 1024  # training sequences (prompt + the target's greedy continuation)
    seq_len: int = 96  # tokens per sequence
    min_prompt: int = 8
    max_prompt: int = 32
    slots: int = 128  # engine slots decoding at once while generating them
    steps: int = 600
    batch: int = 32  # sequences per step
    lr: float = 1e-2  # peak (after `warmup` steps), cosine decay to a tenth
    warmup: int = 50
    depth: int = MTP_DRAFTS
    soft: float = 0.7  # weight of the soft cross-entropy against the target's distribution (rest: greedy token)
    seed: int = 4321
    threads: int = 2


@dataclass
class DistillReport:
    """What distillation saw and reached (the loss per depth at the end, on the training batches)."""

    settings: dict[str, Any]
    positions: int
    seconds_generate: float
    seconds_train: float
    first_loss: float
    final_loss: float
    final_accuracy: list[float] = field(default_factory=list)  # per depth, last 50 steps


def corpus_prompts(stream: torch.Tensor, count: int, min_len: int, max_len: int,
                   gen: torch.Generator) -> list[list[int]]:
    """Seeded prompts: `count` windows of a token stream, each of min_len..max_len tokens."""
    out: list[list[int]] = []
    for _ in range(count):
        n = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
        start = int(torch.randint(0, len(stream) - n, (1,), generator=gen))
        out.append(stream[start:start + n].tolist())
    return out


@torch.no_grad()
def greedy_rows(engine: Any, prompts: Sequence[Sequence[int]], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [N, seq_len], hidden [N, seq_len, D]): each prompt continued greedily to seq_len
    tokens through the engine (batched over its slots), with the target's hidden rows of them all."""
    slots = list(range(engine.cfg.max_slots))
    tokens = torch.zeros(len(prompts), seq_len, dtype=torch.long)
    hidden = torch.zeros(len(prompts), seq_len, engine.cfg.hidden_size)
    for first in range(0, len(prompts), len(slots)):
        chunk = list(prompts[first:first + len(slots)])
        used = slots[:len(chunk)]
        nxt: dict[int, int] = {}
        for slot, prompt in zip(used, chunk, strict=True):
            engine.alloc(slot)
            nxt[slot] = int(engine.prefill(slot, prompt).argmax())
        while True:
            live = [s for s in used if engine.seq_len(s) < seq_len]
            if not live:
                break
            logits = engine.decode_batch(live, [nxt[s] for s in live])
            for s, row in zip(live, logits.argmax(-1).tolist(), strict=True):
                nxt[s] = int(row)
        for j, slot in enumerate(used):
            tokens[first + j] = torch.tensor(engine.tokens(slot))
            hidden[first + j] = engine.hidden_history[slot, :seq_len].float()
            engine.free(slot)
    return tokens, hidden


@dataclass
class ChainData:
    """Training rows of the MTP chain for N sequences of L tokens (T = L - 1 rows each)."""

    next_tokens: torch.Tensor  # [N, T]: t_{i+1}
    hidden: torch.Tensor  # [N, T, D]: h_i
    chain_tokens: list[torch.Tensor]  # per depth k >= 2: [N, T] g_{i+k-1}
    labels: list[torch.Tensor]  # per depth k >= 1: [N, T] g_{i+k}
    valid: list[torch.Tensor]  # per depth: [N, T] rows with a label of a greedy continuation
    all_hidden: torch.Tensor  # [N, L, D]: every hidden row (the teacher's distribution at i+k is row i+k's)


def chain_data(tokens: torch.Tensor, hidden: torch.Tensor, greedy: torch.Tensor, depth: int) -> ChainData:
    """The rows of `mtp_chain_logits` training: greedy[:, j] is the target's token after t_0..t_j."""
    n, length = tokens.shape
    t = length - 1
    pad = torch.zeros(n, depth + 1, dtype=torch.long)
    g = torch.cat([greedy, pad], dim=1)
    nxt = torch.cat([tokens, pad], dim=1)
    rows = torch.arange(t)
    chain, labels, valid = [], [], []
    ok = torch.ones(n, t, dtype=torch.bool)
    for k in range(1, depth + 1):
        if k >= 2:
            chain.append(g[:, rows + k - 1])
            ok = ok & (nxt[:, rows + k] == g[:, rows + k - 1])  # the sequence went on as drafted
        labels.append(g[:, rows + k])
        valid.append(ok & (rows + k <= length - 1)[None, :])
    return ChainData(tokens[:, 1:].clone(), hidden[:, :t].clone(), chain, labels, valid, hidden)


@dataclass
class GreedyData:
    """The target's greedy continuations of the distillation prompts (also the DFlash drafter's data)."""

    tokens: torch.Tensor  # [N, L]: prompt, then the target's greedy tokens
    hidden: torch.Tensor  # [N, L, D]: the target's hidden row of every position (pre final norm)
    prompt_lens: list[int]
    seconds: float


def greedy_data(model_dir: Path, train_stream: torch.Tensor, settings: DistillSettings) -> GreedyData:
    """Continue `settings.sequences` seeded windows of the training stream greedily to seq_len tokens."""
    from ..engine import HybridEngine

    threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        engine = HybridEngine.from_pretrained(model_dir, max_seq_len=settings.seq_len + 8, max_slots=settings.slots)
        gen = torch.Generator().manual_seed(settings.seed)
        prompts = corpus_prompts(train_stream, settings.sequences, settings.min_prompt, settings.max_prompt, gen)
        start = time.perf_counter()
        tokens, hidden = greedy_rows(engine, prompts, settings.seq_len)
        return GreedyData(tokens, hidden, [len(p) for p in prompts], time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)


def distill_mtp(cfg: ModelConfig, w: Weights, data: GreedyData, settings: DistillSettings = DistillSettings(),
                say: Optional[Callable[[str], None]] = None) -> tuple[Weights, DistillReport]:
    """Train the MTP tensors of (cfg, w) on the greedy continuations; returns the full weights with
    the trained MTP tensors and a report (w is not changed)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        with torch.no_grad():
            greedy = linear(rms_norm(data.hidden, w["final_norm"], cfg.rms_norm_eps), w["lm_head"]).argmax(-1)
        chain = chain_data(data.tokens, data.hidden, greedy, settings.depth)
        gen = torch.Generator().manual_seed(settings.seed + 1)
        params = {n: w[n].detach().clone().float().requires_grad_(True) for n in mtp_parameter_names(cfg)}
        report = _train(cfg, w, params, chain, settings, gen, say or (lambda message: None))
        report.seconds_generate = data.seconds
        trained = dict(w)
        trained.update({n: p.detach().to(w[n].dtype) for n, p in params.items()})
        return trained, report
    finally:
        torch.set_num_threads(threads)


def _train(cfg: ModelConfig, w: Weights, params: dict[str, torch.Tensor], data: ChainData,
           settings: DistillSettings, gen: torch.Generator, say: Callable[[str], None]) -> DistillReport:
    frozen = {n: w[n] for n in ("embed", "lm_head", "final_norm")}
    opt = torch.optim.AdamW(list(params.values()), lr=settings.lr, betas=(0.9, 0.98), weight_decay=0.0)
    n = data.next_tokens.shape[0]
    start = time.perf_counter()
    first_loss = final_loss = math.nan
    hits = [0.0] * settings.depth
    counts = [0.0] * settings.depth
    tail = max(1, min(50, settings.steps))
    for step in range(settings.steps):
        set_learning_rate(opt, step, settings.steps, settings.lr, settings.warmup)
        pick = torch.randint(0, n, (settings.batch,), generator=gen)
        logits = mtp_chain_logits(cfg, {**frozen, **params}, data.next_tokens[pick], data.hidden[pick],
                                  [c[pick] for c in data.chain_tokens])
        loss = torch.zeros(())
        for k, out in enumerate(logits):
            mask = data.valid[k][pick]
            if mask.any():
                loss = loss + (1 - settings.soft) * F.cross_entropy(out[mask], data.labels[k][pick][mask])
                if settings.soft:
                    at = torch.clamp(torch.arange(out.shape[1]) + k + 1, max=data.all_hidden.shape[1] - 1)
                    with torch.no_grad():
                        teacher = linear(rms_norm(data.all_hidden[pick][:, at], w["final_norm"], cfg.rms_norm_eps),
                                         w["lm_head"]).softmax(-1)
                    soft = -(teacher[mask] * out[mask].log_softmax(-1)).sum(-1).mean()
                    loss = loss + settings.soft * soft
                if step >= settings.steps - tail:
                    hits[k] += float((out[mask].argmax(-1) == data.labels[k][pick][mask]).sum())
                    counts[k] += float(mask.sum())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        value = float(loss.detach())
        first_loss = value if step == 0 else first_loss
        final_loss = value
        if step % 100 == 0 or step == settings.steps - 1:
            say(f"step {step + 1}/{settings.steps}: loss {value:.3f} ({time.perf_counter() - start:.0f}s)")
    return DistillReport(settings=asdict(settings), positions=int(data.valid[0].sum()), seconds_generate=0.0,
                         seconds_train=time.perf_counter() - start, first_loss=first_loss, final_loss=final_loss,
                         final_accuracy=[h / c if c else 0.0 for h, c in zip(hits, counts, strict=True)])
