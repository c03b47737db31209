"""``fxsched bench host``'s command line: its options, and the table, JSON rows or profiles it prints
(the measurement itself: runtime/bench/host.py; the overlap table of ``--forward-ms``:
runtime/bench/host_overlap.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from fxsched.runtime.bench import host
from fxsched.runtime.bench.host import (EXIT_USAGE, MODES, BenchError, format_table, profile_text,
                                        run_host_bench)
from fxsched.runtime.bench.host_overlap import overlap_main
from fxsched.runtime.cli.arguments import ArgumentParser, int_arg, sizes_arg


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="fxsched bench host", description=(host.__doc__ or "").splitlines()[0])
    ap.add_argument("--batches", type=sizes_arg, default=(1, 8, 64, 256), help="batch sizes (default 1,8,64,256)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)} (default all)")
    ap.add_argument("--ticks", type=int_arg(1, 100_000), default=64, help="decode ticks measured per run (64)")
    ap.add_argument("--rounds", type=int_arg(1, 1000), default=3, help="runs per row; medians reported (3)")
    ap.add_argument("--warm", type=int_arg(1, 10_000), default=3, help="steady ticks before the window (3)")
    ap.add_argument("--prompt-len", type=int_arg(80, 4096), default=96,
                    help="prompt ids counting from 0 (at least 80: n-gram lookups need a period of the vocabulary)")
    ap.add_argument("--accept", type=float, default=1.0, help="chance that each MTP / DFlash draft is right (1)")
    ap.add_argument("--device", default="cpu", help="torch device of the engine (cpu)")
    ap.add_argument("--threads", type=int_arg(1, 1024), default=1, help="torch threads (1: the host's one thread)")
    ap.add_argument("--static", action="store_true",
                    help="decodes and uniform verifies over the static forwards' inputs (graphs.py, not recorded)")
    ap.add_argument("--bare", action="store_true",
                    help="none, sampled and ngram on an engine without MTP head and DFlash drafter (no hidden rows "
                         "kept); mtp and dflash keep theirs")
    ap.add_argument("--seed", type=int_arg(0, 2**31), default=0)
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=False,
                    help="plain decodes answered ahead, their tokens read one tick late (specs/async.md §16.6; "
                         "default off: the host's own work per tick; --forward-ms runs both)")
    ap.add_argument("--json", action="store_true", help="one JSON object per row instead of the table")
    ap.add_argument("--profile", action="store_true",
                    help="one more run per row under cProfile: its window's top functions on stderr")
    ap.add_argument("--profile-top", type=int_arg(1, 1000), default=25, help="functions per profile list (25)")
    ap.add_argument("--profile-dir", default=None, help="also write each row's profile there (pstats files)")
    ap.add_argument("--forward-ms", default=None, metavar="MS,MS",
                    help="the overlap table instead: every forward takes that much device time behind the host "
                         "(as on a GPU), and each row runs --rounds times with async scheduling off and on, "
                         "interleaved (e.g. 0.4,2)")
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    from tqdm import tqdm

    from fxsched.runtime.logs import configure_logging

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else EXIT_USAGE
    configure_logging(False)
    modes = [m.strip() for m in args.modes.split(",")]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        print(f"fxsched bench host: --modes {args.modes}: unknown mode {bad[0] if bad else ''!r} "
              f"(choose from {', '.join(MODES)})", file=sys.stderr)
        return EXIT_USAGE
    if not 0.0 < args.accept <= 1.0:
        print(f"fxsched bench host: --accept {args.accept}: must be above 0, at most 1", file=sys.stderr)
        return EXIT_USAGE
    if args.forward_ms is not None:
        return overlap_main(args, modes)
    try:
        with tqdm(total=len(modes) * len(args.batches), unit="row", file=sys.stderr, disable=None,
                  leave=False) as bar:
            rows, profiles = run_host_bench(args.batches, modes, ticks=args.ticks, rounds=args.rounds,
                                            warm=args.warm, prompt_len=args.prompt_len, device=args.device,
                                            accept=args.accept, seed=args.seed, static=args.static, bare=args.bare,
                                            threads=args.threads, profile=args.profile,
                                            async_scheduling=args.async_scheduling, on_row=lambda row: bar.update())
    except BenchError as err:  # a row with no steady window: one line, not a traceback
        print(f"fxsched bench host: {err}", file=sys.stderr)
        return 1
    for (mode, batch), stats in profiles.items():
        print(profile_text(stats, mode, batch, args.ticks, args.profile_top), file=sys.stderr)
        if args.profile_dir is not None:
            folder = Path(args.profile_dir)
            folder.mkdir(parents=True, exist_ok=True)
            stats.dump_stats(str(folder / f"host-{mode}-{batch}.prof"))
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print(format_table(rows))
    return 0
