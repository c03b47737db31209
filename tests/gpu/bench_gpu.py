"""The measuring steps of tests/gpu/check.sh (a script run by it, not a test module, not product code).

Sub-commands, each writing one JSON object to ``--json PATH`` (rewritten as it goes, so a step
killed at its time limit still leaves what it measured). A figure the step decides to leave out
says why; ``status`` / ``reason`` at the top are the step's own verdict (check.sh adds the exit
code and the seconds):

* ``imports``: the modules the check needs import (fxsched through the linked package, structlog
  and fla from the carried wheels, torch, triton, transformers, ...), with versions and paths, and
  ``python -m fxsched.runtime.cli --help`` runs.
* ``env``: versions, the GPU, its multiprocessor count, and the machine's two ceilings measured
  once: a device-to-device copy (GB/s, bytes read + written) and a bf16 8192^3 matrix product
  (TFLOP/s), medians of event-timed repeats.
* ``models``: real-size random bf16 checkpoints built on the device (runtime/bench/e2e_models.py:
  ``qwen3-0.6b``, ``qwen3.5-hybrid`` with its MTP layer, and the ``qwen3-next-moe`` dimensions with
  ``--moe-layers`` layers instead of 12, see ``MOE_LAYERS``), then per model: tokens/s at each batch
  and speculation mode with CUDA graphs on and off (interleaved rounds, medians; whole-run rate and
  the decode rate of the window after prefill), transformers' ``generate`` on the same checkpoint
  and prompts (spec none, greedy), tokens identical with graphs on and off and against
  transformers, host syncs per decode tick (torch.cuda.set_sync_debug_mode("warn") over the window
  after prefill, divided by the target forwards of that window) for greedy, sampled (T 0.8, top-p
  0.9) and MTP, the graphs' static / eager forward counts, and batch-1 decode against the HBM
  roofline (``e2e_models.decode_weight_bytes`` / the measured copy bandwidth). Each cell is
  guarded: a failure is recorded and the next cell runs; ``--budget-s`` bounds the whole step
  (cells past it are listed as skipped). Without CUDA (or with ``--tiny``) the same families are
  built at toy dimensions and run on the CPU, so every code path runs in a rehearsal.
* ``kernels``: ``fxsched bench kernels --json`` (its rows, or ``run_kernel_bench``'s when the
  command prints a table), Triton paged attention against SDPA over the same K/V, and the GDN
  recurrence kernel against flash-linear-attention's ``fused_recurrent_gated_delta_rule`` (decode
  and verify rows) and fxsched's chunked prefill against fla's ``chunk_gated_delta_rule``, each
  with the relative difference of the outputs. Without fla those rows are "skipped: fla missing".
* ``parity``: greedy tokens of the default model with ``fxsched generate --device cuda`` equal
  those of ``--device cpu`` (same prompts, ``--json``), for spec none and mtp.

Usage: python tests/gpu/bench_gpu.py SUB-COMMAND --json PATH [options]   (see --help)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, cast

FAMILIES = ("qwen3-0.6b", "qwen3.5-hybrid", "qwen3-next-moe")
MOE_LAYERS = 4  # the qwen3-next-moe dimensions with 4 layers (3 GDN + 1 attention) instead of 12
BATCHES = (1, 8, 32, 64)
PROMPT_LEN = 32
MAX_SEQ_LEN = 512
SYNC_BATCH = 8
SYNC_TOKENS = 32
SAMPLED: dict[str, Any] = {"temperature": 0.8, "top_p": 0.9, "seed": 7}

# toy dimensions for --tiny (no CUDA): the same families, every code path, seconds on a CPU
_TINY_ATTN = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
_TINY_GDN = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
             "linear_value_head_dim": 16}
_TINY_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}


def _layer_types(layers: int) -> list[str]:
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]


TINY: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {**_TINY_ATTN, "num_hidden_layers": 2, "intermediate_size": 128},
    "qwen3.5-hybrid": {**_TINY_ATTN, **_TINY_GDN, "num_hidden_layers": 4, "layer_types": _layer_types(4),
                       "intermediate_size": 128,
                       "rope_parameters": {**_TINY_ROPE, "mrope_interleaved": True, "mrope_section": [1, 1, 0]}},
    "qwen3-next-moe": {**_TINY_ATTN, **_TINY_GDN, "num_hidden_layers": 4, "layer_types": _layer_types(4),
                       "intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2,
                       "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
                       "rope_parameters": dict(_TINY_ROPE)},
}


# --- shared helpers ----------------------------------------------------------------------------------


class Record:
    """The step's JSON object, written atomically after every change worth keeping."""

    def __init__(self, path: Optional[str]):
        self.path = Path(path) if path else None
        self.data: dict[str, Any] = {}

    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        tmp.replace(self.path)


def say(*parts: Any) -> None:
    print(*parts, flush=True)


def error_text(err: BaseException) -> str:
    """One line: the exception, and where in our code or the product it was raised."""
    frames = traceback.extract_tb(err.__traceback__)
    where = next((f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames)
                  if "fxsched" in f.filename or "/tests/gpu/" in f.filename or "/runtime/" in f.filename), "")
    first = (str(err).strip().splitlines() or [""])[0][:400]
    return f"{type(err).__name__}: {first}" + (f" (at {where})" if where else "")


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def median(values: list[float]) -> Optional[float]:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(values) if values else None


