"""Figures of a default-model build (specs/default-model.md §19.6).

* Held-out perplexity of the target (its training forward, forward.py, which tests check against the
  engine) over non-overlapping windows of the held-out text, each read from a fresh state.
* The bigram baseline on the same tokenizer: maximum-likelihood bigram counts of the training text
  interpolated with an add-one unigram, the interpolation weight picked on the held-out text itself
  from a grid (the baseline's best case, a generous comparison).
* A multiple-choice task from held-out text, "how does this sentence end" (as HellaSwag asks of a
  scene): the first half of a held-out sentence of 12-60 words as the context, its true second
  half and three distractors (second halves of sentences from other held-out paragraphs, within
  25 % of its length, so that a model cannot win by length alone). Scored here by summed
  log-likelihood (`acc`) and per byte (`acc_norm`, lm-eval's normalisation), and written as an
  lm-eval task (`write_lm_eval_task`) to score the same items served through `fxsched serve`.
  (Whole next sentences among four were tried first: a model of this size picks the true one
  about 29 % of the time, its interval not clear of chance; the information it has is local.)
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import ModelConfig
from ..weights import Weights
from .austen import Corpus
from .forward import target_hidden, target_logits

CHOICES = 4
TASK_NAME = "austen_sentence_end"
MIN_WORDS, MAX_WORDS = 12, 60
_TITLES = (" Mr.", " Mrs.", " Dr.", " St.", " Col.", " Capt.", " Messrs.", "Mr.", "Mrs.")
_SENTENCE_END = re.compile(r'(?<=[.!?])["\']?\s+(?=["\']?[A-Z])')


@torch.no_grad()
def window_loss(cfg: ModelConfig, w: Weights, stream: torch.Tensor, seq_len: int = 256) -> tuple[float, int]:
    """(mean next-token loss in nats, tokens scored) over every non-overlapping window of the stream."""
    n = (len(stream) - 1) // seq_len
    total = 0.0
    for first in range(0, n, 16):
        starts = torch.arange(first, min(first + 16, n)) * seq_len
        chunk = stream[starts[:, None] + torch.arange(seq_len + 1)[None, :]]
        hidden, _ = target_hidden(cfg, w, chunk[:, :-1])
        logits = target_logits(cfg, w, hidden)
        total += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum"))
    return total / (n * seq_len), n * seq_len


def bigram_loss(train: torch.Tensor, held: torch.Tensor, vocab: int) -> tuple[float, float]:
    """(mean held-out loss in nats of the interpolated bigram, its interpolation weight)."""
    counts = torch.zeros(vocab * vocab, dtype=torch.float64)
    counts.index_add_(0, train[:-1] * vocab + train[1:], torch.ones(len(train) - 1, dtype=torch.float64))
    counts = counts.view(vocab, vocab)
    uni = (torch.bincount(train, minlength=vocab).double() + 1.0) / (len(train) + vocab)
    rows = counts.sum(1, keepdim=True)
    ml = torch.where(rows > 0, counts / rows.clamp(min=1), uni[None, :].expand(vocab, vocab))
    prev, nxt = held[:-1], held[1:]
    p_ml, p_uni = ml[prev, nxt], uni[nxt]
    best = (math.inf, 0.0)
    for lam in [i / 20 for i in range(1, 20)]:
        loss = float(-(lam * p_ml + (1 - lam) * p_uni).log().mean())
        best = min(best, (loss, lam))
    return best


@dataclass(frozen=True)
class ChoiceItem:
    context: str
    choices: tuple[str, ...]
    label: int


def sentences(paragraph: str) -> list[str]:
    """A paragraph's sentences: split after . ! or ? (and a closing quote) before a capital, except
    after a title such as "Mr." or "Mrs." (the next word is a name, not a sentence)."""
    out: list[str] = []
    for piece in (s.strip() for s in _SENTENCE_END.split(paragraph)):
        if not piece:
            continue
        if out and out[-1].endswith(_TITLES):
            out[-1] = f"{out[-1]} {piece}"
        else:
            out.append(piece)
    return out


def choice_items(corpus: Corpus, count: int = 300, seed: int = 55) -> list[ChoiceItem]:
    """Seeded "how does this sentence end" items from the held-out paragraphs (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    cands: list[tuple[int, str, str]] = []  # (paragraph, first half, second half)
    for i, para in enumerate(p for novel in corpus.held_out for p in novel):
        for sentence in sentences(para):
            words = sentence.split()
            if MIN_WORDS <= len(words) <= MAX_WORDS:
                cut = len(words) // 2
                cands.append((i, " ".join(words[:cut]), " ".join(words[cut:])))
    items: list[ChoiceItem] = []
    for k in torch.randperm(len(cands), generator=gen).tolist()[:count]:
        para, head, tail = cands[k]
        near = [t for j, _, t in cands if j != para and t != tail and 0.8 <= len(t) / len(tail) <= 1.25]
        if len(near) < CHOICES - 1:
            continue
        choices = [near[j] for j in torch.randperm(len(near), generator=gen)[:CHOICES - 1].tolist()]
        label = int(torch.randint(0, CHOICES, (1,), generator=gen))
        choices.insert(label, tail)
        items.append(ChoiceItem(head, tuple(choices), label))
    return items


@torch.no_grad()
def choice_accuracy(cfg: ModelConfig, w: Weights, tokenizer: Any, items: list[ChoiceItem]) -> dict[str, float]:
    """acc (summed log-likelihood) and acc_norm (per byte of the choice) of the items, as lm-eval
    scores a multiple-choice task (the choice follows the context after one space)."""
    hits = hits_norm = 0
    for item in items:
        ctx = tokenizer.encode(item.context).ids
        scores, norms = [], []
        for choice in item.choices:
            cont = tokenizer.encode(" " + choice).ids
            tokens = torch.tensor([ctx + cont])
            hidden, _ = target_hidden(cfg, w, tokens[:, :-1])
            logp = target_logits(cfg, w, hidden)[0, len(ctx) - 1:].log_softmax(-1)
            ll = float(logp.gather(1, torch.tensor(cont)[:, None]).sum())
            scores.append(ll)
            norms.append(ll / len((" " + choice).encode("utf-8")))
        hits += int(max(range(CHOICES), key=lambda j: scores[j]) == item.label)
        hits_norm += int(max(range(CHOICES), key=lambda j: norms[j]) == item.label)
    n = max(len(items), 1)
    return {"items": len(items), "acc": hits / n, "acc_norm": hits_norm / n}


def wilson_interval(hits: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95 % Wilson score interval of a proportion hits / n."""
    if n == 0:
        return (0.0, 1.0)
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (centre - half, centre + half)


def write_lm_eval_task(out_dir: Path, items: list[ChoiceItem]) -> Path:
    """An lm-eval task directory (`--include_path DIR --tasks austen_sentence_end`) of the items."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = out_dir / f"{TASK_NAME}.jsonl"
    data.write_text("".join(json.dumps({"context": it.context, "choices": list(it.choices), "label": it.label}) + "\n"
                            for it in items), encoding="utf-8")
    (out_dir / f"{TASK_NAME}.yaml").write_text(
        f"task: {TASK_NAME}\n"
        "dataset_path: json\n"
        "dataset_kwargs:\n"
        "  data_files:\n"
        f"    test: {data.resolve()}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        "doc_to_target: label\n"
        "metric_list:\n"
        "  - metric: acc\n"
        "  - metric: acc_norm\n", encoding="utf-8")
    return out_dir
