"""``fxsched generate`` and ``fxsched bench generate``: the torch model driven by the scheduler.

Wiring into ``fxsched.runtime.cli.app.build_parser`` takes one line per command::

    add_generate_command(sub)      # after the other sub.add_parser(...) calls
    add_bench_generate(bench)      # after the bench parser is set up

``python -m fxsched.runtime.cli.generate generate ...`` runs the same commands standalone.

The model: ``--model DIR`` (a Hugging Face checkpoint directory, through ``HybridEngine.from_pretrained``,
with ``--dtype``, ``--max-seq-len`` and a DFlash ``--draft-model DIR``), ``--weights FILE`` (a
safetensors file of the internal toy model), or, with neither, the embedded default model: the
Hugging Face directory ``specs/models/default/`` (a small Qwen3.5 checkpoint trained on Jane Austen's
novels, with its MTP layer, its tokenizer and a DFlash drafter that ``--spec dflash`` takes when no
``--draft-model`` is given; specs/default-model.md), loaded exactly like a ``--model`` directory. With ``--ep-ranks N > 1`` and neither option the internal toy model runs (the
EP workers build it); with ``--model DIR`` of a MoE checkpoint the N ranks split its experts, each
loading its share from DIR (runtime/cli/ep.py). The tokenizer comes from the model directory (or ``--tokenizer DIR``); a model
without one takes token ids only.

Prompts: ``--prompt TEXT`` / ``--prompt-file FILE`` (text, one prompt per non-blank line,
encoded with the tokenizer; ``--chat`` wraps each as one user message through the chat
template) or ``--prompt-ids "1 2 3"`` / ``--prompt-ids-file FILE`` (token ids).

Output on stdout. Without a tokenizer: each request's token ids and a summary line. With one:
a single request's text is streamed as it is generated (flushed piece by piece, whether or not
stdout is a terminal), followed by a status line; with several requests each one's status line
and text are printed when it finishes. ``--json``: one JSON object per request and line, as each
finishes (``RequestResult.to_json``: ``index``, ``token_ids``, ``text``, ``finish_reason``, the
counters), then one summary object (``"summary": true``), and nothing else.

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
line on stderr naming the input and what is wrong. Numbers are written in ASCII digits (``1_0`` and
``٣`` are refused; a NaN fails the range check).

``--record FILE`` writes the run's event log (``fxsched.runtime.eventlog``, specs/event-log.md):
``fxsched replay FILE`` re-runs the scheduler over it without the model. A path that cannot be
written, or an existing file without ``--force``, is refused before the model loads, and the file
is only created once the input is checked.

Prompt files are read with a bound (runtime/cli/bounds.py: at most 64 MiB, so ``/dev/zero`` is one
line), and they, the numbers and the paths are checked before torch is imported.

Ctrl-C during a run prints what was generated so far (each unfinished request with finish reason
"interrupted", then the summary), one line on stderr, and exits 130; with ``--ep-ranks`` the
workers ignore it and the leader tears them down.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

EXIT_USAGE = 2
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130
_INTEGER = re.compile(r"[+-]?[0-9]{1,30}")
_DECIMAL = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")
PROGRESS_MIN_TOKENS = 512  # show a progress bar when a run may produce this many tokens
DTYPES = ("float32", "bfloat16", "float16")
DTYPE_ALIASES = {"auto": None, "bf16": "bfloat16", "half": "float16", "fp16": "float16", "float": "float32",
                 "fp32": "float32"}  # vLLM's names (auto: the checkpoint's)
SPECS = ("none", "mtp", "dflash", "ngram")  # runtime/generate.py's SPECS, known here before torch is imported
PROMPT_OPTIONS = ("--prompt", "--prompt-ids", "--prompt-file", "--prompt-ids-file")


class UsageError(Exception):
    """A one-line complaint about the command line."""


# --- argument parsing ------------------------------------------------------------------------------


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


_SIZE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(i?)B?", re.IGNORECASE)


def parse_size(text: str, name: str) -> int:
    """Bytes of a size such as 4GiB, 512MiB, 2G, 1.5GB or 1048576 (K/M/G/T: powers of 1024 with or
    without i, as vLLM reads them); UsageError naming the flag otherwise."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise UsageError(f"{name} {text}: not a size (give bytes or a number with KiB, MiB, GiB or TiB)")
    number, unit = float(match.group(1)), match.group(2).upper()
    size = int(number * 1024 ** "KMGT".find(unit) * 1024) if unit else int(number)
    if size < 1:
        raise UsageError(f"{name} {text}: must be positive")
    return size


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


