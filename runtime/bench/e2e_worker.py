"""One cell of ``fxsched bench e2e``: one engine, one batch, in a process of its own.

Run as ``python -m fxsched.runtime.bench.e2e_worker ARGS`` (fxsched, transformers) or as
``VLLM_PYTHON .../e2e_worker.py ARGS`` (vLLM, whose environment has no fxsched): this file imports
nothing but the standard library at module level, and fxsched only inside the fxsched cell.

The cell reads its prompts (token-id lists, every prompt the same length) from ``--prompts FILE``:
a JSON object of three sets, ``warmup``, ``ttft`` and ``run``, none sharing a prefix with another
(so no engine's prefix cache serves one run from another), then in this one process: a warm-up
generate (``warmup``, 2 tokens: first-call and allocation costs out of the timings), a timed run
of ``ttft`` with max_tokens=1 (time to first token of the whole batch), a timed run of ``run`` with
max_tokens=N; greedy, EOS ignored, so every engine generates exactly N tokens per prompt. It prints one JSON object as the last line of stdout: ``ttft_s``, ``total_s``
(the N-token run), ``tokens`` (the N-token run's generated ids per prompt), ``peak_rss_bytes``
(the peak resident sets of this process and of its live child processes, summed), ``threads``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from typing import Any, Callable

ENGINES = ("fxsched", "fxsched-overlap", "fxsched-async", "fxsched-lora", "transformers", "vllm", "vllm-lora")
WARMUP_TOKENS = 2


def _descendants(root: int) -> list[int]:
    """Live processes below ``root`` (from /proc; empty where there is none)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def _hwm_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def _peak_rss_bytes() -> int:
    """The peak resident set of this process plus those of its live descendants (vLLM's engine
    core runs in one), in bytes; ``getrusage`` where /proc cannot be read."""
    own = _hwm_kib(os.getpid())  # not ru_maxrss: a forked child inherits its parent's
    if own == 0:
        own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return 1024 * (own + sum(_hwm_kib(p) for p in _descendants(os.getpid())))


def _timed(run: Callable[[list[list[int]], int], list[list[int]]], prompts: list[list[int]],
           max_tokens: int) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    tokens = run(prompts, max_tokens)
    return time.perf_counter() - start, tokens


def _fxsched_runner(args: argparse.Namespace, batch: int, overlap: bool = False,
                    async_scheduling: bool = False, lora: bool = False
                    ) -> Callable[[list[list[int]], int], list[list[int]]]:
    """fxsched's cell: the engine and ``generate`` that ``fxsched generate --model`` runs, at --spec
    (``overlap``: with the device lane, as ``--overlap``; ``async_scheduling``: as
    ``--async-scheduling``, else ``--no-async-scheduling``; ``lora``: the ``--lora-paths`` adapters
    loaded, one slot each, request i running with adapter i mod their count)."""
    import torch

    from fxsched.runtime.generate import generate
    from fxsched.runtime.torch_model import HybridEngine

    torch.set_num_threads(args.threads)
    kwargs: dict[str, Any] = {"device": "cpu", "max_slots": max(16, batch), "max_seq_len": args.max_seq_len}
    if args.kv_cache_memory is not None:
        kwargs["kv_cache_memory"] = args.kv_cache_memory
    paths = _lora_paths(args) if lora else []
    if lora:
        kwargs.update(max_loras=len(paths), max_lora_rank=args.lora_rank)
    engine = HybridEngine.from_pretrained(args.model, **kwargs)
    count = len(paths)
    for slot, folder in enumerate(paths):
        engine.load_adapter(slot, folder)

    def run(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        slots = [i % count for i in range(len(prompts))] if count else None
        result = generate(engine, prompts, max_tokens, args.spec, len(prompts), eos_ids=(), overlap=overlap,
                          async_scheduling=async_scheduling, adapter_slots=slots)
        failed = [r.error for r in result.results if r.error]
        if failed:
            raise RuntimeError(f"fxsched: {failed[0]}")
        return [list(map(int, t)) for t in result.outputs]

    return run


_GDN_MODULES = ("qwen3_5.modeling_qwen3_5", "qwen3_5_moe.modeling_qwen3_5_moe", "qwen3_next.modeling_qwen3_next")
_GDN_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                  "causal_conv1d_update")


def _torch_gdn() -> None:
    """transformers' GDN layers on their own torch functions: with flash-linear-attention installed
    they are bound to its Triton kernels, which do not run on a CPU."""
    import inspect

    for name in _GDN_MODULES:
        module = sys.modules.get(f"transformers.models.{name}")
        if module is None:
            continue
        for fn in _GDN_FUNCTIONS:
            if hasattr(module, fn):
                setattr(module, fn, inspect.unwrap(getattr(module, fn)))


