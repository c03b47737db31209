"""``fxsched bench linears``: the CPU's bf16 products at a model's projection shapes, against the
core's own peak (specs/cpu-kernels.md §15.8).

For each row count M of ``--rows`` (default 1,8,32,512) and each projection of one decoder layer of
the model (``--model DIR``'s config.json, default Qwen3-0.6B's dimensions: q, k, v, o, gate, up,
down, and the output head), the median time of ``F.linear`` on the [N, K] bf16 weight and of the
packed product (``cpu_pairs``) in each arithmetic its kernel has (bf16: VDPBF16PS; fp32: the
packing widened to fp32 FMAs), at ``--threads`` threads (default 1); then GFLOP/s summed over the
layer's projections and the head, and the packed products' share of their instruction's peak (the
rate of back-to-back register-only issue on one core, times the threads: `cpu_pairs.peak_flops`).
The arithmetic ``pairs_linear`` takes on this host is marked. Random weights, the same for every
kernel. On an AMX host the AMX product (kernels/cpu_amx.c, what the engine takes there) is timed
too, as ``amx``. Where no packed kernel is built for the host (AVX2), only ``F.linear`` is timed.
``--json``: one object per row count.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

QWEN3_06B = {"hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
             "intermediate_size": 3072, "vocab_size": 151936}


def shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(N, K) of each projection of one decoder layer, and of the output head."""
    text = config.get("text_config", config)
    d = int(text["hidden_size"])
    heads, kv = int(text["num_attention_heads"]), int(text.get("num_key_value_heads", text["num_attention_heads"]))
    dh = int(text.get("head_dim") or d // heads)
    inter = int(text["intermediate_size"])
    return {"q": (heads * dh, d), "k": (kv * dh, d), "v": (kv * dh, d), "o": (d, heads * dh), "gate": (inter, d),
            "up": (inter, d), "down": (d, inter), "head": (int(text["vocab_size"]), d)}


def _median_s(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench(config: dict[str, Any], rows: tuple[int, ...], threads: int, repeats: int) -> list[dict[str, Any]]:
    import torch
    import torch.nn.functional as F

    from fxsched.kernels import cpu_amx, cpu_pairs

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    weights = {name: (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)
               for name, (n, k) in shapes(config).items()}
    packed = {name: cpu_amx.pack(w) for name, w in weights.items()} if cpu_pairs.ready() else {}
    ariths = cpu_pairs.ARITHMETICS if packed else ()
    peaks = {a: (cpu_pairs.peak_flops(a) or 0.0) * threads for a in ariths}
    chosen = cpu_pairs.arithmetic() if packed else None
    lib = cpu_pairs._library() if packed else None
    products: dict[str, Callable[[torch.Tensor, str], Any]] = {
        "F.linear": lambda x, name: F.linear(x, weights[name])}

    def pairs(kernel: Callable[..., int]) -> Callable[[torch.Tensor, str], Any]:
        return lambda x, name: cpu_amx.packed_product(kernel, x, packed[name], 2, "bench linears")

    for arith in ariths:
        assert lib is not None
        products[f"pairs {arith}"] = pairs(cpu_pairs.kernel(lib, arith))
    if cpu_amx.ready():  # the AMX product the engine takes on this host, over the same packing
        tiles = packed or {name: cpu_amx.pack(w) for name, w in weights.items()}
        products["amx"] = lambda x, name: cpu_amx.amx_linear(x, tiles[name])
    out = []
    for m in rows:
        flop = sum(2 * m * n * k for n, k in shapes(config).values())
        xs = {name: torch.randn(m, w.shape[1], generator=gen).to(torch.bfloat16) for name, w in weights.items()}
        seconds = {label: sum(_median_s(partial(product, xs[name], name), repeats) for name in weights)
                   for label, product in products.items()}
        row: dict[str, Any] = {"rows": m, "threads": threads, "gflop": flop / 1e9, "chosen": chosen,
                               "ms": {k: v * 1e3 for k, v in seconds.items()},
                               "gflops": {k: flop / v / 1e9 for k, v in seconds.items()},
                               "peak_gflops": {a: p / 1e9 for a, p in peaks.items()}}
        row["pct_of_peak"] = {a: 100 * row["gflops"][f"pairs {a}"] / row["peak_gflops"][a]
                              for a in ariths if row["peak_gflops"][a]}
        out.append(row)
    return out


def format_table(result: list[dict[str, Any]], label: str) -> str:
    kernels = list(result[0]["ms"]) if result else []
    head = ["rows", *(f"{k} GFLOP/s" for k in kernels), *(f"{a} % peak" for a in result[0]["pct_of_peak"])] \
        if result else []
    lines = [f"bench linears: {label}, one layer's projections + the head, {result[0]['threads'] if result else 1} "
             f"thread(s); peaks (register-only issue): "
             + (", ".join(f"{a} {p:.0f} GFLOP/s" for a, p in result[0]["peak_gflops"].items()) or "-")
             + (f"; pairs_linear takes {result[0]['chosen']} here" if result and result[0]["chosen"] else "")]
    cells = [[str(r["rows"]), *(f"{r['gflops'][k]:.1f}" for k in kernels),
              *(f"{v:.0f}" for v in r["pct_of_peak"].values())] for r in result]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(head)]
    lines.append("  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)))
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    from fxsched.runtime.cli.arguments import ArgumentParser, int_arg, sizes_arg

    ap = ArgumentParser(prog="fxsched bench linears", description=__doc__.splitlines()[0])
    ap.add_argument("--model", metavar="DIR", default=None, help="a checkpoint whose config.json gives the shapes")
    ap.add_argument("--rows", type=sizes_arg, default=(1, 8, 32, 512), help="row counts (default 1,8,32,512)")
    ap.add_argument("--threads", type=int_arg(1, 1024), default=1)
    ap.add_argument("--repeats", type=int_arg(1, 1000), default=5)
    ap.add_argument("--json", action="store_true", help="one JSON object per row count")
    try:
        args = ap.parse_args(argv)
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else 2
    config, label = QWEN3_06B, "Qwen3-0.6B's dimensions"
    if args.model is not None:
        path = Path(args.model) / "config.json"
        try:
            config, label = json.loads(path.read_text()), f"--model {args.model}"
            shapes(config)
        except (OSError, ValueError, KeyError, TypeError) as err:
            print(f"fxsched bench linears: --model {args.model}: no usable config.json ({type(err).__name__}: "
                  f"{err})", file=sys.stderr)
            return 2
    result = bench(config, args.rows, args.threads, args.repeats)
    if args.json:
        for row in result:
            print(json.dumps(row))
    else:
        print(format_table(result, label))
    return 0