MAX_SEQUENCES = 4096  # the most sequences one engine holds (--batch, --max-num-seqs): slots are tables


def _int(value: str, name: str, low: int, high: Optional[int] = None) -> int:
    if not isinstance(value, str) or not _INTEGER.fullmatch(value.strip()):
        raise UsageError(f"{name} {value}: not an integer")
    n = int(value)
    if n < low or (high is not None and n > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise UsageError(f"{name} {value}: must be {bound}")
    return n


def _float(value: str, name: str) -> float:
    if not isinstance(value, str) or not (_DECIMAL.fullmatch(value.strip())
                                          or value.strip().lower() in ("nan", "inf", "-inf", "+inf")):
        raise UsageError(f"{name} {value}: not a number")
    return float(value)  # a NaN or an infinity is refused by the option's range check


def _sampling(args):
    """The run's ``SamplingOptions`` from the sampling flags (their ranges: ``Request``'s checks)."""
    from fxsched.runtime.generate import GenerateError, SamplingOptions

    def given(name: str, default: str) -> str:
        value = getattr(args, name, None)
        return default if value is None else str(value)

    seed = _int(given("seed", "0"), "--seed", -(2**62), 2**62)

    try:
        return SamplingOptions(
            temperature=_float(given("temperature", "0"), "--temperature"),
            top_p=_float(given("top_p", "1"), "--top-p"),
            top_k=_int(given("top_k", "0"), "--top-k", 0),
            min_p=_float(given("min_p", "0"), "--min-p"),
            seed=seed,
            logprobs=_int(given("logprobs", "0"), "--logprobs", 0),
        )
    except GenerateError as err:
        raise UsageError(str(err)) from None


def _torch_device(name: str) -> str:
    import torch

    if name == "cpu":
        return "cpu"
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise UsageError(f"--device {name}: CUDA is not available on this machine")
        return name
    raise UsageError(f"--device {name}: unknown device (choose cpu or cuda)")


def host_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0))


def _set_threads(value: Optional[str], device: str, checkpoint: bool = False) -> None:
    """torch's CPU threads: ``--threads`` if given, else every core for a checkpoint (the threads
    split each product's weights), else 1 (the embedded model is too small to split)."""
    import torch

    if value is not None:
        torch.set_num_threads(_int(value, "--threads", 1))
    elif device == "cpu":
        torch.set_num_threads(host_cores() if checkpoint else 1)


# --- the model and its tokenizer ------------------------------------------------------------------


@dataclass(frozen=True)
class ModelChoice:
    """Which model the command runs, checked before anything is loaded."""

    weights: Optional[str] = None
    model: Optional[str] = None
    dtype: Optional[str] = None
    max_seq_len: Optional[int] = None
    draft_model: Optional[str] = None
    kv_cache_memory: Optional[int] = None
    default: bool = False  # `model` is the embedded default model (no --model / --weights given)
    ep_ranks: int = 1  # > 1: a --model checkpoint is loaded as rank 0's expert shard (runtime/cli/ep.py)
    max_loras: int = 0  # LoRA adapter slots of the engine (specs/lora.md §18.1; 0: none)
    max_lora_rank: int = 16
    max_slots: Optional[int] = None  # sequences the engine holds at once (None: the loader's default, 16)

    @property
    def label(self) -> str:
        """How errors name the model directory."""
        return f"the default model {self.model}" if self.default else f"--model {self.model}"


def normalize_dtype(dtype: Optional[str]) -> Optional[str]:
    """``--dtype`` in torch's spelling (vLLM's names accepted; auto: None, the checkpoint's)."""
    if dtype is None or dtype in DTYPES:
        return dtype
    if dtype not in DTYPE_ALIASES:
        raise UsageError(f"--dtype {dtype}: unknown dtype (choose auto, {', '.join(DTYPES)}, bf16, half or float)")
    return DTYPE_ALIASES[dtype]