def _transformers_runner(args: argparse.Namespace) -> Callable[[list[list[int]], int], list[list[int]]]:
    """transformers' cell: ``generate`` of AutoModelForCausalLM in the checkpoint's dtype, greedy."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype="auto").eval()
    _torch_gdn()

    def run(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        ids = torch.tensor(prompts, dtype=torch.long)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        return [row[ids.shape[1]:].tolist() for row in out]

    return run


def _hide_broken_extras() -> None:
    """A torchvision, torchaudio or torchcodec built for another torch fails at import (``operator
    torchvision::nms does not exist``, ``libc10_cuda.so``) and takes transformers' image and audio
    utilities, which vLLM imports, down with it; text models need none of them. Such a package is
    made absent (``sys.modules[name] = None``: ``find_spec`` then answers None, so transformers
    sees it missing) here and, through a ``sitecustomize`` put first on PYTHONPATH, in the Python
    processes vLLM starts (it inspects architectures in one)."""
    import importlib
    import atexit
    import shutil
    import tempfile

    broken = []
    for package in ("torchvision", "torchaudio", "torchcodec"):
        try:
            importlib.import_module(package)
        except (ImportError, RuntimeError, OSError):
            broken.append(package)
            for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
                del sys.modules[name]
            sys.modules[package] = None  # type: ignore[assignment]
    if broken:
        folder = tempfile.mkdtemp(prefix="fxsched-e2e-site-")
        atexit.register(shutil.rmtree, folder, True)  # the engine's processes are gone by then
        with open(os.path.join(folder, "sitecustomize.py"), "w") as f:
            f.write(f"import sys\nfor _name in {broken!r}:\n    sys.modules[_name] = None\n")
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (folder, os.environ.get("PYTHONPATH")) if p)


def _lora_paths(args: argparse.Namespace) -> list[str]:
    paths = [p for p in (args.lora_paths or "").split(",") if p]
    if not paths:
        raise SystemExit(f"e2e_worker: --engine {args.engine} needs --lora-paths")
    return paths


def _vllm_runner(args: argparse.Namespace, lora: bool = False) -> Callable[[list[list[int]], int], list[list[int]]]:
    """vLLM's cell: offline ``LLM.generate`` on token-id prompts, greedy, EOS ignored; compiled as
    shipped unless ``--enforce-eager``. ``lora``: multi-LoRA as ``vllm serve --enable-lora`` runs it,
    ``--max-loras`` = the ``--lora-paths`` adapters, all added before the timings (as fxsched's
    cell loads its own), request i on adapter i mod their count."""
    _hide_broken_extras()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    extra: dict[str, Any] = {}
    paths = _lora_paths(args) if lora else []
    if lora:
        extra.update(enable_lora=True, max_loras=len(paths), max_lora_rank=args.lora_rank)
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_seq_len, enforce_eager=args.enforce_eager,
              seed=0, skip_tokenizer_init=True, max_num_seqs=max(16, args.batch),
              max_num_batched_tokens=max(8192, args.batch * args.max_seq_len), **extra)
    requests: list[Any] = []
    if lora:
        from vllm.lora.request import LoRARequest

        requests = [LoRARequest(f"adapter-{i}", i + 1, path) for i, path in enumerate(paths)]
        for request in requests:
            llm.llm_engine.add_lora(request)

    def run(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True,
                                detokenize=False)
        chosen = [requests[i % len(requests)] for i in range(len(prompts))] if requests else None
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False,
                            lora_request=chosen)
        return [list(o.outputs[0].token_ids) for o in outs]

    return run


def run_cell(args: argparse.Namespace) -> dict[str, Any]:
    """Warm up, then time max_tokens=1 and max_tokens=N on the batch (see the module docstring)."""
    with open(args.prompts) as f:
        sets = json.load(f)
    prompts = sets["run"]
    if args.engine.startswith("fxsched"):
        run = _fxsched_runner(args, len(prompts), overlap=args.engine == "fxsched-overlap",
                              async_scheduling=args.engine == "fxsched-async", lora=args.engine == "fxsched-lora")
    elif args.engine == "transformers":
        run = _transformers_runner(args)
    else:
        run = _vllm_runner(args, lora=args.engine == "vllm-lora")
    run(sets["warmup"], WARMUP_TOKENS)
    ttft, _ = _timed(run, sets["ttft"], 1)
    total, tokens = _timed(run, prompts, args.max_tokens)
    return {"engine": args.engine, "batch": len(prompts), "ttft_s": ttft, "total_s": total, "tokens": tokens,
            "peak_rss_bytes": _peak_rss_bytes(), "threads": args.threads}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="e2e_worker", description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=ENGINES, required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True, help="a JSON file: the warmup, ttft and run prompt sets")
    ap.add_argument("--max-tokens", type=int, required=True)
    ap.add_argument("--max-seq-len", type=int, required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", help="vLLM's dtype (the checkpoint's)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--kv-cache-memory", type=int, default=None, help="fxsched: KV cache bytes")
    ap.add_argument("--spec", default="none", help="fxsched: speculation mode")
    ap.add_argument("--enforce-eager", action="store_true", help="vLLM: eager mode (default: compiled, as shipped)")
    ap.add_argument("--lora-paths", default=None, help="fxsched-lora, vllm-lora: comma list of PEFT adapter folders")
    ap.add_argument("--lora-rank", type=int, default=16, help="fxsched-lora, vllm-lora: the max LoRA rank")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    record = run_cell(args)
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), ("\n" + json.dumps(record) + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
