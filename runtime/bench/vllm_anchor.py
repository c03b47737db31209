"""fxsched's ``step`` against vLLM's scheduler, side by side in one run (not part of CI).

``python -m fxsched.runtime.bench.vllm_anchor --vllm-python VENV/bin/python --vllm-bench SCRIPT``
alternates processes, cell by cell: for each round, each size N and each pairing (fxsched
``plain`` with vLLM ``A0``, fxsched ``spec5`` with vLLM ``A5``), one vLLM process timing its
scheduler (``SCRIPT --ns N --configs A0 --reps 1 --json ...``, vLLM 0.33's benchmark of
``schedule()`` + ``update_from_output()`` with a faked model output), then one fxsched process
(``fxsched bench step --mode plain --sizes N --warmup W --json``). Both report this thread's CPU
time per step; the table gives the medians over the rounds and their ratio fxsched / vLLM per N.
``--warmup W`` (default 20) is the number of untimed fxsched ticks before its windows: a cell
runs ``200_000 // N`` ticks (at most ``--steps``) per window, so without it the N = 4096 cells time
younger sequences than the N = 64 ones. These
machines are shared and their speed drifts within seconds, which is why the cells interleave.

vLLM's benchmark schedules at most 8192 tokens per step; with 5 drafts a step of N sequences needs
6 N, so from N = 1366 its A5 cell could never schedule every sequence (the script stops: "a
request dropped out"). For those cells the runner times a copy of the script whose only change is
``max_num_batched_tokens`` raised to 6 N (the copy reads the original's ``fake_opt`` config), so
that both sides run every sequence every step; the table marks those rows. A vLLM cell that still
fails is reported as missing, not retried. ``--json`` prints one object per (mode, N) instead of
the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

from fxsched.runtime.bench.step import WARMUP

PAIRS = (("plain", "A0"), ("spec5", "A5"))


VLLM_TOKEN_BUDGET = 8192  # max_num_batched_tokens in vLLM's scheduler benchmark
DRAFTS = {"A0": 0, "A5": 5}


def budget_for(config: str, n: int) -> Optional[int]:
    """The token budget a vLLM cell needs to schedule all ``n`` sequences every step, when the
    benchmark's own is too small (else None: the script runs as it is)."""
    need = n * (1 + DRAFTS.get(config, 0))
    return need if need > VLLM_TOKEN_BUDGET else None


def _budget_copy(script: str, budget: int, folder: Path) -> str:
    """A copy of vLLM's benchmark with ``max_num_batched_tokens`` = ``budget``, reading the
    original's model config folder."""
    text = Path(script).read_text()
    original = os.path.dirname(os.path.abspath(script))
    changes = ((f"max_num_batched_tokens={VLLM_TOKEN_BUDGET},", f"max_num_batched_tokens={budget},"),
               ("os.path.dirname(os.path.abspath(__file__))", repr(original)))
    for old, new in changes:
        if text.count(old) != 1:
            raise ValueError(f"{script}: cannot raise its token budget (no single {old!r})")
        text = text.replace(old, new)
    copy = folder / "vllm_scheduler_bench_budget.py"
    copy.write_text(text)
    return str(copy)


def _vllm_cell(python: str, script: str, config: str, n: int, steps: int, timeout: float) -> Optional[float]:
    """vLLM's median CPU microseconds per step at ``n``, or None if the cell failed."""
    with tempfile.TemporaryDirectory() as tmp:
        budget = budget_for(config, n)
        if budget is not None:
            script = _budget_copy(script, budget, Path(tmp))
        out = Path(tmp) / "cell.json"
        cmd = [python, script, "--ns", str(n), "--configs", config, "--reps", "1", "--steps", str(steps),
               "--json", str(out)]
        try:
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
            return None
        rows = json.loads(out.read_text())["rows"]
        return float(rows[0]["step_cpu_us"])


