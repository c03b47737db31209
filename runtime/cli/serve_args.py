"""``fxsched serve``'s options: vLLM's ``vllm serve`` flags with vLLM's meanings, in vLLM's help
groups, and fxsched's own names as aliases (specs/serve-security.md §14.2, specs/serve.md §12.9).

``add_serve_arguments(p)`` registers them; ``check_flags(args)`` checks every flag that needs no
model, before torch is imported, and returns ``Flags``: what the run needs of them. Each refusal is
a ``UsageError``: one line naming the flag and what is supported, exit 2, within a second.

The help groups are vLLM's (``ModelConfig``, ``ParallelConfig``, ``CacheConfig``,
``SchedulerConfig``, ``VllmConfig``, ``Frontend``), then fxsched's own (``fxsched``: the device, the
event log, the logs). No torch here.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from fxsched.runtime.cli.generate import add_kv_memory_argument
from fxsched.runtime.cli.usage import DTYPES, UsageError, _int

DEFAULT_PORT = 8000
API_KEY_ENV = "FXSCHED_API_KEY"
KEEP_ALIVE_ENV = "VLLM_HTTP_TIMEOUT_KEEP_ALIVE"  # vLLM's setting of uvicorn's timeout_keep_alive
DEFAULT_KEEP_ALIVE = 5  # seconds, uvicorn's and vLLM's default (whole seconds, as both take it)
DEFAULT_READ_TIMEOUT = 30.0  # specs/serve.md §12.11
TOOL_CALL_PARSERS = ("hermes",)  # the <tool_call>{json}</tool_call> blocks runtime/serve/tools.py reads
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
DEFAULT_MAX_LORA_RANK = 16  # vLLM's default --max-lora-rank
MAX_LORAS = 256  # the most adapter slots --max-loras takes
MTP_METHODS = ("mtp", "deepseek_mtp", "mimo_mtp", "glm4_moe_mtp", "ernie_mtp", "qwen3_next_mtp",
               "longcat_flash_mtp")  # vLLM's MTP method names, all "mtp" there (SpeculativeConfig)
_HUMAN_INT = re.compile(r"([0-9]+(?:\.[0-9]+)?)([kKmMgG]?)")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """``fxsched serve``'s options on its sub-command parser, in vLLM's groups."""
    from fxsched.runtime.cli.ep import add_ep_ranks_argument

    p.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                   help="a Hugging Face model directory, as `vllm serve MODEL` takes it (the same as --model); "
                        "the served model name is MODEL as given")

    model = p.add_argument_group("ModelConfig", "The model, its tokenizer and how it is named.")
    model.add_argument("--model", metavar="DIR",
                       help="a Hugging Face model directory (default: the embedded default model)")
    model.add_argument("--tokenizer", metavar="DIR", help="a directory with tokenizer.json (default: the model's)")
    model.add_argument("--trust-remote-code", action="store_true",
                       help="accepted for vLLM's command lines; changes nothing: fxsched runs only its built-in "
                            "architectures and never runs code from a checkpoint")
    model.add_argument("--dtype", default=None, metavar="{auto," + ",".join(DTYPES) + ",bf16,half,float}",
                       help="weights and compute dtype (default, or auto: the checkpoint's)")
    model.add_argument("--seed", default=None, metavar="N",
                       help="seed of the requests that give none (default: a random one each), so a restarted "
                            "server answers the same requests alike")
    model.add_argument("--max-model-len", "--max-seq-len", dest="max_seq_len", default=None, metavar="N",
                       help="context length (prompt and output) to allocate; 32k (32,000) and 32K (32,768) as vLLM "
                            "reads them (default: the model's)")
    model.add_argument("--served-model-name", nargs="+", metavar="NAME", default=None,
                       help="the model name(s) clients give; the first is the one responses report (default: MODEL "
                            "as given, or fxsched-default for the embedded model)")
    model.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                       help="where the EOS ids come from: auto, the model's generation_config.json; vllm, none read "
                            "(the tokenizer's EOS token); DIR, DIR/generation_config.json (default auto)")

    parallel = p.add_argument_group("ParallelConfig", "How the model is spread over devices.")
    parallel.add_argument("--tensor-parallel-size", "-tp", default="1", metavar="N",
                          help="tensor-parallel ranks: 1 (this server runs the model on one device; a MoE "
                               "checkpoint's experts can be split with --ep-ranks)")
    add_ep_ranks_argument(parallel)

    cache = p.add_argument_group("CacheConfig", "The paged KV cache.")
    cache.add_argument("--gpu-memory-utilization", default=None, metavar="F",
                       help="with --device cuda: the share of the GPU's memory the server may use (0 < F <= 1); the "
                            "KV cache gets what the weights leave of it (vLLM's meaning); on the CPU: not applicable "
                            "(logged), use --kv-cache-memory")
    add_kv_memory_argument(cache, "", "--kv-cache-memory-bytes")
    cache.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                       help="reuse the KV blocks of prompts' common prefixes (default: on, as vLLM V1); "
                            "--no-enable-prefix-caching: every prompt is prefilled whole")

    sched = p.add_argument_group("SchedulerConfig", "Batching and admission.")
    sched.add_argument("--max-num-seqs", "--max-batch", dest="max_batch", default=None, metavar="N",
                       help="sequences running at once (default: the model's slots)")
    sched.add_argument("--max-num-batched-tokens", default=None, metavar="N",
                       help="the most prompt tokens one forward takes, beside its decode rows (default: 512 on a "
                            "CPU, and beside d decoding streams at most max(64, 8 d); on CUDA 8192 while no "
                            "stream decodes and 2048 beside decoding streams), so a stream waits on a chunk, "
                            "never on a whole prompt. Given, it is the only bound, as vLLM's")
    sched.add_argument("--async-scheduling", dest="async_scheduling", action=argparse.BooleanOptionalAction,
                       default=None,
                       help="plain decodes answered ahead: the next tick is planned and launched before this one's "
                            "tokens are read (specs/async.md §16.6; default: on with --device cuda, off on the CPU)")
    sched.add_argument("--max-waiting", default="1024", metavar="N",
                       help="choices waiting to start before new requests get 429 (default 1024)")

    vllm = p.add_argument_group("VllmConfig", "Speculative decoding.")
    vllm.add_argument("--speculative-config", metavar="JSON", default=None,
                      help='\'{"method": "mtp", "num_speculative_tokens": 3}\' (method: mtp (or vLLM\'s *_mtp names), '
                           'dflash (with "model": DRAFTER_DIR) or ngram; num_speculative_tokens: the drafts the mode '
                           'runs)')
    vllm.add_argument("--spec", default=None,
                      help="fxsched's form of --speculative-config: none, mtp, dflash or ngram (default none); "
                           "sampled requests are verified by rejection sampling, which keeps the model's "
                           "distribution")
    vllm.add_argument("--draft-model", metavar="DIR", default=None,
                      help="a DFlash drafter directory (--spec dflash; the default model has no drafter of its own)")

    lora = p.add_argument_group("LoRAConfig", "LoRA adapters (PEFT directories) served next to the model "
                                              "(specs/lora.md §18.7).")
    lora.add_argument("--enable-lora", action="store_true",
                      help="serve LoRA adapters: those of --lora-modules, and /v1/load_lora_adapter and "
                           "/v1/unload_lora_adapter at run time; a request's model field names the adapter")
    lora.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH", default=None,
                      help='adapters served from the start: name=path, or JSON {"name": ..., "path": ..., '
                           '"base_model_name": ...} (vLLM\'s forms); each is read and checked at start (a bad '
                           'one: one line naming it, exit 2) and loaded into a free slot, else when first named')
    lora.add_argument("--max-loras", default=None, metavar="N",
                      help="adapter slots: adapters resident, and so in one batch, at once (default: the number "
                           "of --lora-modules, at least 1); with more adapters than slots, one is loaded when a "
                           "request names it, into the slot of the least recently used idle one")
    lora.add_argument("--max-lora-rank", default=str(DEFAULT_MAX_LORA_RANK), metavar="R",
                      help=f"the largest adapter rank r taken (default {DEFAULT_MAX_LORA_RANK}, as vLLM's)")

    front = p.add_argument_group("Frontend", "The HTTP server, its front door (specs/serve-security.md §14.1) "
                                             "and its logs.")
    front.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    front.add_argument("--port", default=str(DEFAULT_PORT), help=f"port (default {DEFAULT_PORT}; 0: a free one)")
    front.add_argument("--api-key", nargs="+", metavar="KEY", default=None,
                       help=f"require 'Authorization: Bearer KEY' on every route but /health (one key; default: "
                            f"the {API_KEY_ENV} environment variable; none: no key)")
    front.add_argument("--metrics-open", action="store_true", help="serve /metrics without the API key")
    front.add_argument("--allowed-origins", metavar="ORIGINS", default=None,
                       help='web origins allowed to call the server (CORS), comma-separated or a JSON list such as '
                            '\'["http://localhost:3000"]\'; "*": any (default: none, cross-origin requests are '
                            'refused)')
    front.add_argument("--max-request-bytes", metavar="SIZE", default=None,
                       help="the largest request body taken, e.g. 8MiB (default 8 MiB); a larger one gets 413")
    front.add_argument("--chat-template", metavar="FILE|TEMPLATE", default=None,
                       help="a Jinja chat template (a file, or the template itself) in place of the model's")
    front.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="tool_choice \"auto\" (needs --tool-call-parser; fxsched answers it with or without "
                            "the flag)")
    front.add_argument("--tool-call-parser", metavar="{" + ",".join(TOOL_CALL_PARSERS) + "}", default=None,
                       help="how the model writes tool calls: hermes, <tool_call>{\"name\": ..., \"arguments\": "
                            "...}</tool_call> blocks (Qwen, Hermes), the only format this server reads")
    front.add_argument("--uvicorn-log-level", default=None, choices=UVICORN_LOG_LEVELS,
                       help="uvicorn's own log level (default: warnings and errors); info and below also log every "
                            "HTTP request unless --disable-uvicorn-access-log, and show INFO events (as -v)")
    front.add_argument("--disable-uvicorn-access-log", action="store_true",
                       help="no line per HTTP request, whatever --uvicorn-log-level says")
    front.add_argument("--access-log", action="store_true", help="log every HTTP request (structlog; turns on -v)")
    front.add_argument("--enable-log-requests", dest="enable_log_requests", action="store_true", default=None,
                       help="log one record per finished request (id, model, tokens, TTFT, latency, finish "
                            "reason) and show them (INFO; without the flag they show with -v)")
    front.add_argument("--disable-log-requests", dest="disable_log_requests", action="store_true", default=None,
                       help="no per-request records, even with -v")
    front.add_argument("--timeout-keep-alive", default=None, metavar="SECONDS",
                       help=f"close an idle kept-alive connection after this long (uvicorn's timeout_keep_alive; "
                            f"whole seconds; default: the {KEEP_ALIVE_ENV} environment variable, else {DEFAULT_KEEP_ALIVE})")
    front.add_argument("--request-read-timeout", default=None, metavar="SECONDS",
                       help=f"close a connection whose request has not been read whole this long after its first "
                            f"byte, or whose body stalls this long (default {DEFAULT_READ_TIMEOUT:g})")
    front.add_argument("--drain-timeout", default="30", metavar="SECONDS",
                       help="on SIGTERM, how long in-flight requests may take to finish before they are cancelled "
                            "(default 30)")

    own = p.add_argument_group("fxsched", "The device, the event log, the logs.")
    own.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    own.add_argument("--threads", default=None,
                     help="CPU threads (default: every core with --model, 1 for the embedded model)")
    own.add_argument("--record", metavar="FILE", default=None,
                     help="write the scheduler's event log to FILE (fxsched replay FILE re-runs it without the "
                          "model; after an engine fault the next scheduler life writes FILE.1, ...); an existing "
                          "FILE is refused unless --force")
    own.add_argument("--force", action="store_true", help="let --record overwrite an existing file")


# --- checks without the model ------------------------------------------------------------------------


@dataclass(frozen=True)
class Flags:
    """What ``check_flags`` made of the vLLM flags (see ``add_serve_arguments``)."""

    served_names: Optional[tuple[str, ...]]  # None: the default rule (MODEL as given)
    generation_config: str  # "auto", "vllm" or a directory
    gpu_memory_utilization: Optional[float]
    prefix_caching: bool
    log_requests: Optional[bool]  # None: at INFO (shown with -v)
    uvicorn_log_level: Optional[str]
    access_log: bool
    timeout_keep_alive: int
    request_read_timeout: float
    api_key: Optional[str]
    lora: Optional["LoraFlags"] = None  # --enable-lora's (None: LoRA off)


@dataclass(frozen=True)
class LoraModule:
    """One adapter of ``--lora-modules``: its served name, its directory as given, the base model name
    it reports as parent (None: the served model's)."""

    name: str
    path: str
    base_model_name: Optional[str] = None


@dataclass(frozen=True)
class LoraFlags:
    """``--enable-lora``'s flags, checked (specs/lora.md §18.7)."""

    modules: tuple[LoraModule, ...]
    max_loras: int
    max_lora_rank: int


def _lora_module(item: str) -> LoraModule:
    """A ``--lora-modules`` item: ``name=path`` or vLLM's JSON object."""
    flag = f"--lora-modules {item[:120]}"
    if item.lstrip().startswith("{"):
        import json

        try:
            data = json.loads(item)
        except (ValueError, RecursionError):
            raise UsageError(f"{flag}: not valid JSON") from None
        if not isinstance(data, dict):
            raise UsageError(f"{flag}: expected a JSON object")
        unknown = sorted(set(data) - {"name", "path", "base_model_name"})
        if unknown:
            raise UsageError(f"{flag}: unknown key {unknown[0]!r} (known: name, path, base_model_name)")
        name, path, base = data.get("name"), data.get("path"), data.get("base_model_name")
        if not isinstance(name, str) or not isinstance(path, str):
            raise UsageError(f'{flag}: "name" and "path" must be strings')
        if base is not None and not isinstance(base, str):
            raise UsageError(f'{flag}: "base_model_name" must be a string')
    else:
        name, sep, path = item.partition("=")
        base = None
        if not sep:
            raise UsageError(f"{flag}: expected name=path or a JSON object with name and path")
    if not name.strip() or not name.isprintable():
        raise UsageError(f"{flag}: the adapter name must be printable and not blank")
    if not path:
        raise UsageError(f"{flag}: no path")
    if not Path(path).is_dir():
        raise UsageError(f"--lora-modules {name}: {path}: " + ("not a directory" if Path(path).exists()
                                                             else "no such adapter directory"))
    return LoraModule(name, path, base)


def lora_flags(args, served: Optional[tuple[str, ...]] = None) -> Optional[LoraFlags]:
    """``--enable-lora``, ``--lora-modules``, ``--max-loras``, ``--max-lora-rank`` checked (None: LoRA off;
    ``--max-loras`` and ``--max-lora-rank`` alone are ignored, as vLLM ignores them)."""
    if not args.enable_lora:
        if args.lora_modules:
            raise UsageError("--lora-modules: needs --enable-lora")
        return None
    modules = tuple(_lora_module(item) for item in args.lora_modules or ())
    names = [m.name for m in modules]
    for name in names:
        if names.count(name) > 1:
            raise UsageError(f"--lora-modules {name}: given twice")
        if served is not None and name in served:
            raise UsageError(f"--lora-modules {name}: the name of the served model (give the adapter another name)")
    rank = _int(args.max_lora_rank, "--max-lora-rank", 1, 1024)
    # default: a slot per listed adapter (none swapped); fewer slots load adapters on demand (§18.7)
    slots = max(1, min(len(modules), MAX_LORAS)) if args.max_loras is None else \
        _int(args.max_loras, "--max-loras", 1, MAX_LORAS)
    return LoraFlags(modules, slots, rank)


def human_int(text: str, name: str, low: int, high: int = 1 << 40) -> int:
    """An integer as vLLM reads ``--max-model-len`` (``32k``: 32,000; ``32K``: 32,768; ``25.6k``)."""
    match = _HUMAN_INT.fullmatch(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise UsageError(f"{name} {text}: not an integer (e.g. 4096, 32k or 32K)")
    number, suffix = match.groups()
    if suffix in "KMG" and suffix and "." in number:
        raise UsageError(f"{name} {text}: no decimals with a binary suffix ({suffix}); did you mean "
                         f"{number}{suffix.lower()}?")
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}[suffix]
    value = int(float(number) * scale) if "." in number else int(number) * scale
    if not low <= value <= high:
        raise UsageError(f"{name} {text}: must be between {low} and {high}")
    return value


def seconds(text: str, name: str) -> float:
    from fxsched.runtime.cli.arguments import seconds_arg

    try:
        return seconds_arg(text)
    except argparse.ArgumentTypeError as err:
        raise UsageError(f"{name} {err}") from None


def _fraction(text: str, name: str) -> float:
    try:
        value = float(text) if re.fullmatch(r"[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?", text.strip()) else math.nan
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= 1):
        raise UsageError(f"{name} {text}: expected a fraction above 0, at most 1 (e.g. 0.9)")
    return value


