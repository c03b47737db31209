"""``fxsched bench gdn-prefill``: peak memory and time of one GDN recurrence over a T-token prompt.

Sizes default to Qwen3-Next-80B's linear-attention layers: 32 value heads, Dk = Dv = 128, 16 key
heads whose q/k are repeated to the 32 value heads (the caller's job, done before the baseline).
fp32, batch 1, CPU, from a zero state. Modes:

* ``per_row`` -- `gdn._recurrence`, today's prefill: keeps the state after every row
  ([T, H, Dk, Dv], 8 GiB at T = 4096);
* ``chunked`` -- `gdn_chunked.chunked_gated_delta`, keeping only the state after the last row, or
  (``keep_every=N``) also the states after rows N-1, 2N-1, ... (prefix-cache block boundaries).

Each mode runs in a fresh Python subprocess, so one mode's freed memory cannot hide another's peak.
Peak memory is resident memory (no CPU allocator statistics exist in torch): the child builds the
inputs, resets the kernel's peak-RSS mark (``5`` into /proc/self/clear_refs), runs, and reports
VmHWM - VmRSS-at-reset from /proc/self/status ("rss_method": "vmhwm"). Where clear_refs cannot be
written it falls back to the ru_maxrss increase over the same baseline ("ru_maxrss"), which
under-reports a run whose peak stays below the high-water mark reached while building inputs.
``--allocator mmap`` takes glibc's heap fragmentation out of the figure (see `measure`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

MODES = ("per_row", "chunked")
ALLOCATORS = ("default", "mmap")
_CHILD = "import json, sys; from fxsched.runtime.bench.gdn_prefill import run_here; " \
         "print(json.dumps(run_here(**json.loads(sys.argv[1]))))"


def measure(T: int = 4096, heads: int = 32, dk: int = 128, dv: int = 128, chunk: int = 64, mode: str = "per_row",
            *, key_heads: int = 16, keep_every: int | None = None, allocator: str = "default",
            timeout_s: float = 1800.0) -> dict[str, Any]:
    """Run one mode in a fresh subprocess; returns its figures (see `run_here`). Raises ValueError on bad sizes.

    allocator "mmap" runs the child with MALLOC_MMAP_THRESHOLD_=131072: glibc then maps every block of
    128 KiB or more on its own and unmaps it on free, so the peak is the live tensors; "default" keeps
    glibc's dynamic threshold, under which the per-row loop's 2 MiB temporaries fragment the heap and
    the resident peak roughly doubles at T = 4096 (what a plain CPU process sees).
    """
    params = _validated(T=T, heads=heads, dk=dk, dv=dv, chunk=chunk, mode=mode, key_heads=key_heads,
                        keep_every=keep_every)
    if allocator not in ALLOCATORS:
        raise ValueError(f"allocator must be one of {', '.join(ALLOCATORS)}, got {allocator!r}")
    env = dict(os.environ)
    if allocator == "mmap":
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(params)], capture_output=True, text=True,
                          timeout=timeout_s, check=False, env=env)
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
        raise RuntimeError(f"gdn-prefill {mode} child failed: {tail[0]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    result["allocator"] = allocator
    return result


def run_here(T: int, heads: int, dk: int, dv: int, chunk: int, mode: str, key_heads: int,
             keep_every: int | None) -> dict[str, Any]:
    """Measure one mode in *this* process (meant for a fresh one: `measure` spawns it)."""
    import torch
    import torch.nn.functional as F

    from fxsched.runtime.torch_model.gdn import _recurrence
    from fxsched.runtime.torch_model.gdn_chunked import chunked_gated_delta

    torch.set_grad_enabled(False)
    gen = torch.Generator().manual_seed(0)
    rep = heads // key_heads
    q = (F.normalize(torch.randn(1, T, key_heads, dk, generator=gen), dim=-1) * dk ** -0.5)
    k = F.normalize(torch.randn(1, T, key_heads, dk, generator=gen), dim=-1)
    q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    v = torch.randn(1, T, heads, dv, generator=gen)
    g = -F.softplus(torch.randn(1, T, heads, generator=gen)) * 0.1
    beta = torch.sigmoid(torch.randn(1, T, heads, generator=gen))
    state0 = torch.zeros(1, heads, dk, dv)
    rows = [T - 1] if keep_every is None else sorted({*range(keep_every - 1, T, keep_every), T - 1})
    if mode == "chunked":  # warm-up at a small size so the timed run pays no first-call costs
        chunked_gated_delta(q[:, :chunk], k[:, :chunk], v[:, :chunk], g[:, :chunk], beta[:, :chunk], state0,
                            keep_rows=[chunk - 1], chunk_size=chunk)
    else:
        _recurrence(q[:, :2], k[:, :2], v[:, :2], torch.exp(g[:, :2]), beta[:, :2], state0)

    method, base_kib = _reset_peak()
    start = time.perf_counter()
    if mode == "chunked":
        _, final, _ = chunked_gated_delta(q, k, v, g, beta, state0, keep_rows=rows, chunk_size=chunk)
        kept_states = len(rows)
    else:
        _, states = _recurrence(q, k, v, torch.exp(g), beta, state0)
        final = states[:, -1]
        kept_states = T
    wall = time.perf_counter() - start
    peak_kib = _peak_kib(method)
    state_mib = heads * dk * dv * 4 / 2 ** 20
    return {"mode": mode, "T": T, "heads": heads, "key_heads": key_heads, "dk": dk, "dv": dv,
            "chunk": chunk if mode == "chunked" else None, "keep_every": keep_every, "kept_states": kept_states,
            "peak_mib": round((peak_kib - base_kib) / 1024, 1), "baseline_mib": round(base_kib / 1024, 1),
            "states_mib": round(kept_states * state_mib, 1), "wall_s": round(wall, 3), "rss_method": method,
            "final_state_checksum": float(final.double().abs().sum())}


def _reset_peak() -> tuple[str, int]:
    """Reset the peak-RSS mark if the kernel allows; (method, baseline KiB)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return "vmhwm", _status_kib("VmRSS")
    except OSError:
        import resource

        return "ru_maxrss", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _peak_kib(method: str) -> int:
    if method == "vmhwm":
        return _status_kib("VmHWM")
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _validated(**p: Any) -> dict[str, Any]:
    if p["mode"] not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {p['mode']!r}")
    for name in ("T", "heads", "dk", "dv", "chunk", "key_heads"):
        if not isinstance(p[name], int) or p[name] < 1:
            raise ValueError(f"{name} must be a positive integer, got {p[name]!r}")
    if p["heads"] % p["key_heads"]:
        raise ValueError(f"heads ({p['heads']}) must be a multiple of key_heads ({p['key_heads']})")
    if p["keep_every"] is not None and (p["mode"] != "chunked" or p["keep_every"] < 1):
        raise ValueError(f"keep_every must be a positive integer with mode chunked, got {p['keep_every']!r}")
    return p