def _model_choice(args, dflash: bool = False) -> ModelChoice:
    """The model the arguments name. dflash: a DFlash mode will run, so the default model comes with
    its drafter (specs/default-model.md §19.5) unless --draft-model names another."""
    weights, model = getattr(args, "weights", None), getattr(args, "model", None)
    dtype, max_seq_len = getattr(args, "dtype", None), getattr(args, "max_seq_len", None)
    draft_model = getattr(args, "draft_model", None)
    if weights is not None and model is not None:
        raise UsageError("--weights and --model: give one of them, not both")
    dtype = normalize_dtype(dtype)
    default = model is None and weights is None and getattr(args, "ep_ranks", 1) <= 1
    if default:
        from fxsched.runtime.torch_model.default_model import default_drafter_dir, default_model_dir

        model = str(default_model_dir())
        if dflash and draft_model is None and default_drafter_dir().is_dir():
            draft_model = str(default_drafter_dir())
    if model is None:
        if dtype is not None:
            raise UsageError(f"--dtype {dtype}: only for a --model checkpoint (the internal model runs in float32)")
        if max_seq_len is not None:
            raise UsageError(f"--max-seq-len {max_seq_len}: only for a --model checkpoint")
        if getattr(args, "kv_cache_memory", None) is not None:
            raise UsageError(f"--kv-cache-memory {args.kv_cache_memory}: only for a --model checkpoint")
        if draft_model is not None:
            raise UsageError(f"--draft-model {draft_model}: only for a --model checkpoint")
        return ModelChoice(weights=weights)
    if not Path(model).is_dir():
        what = "the default model" if default else "--model"
        raise UsageError(f"{what} {model}: no such directory")
    if not default:  # config.json first, before torch is imported (runtime/cli/checkpoint.py)
        from fxsched.runtime.cli.checkpoint import CheckpointProblem, check_checkpoint

        try:
            check_checkpoint(model, f"--model {model}")
        except CheckpointProblem as err:
            raise UsageError(str(err)) from None
    if draft_model is not None and not Path(draft_model).is_dir():
        raise UsageError(f"--draft-model {draft_model}: no such directory")
    length = _int(max_seq_len, "--max-seq-len", 16) if max_seq_len is not None else None
    kv_text = getattr(args, "kv_cache_memory", None)
    kv_memory = parse_size(kv_text, "--kv-cache-memory") if kv_text is not None else None
    ranks = getattr(args, "ep_ranks", 1)
    return ModelChoice(model=model, dtype=dtype, max_seq_len=length, draft_model=draft_model,
                       kv_cache_memory=kv_memory, default=default,
                       ep_ranks=ranks if isinstance(ranks, int) else 1)


def _engine(choice: ModelChoice | Optional[str], device: str):
    """The engine of a ``ModelChoice`` (or of a weights path / ``None``, as before)."""
    from fxsched.runtime.torch_model import HybridEngine, default_config
    from fxsched.runtime.torch_model.errors import TorchModelError

    if not isinstance(choice, ModelChoice):
        choice = ModelChoice(weights=choice)
    if choice.model is not None:
        return _pretrained(choice, device)
    if choice.weights is None:
        return HybridEngine(default_config(), device=device)
    path = Path(choice.weights)
    if path.is_dir():
        raise UsageError(f"--weights {choice.weights}: is a directory, not a safetensors file (for a Hugging Face "
                         f"checkpoint directory give --model {choice.weights})")
    if not path.is_file():
        raise UsageError(f"--weights {choice.weights}: no such file")
    try:
        return HybridEngine.from_weights_file(path, device=device)
    except (TorchModelError, OSError, ValueError) as err:
        raise UsageError(f"--weights {choice.weights}: {err}") from None


def _pretrained(choice: ModelChoice, device: str):
    from fxsched.runtime.torch_model import HybridEngine
    from fxsched.runtime.torch_model.errors import TorchModelError

    assert choice.model is not None
    from_pretrained = getattr(HybridEngine, "from_pretrained", None)
    if from_pretrained is None:
        raise UsageError(f"{choice.label}: this build cannot load Hugging Face checkpoints yet "
                         f"(HybridEngine.from_pretrained is missing)")
    kwargs: dict[str, Any] = {"device": device}
    if choice.dtype is not None:
        kwargs["dtype"] = choice.dtype
    if choice.max_seq_len is not None:
        kwargs["max_seq_len"] = choice.max_seq_len
    if choice.draft_model is not None:
        kwargs["draft_model"] = choice.draft_model
    if choice.kv_cache_memory is not None:
        kwargs["kv_cache_memory"] = choice.kv_cache_memory
    if choice.ep_ranks > 1:
        kwargs["expert_shard"] = (0, choice.ep_ranks)
    if choice.max_loras:
        kwargs.update(max_loras=choice.max_loras, max_lora_rank=choice.max_lora_rank)
    if choice.max_slots is not None:
        kwargs["max_slots"] = choice.max_slots
    try:
        return from_pretrained(choice.model, **kwargs)
    except TorchModelError as err:  # ModelDirError among them: the message names the file
        if getattr(err, "field", None) == "kv_cache_memory":
            raise UsageError(f"--kv-cache-memory {choice.kv_cache_memory}: {choice.label} needs "
                             f"{getattr(err, 'expected', '')}") from None
        if getattr(err, "field", None) == "expert_shard":
            expected = getattr(err, "expected", "")
            raise UsageError(f"--ep-ranks {choice.ep_ranks}: {choice.label} takes {expected}") from None
        raise UsageError(f"{_blame(choice, err)}: {_one_line(err)}") from None
    except (OSError, ValueError) as err:
        raise UsageError(f"{_blame(choice, err)}: {type(err).__name__}: {_one_line(err)}") from None


