"""The ``fxsched`` command line.

Bad input never ends in a traceback: an argument the parser refuses, a value out of range, a
scenario or replay file that cannot be used, all print ONE line on stderr naming the input and
what is wrong, and exit 2 (``EXIT_USAGE``). A run that fails exits 1 with one line; output that
cannot be written (a full disk) is one line on stderr and exit 1; Ctrl-C exits 130
(``EXIT_INTERRUPTED``; ``generate`` first prints what it generated so far).

Goldens: ``run NAME --write`` / ``--check`` use ``specs/goldens/NAME.trace`` for a shipped
scenario (named, or given by the path of its own file in ``specs/scenarios``); for any other
scenario file ``PATH.toml`` the golden is the file next to it, ``PATH.trace``, so a copy of a
shipped scenario never overwrites the shipped golden.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from pathlib import Path

from fxsched.runtime.logs import configure_logging

from fxsched.runtime.cli.arguments import (EXIT_INTERRUPTED, EXIT_USAGE, ArgumentParser, int_arg,
                                          sizes_arg)


def _golden_path(name: str) -> Path:
    from fxsched.runtime.scenarios.loader import specs_dir

    return specs_dir() / "goldens" / f"{name}.trace"


def _golden_for(scenario) -> Path:
    """The golden of a scenario (see the module docstring): the shipped one for a shipped
    scenario, else the ``.trace`` file next to the scenario's file."""
    from fxsched.runtime.scenarios.loader import is_shipped

    if is_shipped(scenario):
        return _golden_path(scenario.name)
    return Path(scenario.source).with_suffix(".trace")


def first_difference(got: str, want: str) -> str:
    """The first differing line of two traces, as a short report."""
    a, b = got.splitlines(), want.splitlines()
    for i, (x, y) in enumerate(zip(a, b, strict=False)):  # the traces may differ in length: checked below
        if x != y:
            return f"line {i + 1}:\n  got:  {x}\n  want: {y}"
    if len(a) != len(b):
        return f"line {min(len(a), len(b)) + 1}: got {len(a)} lines, want {len(b)}"
    return "the final newline differs"


def cmd_run(args) -> int:
    from fxsched.runtime.interpreter import RunError
    from fxsched.runtime.scenarios.runner import run_scenario
    from fxsched.runtime.scenarios.loader import ScenarioError, load_scenario, scenario_names

    if args.list:
        for name in scenario_names():
            print(name)
        return 0
    if not args.name:
        print("fxsched run: give a scenario name or path (or --list)", file=sys.stderr)
        return EXIT_USAGE
    try:
        scenario = load_scenario(args.name)
        if args.ep_ranks > 1:
            from fxsched.runtime.cli.ep import run_with_ep

            trace = run_with_ep(args, scenario)
        else:
            trace = run_scenario(scenario)
    except ScenarioError as err:
        print(f"fxsched run: {err}", file=sys.stderr)
        return EXIT_USAGE
    except RunError as err:
        print(f"fxsched run: {err}", file=sys.stderr)
        return 1
    if args.write:
        path = _golden_for(scenario)
        try:
            path.write_text(trace)
        except OSError as err:
            print(f"fxsched run --write: {path}: cannot write it ({err.strerror or err})", file=sys.stderr)
            return 1
        print(f"wrote {path}", file=sys.stderr)
        return 0
    if args.check:
        path = _golden_for(scenario)
        if not path.exists():
            print(f"fxsched run --check: no golden {path} (write it with --write)", file=sys.stderr)
            return 1
        try:
            want = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            print(f"fxsched run --check: {path}: cannot read it ({getattr(err, 'strerror', None) or err})",
                  file=sys.stderr)
            return 1
        if trace == want:
            print(f"{scenario.name}: matches {path.name}")
            return 0
        print(f"{scenario.name}: differs from {path.name} at {first_difference(trace, want)}")
        return 1
    sys.stdout.write(trace)
    return 0