def first_diff(a: list[list[int]], b: list[list[int]]) -> Optional[list[int]]:
    """[prompt, position] of the first difference of two token lists, None when equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            j = next((k for k, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y)))
            return [i, j]
    return None if len(a) == len(b) else [min(len(a), len(b)), 0]


# --- imports -------------------------------------------------------------------------------------------

IMPORTS = ("structlog", "attrs", "tqdm", "numpy", "jinja2", "safetensors", "tokenizers", "torch", "triton",
           "transformers", "einops", "fla", "fla.ops.gated_delta_rule", "fxsched.runtime.cli.app",
           "fxsched.runtime.generate", "fxsched.runtime.devices.torch", "fxsched.runtime.torch_model",
           "fxsched.kernels.bench", "fxsched.runtime.bench.e2e_models", "fxsched.runtime.bench.e2e_worker")


def cmd_imports(args: argparse.Namespace) -> int:
    rec = Record(args.json)
    rec.data.update(python=sys.version.split()[0], executable=sys.executable, modules={})
    failed = []
    for name in IMPORTS:
        try:
            module = importlib.import_module(name)
            rec.data["modules"][name] = {"version": getattr(module, "__version__", None),
                                         "file": getattr(module, "__file__", None)}
        except Exception as err:  # any import failure is a figure
            rec.data["modules"][name] = {"error": error_text(err)}
            failed.append(name)
    cli = subprocess.run([sys.executable, "-m", "fxsched.runtime.cli", "--help"], capture_output=True, text=True,
                         timeout=120)
    rec.data["cli_help_rc"] = cli.returncode
    if cli.returncode != 0:
        failed.append("python -m fxsched.runtime.cli --help")
        rec.data["cli_help_stderr"] = cli.stderr[-2000:]
    if failed:
        rec.data.update(status="failed", reason="cannot import: " + ", ".join(failed))
    for name, info in rec.data["modules"].items():
        say(f"{name:36s} {info.get('version') or ''} {info.get('error') or info.get('file') or ''}")
    rec.save()
    return 1 if failed else 0


# --- env -----------------------------------------------------------------------------------------------


def event_median_ms(fn: Callable[[], Any], repeats: int, warmup: int = 3) -> float:
    """Median of ``repeats`` event-timed calls (CUDA), after ``warmup`` calls."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def copy_bandwidth_gbps(nbytes: int = 2 << 30) -> float:
    """GB/s (1e9) of a device-to-device copy of ``nbytes``, bytes read + bytes written."""
    import torch

    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = event_median_ms(functools.partial(dst.copy_, src), repeats=20)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def matmul_tflops(n: int = 8192) -> float:
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = event_median_ms(lambda: a @ b, repeats=10)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def cmd_env(args: argparse.Namespace) -> int:
    import torch

    rec = Record(args.json)
    rec.data.update(python=sys.version.split()[0], torch=torch.__version__, torch_cuda=torch.version.cuda,
                    cuda=torch.cuda.is_available())
    for name in ("triton", "transformers", "safetensors", "tokenizers", "numpy", "fla", "structlog"):
        try:
            rec.data[name] = getattr(importlib.import_module(name), "__version__", "?")
        except Exception as err:
            rec.data[name] = f"missing ({error_text(err)})"
    if not torch.cuda.is_available():
        rec.data.update(status="skipped", reason="no CUDA (versions only)")
        rec.save()
        say(json.dumps(rec.data))
        return 0
    props = torch.cuda.get_device_properties(0)
    rec.data.update(gpu=props.name, capability=f"{props.major}.{props.minor}", sm_count=props.multi_processor_count,
                    memory_gib=round(props.total_memory / 2**30, 1),
                    l2_mb=round(getattr(props, "L2_cache_size", 0) / 1e6, 1))
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.sm,clocks.mem,power.draw",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        rec.data["nvidia_smi"] = smi.stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as err:
        rec.data["nvidia_smi"] = f"not run ({err})"
    rec.save()
    rec.data["copy_gbps"] = round(copy_bandwidth_gbps(), 1)
    rec.save()
    rec.data["bf16_matmul_tflops"] = round(matmul_tflops(), 1)
    rec.save()
    say(json.dumps(rec.data))
    return 0


# --- models --------------------------------------------------------------------------------------------


def model_config(family: str, tiny: bool, moe_layers: int) -> tuple[str, Any]:
    """(label, transformers config) of a family: e2e_models' dimensions, the MoE with fewer layers,
    everything at toy dimensions with ``tiny``."""
    from fxsched.runtime.bench import e2e_models

    config = e2e_models.LIKE[family]()
    over: dict[str, Any] = {}
    label = family
    if family == "qwen3-next-moe" and moe_layers != config.num_hidden_layers:
        over = {"num_hidden_layers": moe_layers, "layer_types": _layer_types(moe_layers)}
        label = f"{family}-{moe_layers}l"
    if tiny:
        over.update(TINY[family])
        label = f"{family}-tiny"
    if over:
        fields = {**config.to_dict(), **over}
        layers, types = fields["num_hidden_layers"], fields.get("layer_types")
        if types and len(types) != layers:  # Qwen3's all-"full_attention" list, of the old length
            fields["layer_types"] = [types[0]] * layers if len(set(types)) == 1 else _layer_types(layers)
        config = type(config).from_dict(fields)
    return label, config


def build_checkpoint(family: str, label: str, config: Any, models_dir: Path, cuda: bool) -> tuple[Path, dict[str, Any]]:
    """The checkpoint directory (built unless a finished one is there), and how it was built."""
    import torch

    from fxsched.runtime.bench import e2e_models

    path = models_dir / label
    info: dict[str, Any] = {"path": str(path)}
    if (path / e2e_models.DONE).exists():
        info["built"] = "re-used"
        return path, info
    start = time.perf_counter()
    mtp = e2e_models.MTP_LAYERS.get(family, 0)
    attempts: list[tuple[str, Any]] = [("cuda", torch.device("cuda"))] if cuda else []
    attempts.append(("cpu", contextlib.nullcontext()))
    for where, ctx in attempts:
        if path.exists():
            shutil.rmtree(path)
        try:
            with ctx:  # transformers' initialisation under the CUDA default device: seconds, not a minute
                e2e_models.build(config, path, 0, mtp)
            info["built_on"] = where
            break
        except Exception as err:
            info[f"build_error_{where}"] = error_text(err)
            if where == "cpu":
                raise
    (path / e2e_models.DONE).write_text("built\n")
    info["build_s"] = round(time.perf_counter() - start, 2)
    info["checkpoint_gb"] = round(sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e9, 3)
    return path, info


