"""``fxsched check``: the model checker's random walk (specs/checker.md §11.1), one seed or a sweep.

``--seed S`` walks one seed and prints its coverage; ``--seeds 1-200`` (a range, or a comma list of
seeds and ranges) walks each seed in turn for the same ``--steps`` / ``--time``, prints a line per
seed (and the violation, with its replay file, for each seed that breaks an invariant: the sweep
goes on), then one summary line and the features no seed reached. The exit status is 1 when any
seed broke an invariant, 2 for bad input, 0 otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

MAX_SWEEP = 100_000  # seeds in one sweep


def add_check_command(sub: Any) -> None:
    """The ``check`` subcommand on the ``fxsched`` parser's subparsers."""
    from fxsched.runtime.cli.arguments import MAX_SEED, int_arg, seconds_arg

    check = sub.add_parser("check", help="model-check step with a seeded random walk")
    which = check.add_mutually_exclusive_group()
    which.add_argument("--seed", type=int_arg(-MAX_SEED, MAX_SEED), default=0)
    which.add_argument("--seeds", type=seeds_arg, default=None, metavar="A-B[,C...]",
                       help="a sweep: walk each of these seeds (a range A-B, or a comma list of seeds and "
                            "ranges) for --steps or --time each; one line per seed")
    check.add_argument("--steps", type=int_arg(1, 10**12), help="stop after this many steps")
    check.add_argument("--time", type=seconds_arg, help="stop after this many seconds")
    check.add_argument("--replay-file", help="where to write the replay file of a violation (one seed only)")
    check.add_argument("--jobs", type=int_arg(1, 256), default=None,
                       help="processes running episodes (default: the usable CPUs; the report is the same for any)")
    check.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                       help="show a progress bar (default: on runs longer than a few seconds)")
    check.set_defaults(func=cmd_check)


def seeds_arg(text: str) -> tuple[int, ...]:
    """``1-200``, ``7``, ``1-5,9,20-22``: the seeds, in the order given, each once."""
    from fxsched.runtime.cli.arguments import MAX_SEED, strict_int

    seeds: list[int] = []
    for part in text.split(","):
        part = part.strip()
        low, dash, high = part.partition("-") if not part.startswith("-") else ("", "", "")
        try:
            first, last = (strict_int(low), strict_int(high)) if dash else (strict_int(part), strict_int(part))
        except (ValueError, argparse.ArgumentTypeError):
            raise argparse.ArgumentTypeError(f"{part!r} is not a seed or a range A-B of seeds") from None
        if first > last:
            raise argparse.ArgumentTypeError(f"the range {part!r} runs backwards")
        if not (0 <= first and last <= MAX_SEED):
            raise argparse.ArgumentTypeError(f"{part!r}: sweep seeds go from 0 to {MAX_SEED}")
        if last - first + 1 + len(seeds) > MAX_SWEEP:
            raise argparse.ArgumentTypeError(f"more than {MAX_SWEEP} seeds")
        seeds.extend(range(first, last + 1))
    return tuple(dict.fromkeys(seeds))


def cmd_check(args) -> int:
    from fxsched.runtime.cli.arguments import EXIT_USAGE

    if (args.steps is None) == (args.time is None):
        print("fxsched check: give exactly one of --steps N or --time SECONDS", file=sys.stderr)
        return EXIT_USAGE
    if args.replay_file is not None:
        if args.seeds is not None:
            print("fxsched check: --replay-file names one file: a sweep writes fxsched-replay-SEED.json "
                  "for each seed that breaks an invariant", file=sys.stderr)
            return EXIT_USAGE
        problem = _unwritable(Path(args.replay_file))
        if problem:
            print(f"fxsched check: --replay-file {args.replay_file}: {problem}", file=sys.stderr)
            return EXIT_USAGE
    if args.seeds is not None:
        return _sweep(args)
    return _one_seed(args)


def _walk(args, seed: int, progress) -> Any:
    from fxsched.runtime.check.walk import usable_cpus, walk

    return walk(seed, steps=args.steps, seconds=args.time, progress=progress,
                jobs=args.jobs if args.jobs is not None else usable_cpus())


def _one_seed(args) -> int:
    from tqdm import tqdm

    from fxsched.runtime.cli.arguments import EXIT_USAGE

    show = args.progress if args.progress is not None else (args.time or 0) > 3 or (args.steps or 0) > 50_000
    bar = tqdm(total=args.steps, unit="step", desc="check", disable=not show, leave=False)
    try:
        report = _walk(args, args.seed, bar.update)
    except ValueError as err:
        bar.close()
        print(f"fxsched check: {err}", file=sys.stderr)
        return EXIT_USAGE
    except RuntimeError as err:  # a worker process failed or died (specs/checker.md §11.5)
        bar.close()
        print(f"fxsched check: {err}", file=sys.stderr)
        return 1
    bar.close()
    on = f"{report.jobs} processes" if report.jobs > 1 else "1 process"
    print(f"seed {report.seed}: {report.steps} steps in {report.episodes} episodes, {report.seconds:.2f} s on {on}, "
          f"{report.steps_per_second:,.0f} steps/s ({report.steps_per_cpu_second:,.0f} per CPU second)")
    _print_coverage(report.coverage)
    if report.violation is None:
        print("no invariant broken")
        return 0
    return _violation(report, Path(args.replay_file or f"fxsched-replay-{report.seed}.json"))