def _replay_event_log(args) -> int:
    """``fxsched replay`` of an event log (``--record``): identical, or the first departing event."""
    from fxsched.runtime.eventlog_codec import EventLogError
    from fxsched.runtime.eventlog_replay import render_output, replay_log

    try:
        result = replay_log(args.file)
    except EventLogError as err:
        print(f"fxsched replay: {err}", file=sys.stderr)
        return EXIT_USAGE
    if result.departure is not None:
        print("\n".join(result.departure.report()))
        return 1
    if args.outputs:
        for index, output in result.outputs:
            print(render_output(index, output))
    print(result.summary())
    return 0


def cmd_replay(args) -> int:
    from fxsched.runtime.check.replay import ReplayError, replay_run
    from fxsched.runtime.eventlog_reader import is_event_log

    if is_event_log(args.file):
        return _replay_event_log(args)
    if args.outputs:
        print(f"fxsched replay: --outputs: only for an event log (fxsched generate --record), and {args.file} "
              f"is not one", file=sys.stderr)
        return EXIT_USAGE
    try:
        outcome = replay_run(args.file)
    except ReplayError as err:
        print(f"fxsched replay: {err}", file=sys.stderr)
        return EXIT_USAGE
    violation, data = outcome.violation, outcome.data
    departure = outcome.departure()
    if departure is not None:
        print(f"{args.file}: {departure}")
    if violation is None:
        print(f"{args.file}: the episode ran clean; the recorded {data['invariant']} did not happen again")
        return 0
    same = violation.invariant == data["invariant"]
    print(f"VIOLATION {violation.invariant}: {violation.message}"
          + ("" if same else f"  (the file recorded {data['invariant']})"))
    return 1


def cmd_bench(args) -> int:
    if args.what == "step":
        from fxsched.runtime.bench.step import print_step_bench

        print_step_bench(args.sizes, mode=args.mode, ticks=args.ticks, repeats=args.repeats, as_json=args.json,
                         memory=args.memory, warmup=args.warmup)
        return 0
    if args.what == "kernels" and args.aot:
        return _print_kernel_aot(args.json)
    if args.what == "kernels":
        try:
            from fxsched.kernels.bench import run_kernel_bench
        except ImportError as err:
            print(f"fxsched bench kernels: needs the gpu extra (torch, triton): {err}", file=sys.stderr)
            return EXIT_USAGE
        from fxsched.runtime.bench.step import print_table

        rows = run_kernel_bench("cuda" if _cuda() else "cpu", repeats=args.repeats)
        if args.json:
            import json

            for row in rows:
                print(json.dumps(row))
            return 0
        print_table(rows)
        return 0
    if args.what == "check":
        import json
        import statistics

        from fxsched.runtime.check.walk import usable_cpus, walk

        jobs = usable_cpus()
        rates: dict[int, list[float]] = {1: [], jobs: []}
        for seed in range(args.repeats):  # one process and all of them, side by side, seed by seed
            for n in rates:
                rates[n].append(walk(seed, steps=args.ticks * 100, jobs=n).steps_per_second)
        medians = {n: statistics.median(r) for n, r in rates.items()}
        if args.json:
            print(json.dumps({"steps": args.ticks * 100, "seeds": args.repeats, "jobs": jobs,
                              "steps_per_s_1": medians[1], f"steps_per_s_{jobs}": medians[jobs],
                              "ratio": medians[jobs] / medians[1]}))
            return 0
        for n, r in rates.items():
            print(f"random walk, {n} process{'es' if n > 1 else ''}: median {medians[n]:,.0f} steps/s over "
                  f"{args.repeats} seeds of {args.ticks * 100} steps (min {min(r):,.0f}, max {max(r):,.0f})")
        if jobs > 1:
            print(f"{jobs} processes / 1: {medians[jobs] / medians[1]:.2f}")
        return 0
    print(f"fxsched bench: unknown benchmark '{args.what}' (known: step, kernels, check, generate, gdn-prefill, "
          f"serve, e2e, host)", file=sys.stderr)
    return EXIT_USAGE


