"""``fxsched generate`` and ``fxsched bench generate``: the torch model driven by the scheduler.

Wiring into ``fxsched.runtime.cli.app.build_parser`` takes one line per command::

    add_generate_command(sub)      # after the other sub.add_parser(...) calls
    add_bench_generate(bench)      # after the bench parser is set up

``python -m fxsched.runtime.cli.generate generate ...`` runs the same commands standalone.

The parts: the values of the command line and how a refusal is reported (runtime/cli/usage.py), the
model (runtime/cli/model_choice.py), the prompts (runtime/cli/generate_prompts.py), the ``--lora``
adapters (runtime/cli/generate_lora.py), the output (runtime/cli/generate_output.py) and the runs
(runtime/cli/generate_run.py); this module holds the two commands' options and entry points.

Sampling: greedy by default; ``--temperature T`` (> 0 samples), ``--top-p``, ``--top-k``,
``--min-p`` and ``--seed S`` (request i draws with seed S + i, so a seeded run repeats) apply to
every request, with every ``--spec`` (a speculative mode verifies sampled drafts by rejection
sampling, which keeps the target's distribution: specs/speculation.md §6.16); ``--logprobs N``
adds each token's logprob and the N most likely ids to the ``--json`` records (``logprobs``: one
entry per token id, the first token's included, with every ``--spec``: the target's raw
distribution).

Bad input (an out-of-range sampling value, an empty or malformed prompt, a token id outside the vocabulary, a prompt longer than
the context, text for a model without a tokenizer, an unknown ``--spec``, ``--device cuda``
without CUDA, a missing or unreadable weights file, model or tokenizer directory) exits 2 with one
line on stderr naming the input and what is wrong.
"""

from __future__ import annotations

import argparse
import sys

from fxsched.runtime.cli.generate_run import run_bench_generate, run_generate
from fxsched.runtime.cli.usage import DTYPES, EXIT_USAGE, _reporting


def _add_model_arguments(p: argparse.ArgumentParser, what: str = "") -> None:
    p.add_argument("--weights", help=f"a safetensors weights file of the internal model{what}")
    p.add_argument("--model", metavar="DIR", help=f"a Hugging Face model directory (config.json, safetensors, "
                                                  f"tokenizer; default: the embedded default model){what}")
    p.add_argument("--dtype", default=None, metavar="{auto," + ",".join(DTYPES) + ",bf16,half,float}",
                   help=f"weights and compute dtype of a --model checkpoint (default, or auto: the checkpoint's){what}")
    p.add_argument("--max-seq-len", default=None, metavar="N",
                   help=f"context length to allocate for a --model checkpoint (default: the loader's){what}")
    p.add_argument("--draft-model", metavar="DIR", default=None,
                   help=f"a DFlash drafter directory for a --model checkpoint (--spec dflash){what}")
    add_kv_memory_argument(p, what)


def add_kv_memory_argument(p: "argparse._ActionsContainer", what: str = "", *aliases: str) -> None:
    p.add_argument("--kv-cache-memory", *aliases, dest="kv_cache_memory", default=None, metavar="SIZE",
                   help=f"memory for the KV cache (and GDN states) of a --model checkpoint, e.g. 2GiB, 512MiB or bytes (default: "
                        f"every slot at the context length, at most 4 GiB){what}")