def _sweep(args) -> int:
    from collections import Counter

    from tqdm import tqdm

    from fxsched.runtime.check.walk import feature_counts
    from fxsched.runtime.cli.arguments import EXIT_USAGE

    seeds: tuple[int, ...] = args.seeds
    show = args.progress if args.progress is not None else len(seeds) > 1
    bar = tqdm(total=len(seeds), unit="seed", desc="check", disable=not show, leave=False)
    coverage: Counter = Counter()
    broken: list[int] = []
    steps = 0
    seconds = 0.0
    for seed in seeds:
        try:
            report = _walk(args, seed, None)
        except ValueError as err:
            bar.close()
            print(f"fxsched check: {err}", file=sys.stderr)
            return EXIT_USAGE
        except RuntimeError as err:
            bar.close()
            print(f"fxsched check: seed {seed}: {err}", file=sys.stderr)
            return 1
        bar.update(1)
        steps += report.steps
        seconds += report.seconds
        coverage.update(report.coverage)
        if report.violation is None:
            bar.write(f"seed {seed}: {report.steps} steps in {report.episodes} episodes, no invariant broken")
            continue
        broken.append(seed)
        bar.clear()
        _violation(report, Path(f"fxsched-replay-{seed}.json"), prefix=f"seed {seed}: ")
    bar.close()
    never = [name for name, count in feature_counts(dict(coverage)).items() if count == 0]
    print(f"seeds {_span(seeds)}: {len(seeds)} walked, {steps} steps in {seconds:.1f} s, "
          f"{len(broken)} with a violation{': ' + ', '.join(map(str, broken)) if broken else ''}")
    print(f"features no seed reached: {', '.join(never) if never else 'none'}")
    return 1 if broken else 0


def _span(seeds: tuple[int, ...]) -> str:
    """``1-200`` for a run of consecutive seeds, else the first and the count."""
    if list(seeds) == list(range(seeds[0], seeds[0] + len(seeds))):
        return f"{seeds[0]}-{seeds[-1]}" if len(seeds) > 1 else str(seeds[0])
    return f"{seeds[0]}.. ({len(seeds)} seeds)"


def _violation(report, path: Path, prefix: str = "") -> int:
    """Print the report's violation and write its replay file; 1."""
    from fxsched.runtime.check.replay import write_replay

    v = report.violation
    print(f"{prefix}VIOLATION {v['invariant']} at step {v['step']} of episode {v['episode_index']}: {v['message']}",
          flush=True)
    try:
        write_replay(report, path)
    except OSError as err:
        print(f"fxsched check: --replay-file {path}: cannot write it ({err.strerror or err})", file=sys.stderr)
        return 1
    print(f"{prefix}replay file: {path}  (fxsched replay {path})")
    return 1


def _print_coverage(coverage: dict) -> None:
    """The effects, finish reasons and faults on a line each, then one line per feature of the
    walk's ``FEATURES`` with its count (a feature never reached says ``0  NOT REACHED``)."""
    from fxsched.runtime.check.walk import feature_counts

    groups: dict[str, dict[str, int]] = {"effects": {}, "finish reasons": {}, "faults": {}}
    for key, count in coverage.items():
        if key.startswith("finish:"):
            groups["finish reasons"][key[7:]] = count
        elif key.startswith("fault:"):
            groups["faults"][key[6:]] = count
        elif key != "rotation_ack" and ":" not in key:
            groups["effects"][key] = count
    for title, counts in groups.items():
        cells = ", ".join(f"{k}={v}" for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
        print(f"  {title}: {cells or '-'}")
    features = feature_counts(coverage)
    width = max(len(name) for name in features)
    print("  features:")
    for name, count in features.items():
        print(f"    {name:<{width}}  {count}{'  NOT REACHED' if count == 0 else ''}")


def _unwritable(path: Path) -> str:
    """Why a file cannot be written at ``path`` (its folder is missing, it is a folder), or ''."""
    folder = path.parent
    if path.is_dir():
        return "is a directory (give a file name)"
    if not folder.is_dir():
        return f"no such folder {str(folder)!r}"
    if not os.access(folder, os.W_OK):
        return f"the folder {str(folder)!r} is not writable"
    return ""

