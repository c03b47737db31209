"""The default model's build: corpus, tokenizer, pretraining, MTP distillation, DFlash drafter
(specs/default-model.md §19.2).

`build(out_dir, ...)` writes the model directory (config, weights, tokenizer files,
`training_report.json`) and its drafter in `out_dir/dflash`. The corpus package and the pretrained
weights are kept in a cache directory (the pretrained weights under a key of the settings, the
config and the corpus size), so a build interrupted after its longest phase resumes there.
Seeded throughout (data order, initialisations, anchors); the weights are not bit for bit the same
from run to run (threaded reductions), but the figures are, within noise (a second build from an
empty cache: specs/default-model.md §19.6).
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import structlog
import torch

from ..default_model import DRAFTER_SUBDIR, MAX_POSITION_EMBEDDINGS, build_tokenizer, model_config, write_tokenizer
from ..hf_export import save_pretrained_dir
from .austen import SHIPPED_SHA256, Corpus, load_corpus
from .dflash import DFlashSettings, train_drafter, write_drafter_dir
from .distill import DistillSettings, distill_mtp, greedy_data
from .pretrain import PretrainSettings, pretrain

log = structlog.get_logger("fxsched.torch_model.training")

REPORT = "training_report.json"


@dataclass(frozen=True)
class BuildSettings:
    pretrain: PretrainSettings = PretrainSettings(steps=1500)
    distill: DistillSettings = DistillSettings()
    dflash: DFlashSettings = DFlashSettings()


# A few steps of every phase on tiny batches: the pipeline end to end in seconds (tests, --quick).
QUICK = BuildSettings(
    PretrainSettings(steps=3, batch=2, seq_len=32, warmup=1, eval_every=3, eval_windows=2),
    DistillSettings(sequences=8, seq_len=24, min_prompt=4, max_prompt=8, slots=8, steps=3, batch=4, warmup=1),
    DFlashSettings(steps=3, batch=4, blocks=2, warmup=1))


def token_stream(tokenizer: Any, endoftext: int, novels: tuple[tuple[str, ...], ...]) -> torch.Tensor:
    """The novels' paragraphs (joined by blank lines) as one id stream, `<|endoftext|>` after each novel."""
    ids: list[int] = []
    for novel in novels:
        ids += tokenizer.encode("\n\n".join(novel)).ids + [endoftext]
    return torch.tensor(ids)


def _key(settings: PretrainSettings, cfg: Any, tokens: int) -> str:
    text = json.dumps([asdict(settings), repr(cfg), tokens, torch.__version__], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class BuildReport:
    out_dir: str
    corpus: dict[str, Any]
    seconds: dict[str, float] = field(default_factory=dict)
    pretrain: dict[str, Any] = field(default_factory=dict)
    distill: dict[str, Any] = field(default_factory=dict)
    dflash: dict[str, Any] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)


def build(out_dir: Path, cache_dir: Path, deb: Optional[Path] = None, settings: BuildSettings = BuildSettings(),
          say: Optional[Callable[[str], None]] = None, corpus: Optional[Corpus] = None) -> BuildReport:
    """Write the default model directory and its drafter into out_dir (see the module docstring)."""
    tell = say or (lambda message: None)
    begin = time.perf_counter()
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{out_dir}: exists and is not a directory")
    corpus = corpus if corpus is not None else load_corpus(cache_dir, deb)  # before anything is written
    out_dir.mkdir(parents=True, exist_ok=True)
    tell("training the tokenizer")
    tok, ids = build_tokenizer(corpus.train_text())
    write_tokenizer(out_dir, tok, ids)
    train, held = token_stream(tok, ids.endoftext, corpus.train), token_stream(tok, ids.endoftext, corpus.held_out)
    cfg = model_config(ids)
    report = BuildReport(str(out_dir), {"train_tokens": len(train), "held_out_tokens": len(held),
                                        "train_chars": len(corpus.train_text()),
                                        "held_out_chars": len(corpus.held_out_text()),
                                        "package_sha256": corpus.source_sha256,
                                        "package_is_the_shipped_models": corpus.source_sha256 == SHIPPED_SHA256},
                         machine={"torch": torch.__version__, "threads": settings.pretrain.threads,
                                  "processor": platform.processor() or platform.machine()})
    report.seconds["corpus_and_tokenizer"] = time.perf_counter() - begin
    cached = cache_dir / f"pretrain-{_key(settings.pretrain, cfg, len(train))}.pt"
    if cached.is_file():
        tell(f"pretrained weights from {cached}")
        saved = torch.load(cached, weights_only=True)
        weights, report.pretrain = saved["weights"], json.loads(saved["report"])
    else:
        weights, pre = pretrain(cfg, train, held, settings.pretrain, show=say is not None, say=say)
        report.pretrain = asdict(pre)
        cache_dir.mkdir(parents=True, exist_ok=True)
        torch.save({"weights": weights, "report": json.dumps(report.pretrain)}, cached)
    report.seconds["pretrain"] = float(report.pretrain["seconds"])
    save_pretrained_dir(cfg, weights, out_dir, max_position_embeddings=MAX_POSITION_EMBEDDINGS)
    tell("generating the target's greedy continuations")
    data = greedy_data(out_dir, train, settings.distill)
    report.seconds["greedy_data"] = data.seconds
    tell("distilling the MTP chain")
    weights, distilled = distill_mtp(cfg, weights, data, settings.distill, tell)
    report.distill = asdict(distilled)
    report.seconds["distill"] = distilled.seconds_train
    save_pretrained_dir(cfg, weights, out_dir, max_position_embeddings=MAX_POSITION_EMBEDDINGS)
    tell("training the DFlash drafter")
    spec, drafter, drafted = train_drafter(cfg, weights, data, ids.im_start, settings.dflash, say)
    write_drafter_dir(out_dir / DRAFTER_SUBDIR, spec, drafter, cfg.vocab_size, cfg.num_layers)
    report.dflash = asdict(drafted)
    report.seconds["dflash"] = drafted.seconds
    report.seconds["total"] = sum(v for k, v in report.seconds.items() if k != "total")
    (out_dir / REPORT).write_text(json.dumps(asdict(report), indent=2, sort_keys=True) + "\n", encoding="utf-8")
    log.info("built_default_model", path=str(out_dir), seconds=round(report.seconds["total"], 1))
    return report