def _blame(choice: ModelChoice, err: BaseException) -> str:
    """The option a loading error is about: the drafter directory when the message names it."""
    if choice.draft_model is not None and str(Path(choice.draft_model)) in str(err):
        return f"--draft-model {choice.draft_model}"
    return choice.label


def _one_line(err: BaseException) -> str:
    return " ".join(line.strip() for line in str(err).splitlines() if line.strip()) or type(err).__name__


def _check_text_model(args, choice: ModelChoice, option: str) -> None:
    """A text prompt needs a tokenizer: checked on the files, before torch is imported (the
    tokenizer itself is loaded and checked later, by ``_tokenizer``)."""
    from fxsched.runtime.cli.checkpoint import has_tokenizer

    if option not in ("--prompt", "--prompt-file") or getattr(args, "tokenizer", None) is not None:
        return
    if choice.model is not None and not choice.default and not has_tokenizer(choice.model):
        ids_option = "--prompt-ids" if option == "--prompt" else "--prompt-ids-file"
        raise UsageError(f"{option}: the model has no tokenizer (no tokenizer.json in --model {choice.model}), so "
                         f"it takes token ids: use {ids_option} (or --tokenizer DIR)")


def _tokenizer(args, choice: ModelChoice):
    """The tokenizer of ``--tokenizer DIR``, else of the ``--model`` directory; None without one."""
    from fxsched.runtime.text import TokenizerError, load_tokenizer

    directory = getattr(args, "tokenizer", None)
    option = "--tokenizer"
    if directory is None:
        directory, option = choice.model, ("the default model" if choice.default else "--model")
    if directory is None:
        return None
    try:
        tokenizer = load_tokenizer(directory)
    except TokenizerError as err:
        raise UsageError(f"{option}: {err}") from None
    if tokenizer is None and option == "--tokenizer":
        raise UsageError(f"--tokenizer {directory}: no tokenizer.json in it")
    return tokenizer


# --- prompts ---------------------------------------------------------------------------------------


@dataclass
class Prompt:
    source: str  # what an error names: "--prompt", "--prompt-file F line 3", ...
    tokens: list[int]
    text: Optional[str] = None


def _prompt_option(args) -> tuple[str, str]:
    values = [(name, getattr(args, name[2:].replace("-", "_"), None)) for name in PROMPT_OPTIONS]
    given = [(name, str(value)) for name, value in values if value is not None]
    if len(given) > 1:
        raise UsageError(f"{given[0][0]} and {given[1][0]}: give one of them, not both")
    if not given:
        raise UsageError('no prompt: give --prompt TEXT, --prompt-ids "1 2 3", --prompt-file FILE '
                         'or --prompt-ids-file FILE')
    return given[0]


def _lines(option: str, name: str) -> list[tuple[str, str]]:
    from fxsched.runtime.cli.bounds import MAX_PROMPT_FILE_BYTES, UserFileError, read_user_text

    path = Path(name)
    try:
        text = read_user_text(path, option, MAX_PROMPT_FILE_BYTES)
    except UserFileError as err:
        raise UsageError(str(err)) from None
    out = [(f"{option} {path} line {number}", line) for number, line in enumerate(text.splitlines(), 1)
           if line.strip()]
    if not out:
        raise UsageError(f"{option} {path}: no prompts (the file is empty)")
    return out


