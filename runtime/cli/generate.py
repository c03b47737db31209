"""``fxsched generate`` and ``fxsched bench generate``: the torch model driven by the scheduler.

Wiring into ``fxsched.runtime.cli.app.build_parser`` takes one line per command::

    add_generate_command(sub)      # after the other sub.add_parser(...) calls
    add_bench_generate(bench)      # after the bench parser is set up

``python -m fxsched.runtime.cli.generate generate ...`` runs the same commands standalone.

Bad input (an empty or malformed prompt, a token id outside the vocabulary, a prompt longer than
the context, an unknown ``--spec``, ``--device cuda`` without CUDA, a missing or unreadable
weights file) exits 2 with one line on stderr naming the input and what is wrong.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Optional

EXIT_USAGE = 2
EXIT_FAILED = 1
PROGRESS_MIN_TOKENS = 512  # show a progress bar when a run may produce this many tokens


class UsageError(Exception):
    """A one-line complaint about the command line."""


# --- argument parsing ------------------------------------------------------------------------------


def add_generate_command(sub) -> None:
    """Register ``generate`` (with its own ``func``) on an ``add_subparsers`` object."""
    p = sub.add_parser("generate", help="generate tokens with the torch model, scheduled by fxsched",
                       description="Greedy generation on the small hybrid torch model through the scheduler. "
                                   "Prints the tokens of each request and a summary line.")
    p.add_argument("--prompt", help='token ids separated by spaces or commas, e.g. "1 2 3"')
    p.add_argument("--prompt-file", help="a file with one prompt (token ids) per non-blank line")
    p.add_argument("--batch", default="1",
                   help="requests running at once (default 1); fewer prompts are repeated to fill the batch")
    p.add_argument("--max-tokens", default="32", help="tokens to generate per request (default 32)")
    p.add_argument("--spec", default="none", help="speculation: none, mtp, dflash or ngram (default none)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--weights", help="a safetensors weights file (default: the seeded random model)")
    p.add_argument("--threads", default=None, help="torch CPU threads (default 1: the model is tiny)")
    p.add_argument("--no-progress", action="store_true", help="never show the progress bar")
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
    bench.add_argument("--specs", default="none,mtp,dflash", help="speculation modes, comma-separated (generate)")
    bench.add_argument("--weights", help="a safetensors weights file (generate)")
    previous = bench.get_default("func")

    def dispatch(args) -> int:
        if args.what == "generate":
            return cmd_bench_generate(args)
        return previous(args)

    bench.set_defaults(func=dispatch)


def _int(value: str, name: str, low: int, high: Optional[int] = None) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise UsageError(f"{name} {value}: not an integer") from None
    if n < low or (high is not None and n > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise UsageError(f"{name} {value}: must be {bound}")
    return n


def _torch_device(name: str) -> str:
    import torch

    if name == "cpu":
        return "cpu"
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise UsageError(f"--device {name}: CUDA is not available on this machine")
        return name
    raise UsageError(f"--device {name}: unknown device (choose cpu or cuda)")


def _set_threads(value: Optional[str], device: str) -> None:
    import torch

    if value is not None:
        torch.set_num_threads(_int(value, "--threads", 1))
    elif device == "cpu":
        torch.set_num_threads(1)


def _engine(weights: Optional[str], device: str):
    from fxsched.runtime.torch_model import HybridEngine, default_config
    from fxsched.runtime.torch_model.errors import TorchModelError

    if weights is None:
        return HybridEngine(default_config(), device=device)
    path = Path(weights)
    if not path.is_file():
        raise UsageError(f"--weights {weights}: no such file")
    try:
        return HybridEngine.from_weights_file(path, device=device)
    except (TorchModelError, OSError, ValueError) as err:
        raise UsageError(f"--weights {weights}: {err}") from None


def _prompts(args) -> list[tuple[str, list[int]]]:
    from fxsched.runtime.generate import GenerateError, parse_prompt

    if args.prompt is not None and args.prompt_file is not None:
        raise UsageError("--prompt and --prompt-file: give one of them, not both")
    if args.prompt is None and args.prompt_file is None:
        raise UsageError("no prompt: give --prompt \"1 2 3\" or --prompt-file FILE")
    try:
        if args.prompt is not None:
            return [("--prompt", parse_prompt(args.prompt, "--prompt"))]
        path = Path(args.prompt_file)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise UsageError(f"--prompt-file {path}: no such file") from None
        except OSError as err:
            raise UsageError(f"--prompt-file {path}: {err.strerror or err}") from None
        out = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                source = f"--prompt-file {path} line {number}"
                out.append((source, parse_prompt(line, source)))
        if not out:
            raise UsageError(f"--prompt-file {path}: no prompts (the file is empty)")
        return out
    except GenerateError as err:
        raise UsageError(str(err)) from None


# --- the commands ---------------------------------------------------------------------------------


def run_generate(args, out=None) -> int:
    """``fxsched generate``; raises UsageError for bad input."""
    out = out or sys.stdout
    from fxsched.runtime.generate import SPECS, GenerateError, check_prompt, expand_prompts, generate

    if args.spec not in SPECS:
        raise UsageError(f"--spec {args.spec}: unknown speculation mode (choose from {', '.join(SPECS)})")
    max_tokens = _int(args.max_tokens, "--max-tokens", 1)
    batch = _int(args.batch, "--batch", 1)
    sources = _prompts(args)
    device = _torch_device(args.device)
    engine = _engine(args.weights, device)
    cfg = engine.cfg
    if batch > cfg.max_slots:
        raise UsageError(f"--batch {batch}: must be between 1 and {cfg.max_slots} (the model's slots)")
    try:
        for source, tokens in sources:
            check_prompt(tokens, cfg, source)
    except GenerateError as err:
        raise UsageError(str(err)) from None
    _set_threads(args.threads, device)
    prompts = expand_prompts([t for _, t in sources], batch)
    total = len(prompts) * max_tokens
    bar = None
    if total >= PROGRESS_MIN_TOKENS and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="tok", desc=f"generate ({args.spec})", disable=None, leave=False)
    try:
        from fxsched.runtime.cli.ep import generate_function

        run = generate_function(args) if getattr(args, "ep_ranks", 1) > 1 else generate
        result = run(engine, prompts, max_tokens, args.spec, batch, progress=bar.update if bar is not None else None)
    except GenerateError as err:
        raise UsageError(str(err)) from None
    finally:
        if bar is not None:
            bar.close()
    for r in result.results:
        print(r.render(), file=out)
    print(result.summary.line(), file=out)
    return EXIT_FAILED if any(r.error for r in result.results) else 0


def _reporting(command: str, run: Callable[[], int]) -> int:
    """Run a command; a usage error or a failed run is one line on stderr and its exit code."""
    from fxsched.runtime.interpreter import RunError

    try:
        return run()
    except UsageError as err:
        print(f"fxsched {command}: {err}", file=sys.stderr)
        return EXIT_USAGE
    except RunError as err:
        print(f"fxsched {command}: {err}", file=sys.stderr)
        return EXIT_FAILED


def cmd_generate(args) -> int:
    return _reporting("generate", lambda: run_generate(args))


def run_bench_generate(args, out=None) -> list[dict]:
    out = out or sys.stdout
    from fxsched.runtime.bench.generate import bench_generate, format_table
    from fxsched.runtime.generate import SPECS

    device = _torch_device(args.device)
    batches = [_int(b, "--batches", 1) for b in args.batches.split(",") if b.strip()]
    specs = [s.strip() for s in args.specs.split(",") if s.strip()]
    for spec in specs:
        if spec not in SPECS:
            raise UsageError(f"--specs {spec}: unknown speculation mode (choose from {', '.join(SPECS)})")
    max_tokens = _int(args.max_tokens, "--max-tokens", 1)
    engine = _engine(args.weights, device)  # validates the weights once
    for b in batches:
        if b > engine.cfg.max_slots:
            raise UsageError(f"--batches {b}: must be between 1 and {engine.cfg.max_slots} (the model's slots)")
    _set_threads(None, device)
    from tqdm import tqdm

    bar = tqdm(desc="bench generate", unit="run", disable=None, leave=False)

    def progress(what: str) -> None:
        bar.set_postfix_str(what)
        bar.update()

    try:
        rows = bench_generate(lambda: _engine(args.weights, device), batches, max_tokens, specs, progress=progress)
    finally:
        bar.close()
    print(f"bench generate: device={device} max_tokens={max_tokens} weights={args.weights or 'random (seeded)'}",
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
    parser = argparse.ArgumentParser(prog="fxsched", description="fxsched generate / bench generate")
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