class Run:
    """One generate call's figures: whole-run and after-prefill window rates, syncs, ticks."""

    def __init__(self) -> None:
        self.outputs: list[list[int]] = []
        self.seconds = 0.0
        self.tok_s = 0.0
        self.decode_tok_s: Optional[float] = None
        self.window_ticks = 0
        self.syncs: Optional[int] = None
        self.summary: dict[str, Any] = {}
        self.graph_static = 0
        self.graph_eager = 0


def fx_generate(engine: Any, prompts: list[list[int]], max_tokens: int, spec: str, *, sampling: Any = None,
                count_syncs: bool = False) -> Run:
    """``generate`` with a window that opens once every request has its first token (prefill done)
    and closes at the last token: its decode rate, its target forwards (decode + verify: the decode
    ticks) and, with ``count_syncs``, the host syncs torch's sync debug mode reports inside it."""
    import torch

    from fxsched.runtime.generate import GREEDY, generate

    cuda = engine.device.type == "cuda"
    batch, total = len(prompts), 0
    box: dict[str, Any] = {}
    run = Run()

    def ticks() -> int:
        stats = box["device"].stats
        return int(stats.decode_forwards + stats.verify_forwards)

    def keep_device(device: Any) -> Any:  # the same device: only to read its counters
        box["device"] = device
        return device

    def progress(n: int) -> None:
        nonlocal total
        total += n
        if "t0" not in box and total >= batch:
            box.update(t0=time.perf_counter(), ticks0=ticks(), tokens0=total)
            if count_syncs and cuda:
                torch.cuda.set_sync_debug_mode("warn")
        if "t1" not in box and total >= batch * max_tokens:
            if count_syncs and cuda:
                torch.cuda.set_sync_debug_mode("default")
            box.update(t1=time.perf_counter(), ticks1=ticks())

    graphs = engine.graphs
    static0, eager0 = (graphs.stats.static, graphs.stats.eager) if graphs is not None else (0, 0)
    caught: list[Any] = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always" if count_syncs else "default")
        try:
            result = generate(engine, prompts, max_tokens, spec=spec, eos_ids=(), sampling=sampling or GREEDY,
                              progress=progress, wrap_device=keep_device)
        finally:
            if count_syncs and cuda:
                torch.cuda.set_sync_debug_mode("default")
        caught = list(seen) if count_syncs else []
    errors = [r.error for r in result.results if r.error]
    if errors:
        raise RuntimeError(f"fxsched generate: {errors[0]}")
    run.outputs = [list(map(int, t)) for t in result.outputs]
    run.seconds = result.summary.seconds
    run.tok_s = result.summary.tokens_per_s
    s = result.summary
    run.summary = {"forwards_per_token": round(s.forwards_per_token, 3), "steps": s.steps,
                   "mean_accepted_length": s.mean_accepted_length, "cached_prompt_tokens": s.cached_prompt_tokens}
    if "t1" in box and box["t1"] > box["t0"]:
        run.decode_tok_s = (batch * max_tokens - box["tokens0"]) / (box["t1"] - box["t0"])
        run.window_ticks = box["ticks1"] - box["ticks0"]
    if count_syncs and cuda:
        run.syncs = sum("synchroniz" in str(w.message) for w in caught)
    if graphs is not None:
        run.graph_static, run.graph_eager = graphs.stats.static - static0, graphs.stats.eager - eager0
    return run


class HFModel:
    """transformers' ``generate`` on the same checkpoint: greedy, exactly max_tokens new tokens."""

    def __init__(self, path: Path, device: str):
        import torch
        from transformers import AutoModelForCausalLM

        self.device = device
        model: Any = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)
        self.model = cast(Any, model.to(device)).eval()
        if device != "cuda":  # flash-linear-attention's Triton kernels do not run on a CPU
            from fxsched.runtime.bench.e2e_worker import _torch_gdn

            _torch_gdn()

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        import torch

        ids = torch.tensor(prompts, dtype=torch.long, device=self.device)
        if self.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                      min_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)
        if self.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, [row[ids.shape[1]:].tolist() for row in out]