def _prompts(args, tokenizer=None) -> list[Prompt]:
    """The prompts of the command line, as token ids (text encoded with ``tokenizer``)."""
    from fxsched.runtime.generate import GenerateError, parse_prompt
    from fxsched.runtime.text import TokenizerError

    option, value = _prompt_option(args)
    chat = getattr(args, "chat", False)
    is_text = option in ("--prompt", "--prompt-file")
    if chat and not is_text:
        raise UsageError(f"--chat: needs text prompts (--prompt or --prompt-file), not {option}")
    if is_text and tokenizer is None:
        ids_option = "--prompt-ids" if option == "--prompt" else "--prompt-ids-file"
        raise UsageError(f"{option}: the model has no tokenizer (no tokenizer.json), so it takes token ids: "
                         f"use {ids_option} (or --tokenizer DIR)")
    if option in ("--prompt", "--prompt-ids"):
        items = [(option, value)]
    else:
        items = getattr(args, "prompt_lines", None) or _lines(option, value)
    out = []
    try:
        for source, item in items:
            if not is_text:
                out.append(Prompt(source, parse_prompt(item, source)))
                continue
            if not item.strip():
                raise UsageError(f"{source}: the prompt is empty")
            if chat:
                tokens = tokenizer.encode_chat([{"role": "user", "content": item}])
            else:
                tokens = tokenizer.encode(item)
            if not tokens:
                raise UsageError(f"{source}: the prompt encodes to no tokens")
            out.append(Prompt(source, tokens, item))
    except GenerateError as err:
        raise UsageError(str(err)) from None
    except TokenizerError as err:
        raise UsageError(f"{'--chat' if chat else option}: {err}") from None
    return out


# --- LoRA adapters ----------------------------------------------------------------------------------

BASE_ADAPTER = "base"  # --lora-prompts' name of the model without adapter


@dataclass(frozen=True)
class LoraChoice:
    """``--lora`` and ``--lora-prompts``, checked before torch: the adapters (name, directory), in pool
    slot order, the adapter of each prompt (a slot, -1: none, repeated over the requests) and the
    pool's rank (the largest ``r`` of their configs, at least 16)."""

    adapters: tuple[tuple[str, str], ...]
    slots: tuple[int, ...]
    max_rank: int


def _lora_choice(args) -> Optional[LoraChoice]:
    items = getattr(args, "lora", None) or []
    plan = getattr(args, "lora_prompts", None)
    if not items:
        if plan is not None:
            raise UsageError("--lora-prompts: needs --lora [NAME=]PATH")
        return None
    if getattr(args, "ep_ranks", 1) > 1:
        raise UsageError(f"--lora: not under expert parallelism (--ep-ranks {args.ep_ranks})")
    adapters: list[tuple[str, str]] = []
    rank = 16
    for item in items:
        name, sep, path = item.partition("=")
        if not sep:
            name, path = Path(item.rstrip("/")).name or item, item
        if not name or name == BASE_ADAPTER or any(name == n for n, _ in adapters):
            raise UsageError(f"--lora {item}: the name {name!r} is " +
                             ("reserved for the base model" if name == BASE_ADAPTER else "taken or empty") +
                             " (give NAME=PATH)")
        if not Path(path).is_dir():
            raise UsageError(f"--lora {item}: " + ("not a directory" if Path(path).exists()
                                                   else "no such adapter directory"))
        try:
            r = json.loads((Path(path) / "adapter_config.json").read_text()).get("r")
            if isinstance(r, int) and not isinstance(r, bool) and r > rank:
                rank = r
        except (OSError, ValueError, AttributeError):
            pass  # the loader names what is wrong with it
        adapters.append((name, path))
    names = [n for n, _ in adapters]
    if plan is None:
        if len(adapters) > 1:
            raise UsageError(f"--lora: {len(adapters)} adapters; say which prompt runs with which with "
                             f"--lora-prompts NAME,... ({', '.join(names)} or {BASE_ADAPTER})")
        plan = names[0]
    slots = []
    for word in (w.strip() for w in plan.split(",")):
        if word != BASE_ADAPTER and word not in names:
            raise UsageError(f"--lora-prompts {plan}: {word!r} is not an adapter of --lora (choose from "
                             f"{', '.join(names)} or {BASE_ADAPTER})")
        slots.append(-1 if word == BASE_ADAPTER else names.index(word))
    return LoraChoice(tuple(adapters), tuple(slots), rank)


def _load_adapters(engine, lora: LoraChoice) -> None:
    """Load ``lora``'s adapters into the engine's pool, slot i the i-th (one line naming a bad one)."""
    from fxsched.runtime.torch_model.errors import AdapterError

    for slot, (name, path) in enumerate(lora.adapters):
        try:
            engine.load_adapter(slot, path)
        except AdapterError as err:
            raise UsageError(f"--lora {name}: {err}") from None