def _served_names(names: Optional[list[str]]) -> Optional[tuple[str, ...]]:
    if not names:
        return None
    for name in names:
        if not name.strip() or not name.isprintable():
            raise UsageError(f"--served-model-name {name!r}: a name must be printable and not blank")
    return tuple(dict.fromkeys(names))


def _generation_config(value: str) -> str:
    if value in ("auto", "vllm"):
        return value
    from fxsched.runtime.cli.checkpoint import GENERATION_CONFIG_FILE, CheckpointProblem, read_json_object

    if not Path(value).is_dir():
        raise UsageError(f"--generation-config {value}: not auto, vllm or a directory (no such directory)")
    try:
        read_json_object(Path(value) / GENERATION_CONFIG_FILE, f"--generation-config {value}")
    except CheckpointProblem as err:
        raise UsageError(str(err)) from None
    return value


def check_flags(args) -> Flags:
    """Every vLLM flag of ``add_serve_arguments`` that needs no model, checked (``UsageError``)."""
    tp = args.tensor_parallel_size
    if not re.fullmatch(r"0*1", tp.strip()):
        raise UsageError(f"--tensor-parallel-size {tp}: only 1 is supported (this server runs the model on one "
                         f"device; a MoE checkpoint's experts can be split over ranks with --ep-ranks N)")
    if args.tool_call_parser is not None and args.tool_call_parser not in TOOL_CALL_PARSERS:
        raise UsageError(f"--tool-call-parser {args.tool_call_parser}: this server reads the hermes format only, "
                         f"<tool_call>{{json}}</tool_call> blocks (supported: {', '.join(TOOL_CALL_PARSERS)})")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise UsageError(f"--enable-auto-tool-choice: needs --tool-call-parser (supported: "
                         f"{', '.join(TOOL_CALL_PARSERS)})")
    if args.enable_log_requests and args.disable_log_requests:
        raise UsageError("--enable-log-requests and --disable-log-requests: give one of them, not both")
    log_requests = True if args.enable_log_requests else (False if args.disable_log_requests else None)
    if args.max_seq_len is not None:
        args.max_seq_len = str(human_int(args.max_seq_len, "--max-model-len", 16))
    if args.max_num_batched_tokens is not None:
        args.max_num_batched_tokens = str(human_int(args.max_num_batched_tokens, "--max-num-batched-tokens", 1,
                                                    1 << 24))
    fraction = (_fraction(args.gpu_memory_utilization, "--gpu-memory-utilization")
                if args.gpu_memory_utilization is not None else None)
    keep_alive_text = args.timeout_keep_alive
    keep_alive_name = "--timeout-keep-alive"
    if keep_alive_text is None and os.environ.get(KEEP_ALIVE_ENV):
        keep_alive_text, keep_alive_name = os.environ[KEEP_ALIVE_ENV], KEEP_ALIVE_ENV
    keep_alive = (_int(keep_alive_text, keep_alive_name, 1, 86_400) if keep_alive_text is not None
                  else DEFAULT_KEEP_ALIVE)
    read_timeout = (seconds(args.request_read_timeout, "--request-read-timeout")
                    if args.request_read_timeout is not None else DEFAULT_READ_TIMEOUT)
    keys = args.api_key
    if keys is not None and len(keys) > 1:
        raise UsageError(f"--api-key: {len(keys)} keys given; this server takes one")
    api_key = keys[0] if keys else os.environ.get(API_KEY_ENV) or None
    if api_key is not None and (not api_key.strip() or any(c.isspace() for c in api_key) or not api_key.isprintable()):
        raise UsageError("--api-key: the key must be printable characters without spaces")
    level = args.uvicorn_log_level
    access = args.access_log or (level in ("info", "debug", "trace") and not args.disable_uvicorn_access_log)
    served = _served_names(args.served_model_name)
    return Flags(served_names=served,
                 generation_config=_generation_config(args.generation_config),
                 gpu_memory_utilization=fraction,
                 prefix_caching=args.enable_prefix_caching is not False,
                 log_requests=log_requests, uvicorn_log_level=level, access_log=access,
                 timeout_keep_alive=keep_alive, request_read_timeout=read_timeout, api_key=api_key,
                 lora=lora_flags(args, served or (args.model or args.model_tag or "fxsched-default",)))