def _print_kernel_aot(as_json: bool) -> int:
    """`bench kernels --aot`: registers, spills and shared memory of every Triton kernel compiled for sm_90."""
    import json

    try:
        from fxsched.kernels.aot import compile_all  # imports triton before the kernel modules
    except ImportError as err:
        print(f"fxsched bench kernels --aot: needs triton (the gpu extra): {err}", file=sys.stderr)
        return EXIT_USAGE
    try:
        rows = compile_all()
    except RuntimeError as err:
        print(f"fxsched bench kernels --aot: {err}", file=sys.stderr)
        return EXIT_USAGE
    if as_json:
        for row in rows:
            print(json.dumps(row))
        return 0
    keys = list(rows[0]) if rows else []
    cells = [[str(k) for k in keys]] + [["-" if v is None else str(v) for v in row.values()] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(keys))]
    for line in cells:  # names left-aligned, numbers right-aligned
        padded = [c.ljust(w) if i < 5 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True))]
        print("  ".join(padded).rstrip())
    return 0


def cmd_phases(args) -> int:
    """Print the transition table: each phase, what it waits for, its rule, what a fault fails."""
    from fxsched.core.table import rows

    table = rows()
    if args.markdown:
        print("| phase | waits for | rule | a DeviceFault there fails |")
        print("|---|---|---|---|")
        for row in table:
            print("| " + " | ".join(row) + " |")
        return 0
    widths = [max(len(r[i]) for r in table) for i in range(3)]
    for phase, waits, rule, fault in table:
        print(f"{phase:<{widths[0]}}  {waits:<{widths[1]}}  {rule:<{widths[2]}}  {fault}")
    return 0


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="fxsched", description="LLM inference scheduling as a pure step function")
    _add_log_options(parser, False, "text")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a scenario on the recording device and print its trace")
    run.add_argument("name", nargs="?", help="scenario name (see --list) or path to a .toml file")
    run.add_argument("--list", action="store_true", help="list the known scenarios")
    mode = run.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true",
                      help="compare with the golden (specs/goldens/<name>.trace for a shipped scenario, PATH.trace "
                           "next to any other PATH.toml); print the first differing line")
    mode.add_argument("--write", action="store_true",
                      help="regenerate the golden (specs/goldens/<name>.trace for a shipped scenario, PATH.trace "
                           "next to any other PATH.toml)")
    run.add_argument("-v", "--verbose", action="store_true", dest="verbose_run", help="structlog events on stderr")
    from fxsched.runtime.cli.ep import add_ep_ranks_argument

    add_ep_ranks_argument(run)
    run.set_defaults(func=cmd_run)

    from fxsched.runtime.cli.check import add_check_command

    add_check_command(sub)

    rep = sub.add_parser("replay", help="re-run a checker replay file to its violation, or an event log "
                                        "(--record) through step, reporting the first departing event")
    rep.add_argument("file")
    rep.add_argument("--outputs", action="store_true",
                     help="event log: also print the client outputs of the re-run, one per line")
    rep.set_defaults(func=cmd_replay)

    phases = sub.add_parser("phases", help="print the transition table of step (phase, answers, rule, fault scope)")
    phases.add_argument("--markdown", action="store_true", help="as a Markdown table")
    phases.set_defaults(func=cmd_phases)

    bench = sub.add_parser("bench", help="print speed figures (medians of repeats); `bench gdn-prefill --help` "
                                         "for the GDN prefill memory figures, `bench e2e --help` for fxsched "
                                         "against transformers and vLLM end to end, `bench host --help` for "
                                         "the host's time per tick around a free forward")
    bench.add_argument("what", choices=["step", "kernels", "check"])
    bench.add_argument("--sizes", type=sizes_arg, default=(1, 8, 64, 256),
                       help="running sequences, comma-separated, each 1..4096 (step; default 1,8,64,256)")
    bench.add_argument("--ticks", type=int_arg(1, 1_000_000), default=200,
                       help="ticks per measurement (step; check: 100 steps per tick)")
    bench.add_argument("--repeats", type=int_arg(1, 1000), default=5, help="repeats; the median is reported")
    bench.add_argument("--warmup", type=int_arg(20, 1_000_000), default=20,
                       help="step: untimed ticks before the first timed window (default 20: admission and "
                            "prefill); more measures older sequences")
    bench.add_argument("--mode", choices=["plain", "spec5"], default="plain",
                       help="step: plain decode (compare vLLM A0) or 5-draft DFlash speculation (compare A5)")
    bench.add_argument("--memory", action="store_true",
                       help="step: bytes of state per generated token over --ticks ticks (tracemalloc)")
    bench.add_argument("--aot", action="store_true",
                       help="kernels: compile every Triton kernel for sm_90 (no GPU needed) and print registers, "
                            "spills and shared memory per kernel, model shape, dtype and K; --json: one object per row "
                            "(specs/gpu-kernels.md §17.4)")
    bench.set_defaults(func=cmd_bench)

    from fxsched.runtime.cli.generate import add_bench_generate, add_generate_command  # imports torch lazily

    add_generate_command(sub)
    add_bench_generate(bench)
    from fxsched.runtime.cli.serve import add_serve_command  # imports fastapi only when serve runs

    add_serve_command(sub)
    for command in sub.choices.values():  # -v and --log-format before or after the sub-command
        _add_log_options(command, argparse.SUPPRESS, argparse.SUPPRESS)
    return parser


