"""``fxsched bench e2e``: fxsched against transformers ``generate`` and vLLM's CPU build, end to end,
on the same locally built real-size random checkpoint (not run in CI; tests/test_bench_e2e.py is a
smoke test of it).

Models: ``--like`` (a comma list of ``e2e_models.LIKE``, built once under ``--models-dir``) or
``--model DIR``. Engines: fxsched (``HybridEngine.from_pretrained`` + ``generate``, the API of
``fxsched generate --model``, greedy, ``--spec`` none by default, async scheduling off;
``fxsched-overlap`` the same with the device lane, specs/async.md §16.5; ``fxsched-async`` the same
with async scheduling, §16.6), transformers (``generate`` of
AutoModelForCausalLM, greedy, ``min_new_tokens`` = ``max_new_tokens``) and, with ``--vllm-python
PY`` where ``PY -c "import vllm"`` works, vLLM's offline ``LLM.generate`` (``ignore_eos``). Every
(round, batch, engine) cell is a fresh process (``e2e_worker``), rounds interleaved (round r: each
batch, each engine); all with ``--threads`` threads (a comma list, e.g. ``1,16``: one table per count,
every engine at that count; torch.set_num_threads, OMP_NUM_THREADS;
vLLM: VLLM_CPU_OMP_THREADS_BIND=nobind so it keeps OMP_NUM_THREADS, like the others unpinned, and
VLLM_ENABLE_V1_MULTIPROCESSING=0: its engine core runs in the cell's process).
Prompts: ``--prompt-len`` seeded random ids, the same for every engine (batch B takes the first B).
The KV cache: fxsched gets ``--kv-cache-memory`` (default: B + 1 sequences of P + N + 16 tokens of
its attention layers, and of a hybrid's GDN state, which the budget holds too), vLLM the same
rounded up to GiB (VLLM_CPU_KVCACHE_SPACE).

Figures per cell (medians over the rounds; ``--json`` also has every round): ``ttft_s`` the
max_tokens=1 run of the whole batch; ``prefill_tok_s`` = B x P / ttft; ``decode_tok_s`` = B x (N - 1)
/ (t_N - ttft); ``peak_rss_gb`` (GB = 1e9 bytes) the cell process's peak resident set (with its
children's); ``decode_x`` / ``prefill_x`` the engine's rate over fxsched's at the same batch;
``same_tokens`` whether its greedy tokens equal fxsched's (``first_diff``: the first differing
position of the first differing prompt; random weights leave near-ties that bf16 rounding can flip,
so a late difference is not a fault, an early one at every batch is).

``--lora``: the cost of LoRA adapters (specs/lora.md §18.7): ``--lora-adapters`` (4) random PEFT
adapters of rank ``--lora-rank`` (16) on every attention and MLP projection
(``e2e_models.build_adapters``, built once per model and read by every cell), request i on adapter
i mod their count. Engine ``fxsched-lora`` is fxsched with them loaded, ``vllm-lora`` vLLM with
``enable_lora`` (``max_loras`` = the adapters, ``max_lora_rank`` = the rank); defaults ``--engines
fxsched,fxsched-lora`` (plus ``vllm,vllm-lora`` with ``--vllm-python``) and ``--batches 8``. The
record's ``lora`` gives, per batch, ``decode_x`` (fxsched with adapters / without), ``vllm_decode_x``
(vLLM with adapters / without) and ``vs_vllm`` (fxsched-lora / vllm-lora decode); vllm-lora's
``same_tokens`` is against fxsched-lora's (the same adapters on the same prompts).

vLLM runs as shipped (its compiled mode) unless ``--vllm-eager``.

Roofline (batch 1): ``decode_weight_bytes`` (weights one decoded token reads, see e2e_models) against
the bandwidth of a 256 MiB tensor copy at ``--threads`` threads, counting bytes read + bytes written:
``roofline_tok_s`` = bandwidth / bytes per token, and fxsched's batch-1 decode as a percentage of it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import structlog

from fxsched.runtime.bench import e2e_models
from fxsched.runtime.bench.e2e_worker import ENGINES
from fxsched.runtime.cli.arguments import ArgumentParser, int_arg, sizes_arg

log = structlog.get_logger(__name__)
EXIT_USAGE = 2
WORKER = Path(__file__).with_name("e2e_worker.py")
COLUMNS = ("engine", "batch", "decode tok/s", "prefill tok/s", "TTFT s", "peak RSS GB", "decode x", "prefill x",
           "same tokens")
GB = 1e9
LORA_ENGINES = ("fxsched-lora", "vllm-lora")  # engines that run the --lora adapters
COPY_BYTES = 256 * 1024 * 1024


class UsageError(ValueError):
    """Bad input: one line, exit 2."""


# --- inputs ------------------------------------------------------------------------------------------


def _vllm_ok(python: str) -> Optional[str]:
    """Why ``python -c 'import vllm'`` does not work (None: it does)."""
    try:
        done = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"cannot run it ({getattr(err, 'strerror', None) or err})"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["exit status " + str(done.returncode)])[-1]
        return f"cannot import vllm ({last})"
    return None


def resolve_models(args: argparse.Namespace) -> list[tuple[str, Path]]:
    """(label, directory) of each model to run; builds missing ``--like`` checkpoints."""
    if args.model is not None and args.like is not None:
        raise UsageError(f"--model {args.model} and --like {args.like}: give one of them")
    if args.model is not None:
        path = Path(args.model)
        if not (path / "config.json").is_file():
            raise UsageError(f"--model {args.model}: no config.json there")
        return [(path.name, path)]
    names = [n.strip() for n in (args.like or "qwen3-0.6b").split(",")]
    for name in names:
        if name not in e2e_models.LIKE:
            raise UsageError(f"--like {name}: unknown model (choose from {', '.join(e2e_models.LIKE)})")
    folder = Path(args.models_dir).expanduser()
    return [(name, e2e_models.ensure_model(name, folder, args.seed)) for name in names]


def prompts_for(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    """``count`` seeded random prompts of ``length`` ids (the same for every engine)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


