"""``fxsched bench host --forward-ms``: does async scheduling hide the host behind the device?

Each forward takes ``--forward-ms`` of device time behind the host (host_free.DeviceClock: the
host's launch returns at once; a read waits until the device has caught up), so a tick costs
host + forward when the host waits for every answer, and max(host, forward) when the host plans
tick t+1 while the device runs tick t (specs/async.md §16.6). Every row runs async scheduling off
and on, interleaved, on fresh free engines (runtime/bench/host.py's ``run_once``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

import torch

from fxsched.runtime.bench.host import EXIT_USAGE, fixed_width, run_once

OVERLAP_FACTOR = 1.1  # async ticks at most 1.1 x max(host, forward)


def measure_overlap(mode: str, batch: int, forward_ms: float, *, ticks: int = 64, rounds: int = 3, warm: int = 3,
                    prompt_len: int = 96, seed: int = 0, bare: bool = False, max_slots: int = 256) -> dict[str, Any]:
    """One row of the overlap table: every forward takes ``forward_ms`` of device time behind the
    host (``DeviceClock``); ``rounds`` runs each way, async scheduling off and on, interleaved (the
    first of each round alternating). ``host_us``: the host thread's CPU time per tick (the clock's
    waits sleep, so they are not in it); ``tick_us_off`` / ``tick_us_on``: wall time per tick,
    medians; ``off/sum``: the synchronous tick against host + forward (below 1: the work after a
    launch already runs beside the forward); ``hidden_percent``: the share of min(host, forward) that
    async scheduling took off the measured synchronous tick, ``hidden_of_sum_percent`` off host +
    forward; ``pass``: async ticks within ``OVERLAP_FACTOR`` x max(host, forward)."""
    kw: dict[str, Any] = dict(ticks=ticks, warm=warm, prompt_len=prompt_len, seed=seed, bare=bare,
                              max_slots=max_slots, forward_ms=forward_ms)
    runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for r in range(rounds):
        for asynchronous in ((False, True) if r % 2 == 0 else (True, False)):
            runs[asynchronous].append(run_once(mode, batch, async_scheduling=asynchronous, **kw))
    host = statistics.median(x["cpu"] for x in runs[False])
    off = statistics.median(x["total"] for x in runs[False])
    on = statistics.median(x["total"] for x in runs[True])
    device_us = forward_ms * 1e3 * statistics.median(x["forwards_per_tick"] for x in runs[False])
    least = min(host, device_us)
    hidden = (off - on) / least * 100 if least > 0 else 0.0
    hidden_of_sum = (host + device_us - on) / least * 100 if least > 0 else 0.0
    return {"mode": mode, "batch": batch, "ticks": ticks, "rounds": rounds, "forward_ms": forward_ms,
            "device_us": device_us, "host_us": host, "tick_us_off": off, "tick_us_on": on, "on/off": on / off,
            "off/sum": off / (host + device_us), "hidden_percent": hidden, "hidden_of_sum_percent": hidden_of_sum,
            "bound_us": OVERLAP_FACTOR * max(host, device_us),
            "pass": on <= OVERLAP_FACTOR * max(host, device_us),
            "counting": all(x["counting"] for x in runs[False] + runs[True])}


OVERLAP_COLUMNS = ("mode", "batch", "forward_ms", "host_us", "device_us", "tick_us_off", "tick_us_on", "on/off",
                   "off/sum", "hidden_percent", "hidden_of_sum_percent", "bound_us", "pass")


def format_overlap(rows: list[dict[str, Any]]) -> str:
    """The overlap rows as a fixed-width table."""
    heads = [c.replace("_percent", " %").replace("hidden_of_sum", "hidden of sum") for c in OVERLAP_COLUMNS]
    lines = fixed_width(rows, OVERLAP_COLUMNS, heads, 7, lambda c: c in ("on/off", "off/sum", "forward_ms"))
    lines.append("every output counts: " + ("yes" if all(r["counting"] for r in rows) else "NO"))
    return "\n".join(lines)


def overlap_main(args: argparse.Namespace, modes: list[str]) -> int:
    """``--forward-ms``: the overlap table (``measure_overlap``) for every mode, batch and time."""
    from tqdm import tqdm

    try:
        times = [float(x) for x in args.forward_ms.split(",") if x.strip()]
    except ValueError:
        times = []
    if not times or any(not 0 < t <= 1000 for t in times):
        print(f"fxsched bench host: --forward-ms {args.forward_ms}: comma-separated milliseconds, each above 0 "
              f"and at most 1000", file=sys.stderr)
        return EXIT_USAGE
    rows = []
    before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        with tqdm(total=len(modes) * len(args.batches) * len(times), unit="row", file=sys.stderr, disable=None,
                  leave=False) as bar:
            for mode in modes:
                for batch in args.batches:
                    for ms in times:
                        rows.append(measure_overlap(mode, batch, ms, ticks=args.ticks, rounds=args.rounds,
                                                    warm=args.warm, prompt_len=args.prompt_len, seed=args.seed,
                                                    bare=args.bare and mode not in ("mtp", "dflash"),
                                                    max_slots=max(256, *args.batches)))
                        bar.update()
    finally:
        torch.set_num_threads(before)
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print(format_overlap(rows))
    return 0