# --- output ---------------------------------------------------------------------------------------


class Printer:
    """Writes a run's results to ``out`` as the chosen mode asks (see the module docstring)."""

    def __init__(self, out, mode: str, count: int, think: bool = False):
        self.out, self.mode, self.count, self.think = out, mode, count, think
        self.streaming = mode == "text" and count == 1
        self._ended_with_newline = True
        self.adapters: dict[int, Optional[str]] = {}  # request id -> its --lora adapter's name (None: base)

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def on_text(self, request_id: int, piece: str) -> None:
        if self.streaming:
            self._write(piece)
            self._ended_with_newline = piece.endswith("\n")

    def on_finish(self, result) -> None:
        if self.mode == "json":
            record = result.to_json(result.id - 1)
            if self.adapters:
                record["lora"] = self.adapters.get(result.id)
            self._write(json.dumps(record, ensure_ascii=False) + "\n")
        elif self.mode == "text" and self.streaming:
            self._write(("" if self._ended_with_newline else "\n") + result.render_header(self.think) + "\n")
        elif self.mode == "text":
            text = result.text or ""
            self._write(result.render_header(self.think) + "\n" + text + ("" if text.endswith("\n") else "\n"))

    def finish(self, result) -> None:
        if self.mode == "tokens":
            for r in result.results:
                print(r.render(), file=self.out)
        if self.mode == "json":
            self._write(json.dumps(result.summary.to_json()) + "\n")
        else:
            print(result.summary.line(), file=self.out)


# --- the commands ---------------------------------------------------------------------------------