def add_generate_command(sub) -> None:
    """Register ``generate`` (with its own ``func``) on an ``add_subparsers`` object."""
    p = sub.add_parser("generate", help="generate text or tokens with the torch model, scheduled by fxsched",
                       description="Generation (greedy unless --temperature > 0) through the scheduler on a Hugging Face checkpoint "
                                   "(--model; default: the embedded default model) or the internal toy model (--weights). Prints each request's text (or token "
                                   "ids, for a model without a tokenizer) and a summary line.")
    p.add_argument("--prompt", help="prompt text (encoded with the model's tokenizer)")
    p.add_argument("--prompt-ids", help='prompt token ids separated by spaces or commas, e.g. "1 2 3"')
    p.add_argument("--prompt-file", help="a file with one text prompt per non-blank line")
    p.add_argument("--prompt-ids-file", help="a file with one prompt (token ids) per non-blank line")
    p.add_argument("--chat", action="store_true",
                   help="wrap each text prompt as one user message through the model's chat template")
    p.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="end a request when its text contains STR (cut before it); repeatable")
    p.add_argument("--ignore-eos", action="store_true", help="never stop at EOS: generate --max-tokens tokens")
    p.add_argument("--json", action="store_true",
                   help="one JSON object per request and line, then a summary object; nothing else on stdout")
    p.add_argument("--tokenizer", metavar="DIR", help="a directory with tokenizer.json (default: the --model DIR)")
    p.add_argument("--batch", default="1",
                   help="requests running at once (default 1); fewer prompts are repeated to fill the batch")
    p.add_argument("--max-tokens", default="32", help="tokens to generate per request (default 32)")
    p.add_argument("--spec", default="none", help="speculation: none, mtp, dflash or ngram (default none)")
    p.add_argument("--temperature", default="0", help="sampling temperature (default 0: greedy)")
    p.add_argument("--top-p", default="1", help="nucleus sampling: keep the most likely tokens up to this mass "
                                                "(0 < p <= 1, default 1: off)")
    p.add_argument("--top-k", default="0", help="keep the k most likely tokens (default 0: off)")
    p.add_argument("--min-p", default="0", help="drop tokens below min-p x the most likely one's probability "
                                                "(0..1, default 0: off)")
    p.add_argument("--seed", default="0", help="sampling seed; request i uses seed + i (default 0)")
    p.add_argument("--logprobs", default="0", metavar="N",
                   help="with --json: each token's logprob and the N most likely ids (default 0: none)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    _add_model_arguments(p)
    p.add_argument("--threads", default=None,
                   help="CPU threads (default: every core with --model, 1 for the embedded model)")
    p.add_argument("--no-progress", action="store_true", help="never show the progress bar")
    p.add_argument("--record", metavar="FILE", default=None,
                   help="write the run's event log to FILE (every event step took and a digest of its effects); "
                        "fxsched replay FILE re-runs it without the model; an existing FILE is refused unless "
                        "--force")
    p.add_argument("--force", action="store_true", help="let --record overwrite an existing file")
    p.add_argument("--overlap", action="store_true",
                   help="carry the device's work out on its own thread while the host steps the scheduler and "
                        "serves the output (specs/async.md §16.5; the summary gains host_s and hidden_host_s)")
    p.add_argument("--async-scheduling", dest="async_scheduling", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="plain decodes answered ahead: the host plans and launches the next tick before it reads "
                        "this one's tokens (specs/async.md §16.6; default: on with --device cuda, off on the CPU)")
    p.add_argument("--lora", action="append", default=None, metavar="[NAME=]PATH",
                   help="a PEFT LoRA adapter directory the prompts run with (repeatable; NAME: the directory's "
                        "name unless given); with one adapter every prompt uses it, with several "
                        "--lora-prompts says which (specs/lora.md §18.7)")
    p.add_argument("--lora-prompts", default=None, metavar="NAME,...",
                   help="the adapter of each prompt, in order: an adapter's NAME or base (the model without "
                        "adapter), repeated over the requests when shorter")
    from fxsched.runtime.cli.ep import add_ep_ranks_argument

    add_ep_ranks_argument(p)
    p.set_defaults(func=cmd_generate)


def add_bench_generate(bench: argparse.ArgumentParser) -> None:
    """Teach an existing ``bench WHAT`` parser the ``generate`` benchmark (its choices and its
    options); other benchmarks still go to the parser's previous ``func``."""
    for action in bench._actions:
        if action.dest == "what" and action.choices is not None and "generate" not in action.choices:
            action.choices = list(action.choices) + ["generate"]
    bench.add_argument("--device", default="cpu", help="cpu or cuda (generate)")
    bench.add_argument("--batches", default="1,4,16", help="batch sizes, comma-separated (generate)")
    bench.add_argument("--max-tokens", default="32", help="tokens per request (generate)")
    bench.add_argument("--specs", default="none,mtp,dflash,ngram",
                       help="speculation modes, comma-separated; one the model cannot run is reported as skipped "
                            "(generate)")
    bench.add_argument("--temperature", dest="bench_temperature", default="0",
                       help="sampling temperature of every request (default 0: greedy; > 0: the rows report "
                            "the accepted length at that temperature, seeded, and no losslessness) (generate)")
    bench.add_argument("--prompts", default="held-out,repetitive",
                       help="prompt sets, comma-separated: held-out, repetitive (generate)")
    bench.add_argument("--json", action="store_true", help="one JSON object per row, nothing else (step, check, generate)")
    bench.add_argument("--overlap", dest="bench_overlap", default="off",
                       help="the device lane (specs/async.md §16.5): off, on, or compare (every row --rounds "
                            "times each way, interleaved; medians, ratio, hidden host time) (generate)")
    bench.add_argument("--rounds", dest="bench_rounds", default="3",
                       help="runs each way of --overlap compare (default 3) (generate)")
    bench.add_argument("--ep-ranks", dest="bench_ep_ranks", default="1", metavar="N,N",
                       help="expert-parallel rank counts, comma-separated (e.g. 1,2,4): every row runs on each; "
                            "a MoE --model is split across the ranks (generate)")
    _add_model_arguments(bench, " (generate)")
    previous = bench.get_default("func")

    def dispatch(args) -> int:
        if args.what == "generate":
            return cmd_bench_generate(args)
        return previous(args)

    bench.set_defaults(func=dispatch)


def cmd_generate(args) -> int:
    return _reporting("generate", lambda: run_generate(args))


def cmd_bench_generate(args) -> int:
    def run() -> int:
        run_bench_generate(args)
        return 0

    return _reporting("bench generate", run)


# --- standalone entry point -----------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from fxsched.runtime.cli.arguments import ArgumentParser  # one-line refusals, as the fxsched command's

    parser = ArgumentParser(prog="fxsched", description="fxsched generate / bench generate")
    parser.add_argument("-v", "--verbose", action="store_true", help="structlog events on stderr")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_command(sub)
    bench = sub.add_parser("bench", help="print speed figures")
    bench.add_argument("what", choices=[])
    bench.set_defaults(func=lambda args: EXIT_USAGE)
    add_bench_generate(bench)
    return parser


def main(argv=None) -> int:
    from fxsched.runtime.logs import configure_logging

    args = build_parser().parse_args(argv)
    configure_logging(args.verbose)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
