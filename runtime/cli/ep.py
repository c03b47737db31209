"""``--ep-ranks N`` for ``fxsched run`` and ``fxsched generate``: helpers the CLI calls.

Wiring (``fxsched.runtime.cli.app``), three lines::

    add_ep_ranks_argument(run)                        # in build_parser, after the run options
    trace = run_with_ep(args) if args.ep_ranks > 1 else run_scenario(scenario)   # in cmd_run

and for ``generate`` (``fxsched.runtime.cli.generate``, its run ``fxsched.runtime.cli.generate_run``)::

    add_ep_ranks_argument(p)                          # in add_generate_command
    result = generate_function(args)(engine, prompts, max_tokens, args.spec, batch, progress=...)

``--ep-ranks 1`` (the default) is the plain single-rank run. A failed EP group raises
``EpRunError``, a ``RunError``: the commands print it (``fxsched run: EP worker 1 did not answer
within 30s``, or ``EP worker 1 died (its process exited with code 3)`` when it ended) and exit 1;
``generate`` first prints what the run generated until then, when it got that far.
``--ep-ranks`` takes 1 to ``MAX_RANKS``, ``--ep-timeout`` seconds above 0, at most ``MAX_TIMEOUT_S``.

With ``--model DIR`` of a MoE checkpoint the ranks split its experts (specs/expert-parallel.md
§10.2): the leader loads ``expert_shard=(0, N)``, each worker its own range from DIR, and before the
first forward ``generate`` prints one line on stderr with every rank's weight memory
(``fxsched generate: EP weights per rank: rank 0 0.854 MiB (experts 0.234 + other 0.619), rank 1
0.234 MiB (experts 0.234)``).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from typing import Callable

from fxsched.runtime.ep import DEFAULT_TIMEOUT_S


MAX_RANKS = 64
MAX_TIMEOUT_S = 86_400.0  # a day


def _ranks(text: str) -> int:
    if not re.fullmatch(r"[0-9]{1,9}", text):
        raise argparse.ArgumentTypeError(f"{text}: not an integer")
    n = int(text)
    if not 1 <= n <= MAX_RANKS:
        raise argparse.ArgumentTypeError(f"{text}: must be from 1 to {MAX_RANKS}")
    return n


def _seconds(text: str) -> float:
    if not re.fullmatch(r"[0-9]+\.?[0-9]*|\.[0-9]+|[0-9]+(\.[0-9]*)?[eE][+-]?[0-9]+", text):
        raise argparse.ArgumentTypeError(f"{text}: not a number of seconds")
    s = float(text)
    if not (math.isfinite(s) and 0 < s <= MAX_TIMEOUT_S):
        raise argparse.ArgumentTypeError(f"{text}: must be a number of seconds above 0, at most {MAX_TIMEOUT_S:g}")
    return s


def add_ep_ranks_argument(parser: "argparse._ActionsContainer") -> None:
    """``--ep-ranks N`` and ``--ep-timeout S`` on a ``run`` or ``generate`` parser."""
    parser.add_argument("--ep-ranks", type=_ranks, default=1, metavar="N",
                        help="expert-parallel ranks: rank 0 schedules, ranks 1..N-1 are worker processes "
                             "(torch.distributed over loopback; default 1)")
    parser.add_argument("--ep-timeout", type=_seconds, default=DEFAULT_TIMEOUT_S, metavar="S",
                        help=f"seconds the leader waits on a worker before failing the requests in flight "
                             f"(default {DEFAULT_TIMEOUT_S:g})")


def run_with_ep(args, scenario=None) -> str:
    """The trace of ``fxsched run NAME --ep-ranks N`` (byte for byte the single-rank trace).
    Raises ScenarioError for a bad name and RunError (EpRunError) when the run or the group fails."""
    from fxsched.runtime.ep.run import run_scenario_ep, stop_launcher
    from fxsched.runtime.scenarios.loader import load_scenario

    try:
        return run_scenario_ep(scenario if scenario is not None else load_scenario(args.name), args.ep_ranks,
                               args.ep_timeout)
    finally:
        stop_launcher()


def generate_function(args) -> Callable:
    """``generate.generate`` for one rank, else ``generate_ep`` bound to the EP options (same
    positional and keyword arguments, same result type)."""
    if getattr(args, "ep_ranks", 1) <= 1:
        from fxsched.runtime.generate import generate

        return generate
    from functools import partial

    model = getattr(args, "model", None)
    extra = {"model_dir": model, "on_weights": print_weights} if model is not None else {}
    return partial(generate_ep_then_stop, ep_ranks=args.ep_ranks, weights=getattr(args, "weights", None),
                   timeout_s=args.ep_timeout, **extra)


def generate_ep_then_stop(*args, **kwargs):
    """``generate_ep``, then the launcher stopped: no EP process outlives the command
    (runtime/ep/run.py ``stop_launcher``)."""
    from fxsched.runtime.ep.generate import generate_ep
    from fxsched.runtime.ep.run import stop_launcher

    try:
        return generate_ep(*args, **kwargs)
    finally:
        stop_launcher()


def print_weights(report) -> None:
    """The per-rank weights line of ``fxsched generate --ep-ranks N --model DIR`` (stderr)."""
    print(f"fxsched generate: {report.line()}", file=sys.stderr, flush=True)


def parse_ranks_list(text: str) -> list[int]:
    """``--ep-ranks 1,2,4`` of ``bench generate``: rank counts from 1 to MAX_RANKS, comma-separated
    (ValueError with a one-line reason otherwise)."""
    out = []
    for item in text.split(","):
        try:
            out.append(_ranks(item.strip()))
        except argparse.ArgumentTypeError as err:
            raise ValueError(str(err)) from None
    return out