def run_generate(args, out=None) -> int:
    """``fxsched generate``; raises UsageError for bad input."""
    out = out or sys.stdout
    # what can be checked without torch first (an error within a second): the numbers, the paths,
    # the prompt files (read, bounded, now; tokenized once the tokenizer is loaded)
    if args.spec not in SPECS:
        raise UsageError(f"--spec {args.spec}: unknown speculation mode (choose from {', '.join(SPECS)})")
    max_tokens = _int(args.max_tokens, "--max-tokens", 1)
    batch = _int(args.batch, "--batch", 1, MAX_SEQUENCES)
    for name, default in (("temperature", "0"), ("top_p", "1"), ("min_p", "0")):
        _float(str(getattr(args, name, None) or default), "--" + name.replace("_", "-"))
    for name, default in (("top_k", "0"), ("logprobs", "0")):
        _int(str(getattr(args, name, None) or default), "--" + name.replace("_", "-"), 0)
    _int(str(getattr(args, "seed", None) or "0"), "--seed", -(2**62), 2**62)
    if _int(str(getattr(args, "logprobs", None) or "0"), "--logprobs", 0) and not args.json:
        raise UsageError(f"--logprobs {args.logprobs}: needs --json (the logprobs are written in its records)")
    args.dtype = normalize_dtype(getattr(args, "dtype", None))
    option, value = _prompt_option(args)
    if option.endswith("-file"):
        args.prompt_lines = _lines(option, value)
    stops = tuple(getattr(args, "stop", None) or ())
    if any(not s for s in stops):
        raise UsageError("--stop: a stop string must not be empty")
    record = getattr(args, "record", None)
    if record is not None:
        from fxsched.runtime.cli.bounds import record_problem

        problem = record_problem(record, getattr(args, "force", False))
        if problem:
            raise UsageError(f"--record {record}: {problem}")
    choice = _model_choice(args, dflash=args.spec == "dflash")
    if batch > 16 and choice.model is not None and not choice.default:  # a checkpoint gets the slots asked
        choice = dataclasses.replace(choice, max_slots=batch)
    lora = _lora_choice(args)
    if lora is not None:
        if choice.model is None:
            raise UsageError("--lora: needs a Hugging Face checkpoint (--model DIR or the default model), not --weights")
        choice = dataclasses.replace(choice, max_loras=len(lora.adapters), max_lora_rank=lora.max_rank)
    _check_text_model(args, choice, option)
    if getattr(args, "overlap", False) and choice.ep_ranks > 1:
        raise UsageError(f"--overlap: the device lane does not run under expert parallelism (--ep-ranks {choice.ep_ranks})")
    if getattr(args, "async_scheduling", None) and choice.ep_ranks > 1:
        raise UsageError(f"--async-scheduling: not under expert parallelism (--ep-ranks {choice.ep_ranks}): its "
                         f"words carry every token to the workers")
    from fxsched.runtime.generate import GenerateError, TextOptions, check_prompt, expand_prompts

    sampling = _sampling(args)
    device = _torch_device(args.device)
    tokenizer = _tokenizer(args, choice)
    if stops and tokenizer is None:
        raise UsageError("--stop: stop strings need a tokenizer, and the model has none (give --tokenizer DIR)")
    prompts = _prompts(args, tokenizer)
    engine = _engine(choice, device)
    cfg = engine.cfg
    if batch > cfg.max_slots:
        raise UsageError(f"--batch {batch}: must be between 1 and {cfg.max_slots} (the model's slots)")
    try:
        for prompt in prompts:
            check_prompt(prompt.tokens, cfg, prompt.source)
    except GenerateError as err:
        raise UsageError(str(err)) from None
    _set_threads(args.threads, device, checkpoint=args.model is not None)
    token_lists = expand_prompts([p.tokens for p in prompts], batch)
    if lora is not None:
        _load_adapters(engine, lora)
    if args.ignore_eos:
        eos_ids: Optional[tuple[int, ...]] = ()
    elif tokenizer is not None and tokenizer.eos_ids:
        eos_ids = tokenizer.eos_ids
    else:
        eos_ids = None  # the model config's
    from fxsched.runtime.generate import GenerateInterrupted

    mode = "json" if args.json else ("text" if tokenizer is not None else "tokens")
    printer = Printer(out, mode, len(token_lists), think=tokenizer is not None and tokenizer.think_ids is not None)
    text = TextOptions(tokenizer, stops) if tokenizer is not None else None
    total = len(token_lists) * max_tokens
    bar = None
    if total >= PROGRESS_MIN_TOKENS and not args.no_progress and not printer.streaming:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="tok", desc=f"generate ({args.spec})", disable=None, leave=False)
    interrupted, failure = False, None
    from fxsched.runtime.interpreter import RunError

    try:
        from fxsched.runtime.cli.ep import generate_function

        run = generate_function(args)
        lane: dict[str, Any] = {"overlap": True} if getattr(args, "overlap", False) else {}
        if getattr(args, "async_scheduling", None) is not None and choice.ep_ranks <= 1:
            lane["async_scheduling"] = args.async_scheduling
        if lora is not None:
            lane["adapter_slots"] = [lora.slots[i % len(lora.slots)] for i in range(len(token_lists))]
            printer.adapters = {i + 1: lora.adapters[slot][0] if slot >= 0 else None
                                for i, slot in enumerate(lane["adapter_slots"])}
        result = run(engine, token_lists, max_tokens, args.spec, batch,
                     progress=bar.update if bar is not None else None, eos_ids=eos_ids, text=text,
                     on_text=printer.on_text, on_finish=printer.on_finish, sampling=sampling,
                     **_record_options(record, choice, prompts), **lane)
    except GenerateError as err:
        raise UsageError(str(err)) from None
    except GenerateInterrupted as stop:  # Ctrl-C: the unfinished requests were reported as "interrupted"
        result, interrupted = stop.result, True
    except RunError as err:  # an EP group that failed mid-run: what was generated until then, then the error
        if getattr(err, "result", None) is None:
            raise
        result, failure = err.result, str(err)  # type: ignore[attr-defined]
    finally:
        if bar is not None:
            bar.close()
    printer.finish(result)
    if failure is not None:
        print(f"fxsched generate: {failure}", file=sys.stderr)
        return EXIT_FAILED
    if interrupted:
        print("fxsched generate: interrupted (Ctrl-C); the output is what was generated until then",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_FAILED if any(r.error for r in result.results) else 0


def _record_options(record: Optional[str], choice: ModelChoice, prompts: list) -> dict[str, Any]:
    """The ``generate`` keywords of ``--record`` (none without it): the path and the header's meta."""
    if record is None:
        return {}
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = version("fxsched")
    except PackageNotFoundError:
        release = "unknown"
    model = choice.model or choice.weights or "internal model (seeded)"
    return {"record": record, "record_meta": {"model": model, "prompts": len(prompts), "fxsched": release}}


def _reporting(command: str, run: Callable[[], int]) -> int:
    """Run a command; a usage error or a failed run is one line on stderr and its exit code. (The
    interpreter, and with it the scheduler, is imported only once a run has failed: a RunError can
    only come from a run that imported it, and a usage error needs neither.)"""
    try:
        return run()
    except UsageError as err:
        print(f"fxsched {command}: {err}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as err:
        from fxsched.runtime.interpreter import RunError

        if not isinstance(err, RunError):
            raise
        print(f"fxsched {command}: {err}", file=sys.stderr)
        return EXIT_FAILED


def cmd_generate(args) -> int:
    return _reporting("generate", lambda: run_generate(args))


def run_bench_generate(args, out=None) -> list[dict]:
    out = out or sys.stdout
    from fxsched.runtime.bench.generate import PROMPT_SETS, bench_generate, format_table, row_json
    from fxsched.runtime.generate import SPECS

    device = _torch_device(args.device)
    batches = [_int(b, "--batches", 1) for b in args.batches.split(",") if b.strip()]
    if not batches:
        raise UsageError(f"--batches {args.batches!r}: give batch sizes separated by commas, e.g. 1,4,16")
    specs = [s.strip() for s in args.specs.split(",") if s.strip()]
    if not specs:
        raise UsageError(f"--specs {args.specs!r}: give speculation modes separated by commas, e.g. none,mtp")
    for spec in specs:
        if spec not in SPECS:
            raise UsageError(f"--specs {spec}: unknown speculation mode (choose from {', '.join(SPECS)})")
    max_tokens = _int(args.max_tokens, "--max-tokens", 1)
    temperature = _float(getattr(args, "bench_temperature", None) or "0", "--temperature")
    if not 0 <= temperature <= 100:
        raise UsageError(f"--temperature {args.bench_temperature}: must be between 0 and 100")
    sets = [s.strip() for s in getattr(args, "prompts", ",".join(PROMPT_SETS)).split(",") if s.strip()]
    for name in sets or [""]:
        if name not in PROMPT_SETS:
            raise UsageError(f"--prompts {name or args.prompts!r}: unknown prompt set (choose from "
                             f"{', '.join(PROMPT_SETS)})")
    from fxsched.runtime.bench.generate import OVERLAPS

    overlap = getattr(args, "bench_overlap", None) or "off"
    if overlap not in OVERLAPS:
        raise UsageError(f"--overlap {overlap}: choose from {', '.join(OVERLAPS)}")
    rounds = _int(getattr(args, "bench_rounds", None) or "3", "--rounds", 1)
    from fxsched.runtime.cli.ep import parse_ranks_list

    try:
        ranks = parse_ranks_list(getattr(args, "bench_ep_ranks", None) or "1")
    except ValueError as err:
        raise UsageError(f"--ep-ranks {err}") from None
    choice = _model_choice(args, dflash="dflash" in specs)
    tokenizer = _tokenizer(args, choice)
    engine = _engine(choice, device)  # validates the model once
    for b in batches:
        if b > engine.cfg.max_slots:
            raise UsageError(f"--batches {b}: must be between 1 and {engine.cfg.max_slots} (the model's slots)")
    experts = engine.cfg.num_experts if "moe" in engine.cfg.mlp_pattern else 0
    for n in ranks:
        if experts and n > experts:
            raise UsageError(f"--ep-ranks {n}: {choice.label} takes at most {experts} ranks ({experts} experts per "
                             f"MoE layer, at least one per rank)")
    _set_threads(None, device)
    from tqdm import tqdm

    bar = tqdm(desc="bench generate", unit="run", disable=None, leave=False)

    def progress(what: str) -> None:
        bar.set_postfix_str(what)
        bar.update()

    try:
        from dataclasses import replace

        rows = bench_generate(lambda n=1: _engine(replace(choice, ep_ranks=n), device), batches, max_tokens, specs,
                              progress=progress, tokenizer=tokenizer, prompt_sets=sets, ep_ranks=ranks,
                              model_dir=choice.model, weights=choice.weights, temperature=temperature,
                              overlap=overlap, rounds=rounds)
    finally:
        bar.close()
    model = choice.model or choice.weights or "random (seeded)"
    label = "default model" if choice.default else ("model" if choice.model else "weights")
    if getattr(args, "json", False):
        for row in rows:
            record = {**row_json(row), "device": device, "max_tokens": max_tokens, "temperature": temperature,
                      "model": model}
            print(json.dumps(record), file=out)
        return rows
    print(f"bench generate: device={device} max_tokens={max_tokens} temperature={temperature:g} {label}={model}",
          file=out)
    print(format_table(rows), file=out)
    return rows


def cmd_bench_generate(args) -> int:
    def run() -> int:
        run_bench_generate(args)
        return 0

    return _reporting("bench generate", run)


# --- standalone entry point -----------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from fxsched.runtime.cli.app import ArgumentParser  # one-line refusals, as the fxsched command's

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