def _add_log_options(parser: argparse.ArgumentParser, verbose_default: object, format_default: object) -> None:
    """``-v`` and ``--log-format`` on ``parser``; a sub-command's take ``SUPPRESS`` as their default,
    so the value given before the sub-command stands unless repeated after it."""
    from fxsched.runtime.logs import LOG_FORMATS

    names = {s for a in parser._actions for s in a.option_strings}
    if "-v" not in names:
        parser.add_argument("-v", "--verbose", action="store_true", default=verbose_default,
                            help="structlog events on stderr (INFO and up)")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default=format_default,
                        help="structlog events as key=value lines (text, the default) or one JSON object per line "
                             "(json)")


_OUTPUT_ERRORS = (errno.ENOSPC, errno.EIO, errno.EFBIG, errno.EDQUOT)


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush of what could not be written
    raises nothing more at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout without a file descriptor (a test's capture)
        pass


def main(argv=None) -> int:
    words = sys.argv[1:] if argv is None else list(argv)
    if words[:2] == ["bench", "gdn-prefill"]:  # its own options (runtime/bench/gdn_prefill.py)
        from fxsched.runtime.bench.gdn_prefill import main as gdn_prefill_main

        return gdn_prefill_main(words[2:])
    if words[:2] == ["bench", "e2e"]:  # its own options (runtime/bench/e2e.py)
        from fxsched.runtime.bench.e2e import main as bench_e2e_main

        return bench_e2e_main(words[2:])
    if words[:2] == ["bench", "linears"]:  # its own options (runtime/bench/linears.py)
        from fxsched.runtime.bench.linears import main as bench_linears_main

        return bench_linears_main(words[2:])
    if words[:2] == ["bench", "serve"] and any(w.split("=")[0] == "--vllm-python" for w in words[2:]):
        from fxsched.runtime.bench.serve_vllm import cli as bench_serve_vllm  # vLLM's client, both servers

        return bench_serve_vllm(words[2:])
    if words[:2] == ["bench", "serve"]:  # its own options (runtime/bench/serve.py)
        from fxsched.runtime.bench.serve import main as bench_serve_main

        return bench_serve_main(words[2:])
    if words[:2] == ["bench", "host"]:  # its own options (runtime/bench/host_cli.py)
        from fxsched.runtime.bench.host_cli import main as bench_host_main

        return bench_host_main(words[2:])
    parser = build_parser()
    try:
        args = parser.parse_args(words)
    except SystemExit as stop:  # --help, or a refusal already printed as one line
        return stop.code if isinstance(stop.code, int) else EXIT_USAGE
    configure_logging(args.verbose or getattr(args, "verbose_run", False), fmt=args.log_format)
    command = f"fxsched {args.command}"
    try:
        code = args.func(args)
        sys.stdout.flush()
        return code
    except BrokenPipeError:  # e.g. piped into head
        _silence_stdout()
        return 0
    except OSError as err:
        if err.errno not in _OUTPUT_ERRORS:
            raise
        print(f"{command}: cannot write the output ({err.strerror or err})", file=sys.stderr)
        _silence_stdout()
        return 1
    except KeyboardInterrupt:
        print(f"{command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