class ModelBench:
    """The cells of one model (see the module docstring)."""

    def __init__(self, label: str, path: Path, device: str, batches: tuple[int, ...], specs: tuple[str, ...],
                 out: dict[str, Any], save: Callable[[], None], slice_end: float, args: argparse.Namespace):
        self.label, self.path, self.device = label, path, device
        self.batches, self.specs, self.out, self.save = batches, specs, out, save
        self.slice_end, self.args = slice_end, args
        self.engines: dict[str, Any] = {}
        self.hf: Optional[HFModel] = None
        self.prompt_len = PROMPT_LEN if not args.tiny else 16

    def left(self) -> float:
        return self.slice_end - time.perf_counter()

    def prompts(self, batch: int, seed: int) -> list[list[int]]:
        """Seeded random prompts: every run gets its own, so no engine serves one from its prefix cache."""
        rng = random.Random(seed)
        vocab = int(self.engines["graphs_on"].cfg.vocab_size)
        return [[rng.randrange(vocab) for _ in range(self.prompt_len)] for _ in range(batch)]

    def start(self) -> None:
        from fxsched.runtime.torch_model import HybridEngine

        for arm, on in (("graphs_on", True), ("graphs_off", False)):
            t0 = time.perf_counter()
            engine = HybridEngine.from_pretrained(self.path, device=self.device, max_slots=max(self.batches),
                                                  max_seq_len=MAX_SEQ_LEN, cuda_graphs=on)
            if on and engine.graphs is None and self.device != "cuda":
                engine.use_graphs(capture=False)  # the CPU's static forwards: what a graph would record
            self.engines[arm] = engine
            self.out[f"{arm}_load_s"] = round(time.perf_counter() - t0, 2)
        graphs = self.engines["graphs_on"].graphs
        self.out["graphs_captured"] = bool(graphs is not None and getattr(graphs, "captured", False))
        self.save()
        for arm, engine in self.engines.items():  # first calls: Triton compiles, allocator, cuBLAS
            t0 = time.perf_counter()
            for spec in self.specs:
                fx_generate(engine, self.prompts(2, 1), 4, spec)
            self.out[f"{arm}_warmup_s"] = round(time.perf_counter() - t0, 2)
        if not self.args.no_hf and set(self.args.hf_batches) & set(self.batches):
            t0 = time.perf_counter()
            try:
                self.hf = HFModel(self.path, self.device)
                self.hf.generate(self.prompts(2, 1), 4)
                self.out["transformers_load_and_warmup_s"] = round(time.perf_counter() - t0, 2)
            except Exception as err:
                self.out["transformers_error"] = error_text(err)
                self.hf = None
        self.save()

    def cell(self, batch: int, spec: str) -> dict[str, Any]:
        big = batch >= 32
        tokens = self.args.tokens_large if big else self.args.tokens
        rounds = self.args.rounds_large if big else self.args.rounds
        with_hf = spec == "none" and self.hf is not None and batch in self.args.hf_batches
        arms: list[str] = ["graphs_on", "graphs_off"] + (["transformers"] if with_hf else [])
        cell: dict[str, Any] = {"batch": batch, "spec": spec, "max_tokens": tokens, "rounds": rounds}
        rates: dict[str, list[float]] = {a: [] for a in arms}
        decode: dict[str, list[float]] = {a: [] for a in arms}
        same_graphs, same_hf, diffs_hf = True, True, []
        t0 = time.perf_counter()
        for arm in arms[:2]:  # a short run at this batch first: shapes, buckets, allocator
            fx_generate(self.engines[arm], self.prompts(batch, 2), 2, spec)
        for r in range(rounds):
            prompts = self.prompts(batch, 1000 + 97 * batch + r)
            outs: dict[str, list[list[int]]] = {}
            for arm in arms:
                if arm == "transformers":
                    assert self.hf is not None
                    seconds, outs[arm] = self.hf.generate(prompts, tokens)
                    rates[arm].append(batch * tokens / seconds)
                    continue
                run = fx_generate(self.engines[arm], prompts, tokens, spec)
                outs[arm] = run.outputs
                rates[arm].append(run.tok_s)
                if run.decode_tok_s is not None:
                    decode[arm].append(run.decode_tok_s)
                if arm == "graphs_on":
                    cell.update(run.summary)
                    cell["graph_forwards_static"] = run.graph_static
                    cell["graph_forwards_eager"] = run.graph_eager
            same_graphs &= outs["graphs_on"] == outs["graphs_off"]
            if "transformers" in outs:
                d = first_diff(outs["graphs_on"], outs["transformers"])
                same_hf &= d is None
                diffs_hf.append(d)
        for arm in arms:
            cell[f"{arm}_tok_s"] = _round(median(rates[arm]))
            if arm != "transformers":
                cell[f"{arm}_decode_tok_s"] = _round(median(decode[arm]))
            cell[f"{arm}_tok_s_rounds"] = [_round(v) for v in rates[arm]]
        cell["graphs_speedup"] = _ratio(cell.get("graphs_on_tok_s"), cell.get("graphs_off_tok_s"))
        cell["graphs_decode_speedup"] = _ratio(cell.get("graphs_on_decode_tok_s"), cell.get("graphs_off_decode_tok_s"))
        cell["same_tokens_graphs_on_off"] = same_graphs
        if "transformers" in arms:
            cell["fxsched_over_transformers"] = _ratio(cell.get("graphs_on_tok_s"), cell.get("transformers_tok_s"))
            cell["same_tokens_transformers"] = same_hf
            cell["first_diff_transformers"] = next((d for d in diffs_hf if d is not None), None)
        cell["seconds"] = round(time.perf_counter() - t0, 2)
        return cell

    def syncs(self) -> dict[str, Any]:
        """Host syncs per decode tick over the window after prefill, at SYNC_BATCH."""
        from fxsched.runtime.generate import SamplingOptions

        runs: list[tuple[str, str, str, Any]] = [("greedy", "graphs_on", "none", None),
                                                 ("sampled", "graphs_on", "none", SamplingOptions(**SAMPLED)),
                                                 ("greedy_graphs_off", "graphs_off", "none", None)]
        if "mtp" in self.specs:
            runs.append(("mtp", "graphs_on", "mtp", None))
        found: dict[str, Any] = {}
        for name, arm, spec, sampling in runs:
            try:
                run = fx_generate(self.engines[arm], self.prompts(SYNC_BATCH, 5000 + len(found)),
                                  self.args.tokens if self.args.tiny else SYNC_TOKENS, spec, sampling=sampling,
                                  count_syncs=True)
                per_tick = None if run.syncs is None or not run.window_ticks else round(run.syncs / run.window_ticks, 3)
                found[name] = {"syncs": run.syncs if run.syncs is not None else "skipped: no CUDA",
                               "decode_ticks": run.window_ticks, "syncs_per_tick": per_tick,
                               "graph_forwards_static": run.graph_static, "graph_forwards_eager": run.graph_eager}
            except Exception as err:
                found[name] = {"error": error_text(err)}
        return found

    def close(self) -> None:
        self.engines.clear()
        self.hf = None


def _round(value: Optional[float], digits: int = 1) -> Optional[float]:
    return None if value is None else round(value, digits)


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return round(a / b, 3) if a and b else None


def cell_order(batches: tuple[int, ...], specs: tuple[str, ...]) -> Iterator[tuple[int, str]]:
    """Plain decoding at every batch first, then each speculation mode (what matters most goes first)."""
    for spec in specs:
        for batch in batches:
            yield batch, spec