def prompt_sets(vocab: int, batch: int, length: int, seed: int) -> dict[str, list[list[int]]]:
    """The worker's prompt sets for a batch (e2e_worker), from three seeded streams: ``run`` (the
    first ``batch`` prompts of the ``seed`` stream, so the same at every batch), ``ttft`` (as many of
    another stream) and ``warmup`` (at most two of 8 ids). Random prompts share no cached block
    (16 ids) with one another, so no run is served from another's prefix cache."""
    return {"run": prompts_for(vocab, batch, length, seed),
            "ttft": prompts_for(vocab, batch, length, seed + 1_000_003),
            "warmup": prompts_for(vocab, min(batch, 2), 8, seed + 2_000_003)}


def prompt_file(folder: Path, vocab: int, batch: int, args: argparse.Namespace) -> Path:
    path = folder / f"prompts-{batch}.json"
    path.write_text(json.dumps(prompt_sets(vocab, batch, args.prompt_len, args.seed)))
    return path


def kv_budget(config: dict[str, Any], batch: int, tokens: int) -> int:
    """fxsched's KV cache bytes for ``batch`` sequences of ``tokens`` (see the module docstring)."""
    text = config.get("text_config", config)
    types = text.get("layer_types") or ["full_attention"] * int(text["num_hidden_layers"])
    layers = sum(1 for t in types if t == "full_attention") + int(text.get("mtp_num_hidden_layers") or 0)
    head_dim = int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"])
    per_token = 2 * max(layers, 1) * int(text["num_key_value_heads"]) * head_dim * 2
    return (batch + 1) * (16 * math.ceil((tokens + 16) / 16) * per_token + gdn_state_bytes(text))


def gdn_state_bytes(text: dict[str, Any]) -> int:
    """One sequence's GDN state in bf16, from the HF config: per linear-attention layer, the
    recurrent state (value heads x key dim x value dim) and the conv state (conv channels x
    (kernel - 1)); 0 for a model without such layers."""
    layers = sum(1 for t in text.get("layer_types") or () if t == "linear_attention")
    if not layers:
        return 0
    hk, hv = int(text["linear_num_key_heads"]), int(text["linear_num_value_heads"])
    dk, dv = int(text["linear_key_head_dim"]), int(text["linear_value_head_dim"])
    channels = 2 * hk * dk + hv * dv
    return layers * (hv * dk * dv + channels * (int(text["linear_conv_kernel_dim"]) - 1)) * 2


