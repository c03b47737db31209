"""`python -m fxsched.runtime.torch_model.training train OUT_DIR | evaluate DIR`.

`train` builds the default model (build.py; progress bars and phase lines on stderr, the build
report as one JSON line on stdout); `evaluate` measures a built directory (evaluate.py) and prints
its figures as one JSON line, writing the lm-eval task with `--lm-eval-task DIR`. Bad input (an
OUT_DIR that is a file, a missing model directory or .deb, a corpus that cannot be fetched) is one
line on stderr naming it, exit 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Optional, Sequence

DEFAULT_CACHE = Path.home() / ".cache" / "fxsched" / "default-model"


def _say(message: str) -> None:
    sys.stderr.write(f"default model: {message}\n")
    sys.stderr.flush()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fxsched.runtime.torch_model.training",
                                description="Train or evaluate the embedded default model.")
    sub = p.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="build the model directory (specs/models/default to refresh the shipped one)")
    train.add_argument("out_dir")
    train.add_argument("--quick", action="store_true", help="a few steps of every phase (a smoke test, not a model)")
    ev = sub.add_parser("evaluate", help="held-out perplexity, bigram baseline, sentence-end choice accuracy")
    ev.add_argument("model_dir")
    ev.add_argument("--items", type=int, default=300, help="multiple-choice items (default 300)")
    ev.add_argument("--lm-eval-task", metavar="DIR", default=None, help="also write the items as an lm-eval task")
    for q in (train, ev):
        q.add_argument("--cache", default=str(DEFAULT_CACHE), help=f"corpus and checkpoint cache (default {DEFAULT_CACHE})")
        q.add_argument("--corpus-deb", default=None, metavar="FILE",
                       help="the r-cran-janeaustenr .deb (default: apt-get download into the cache)")
    return p


def _evaluate(args: argparse.Namespace) -> dict[str, object]:
    from tokenizers import Tokenizer

    from ..hf_checkpoint import load_pretrained
    from ..default_model import build_tokenizer
    from .austen import load_corpus
    from .build import token_stream
    from .evaluate import bigram_loss, choice_accuracy, choice_items, wilson_interval, window_loss, write_lm_eval_task

    model_dir = Path(args.model_dir)
    corpus = load_corpus(Path(args.cache), Path(args.corpus_deb) if args.corpus_deb else None)
    cfg, w = load_pretrained(model_dir)
    shipped = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    fast, ids = build_tokenizer(corpus.train_text())  # the build's tokenizer, to encode the streams as it did
    if fast.get_vocab(with_added_tokens=True) != shipped.get_vocab(with_added_tokens=True):
        raise ValueError(f"{model_dir}: its tokenizer is not the one this corpus trains")
    train, held = token_stream(fast, ids.endoftext, corpus.train), token_stream(fast, ids.endoftext, corpus.held_out)
    loss, scored = window_loss(cfg, w, held)
    bigram, lam = bigram_loss(train, held, cfg.vocab_size)
    items = choice_items(corpus, args.items)
    mc = choice_accuracy(cfg, w, fast, items)
    low, high = wilson_interval(mc["acc"] * mc["items"], int(mc["items"]))
    out: dict[str, object] = {
        "held_out_tokens": scored, "perplexity": math.exp(loss), "bigram_perplexity": math.exp(bigram),
        "bigram_weight": lam, "choice": {**mc, "acc_95": [low, high], "chance": 0.25}}
    if args.lm_eval_task:
        out["lm_eval_task"] = str(write_lm_eval_task(Path(args.lm_eval_task), items))
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    from .austen import CorpusError
    from .rdata import RDataError

    try:
        if args.command == "train":
            from .build import QUICK, BuildSettings, build

            report = build(Path(args.out_dir), Path(args.cache), Path(args.corpus_deb) if args.corpus_deb else None,
                           QUICK if args.quick else BuildSettings(), say=_say)
            sys.stdout.write(json.dumps({"out_dir": report.out_dir, "seconds": report.seconds,
                                         "corpus": report.corpus}, sort_keys=True) + "\n")
            return 0
        if not Path(args.model_dir).is_dir():
            raise ValueError("no such model directory")
        sys.stdout.write(json.dumps(_evaluate(args), sort_keys=True) + "\n")
        return 0
    except (ValueError, OSError, CorpusError, RDataError) as err:
        where = args.out_dir if args.command == "train" else args.model_dir
        sys.stderr.write(f"default model: {where}: {err}\n")
        return 2