def cmd_models(args: argparse.Namespace) -> int:
    import torch

    from fxsched.runtime.bench import e2e_models

    deadline = time.perf_counter() + args.budget_s
    cuda = torch.cuda.is_available() and not args.cpu
    args.tiny = args.tiny or not cuda
    device = "cuda" if cuda else "cpu"
    if args.tiny:  # a rehearsal: the code paths, not the figures
        args.tokens, args.tokens_large = min(args.tokens, 8), min(args.tokens_large, 6)
        args.rounds, args.rounds_large = 1, 1
    batches = tuple(int(b) for b in args.batches.split(","))
    args.hf_batches = tuple(int(b) for b in args.hf_batches.split(",")) if args.hf_batches else ()
    if args.tiny and not cuda:
        batches = tuple(b for b in batches if b <= 8) or (1,)
        args.hf_batches = batches
    rec = Record(args.json)
    rec.data.update(device=device, tiny=args.tiny, batches=list(batches), budget_s=args.budget_s,
                    moe=f"qwen3-next-moe dimensions with {args.moe_layers} layers (e2e_models.LIKE builds 12; "
                        "ensure_model takes no size, so the config is built here and passed to e2e_models.build)",
                    models={})
    if args.tiny:
        rec.data["note"] = ("no CUDA: toy dimensions on the CPU, one round, few tokens; the figures only show "
                            "that every path runs") if not cuda else "--tiny: toy dimensions"
    bandwidth = None
    if args.env_json and Path(args.env_json).exists():
        bandwidth = json.loads(Path(args.env_json).read_text()).get("copy_gbps")
    if cuda and bandwidth is None:
        bandwidth = round(copy_bandwidth_gbps(), 1)
    rec.data["copy_gbps"] = bandwidth
    rec.save()
    models_dir = Path(args.models_dir)
    families = [f for f in args.models.split(",") if f]
    weights = [3 if e2e_models.MTP_LAYERS.get(f) else 2 for f in families]  # one share per speculation mode
    failures = 0
    for index, family in enumerate(families):
        out: dict[str, Any] = {}
        try:
            label, config = model_config(family, args.tiny, args.moe_layers)
        except Exception as err:
            rec.data["models"][family] = {"error": error_text(err)}
            failures += 1
            continue
        rec.data["models"][label] = out
        share = weights[index] / sum(weights[index:])  # unused time of earlier models passes on
        slice_end = time.perf_counter() + (deadline - time.perf_counter()) * share
        say(f"== {label}: {slice_end - time.perf_counter():.0f}s of the budget")
        bench: Optional[ModelBench] = None
        try:
            path, info = build_checkpoint(family, label, config, models_dir, cuda)
            out.update(info)
            out["decode_weight_bytes"] = e2e_models.decode_weight_bytes(path)
            specs = ("none", "mtp", "ngram") if e2e_models.MTP_LAYERS.get(family) else ("none", "ngram")
            out["specs"] = list(specs)
            rec.save()
            bench = ModelBench(label, path, device, batches, specs, out, rec.save, slice_end, args)
            bench.start()
            cells: list[dict[str, Any]] = out.setdefault("cells", [])
            for batch, spec in cell_order(batches, specs):
                if bench.left() <= 0:
                    cells.append({"batch": batch, "spec": spec, "status": "skipped: time budget"})
                    continue
                try:
                    cell = bench.cell(batch, spec)
                except Exception as err:
                    cell = {"batch": batch, "spec": spec, "error": error_text(err)}
                    failures += 1
                cells.append(cell)
                rec.save()
                say(f"{label} batch {batch:3d} {spec:5s} " + " ".join(
                    f"{k}={cell.get(k)}" for k in ("graphs_on_tok_s", "graphs_off_tok_s", "graphs_on_decode_tok_s",
                                                   "transformers_tok_s", "fxsched_over_transformers",
                                                   "same_tokens_graphs_on_off", "error") if k in cell))
                if batch == min(batches) and spec == "none":
                    if bench.left() > 0:
                        out["host_syncs"] = bench.syncs()
                        rec.save()
                        say(f"{label} syncs {json.dumps(out['host_syncs'])}")
                    else:
                        out["host_syncs"] = "skipped: time budget"
            graphs = bench.engines["graphs_on"].graphs
            if graphs is not None:
                out["graph_stats_total"] = {"static": graphs.stats.static, "eager": graphs.stats.eager}
            one = next((c for c in cells if c.get("batch") == 1 and c.get("spec") == "none"
                        and c.get("graphs_on_decode_tok_s")), None)
            if one and bandwidth and cuda:
                roof = bandwidth * 1e9 / out["decode_weight_bytes"]
                out["roofline"] = {"copy_gbps": bandwidth, "decode_weight_bytes": out["decode_weight_bytes"],
                                   "roofline_tok_s": round(roof, 1), "batch1_decode_tok_s": one["graphs_on_decode_tok_s"],
                                   "percent_of_roofline": round(100 * one["graphs_on_decode_tok_s"] / roof, 1)}
            elif not cuda:
                out["roofline"] = "skipped: no CUDA"
        except Exception as err:
            out["error"] = error_text(err)
            failures += 1
            say(f"{label}: {out['error']}")
        finally:
            if bench is not None:
                bench.close()
            if cuda:
                torch.cuda.empty_cache()
        rec.save()
    if failures:
        rec.data.update(status="failed", reason=f"{failures} model(s) or cell(s) failed (see their 'error')")
    rec.save()
    return 1 if failures else 0


# --- kernels -------------------------------------------------------------------------------------------