def copy_bandwidth(threads: int) -> float:
    """Bytes per second of a 256 MiB tensor copy (read + written), best of 5, at ``threads``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.ones(COPY_BYTES // 4, dtype=torch.float32)
        dst = torch.empty_like(src)
        best = math.inf
        for _ in range(5):
            start = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return 2 * COPY_BYTES / best


# --- cells -------------------------------------------------------------------------------------------


def _env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
                "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_LOGGING_LEVEL": "WARNING"})
    return env


def run_cell(args: argparse.Namespace, engine: str, model: Path, prompts_file: Path, batch: int,
             config: dict[str, Any]) -> dict[str, Any]:
    """One worker process; its JSON record, or {'error': ...} when it failed."""
    max_seq_len = args.prompt_len + args.max_tokens + 16
    budget = args.kv_cache_memory or kv_budget(config, batch, args.prompt_len + args.max_tokens)
    common = ["--engine", engine, "--model", str(model), "--prompts", str(prompts_file), "--max-tokens",
              str(args.max_tokens), "--max-seq-len", str(max_seq_len), "--threads", str(args.threads),
              "--batch", str(batch)]
    if args.in_process and not engine.startswith("vllm"):  # tests: the worker's code without the process boundary
        from fxsched.runtime.bench import e2e_worker

        return e2e_worker.run_cell(e2e_worker.parse([*common, "--kv-cache-memory", str(budget), "--spec", args.spec,
                                                     *_lora_args(args)]))
    env = _env(args.threads)
    if engine.startswith("vllm"):
        cmd = [args.vllm_python, str(WORKER), *common, "--dtype", _dtype(config), *_lora_args(args)]
        if args.vllm_eager:
            cmd.append("--enforce-eager")
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(budget / 2**30)))
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in the cell's process (e2e_worker)
    else:
        cmd = [sys.executable, "-m", "fxsched.runtime.bench.e2e_worker", *common, "--kv-cache-memory", str(budget),
               "--spec", args.spec, *_lora_args(args)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout:g} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = failure_line(done.stderr) or f"exit status {done.returncode}"
        log.warning("e2e_cell_failed", engine=engine, batch=batch, error=tail)
        return {"error": tail}
    record: dict[str, Any] = json.loads(lines[-1])
    return record


def _lora_args(args: argparse.Namespace) -> list[str]:
    paths = getattr(args, "lora_paths", None)
    return ["--lora-paths", paths, "--lora-rank", str(args.lora_rank)] if paths else []


_EXCEPTION = re.compile(r"^(?:[A-Za-z_][\w.]*(?:Error|Exception|Exit)\b|Value error,)")


def failure_line(stderr: str) -> str:
    """The line of a failed cell's stderr that says why: the last exception line (``Value error, ...``
    of a pydantic error), else the last line; at most 300 characters."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    named = [line for line in lines if _EXCEPTION.match(line)]
    return (named or lines or [""])[-1][:300]


def _dtype(config: dict[str, Any]) -> str:
    text = config.get("text_config", config)
    return str(text.get("dtype") or text.get("torch_dtype") or "bfloat16")


def figures(record: dict[str, Any], batch: int, prompt_len: int, max_tokens: int) -> dict[str, Any]:
    """A round's figures from a worker record."""
    ttft, total = record["ttft_s"], record["total_s"]
    decode = batch * (max_tokens - 1) / (total - ttft) if max_tokens > 1 and total > ttft else None
    return {"ttft_s": ttft, "total_s": total, "prefill_tok_s": batch * prompt_len / ttft, "decode_tok_s": decode,
            "peak_rss_gb": record["peak_rss_bytes"] / GB}