def parse_runs(spec: str) -> list[tuple[str, int | None]]:
    """'per_row,chunked,chunked:256' -> [(mode, keep_every)]; ValueError naming the bad item."""
    runs: list[tuple[str, int | None]] = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        mode, _, every = item.partition(":")
        if mode not in MODES or (every and (mode != "chunked" or not every.isdigit() or int(every) < 1)):
            raise ValueError(f"--runs: bad item {item!r} (per_row, chunked or chunked:N with N >= 1)")
        runs.append((mode, int(every) if every else None))
    if not runs:
        raise ValueError("--runs: no runs given")
    return runs


def main(argv: list[str] | None = None) -> int:
    """Print one row per run (a table, or JSON lines with --json). Bad input: one line on stderr, exit 2."""
    ap = argparse.ArgumentParser(prog="fxsched bench gdn-prefill", description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=4096, help="prompt rows")
    ap.add_argument("--heads", type=int, default=32, help="value heads (q/k repeated to these)")
    ap.add_argument("--key-heads", type=int, default=16, help="key heads")
    ap.add_argument("--dk", type=int, default=128)
    ap.add_argument("--dv", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=64, help="chunk size of the chunked form")
    ap.add_argument("--runs", default="per_row,chunked,chunked:256",
                    help="comma-separated: per_row, chunked (last state only), chunked:N (a state every N rows)")
    ap.add_argument("--allocator", choices=ALLOCATORS, default="default",
                    help="glibc malloc as is, or mmap for every block >= 128 KiB (peak = live tensors)")
    ap.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    args = ap.parse_args(argv)
    try:
        runs = parse_runs(args.runs)
        for mode, every in runs:
            _validated(T=args.T, heads=args.heads, dk=args.dk, dv=args.dv, chunk=args.chunk, mode=mode,
                       key_heads=args.key_heads, keep_every=every)
    except ValueError as err:
        print(f"fxsched bench gdn-prefill: {err}", file=sys.stderr)
        return 2
    keys = ("mode", "keep_every", "T", "allocator", "kept_states", "states_mib", "peak_mib", "wall_s")
    if not args.json:
        print("  ".join(f"{k:>12}" for k in keys))
    for mode, every in runs:
        row = measure(args.T, args.heads, args.dk, args.dv, args.chunk, mode, key_heads=args.key_heads,
                      keep_every=every, allocator=args.allocator)
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            print("  ".join(f"{str(row[k]):>12}" for k in keys), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