def bench_ms(fn: Callable[[], Any], cuda: bool) -> float:
    if cuda:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))
    fn()
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def rel_err(a: Any, b: Any) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def paged_rows(cuda: bool, tiny: bool) -> list[dict[str, Any]]:
    """Triton paged attention (CPU: the torch reference) against SDPA over the same K/V, gathered
    densely beforehand (not timed): Qwen3-0.6B's heads (16 q, 8 kv, 128), block 16."""
    heads = (16, 8, 128) if not tiny else (4, 2, 32)
    shapes = [(1, 2048, 1), (8, 2048, 1), (32, 2048, 1), (64, 2048, 1), (1, 8192, 1), (32, 2048, 4), (64, 512, 4)]
    if tiny:
        shapes = [(2, 64, 1), (2, 64, 4)]
    rows = []
    for batch, ctx, k_rows in shapes:
        row: dict[str, Any] = {"kernel": "paged_attention", "B": batch, "ctx": ctx, "K": k_rows, "Hq": heads[0],
                               "Hkv": heads[1], "D": heads[2], "block": 16}
        try:
            row.update(paged_row(cuda, batch, ctx, k_rows, *heads))
        except Exception as err:
            row["error"] = error_text(err)
        rows.append(row)
        say(json.dumps(row))
    return rows


def paged_row(cuda: bool, batch: int, ctx: int, k_rows: int, hq: int, hkv: int, dim: int,
              block: int = 16) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from fxsched.kernels import paged_attention as pa

    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    gen = torch.Generator().manual_seed(batch * 131 + ctx + k_rows)
    per_seq = -(-ctx // block)
    blocks = batch * per_seq + 4
    k_cache = torch.randn(blocks, block, hkv, dim, generator=gen).to(device, dtype)
    v_cache = torch.randn(blocks, block, hkv, dim, generator=gen).to(device, dtype)
    table = torch.randperm(blocks, generator=gen)[:batch * per_seq].view(batch, per_seq).to(device, torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    query = torch.randn(batch, k_rows, hq, dim, generator=gen).to(device, dtype)
    scale = dim ** -0.5
    flat = table.long()
    k_dense = k_cache[flat].reshape(batch, per_seq * block, hkv, dim)[:, :ctx].transpose(1, 2).contiguous()
    v_dense = v_cache[flat].reshape(batch, per_seq * block, hkv, dim)[:, :ctx].transpose(1, 2).contiguous()
    q_sdpa = query.transpose(1, 2).contiguous()
    mask = None
    if k_rows > 1:  # row j of the K new rows sees positions < ctx - K + j + 1
        pos = torch.arange(ctx, device=device)
        mask = pos[None, :] <= (ctx - k_rows + torch.arange(k_rows, device=device))[:, None]

    def sdpa() -> Any:
        return F.scaled_dot_product_attention(q_sdpa, k_dense, v_dense, attn_mask=mask, scale=scale, enable_gqa=True)

    def paged() -> Any:
        fn = pa.paged_attention_triton if cuda else pa.paged_attention_reference
        return fn(query, k_cache, v_cache, table, lens, scale)

    row: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch."),
                           "impl": "triton" if cuda else "torch reference (no CUDA)",
                           "rel_err_vs_sdpa": rel_err(paged(), sdpa().transpose(1, 2))}
    nbytes = (2 * batch * ctx * hkv * dim + 2 * query.numel()) * query.element_size()
    row["ms_paged"] = round(bench_ms(paged, cuda), 4)
    row["ms_sdpa_dense"] = round(bench_ms(sdpa, cuda), 4)
    row["gbps_paged"] = round(nbytes / (row["ms_paged"] * 1e-3) / 1e9, 1)
    row["gbps_sdpa_dense"] = round(nbytes / (row["ms_sdpa_dense"] * 1e-3) / 1e9, 1)
    row["paged_over_sdpa_time"] = round(row["ms_paged"] / row["ms_sdpa_dense"], 3)
    return row


def gdn_inputs(batch: int, steps: int, heads: int, dk: int, dv: int, device: str, dtype: Any, seed: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(batch, steps, heads, dk, generator=gen), dim=-1).to(device, dtype)
    k = F.normalize(torch.randn(batch, steps, heads, dk, generator=gen), dim=-1).to(device, dtype)
    v = torch.randn(batch, steps, heads, dv, generator=gen).to(device, dtype)
    g = (-torch.rand(batch, steps, heads, generator=gen) * 2).to(device)  # log decay <= 0, fp32
    beta = torch.rand(batch, steps, heads, generator=gen).to(device)
    state = (torch.randn(batch, heads, dk, dv, generator=gen) * 0.1).to(device)
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta, "state": state, "scale": dk ** -0.5}


def fla_functions() -> tuple[Any, Any, str]:
    """(chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, "") or (None, None, why not)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception as err:
        return None, None, f"skipped: fla missing ({error_text(err)})"
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, ""


def gdn_rows(cuda: bool, tiny: bool) -> list[dict[str, Any]]:
    """fxsched's GDN against flash-linear-attention at the same shapes (Qwen3.5 hybrid: 16 heads of 128)."""
    heads = (16, 128, 128) if not tiny else (4, 16, 16)
    recurrent = [(1, 1), (8, 1), (32, 1), (64, 1), (8, 4), (32, 4), (64, 4)] if not tiny else [(2, 1), (2, 4)]
    prefill = [(1, 512), (1, 2048), (4, 512)] if not tiny else [(1, 64)]
    rows: list[dict[str, Any]] = []
    for kind, shapes in (("gdn_recurrent", recurrent), ("gdn_prefill", prefill)):
        for batch, steps in shapes:
            row: dict[str, Any] = {"kernel": kind, "B": batch, "T": steps, "H": heads[0], "Dk": heads[1],
                                   "Dv": heads[2]}
            try:
                fn = gdn_recurrent_row if kind == "gdn_recurrent" else gdn_prefill_row
                row.update(fn(cuda, batch, steps, *heads))
            except Exception as err:
                row["error"] = error_text(err)
            rows.append(row)
            say(json.dumps(row))
    return rows