def served_names(flags: Flags, model_arg: Optional[str]) -> tuple[str, ...]:
    """The served model names (specs/serve.md §12.9): ``--served-model-name``, else the model argument
    as given (``fxsched serve ./models/x`` serves "./models/x"), else ``fxsched-default``."""
    if flags.served_names:
        return flags.served_names
    return (model_arg,) if model_arg is not None else ("fxsched-default",)


# --- the KV budget of --gpu-memory-utilization -------------------------------------------------------

ACTIVATION_RESERVE = 1 << 30  # bytes kept out of the KV budget for activations, logits and CUDA's own


def kv_budget_from_utilization(fraction: float, total: int, free: int, weight_bytes: int) -> int:
    """The KV cache budget (bytes) of ``--gpu-memory-utilization fraction`` on a GPU of ``total``
    bytes of which ``free`` are free: vLLM's rule, the instance may use ``fraction x total``, the
    weights and ``ACTIVATION_RESERVE`` come out of it, the rest is the KV cache. ``UsageError`` when
    the GPU has less free than that share, or the share leaves nothing for the cache."""
    name = f"--gpu-memory-utilization {fraction:g}"
    allowed = int(fraction * total)
    gib = 1 << 30
    if free < allowed:
        raise UsageError(f"{name}: the GPU has {free / gib:.2f} GiB free, less than the {allowed / gib:.2f} GiB "
                         f"asked (of {total / gib:.2f} GiB); lower it or free the GPU")
    budget = allowed - weight_bytes - ACTIVATION_RESERVE
    if budget <= 0:
        raise UsageError(f"{name}: {allowed / gib:.2f} GiB leaves no room for the KV cache after the weights "
                         f"({weight_bytes / gib:.2f} GiB) and {ACTIVATION_RESERVE / gib:.0f} GiB for activations")
    return budget


def checkpoint_bytes(directory: str) -> int:
    """The bytes of a checkpoint's safetensors files (the weights' size at the checkpoint's dtype)."""
    return sum(f.stat().st_size for f in Path(directory).glob("*.safetensors") if f.is_file())