def _fxsched_cell(mode: str, n: int, steps: int, timeout: float, warmup: int = WARMUP) -> Optional[float]:
    """fxsched's median CPU microseconds per tick at ``n`` after ``warmup`` untimed ticks, or None
    if the cell failed."""
    cmd = [sys.executable, "-m", "fxsched.runtime.cli", "bench", "step", "--mode", mode, "--sizes", str(n),
           "--ticks", str(steps), "--repeats", "5", "--warmup", str(warmup), "--json"]
    try:
        done = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=timeout)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
        return None
    return float(json.loads(done.stdout.strip().splitlines()[-1])["us_per_tick"])


def run(python: str, script: str, sizes: list[int], rounds: int, steps: int, timeout: float,
        modes: tuple[str, ...], warmup: int = WARMUP) -> list[dict]:
    cells: dict[tuple[str, int], dict[str, list[float]]] = {}
    for r in range(rounds):
        for mode, config in PAIRS:
            if mode not in modes:
                continue
            for n in sizes:
                got = cells.setdefault((mode, n), {"vllm": [], "fxsched": []})
                ticks = max(20, min(steps, 200_000 // n))
                v = _vllm_cell(python, script, config, n, ticks, timeout)
                f = _fxsched_cell(mode, n, ticks, timeout, warmup)
                if v is not None:
                    got["vllm"].append(v)
                if f is not None:
                    got["fxsched"].append(f)
                print(f"round {r + 1}/{rounds} {mode}/{config} N={n}: vllm {v} us, fxsched {f} us",
                      file=sys.stderr, flush=True)
    rows = []
    for (mode, n), got in cells.items():
        v = statistics.median(got["vllm"]) if got["vllm"] else None
        f = statistics.median(got["fxsched"]) if got["fxsched"] else None
        rows.append({"mode": mode, "vllm_config": dict(PAIRS)[mode], "n": n, "rounds": rounds,
                     "vllm_token_budget": budget_for(dict(PAIRS)[mode], n) or VLLM_TOKEN_BUDGET,
                     "vllm_us_per_step": v, "fxsched_us_per_tick": f,
                     "vllm_us_per_seq": v / n if v is not None else None,
                     "fxsched_us_per_seq": f / n if f is not None else None,
                     "ratio": f / v if (v and f) else None,
                     "vllm_rounds": got["vllm"], "fxsched_rounds": got["fxsched"]})
    return rows


def _fmt(x: Optional[float], spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fxsched.runtime.bench.vllm_anchor", description=__doc__.split("\n")[0])
    ap.add_argument("--vllm-python", required=True, help="a Python with vllm 0.33 installed")
    ap.add_argument("--vllm-bench", required=True, help="vLLM's scheduler benchmark script")
    ap.add_argument("--sizes", default="1,8,64,256,1024,4096")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=200, help="steps per cell (fewer at large N)")
    ap.add_argument("--modes", default="plain,spec5")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per cell")
    ap.add_argument("--warmup", type=int, default=WARMUP,
                    help=f"untimed ticks before fxsched's windows (at least {WARMUP}; more times older sequences)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    for flag, path in (("--vllm-python", args.vllm_python), ("--vllm-bench", args.vllm_bench)):
        if not os.path.isfile(path):
            print(f"vllm_anchor: {flag} {path}: no such file", file=sys.stderr)
            return 2
    if args.warmup < WARMUP:
        print(f"vllm_anchor: --warmup {args.warmup}: must be at least {WARMUP}", file=sys.stderr)
        return 2
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = run(args.vllm_python, args.vllm_bench, sizes, args.rounds, args.steps, args.timeout,
               tuple(args.modes.split(",")), args.warmup)
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    print(f"{'mode':>6} {'vLLM':>5} {'N':>5} {'vLLM us/seq':>12} {'fxsched us/seq':>15} {'ratio':>7}")
    for row in rows:
        budget = row["vllm_token_budget"]
        note = f"  (vLLM token budget {budget})" if budget != VLLM_TOKEN_BUDGET else ""
        print(f"{row['mode']:>6} {row['vllm_config']:>5} {row['n']:>5} {_fmt(row['vllm_us_per_seq']):>12} "
              f"{_fmt(row['fxsched_us_per_seq']):>15} {_fmt(row['ratio'], '.3f'):>7}{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