def gdn_recurrent_row(cuda: bool, batch: int, steps: int, heads: int, dk: int, dv: int) -> dict[str, Any]:
    """Decode (T 1) and verify (T 4) rows: fxsched's Triton recurrence against fla's fused recurrent."""
    import torch

    from fxsched.kernels import gated_delta as gd

    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    x = gdn_inputs(batch, steps, heads, dk, dv, device, dtype, seed=batch * 10 + steps)
    _, fused_recurrent, fla_missing = fla_functions()

    def ours() -> Any:
        fn = gd.gated_delta_triton if cuda else gd.gated_delta_reference
        return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"], x["scale"])

    def theirs() -> Any:
        return fused_recurrent(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], scale=x["scale"],
                               initial_state=x["state"], output_final_state=True)

    row: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch."),
                           "impl": "triton" if cuda else "torch reference (no CUDA)",
                           "note": "fxsched writes every row's fp32 state (verify rollback); fla the last only",
                           "ms_fxsched": round(bench_ms(ours, cuda), 4)}
    if fla_missing or not cuda:
        row["fla"] = fla_missing or "skipped: no CUDA (fla's kernels are Triton)"
        return row
    row["rel_err_vs_fla"] = rel_err(ours()[0], theirs()[0])
    row["ms_fla_fused_recurrent"] = round(bench_ms(theirs, cuda), 4)
    row["fxsched_over_fla_time"] = round(row["ms_fxsched"] / row["ms_fla_fused_recurrent"], 3)
    return row


def gdn_prefill_row(cuda: bool, batch: int, steps: int, heads: int, dk: int, dv: int) -> dict[str, Any]:
    """Prefill rows: fxsched's chunked form (torch, what the product prefills with) against fla's chunk kernel."""
    import torch

    from fxsched.runtime.torch_model.gdn_chunked import chunked_gated_delta

    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    x = gdn_inputs(batch, steps, heads, dk, dv, device, dtype, seed=7 + steps)
    chunk, _, fla_missing = fla_functions()
    q_scaled = (x["q"].float() * x["scale"]).to(dtype)  # the product passes q already scaled
    beta = x["beta"].to(dtype)

    def ours() -> Any:
        return chunked_gated_delta(q_scaled, x["k"], x["v"], x["g"], beta, x["state"])

    def theirs() -> Any:
        return chunk(x["q"], x["k"], x["v"], g=x["g"], beta=beta, scale=x["scale"], initial_state=x["state"],
                     output_final_state=True)

    row: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch."),
                           "note": "fxsched: gdn_chunked.chunked_gated_delta (torch, fp32 inside), the product's "
                                   "prefill path", "ms_fxsched_chunked": round(bench_ms(ours, cuda), 4)}
    if fla_missing or not cuda:
        row["fla"] = fla_missing or "skipped: no CUDA (fla's kernels are Triton)"
        return row
    row["rel_err_vs_fla"] = rel_err(ours()[0], theirs()[0])
    row["ms_fla_chunk"] = round(bench_ms(theirs, cuda), 4)
    row["fxsched_over_fla_time"] = round(row["ms_fxsched_chunked"] / row["ms_fla_chunk"], 3)
    return row


def cli_kernel_rows(cuda: bool, timeout: float) -> dict[str, Any]:
    """``fxsched bench kernels --json``: its JSON rows, or run_kernel_bench's when it prints a table."""
    command = [sys.executable, "-m", "fxsched.runtime.cli", "bench", "kernels", "--json", "--repeats", "20"]
    found: dict[str, Any] = {"command": "fxsched " + " ".join(command[3:])}
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    found["rc"] = done.returncode
    rows = []
    for line in done.stdout.splitlines():
        with contextlib.suppress(ValueError):
            value = json.loads(line)
            if isinstance(value, dict):
                rows.append(value)
            elif isinstance(value, list):
                rows.extend(v for v in value if isinstance(v, dict))
    if done.returncode != 0:
        found["error"] = (done.stderr.strip().splitlines() or ["exit status " + str(done.returncode)])[-1]
    elif rows:
        found["json"] = True
        found["rows"] = rows
    else:
        from fxsched.kernels.bench import run_kernel_bench

        found["json"] = False
        found["note"] = "the command printed a table, not JSON: rows from kernels.bench.run_kernel_bench"
        found["table"] = done.stdout[-4000:]
        found["rows"] = run_kernel_bench("cuda" if cuda else "cpu", repeats=20)
    for row in found.get("rows", []):
        say(json.dumps(row))
    return found


def cmd_kernels(args: argparse.Namespace) -> int:
    cuda = cuda_available() and not args.cpu
    tiny = args.tiny or not cuda
    rec = Record(args.json)
    rec.data.update(device="cuda" if cuda else "cpu", tiny=tiny)
    failed = []
    parts: list[tuple[str, Callable[[], Any]]] = [
        ("bench_kernels", lambda: cli_kernel_rows(cuda, timeout=args.cli_timeout_s)),
        ("paged_attention_vs_sdpa", lambda: paged_rows(cuda, tiny)),
        ("gdn_vs_fla", lambda: gdn_rows(cuda, tiny)),
    ]
    for name, part in parts:
        t0 = time.perf_counter()
        try:
            rec.data[name] = part()
        except Exception as err:
            rec.data[name] = {"error": error_text(err)}
        value = rec.data[name]
        rows = value if isinstance(value, list) else value.get("rows", [value])
        if (isinstance(value, dict) and "error" in value) or any(isinstance(r, dict) and "error" in r for r in rows):
            failed.append(name)
        rec.data[f"{name}_s"] = round(time.perf_counter() - t0, 2)
        rec.save()
    if failed:
        rec.data.update(status="failed", reason="errors in: " + ", ".join(failed))
    elif not cuda:
        rec.data.update(status="skipped", reason="no CUDA: the CLI's CPU rows and the torch references ran at toy "
                                                 "shapes; Triton and fla timings need CUDA")
    rec.save()
    return 1 if failed else 0


