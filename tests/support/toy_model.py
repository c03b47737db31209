"""The internal toy model as a weights file, for CLI tests written against it.

`fxsched generate` / `fxsched bench generate` without `--model` or `--weights` run the embedded
default model (the Hugging Face directory specs/models/default/). Tests that check the internal
model's tokens, vocabulary bounds or "no tokenizer" errors name it explicitly: `toy_argv(argv)` adds
`--weights FILE` (the seeded `default_config()` weights, written once per process to a temporary
folder that is removed at exit) to a generate / bench generate command line that names no model.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import shutil
import tempfile
from pathlib import Path

MODEL_OPTIONS = ("--model", "--weights")


@functools.cache
def toy_weights_file() -> Path:
    """A safetensors file of the internal model's seeded weights (fxsched/specs/models/default.toml)."""
    from fxsched.runtime.torch_model import default_config, init_weights, save_weights

    folder = Path(tempfile.mkdtemp(prefix="fxsched-toy-"))
    atexit.register(shutil.rmtree, folder, True)
    path = folder / "toy.safetensors"
    cfg = default_config()
    save_weights(path, init_weights(cfg), cfg)
    return path


def toy_argv(argv: list[str]) -> list[str]:
    """argv with `--weights <toy>` appended when it is a generate / bench generate command naming no model."""
    command = argv[:2] if argv[:1] == ["bench"] else argv[:1]
    if command not in (["generate"], ["bench", "generate"]) or any(a in MODEL_OPTIONS for a in argv):
        return argv
    return [*argv, "--weights", str(toy_weights_file())]


def wired_parser() -> argparse.ArgumentParser:
    """build_parser(), which already has the two lines the CLI adds (added again if missing)."""
    from fxsched.runtime.cli.app import build_parser
    from fxsched.runtime.cli.generate import add_bench_generate, add_generate_command

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    if "generate" not in sub.choices:
        add_generate_command(sub)
        add_bench_generate(sub.choices["bench"])
    return parser


def run_fxsched(*argv: str, toy: bool = True) -> int:
    """Run one fxsched command in this process; with `toy`, on the internal model unless one is named."""
    words = toy_argv(list(argv)) if toy else list(argv)
    args = wired_parser().parse_args(words)
    return int(args.func(args))