def first_diff(a: list[list[int]], b: list[list[int]]) -> Optional[list[int]]:
    """[prompt, position] of the first differing token of two runs (None: the same)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        for j in range(max(len(x), len(y))):
            if j >= len(x) or j >= len(y) or x[j] != y[j]:
                return [i, j]
    return None if len(a) == len(b) else [min(len(a), len(b)), 0]


def _median(values: list[Any]) -> Optional[float]:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def run_model(args: argparse.Namespace, label: str, model: Path, engines: list[str],
              bar: Any) -> dict[str, Any]:
    """Every cell of one model, rounds interleaved; the model's JSON record."""
    config = json.loads((model / "config.json").read_text())
    vocab = int(config.get("text_config", config)["vocab_size"])
    rounds: dict[tuple[str, int], list[dict[str, Any]]] = {}
    tokens: dict[tuple[str, int], list[list[int]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        files = {b: prompt_file(Path(tmp), vocab, b, args) for b in args.batches}
        args.lora_paths = None
        if any(e in LORA_ENGINES for e in engines):
            folders = e2e_models.build_adapters(model, Path(tmp) / "adapters", args.lora_adapters, args.lora_rank)
            args.lora_paths = ",".join(str(f) for f in folders)
        for r in range(args.rounds):
            for b in args.batches:
                for engine in engines:
                    bar.set_description(f"{label} round {r + 1} batch {b} {engine}")
                    record = run_cell(args, engine, model, files[b], b, config)
                    bar.update(1)
                    if "error" in record:
                        rounds.setdefault((engine, b), []).append({"error": record["error"]})
                        continue
                    rounds.setdefault((engine, b), []).append(figures(record, b, args.prompt_len, args.max_tokens))
                    tokens.setdefault((engine, b), record["tokens"])
    cells = [_cell(engine, b, rounds.get((engine, b), []), tokens) for b in args.batches for engine in engines]
    _ratios(cells)
    weight_bytes = e2e_models.decode_weight_bytes(model)
    roof = args.bandwidth / weight_bytes
    fx1 = next((c["decode_tok_s"] for c in cells if c["engine"] == "fxsched" and c["batch"] == 1), None)
    lora = _lora_record(args, cells) if any(e in LORA_ENGINES for e in engines) else None
    return {"model": label, "path": str(model), "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
            "threads": args.threads, "rounds": args.rounds, "cells": cells, "lora": lora,
            "roofline": {"decode_weight_bytes": weight_bytes, "copy_bandwidth_bytes_per_s": args.bandwidth,
                         "bandwidth_counts": "bytes read + bytes written", "roofline_tok_s": roof,
                         "fxsched_batch1_decode_tok_s": fx1,
                         "fxsched_pct_of_roofline": 100.0 * fx1 / roof if fx1 is not None else None}}


def _lora_record(args: argparse.Namespace, cells: list[dict[str, Any]]) -> dict[str, Any]:
    """Per batch: fxsched with adapters / without, vLLM with / without, fxsched-lora / vllm-lora."""
    rate = {(c["engine"], c["batch"]): c.get("decode_tok_s") for c in cells}

    def ratio(a: str, b: str) -> dict[str, Optional[float]]:
        out = {}
        for batch in args.batches:
            x, y = rate.get((a, batch)), rate.get((b, batch))
            out[str(batch)] = x / y if x is not None and y else None
        return out

    return {"adapters": args.lora_adapters, "rank": args.lora_rank, "decode_x": ratio("fxsched-lora", "fxsched"),
            "vllm_decode_x": ratio("vllm-lora", "vllm"), "vs_vllm": ratio("fxsched-lora", "vllm-lora")}


def _cell(engine: str, batch: int, got: list[dict[str, Any]],
          tokens: dict[tuple[str, int], list[list[int]]]) -> dict[str, Any]:
    ok = [g for g in got if "error" not in g]
    cell: dict[str, Any] = {"engine": engine, "batch": batch, "rounds": got}
    if not ok:
        cell["error"] = got[-1]["error"] if got else "not run"
        return cell
    for key in ("decode_tok_s", "prefill_tok_s", "ttft_s", "peak_rss_gb"):
        cell[key] = _median([g[key] for g in ok])
    # an adapted run's tokens are its adapters': vLLM's against fxsched's with the same adapters
    reference = {"fxsched-lora": None, "vllm-lora": "fxsched-lora"}.get(engine, "fxsched")
    mine = tokens.get((engine, batch))
    base = tokens.get((reference, batch)) if reference is not None else None
    diff = first_diff(mine, base) if mine is not None and base is not None else None
    cell["same_tokens"] = None if base is None or mine is None else diff is None
    cell["first_diff"] = diff
    cell["tokens"] = mine
    return cell


def _ratios(cells: list[dict[str, Any]]) -> None:
    base = {c["batch"]: c for c in cells if c["engine"] == "fxsched" and "error" not in c}
    for c in cells:
        ref = base.get(c["batch"])
        for key, out in (("decode_tok_s", "decode_x"), ("prefill_tok_s", "prefill_x")):
            mine, theirs = c.get(key), ref.get(key) if ref else None
            c[out] = mine / theirs if mine is not None and theirs else None


# --- output ------------------------------------------------------------------------------------------


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def format_model(result: dict[str, Any]) -> str:
    """The table of one model, then its roofline line."""
    rows = []
    for c in result["cells"]:
        if "error" in c:
            rows.append([c["engine"], str(c["batch"]), "n/a", "n/a", "n/a", "n/a", "-", "-", "-"])
            continue
        same = _fmt(c["same_tokens"]) + (f" (from {c['first_diff'][1]})" if c.get("first_diff") else "")
        rows.append([c["engine"], str(c["batch"]), _fmt(c["decode_tok_s"]), _fmt(c["prefill_tok_s"]),
                     _fmt(c["ttft_s"], 3), _fmt(c["peak_rss_gb"]), _fmt(c["decode_x"]), _fmt(c["prefill_x"]), same])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(COLUMNS)]
    lines = [f"{result['model']}  (prompt {result['prompt_len']}, {result['max_tokens']} tokens, "
             f"{result['threads']} thread(s), median of {result['rounds']} round(s))",
             "  ".join(h.rjust(w) for h, w in zip(COLUMNS, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    roof = result["roofline"]
    pct = roof["fxsched_pct_of_roofline"]
    lines.append(f"roofline batch 1: {roof['decode_weight_bytes'] / 1e6:.0f} MB of weights per token, copy "
                 f"bandwidth {roof['copy_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s (read + written) -> "
                 f"{roof['roofline_tok_s']:.1f} tok/s; fxsched {_fmt(roof['fxsched_batch1_decode_tok_s'])} tok/s"
                 + (f" = {pct:.0f}%" if pct is not None else ""))
    lora = result.get("lora")
    if lora is not None:
        lines.append(f"LoRA: {lora['adapters']} adapters of rank {lora['rank']}, request i on adapter i mod "
                     f"{lora['adapters']}; decode tok/s ratios per batch:")
        for key, what in (("decode_x", "fxsched with adapters / without"),
                          ("vllm_decode_x", "vLLM with adapters / without"),
                          ("vs_vllm", "fxsched-lora / vllm-lora")):
            if any(x is not None for x in lora[key].values()):
                lines.append(f"  {what}: " + ", ".join(f"batch {b}: {_fmt(x)}x" for b, x in lora[key].items()))
    for c in result["cells"]:
        if "error" in c:
            lines.append(f"{c['engine']} batch {c['batch']}: n/a ({c['error']})")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="fxsched bench e2e", description=__doc__.splitlines()[0])
    ap.add_argument("--like", default=None,
                    help=f"comma list of model shapes to build and run: {', '.join(e2e_models.LIKE)} "
                         f"(default qwen3-0.6b)")
    ap.add_argument("--model", metavar="DIR", default=None, help="run this checkpoint instead of --like")
    ap.add_argument("--models-dir", default=str(e2e_models.default_models_dir()),
                    help="where --like checkpoints are built and kept")
    ap.add_argument("--batches", type=sizes_arg, default=None, help="batch sizes (default 1,8,32; 8 with --lora)")
    ap.add_argument("--rounds", type=int_arg(1, 1000), default=3)
    ap.add_argument("--threads", dest="thread_counts", type=sizes_arg, default=(1,),
                    help="comma list of thread counts, each engine given the same (default 1); every cell at each")
    ap.set_defaults(threads=1)  # the count the cells run at now (main sets each of --threads in turn)
    ap.add_argument("--prompt-len", type=int_arg(1, 1 << 20), default=512)
    ap.add_argument("--max-tokens", type=int_arg(2, 1 << 20), default=64)
    ap.add_argument("--seed", type=int_arg(0, 2**31), default=0, help="prompts and built weights")
    ap.add_argument("--engines", default=None,
                    help="comma list of fxsched, fxsched-overlap (with the device lane, as generate --overlap), "
                         "fxsched-async (as generate --async-scheduling), transformers, vllm (vllm only with "
                         "--vllm-python)")
    ap.add_argument("--vllm-python", default=None, metavar="PY", help="a Python where `import vllm` works")
    ap.add_argument("--vllm-eager", action="store_true",
                    help="run vLLM with enforce_eager (default: its compiled mode, as shipped)")
    ap.add_argument("--kv-cache-memory", default=None, metavar="SIZE",
                    help="fxsched's KV cache budget (default: sized for batch x (prompt + tokens))")
    ap.add_argument("--spec", default="none", help="fxsched's speculation mode (default none)")
    ap.add_argument("--timeout", type=int_arg(1, 86_400), default=3600, help="seconds per cell")
    ap.add_argument("--lora", action="store_true",
                    help="LoRA's cost: --lora-adapters random adapters of rank --lora-rank, request i on "
                         "adapter i mod their count (engines fxsched-lora, vllm-lora), against the same engines "
                         "without; defaults then: --engines fxsched,fxsched-lora (+ vllm,vllm-lora with "
                         "--vllm-python), --batches 8 (qwen3-0.6b only: a dense Qwen3's projections)")
    ap.add_argument("--lora-adapters", type=int_arg(1, 256), default=4, help="with --lora: adapters (default 4)")
    ap.add_argument("--lora-rank", type=int_arg(1, 1024), default=16, help="with --lora: their rank (default 16)")
    ap.add_argument("--json", action="store_true", help="one JSON object per model instead of the tables")
    ap.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)  # tests: no worker processes
    return ap


def _checked(args: argparse.Namespace) -> list[str]:
    """The engines to run; UsageError for bad input."""
    from fxsched.runtime.cli.usage import parse_size
    from fxsched.runtime.generate import SPECS

    if args.engines is None:
        args.engines = "fxsched,fxsched-lora,vllm,vllm-lora" if args.lora else "fxsched,transformers,vllm"
    if args.batches is None:
        args.batches = (8,) if args.lora else (1, 8, 32)
    engines = [e.strip() for e in args.engines.split(",")]
    if any(e in LORA_ENGINES for e in engines) and (args.like or "qwen3-0.6b") != "qwen3-0.6b" and args.model is None:
        raise UsageError(f"--lora: random adapters are built for a dense Qwen3 (--like qwen3-0.6b), not {args.like}")
    for e in engines:
        if e not in ENGINES:
            raise UsageError(f"--engines {args.engines}: unknown engine {e!r} (choose {', '.join(ENGINES)})")
    if "fxsched" not in engines:
        raise UsageError(f"--engines {args.engines}: fxsched is the reference of the ratios; list it")
    if args.spec not in SPECS:
        raise UsageError(f"--spec {args.spec}: unknown speculation mode (choose from {', '.join(SPECS)})")
    if args.kv_cache_memory is not None:
        args.kv_cache_memory = parse_size(args.kv_cache_memory, "--kv-cache-memory")
    if args.vllm_python is not None:
        problem = _vllm_ok(args.vllm_python)
        if problem:
            raise UsageError(f"--vllm-python {args.vllm_python}: {problem}")
    else:
        engines = [e for e in engines if not e.startswith("vllm")]
    return engines


def main(argv: Optional[list[str]] = None) -> int:
    from tqdm import tqdm

    from fxsched.runtime.cli.usage import UsageError as CliUsageError
    from fxsched.runtime.logs import configure_logging

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else EXIT_USAGE
    configure_logging(False)
    try:
        engines = _checked(args)
        models = resolve_models(args)
    except (UsageError, CliUsageError) as err:
        print(f"fxsched bench e2e: {err}", file=sys.stderr)
        return EXIT_USAGE
    counts = tuple(args.thread_counts)
    total = len(counts) * len(models) * args.rounds * len(args.batches) * len(engines)
    results = []
    with tqdm(total=total, unit="cell", file=sys.stderr, disable=None, leave=False) as bar:
        for threads in counts:  # one table per (thread count, model): its cells' rounds interleave
            args.threads = threads
            args.bandwidth = copy_bandwidth(threads)
            for label, path in models:
                results.append(run_model(args, label, path, engines, bar))
    for result in results:
        if args.json:
            print(json.dumps(result))
        else:
            print(format_model(result))
            print()
    return 0