# --- parity --------------------------------------------------------------------------------------------

PARITY_PROMPTS = ("The lighthouse keeper climbed the stairs", "Once upon a time, in a small village,",
                  "The recipe calls for two cups of flour and", "In 1969 the first people walked on")


def generate_json(device: str, spec: str, prompt_file: Path, tokens: int, timeout: float) -> list[list[int]]:
    command = [sys.executable, "-m", "fxsched.runtime.cli", "generate", "--prompt-file", str(prompt_file),
               "--batch", str(len(PARITY_PROMPTS)), "--max-tokens", str(tokens), "--ignore-eos", "--json",
               "--no-progress", "--device", device, "--spec", spec]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"fxsched generate --device {device} --spec {spec}: exit {done.returncode}: "
                           + (done.stderr.strip().splitlines() or [""])[-1])
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    requests = sorted((r for r in records if "token_ids" in r), key=lambda r: r["index"])
    return [list(r["token_ids"]) for r in requests]


def cmd_parity(args: argparse.Namespace) -> int:
    import tempfile

    cuda = cuda_available() and not args.cpu
    rec = Record(args.json)
    rec.data.update(model="the embedded default model (fp32)", prompts=list(PARITY_PROMPTS), max_tokens=args.tokens,
                    runs={})
    failed = []
    with tempfile.TemporaryDirectory() as folder:
        prompt_file = Path(folder) / "prompts.txt"
        prompt_file.write_text("\n".join(PARITY_PROMPTS) + "\n")
        for spec in ("none", "mtp"):
            entry: dict[str, Any] = {}
            rec.data["runs"][spec] = entry
            try:
                t0 = time.perf_counter()
                cpu = generate_json("cpu", spec, prompt_file, args.tokens, args.timeout_s)
                entry["cpu_s"] = round(time.perf_counter() - t0, 2)
                entry["cpu_tokens"] = cpu
                if not cuda:
                    entry["cuda"] = "skipped: no CUDA"
                    continue
                t0 = time.perf_counter()
                gpu = generate_json("cuda", spec, prompt_file, args.tokens, args.timeout_s)
                entry["cuda_s"] = round(time.perf_counter() - t0, 2)
                entry["same_tokens"] = gpu == cpu
                entry["first_diff"] = first_diff(gpu, cpu)
                if gpu != cpu:
                    entry["cuda_tokens"] = gpu
                    failed.append(f"{spec}: CUDA tokens differ from the CPU's at [prompt, position] {entry['first_diff']}")
            except Exception as err:
                entry["error"] = error_text(err)
                failed.append(f"{spec}: {entry['error']}")
            rec.save()
            say(f"parity {spec}: {json.dumps({k: v for k, v in entry.items() if not k.endswith('tokens')})}")
    if failed:
        rec.data.update(status="failed", reason="; ".join(failed))
    elif not cuda:
        rec.data.update(status="skipped", reason="no CUDA: the CPU side ran")
    rec.save()
    return 1 if failed else 0


# --- command line --------------------------------------------------------------------------------------


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("imports", "env", "models", "kernels", "parity"):
        p = sub.add_parser(name)
        p.add_argument("--json", help="write the step's JSON object here")
        p.add_argument("--cpu", action="store_true", help="as if there were no CUDA")
        if name == "models":
            p.add_argument("--models", default=",".join(FAMILIES))
            p.add_argument("--moe-layers", type=int, default=MOE_LAYERS)
            p.add_argument("--batches", default=",".join(map(str, BATCHES)))
            p.add_argument("--tokens", type=int, default=32, help="tokens per request at batch < 32")
            p.add_argument("--tokens-large", type=int, default=24, help="tokens per request at batch >= 32")
            p.add_argument("--rounds", type=int, default=3, help="interleaved rounds at batch < 32")
            p.add_argument("--rounds-large", type=int, default=2, help="interleaved rounds at batch >= 32")
            p.add_argument("--budget-s", type=float, default=240.0, help="the whole step's seconds")
            p.add_argument("--models-dir", default=os.environ.get("FXSCHED_GPU_MODELS_DIR") or str(
                Path(os.environ.get("TMPDIR", "/tmp")) / "fxsched-e2e-models"),
                help="where checkpoints are built (a finished one is re-used; default $FXSCHED_GPU_MODELS_DIR, "
                     "else $TMPDIR/fxsched-e2e-models)")
            p.add_argument("--env-json", help="the env step's JSON (its copy bandwidth)")
            p.add_argument("--no-hf", action="store_true", help="leave transformers out")
            p.add_argument("--hf-batches", default="1,64", help="batches with a transformers arm (spec none)")
            p.add_argument("--tiny", action="store_true", help="toy dimensions (implied without CUDA)")
        if name == "kernels":
            p.add_argument("--tiny", action="store_true", help="toy shapes (implied without CUDA)")
            p.add_argument("--cli-timeout-s", type=float, default=120.0)
        if name == "parity":
            p.add_argument("--tokens", type=int, default=24)
            p.add_argument("--timeout-s", type=float, default=120.0)
    args = parser.parse_args(argv)
    commands: dict[str, Callable[[argparse.Namespace], int]] = {
        "imports": cmd_imports, "env": cmd_env, "models": cmd_models, "kernels": cmd_kernels, "parity": cmd_parity}
    try:
        return commands[args.command](args)
    except Exception as err:  # the step's verdict, in its JSON, before the traceback
        rec = Record(getattr(args, "json", None))
        with contextlib.suppress(Exception):
            if rec.path is not None and rec.path.exists():
                rec.data = json.loads(rec.path.read_text())
        rec.data.update(status="failed", reason=error_text(err))
        rec.save()
        raise


if __name__ == "__main__":
    sys.exit(main())
