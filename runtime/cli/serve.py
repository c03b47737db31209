"""``fxsched serve``: the OpenAI-compatible server (runtime/serve/), and its wiring.

Wiring into ``fxsched.runtime.cli.app.build_parser`` takes one line: ``add_serve_command(sub)``.
``fxsched bench serve`` is runtime/bench/serve.py (it has its own options; ``cli.app.main`` hands
it the words after ``bench serve``).

The model is chosen as for ``fxsched generate``: ``--model DIR`` (with ``--dtype``,
``--max-seq-len``, ``--draft-model DIR`` for ``--spec dflash``), or the embedded default model
(``specs/models/default/``) when ``--model`` is left out; the tokenizer comes from the model
directory or ``--tokenizer DIR`` (the server speaks text, so a model without one is refused).

The server listens on ``--host`` / ``--port`` (``--port 0``: a free port) and writes one line on
stderr once it listens: ``fxsched serve: listening on http://HOST:PORT (model NAME, spec MODE)``.
SIGTERM (or Ctrl-C) drains: no new requests, the ones in flight finish (at most
``--drain-timeout`` seconds, then they are cancelled with a final chunk), exit 0.

vLLM's ``vllm serve`` flags work with vLLM's meanings, in vLLM's help groups (runtime/cli/serve_args.py,
serve-security.md §14.2): the model as the positional ``MODEL`` (served under that name as given,
``--served-model-name`` overriding: serve.md §12.9), ``--max-model-len`` (``--max-seq-len``),
``--max-num-seqs`` (``--max-batch``), ``--max-num-batched-tokens``, ``--speculative-config JSON``
(``--spec``), ``--seed``, ``--chat-template``, ``--dtype``, ``--generation-config``,
``--gpu-memory-utilization``, ``--enable-prefix-caching``, ``--tensor-parallel-size 1``,
``--enable-auto-tool-choice`` / ``--tool-call-parser hermes``, ``--uvicorn-log-level``,
``--enable-log-requests`` (serve.md §12.10); a flag this server cannot honour is refused naming what
it supports. ``--ep-ranks N`` runs the engine on expert-parallel ranks (runtime/ep/serve.py). The
front door's flags (serve-security.md §14.1): ``--api-key`` (or ``FXSCHED_API_KEY``),
``--metrics-open``, ``--allowed-origins``, ``--max-request-bytes``; the connections'
``--request-read-timeout`` and ``--timeout-keep-alive`` (serve.md §12.11).

``open_serving(args)`` builds the ``Serving`` of parsed arguments without running it (tests run it
on a thread); ``run_serve`` runs it until drained.

Bad input (an unknown ``--spec`` or one the model cannot run, a missing model directory, one
without config.json or a tokenizer, a port in use or a host that cannot be bound, an unwritable or
existing ``--record`` path without ``--force``, the ``serve`` extra not installed, a vLLM flag
value this server cannot honour) is one line on stderr and exit 2, before anything listens; what
needs no model (numbers, JSON, origins, sizes, files, the model directory's config.json and
tokenizer.json) before torch is imported (serve.md §12.12).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from pathlib import Path
from typing import Callable, Iterator, Optional

import structlog

from fxsched.runtime.cli.usage import MAX_SEQUENCES, SPECS, UsageError, _int, _reporting
from fxsched.runtime.cli.serve_args import (
    API_KEY_ENV,
    DEFAULT_PORT,
    MTP_METHODS,
    Flags,
    add_serve_arguments,
    check_flags,
    checkpoint_bytes,
    kv_budget_from_utilization,
    seconds,
    served_names,
)

__all__ = ["API_KEY_ENV", "DEFAULT_PORT", "add_serve_command", "open_serving", "run_serve"]

MAX_TEMPLATE_BYTES = 1024 * 1024
log = structlog.get_logger("fxsched.serve")


def add_serve_command(sub) -> None:
    """Register ``serve`` (with its own ``func``) on an ``add_subparsers`` object."""
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                       description="An OpenAI-compatible server (/v1/completions, /v1/chat/completions, /v1/models, "
                                   "/health, /metrics) on the scheduler's continuous-batching loop. vLLM's `vllm "
                                   "serve` flags are taken with vLLM's meanings (a flag this server cannot honour is "
                                   "refused, naming what it supports), in vLLM's help groups.")
    add_serve_arguments(p)
    p.set_defaults(func=cmd_serve)


SPEC_METHODS = ("mtp", "dflash", "ngram")


def speculation(args) -> tuple[str, Optional[int]]:
    """The speculation mode of ``--spec`` or ``--speculative-config`` (and the drafts the latter
    asks for, checked once the model is loaded); a ``"model"`` there is the ``--draft-model``."""
    if args.speculative_config is None:
        return args.spec or "none", None
    if args.spec is not None:
        raise UsageError("--spec and --speculative-config: give one of them, not both")
    text = args.speculative_config
    try:
        config = json.loads(text)
    except (ValueError, RecursionError):
        raise UsageError(f"--speculative-config {text[:80]}: not valid JSON") from None
    if not isinstance(config, dict):
        raise UsageError(f"--speculative-config {text[:80]}: expected a JSON object such as "
                         f'{{"method": "mtp", "num_speculative_tokens": 3}}')
    unknown = sorted(set(config) - {"method", "num_speculative_tokens", "model"})
    if unknown:
        raise UsageError(f"--speculative-config: unknown key {unknown[0]!r} (known: method, num_speculative_tokens, "
                         f"model)")
    method = config.get("method")
    if method in MTP_METHODS:  # vLLM's model-specific MTP names: its "mtp"
        method = "mtp"
    if method not in SPEC_METHODS:
        raise UsageError(f"--speculative-config: method {json.dumps(method)}: choose from {', '.join(SPEC_METHODS)}")
    drafts = config.get("num_speculative_tokens")
    if drafts is not None and (isinstance(drafts, bool) or not isinstance(drafts, int) or drafts < 1):
        raise UsageError(f"--speculative-config: num_speculative_tokens {json.dumps(drafts)}: expected an integer "
                         f"of at least 1")
    model = config.get("model")
    if model is not None:
        if method != "dflash" or not isinstance(model, str):
            raise UsageError('--speculative-config: "model" (a drafter directory) is for the dflash method only')
        if args.draft_model is not None and args.draft_model != model:
            raise UsageError('--speculative-config "model" and --draft-model: give one of them, not both')
        args.draft_model = model
    return method, drafts


def check_drafts(spec: str, asked: Optional[int], runs: int) -> None:
    """``num_speculative_tokens`` must be what the mode runs (this server does not resize drafts)."""
    if asked is not None and asked != runs:
        raise UsageError(f"--speculative-config: num_speculative_tokens {asked}: the {spec} mode of this model "
                         f"runs {runs}")


def chat_template(value: str) -> str:
    """The template of ``--chat-template``: a file's text, or the value itself when it is a template."""
    from fxsched.runtime.cli.bounds import UserFileError, read_user_text

    path = Path(value)
    if any(c in value for c in "{}\n") and not path.is_file():
        return value
    try:
        return read_user_text(path, "--chat-template", MAX_TEMPLATE_BYTES)
    except UserFileError as err:
        raise UsageError(str(err)) from None


def origins(value: Optional[str]) -> tuple[str, ...]:
    """``--allowed-origins``: comma-separated, or a JSON list as vLLM takes it."""
    if value is None:
        return ()
    if value.strip().startswith("["):
        try:
            items = json.loads(value)
        except (ValueError, RecursionError):
            items = None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise UsageError(f"--allowed-origins {value[:80]}: expected a JSON list of strings or origins separated "
                             f"by commas")
    else:
        items = [i.strip() for i in value.split(",")]
    out = tuple(i.rstrip("/") for i in items if i.strip())
    if not out:
        raise UsageError(f"--allowed-origins {value!r}: no origin given")
    for origin in out:
        if origin != "*" and not (origin.startswith(("http://", "https://")) and "://" in origin):
            raise UsageError(f"--allowed-origins {origin}: not an origin (expected e.g. http://localhost:3000, or *)")
    return out


def _listening(names: tuple[str, ...], spec: str, api_key: Optional[str]) -> Callable:
    def listening(serving) -> None:
        print(f"fxsched serve: listening on {serving.url} (model {names[0]}, spec {spec}"
              f"{', API key required' if api_key else ''}); SIGTERM or Ctrl-C drains", file=sys.stderr, flush=True)

    return listening


def _generation_eos(flags: Flags, tokenizer, model_dir: Optional[str]) -> None:
    """``--generation-config``: the EOS ids of the generation config it names (auto: the model's,
    already the tokenizer's), or none of a generation config (vllm: the tokenizer's EOS token)."""
    from fxsched.runtime.cli.checkpoint import GENERATION_CONFIG_FILE, CheckpointProblem, read_json_object

    if flags.generation_config == "auto":
        return
    if flags.generation_config == "vllm":
        eos = tokenizer.special_tokens.get("eos_token")
        token = tokenizer.token_id(eos) if eos is not None else None
        if token is not None:
            tokenizer.eos_ids = (token,)
        return
    path = Path(flags.generation_config) / GENERATION_CONFIG_FILE
    try:
        data = read_json_object(path, f"--generation-config {flags.generation_config}") or {}
    except CheckpointProblem as err:
        raise UsageError(str(err)) from None
    value = data.get("eos_token_id")
    ids = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise UsageError(f"--generation-config {flags.generation_config}: {path.name}: eos_token_id: expected an id "
                         f"or a list of ids, got {json.dumps(value)[:60]}")
    tokenizer.eos_ids = tuple(dict.fromkeys(ids))


def _kv_budget(flags: Flags, args, device: str, model_dir: Optional[str]) -> None:
    """``--gpu-memory-utilization``: on CUDA the KV budget (``--kv-cache-memory`` given wins, as
    vLLM's ``kv_cache_memory_bytes`` does); on the CPU not applicable, logged."""
    fraction = flags.gpu_memory_utilization
    if fraction is None:
        return
    if not device.startswith("cuda"):
        log.warning("gpu_memory_utilization_not_applicable", value=fraction, device=device,
                    hint="on the CPU the KV cache is sized by --kv-cache-memory")
        return
    if args.kv_cache_memory is not None:
        log.info("gpu_memory_utilization_overridden", value=fraction, kv_cache_memory=args.kv_cache_memory)
        return
    import torch

    free, total = torch.cuda.mem_get_info(torch.device(device))
    weights = checkpoint_bytes(model_dir) if model_dir is not None else 0
    args.kv_cache_memory = str(kv_budget_from_utilization(fraction, total, free, weights))
    log.info("gpu_memory_utilization", value=fraction, total_bytes=total, weight_bytes=weights,
             kv_cache_memory=int(args.kv_cache_memory))


@contextlib.contextmanager
def open_serving(args, on_started: Optional[Callable] = None) -> Iterator:
    """The ``Serving`` of ``fxsched serve``'s parsed ``args``, bound and ready to ``run()`` (the
    socket is closed, and expert-parallel workers stopped, on leaving); raises UsageError for bad
    input. ``on_started`` (default: the "listening on" line) is called once it accepts connections."""
    from fxsched.runtime.cli.usage import parse_size

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise UsageError(f"MODEL {args.model_tag} and --model {args.model}: give one of them, not both")
        args.model = args.model_tag
    from fxsched.runtime.cli.usage import normalize_dtype

    args.dtype = normalize_dtype(args.dtype)
    flags = check_flags(args)
    _configure_logs(flags)
    spec, drafts = speculation(args)
    if spec not in SPECS:
        raise UsageError(f"--spec {spec}: unknown speculation mode (choose from {', '.join(SPECS)})")
    port = _int(args.port, "--port", 0, 65535)
    max_waiting = _int(args.max_waiting, "--max-waiting", 0)
    drain_timeout = seconds(args.drain_timeout, "--drain-timeout")
    max_batch = _int(args.max_batch, "--max-batch", 1, MAX_SEQUENCES) if args.max_batch is not None else None
    batch_tokens = (_int(args.max_num_batched_tokens, "--max-num-batched-tokens", 1, 1 << 24)
                    if args.max_num_batched_tokens is not None else None)
    seed = _int(args.seed, "--seed", 0, 2**63 - 1) if args.seed is not None else None
    api_key = flags.api_key
    allowed = origins(args.allowed_origins)
    max_request = (parse_size(args.max_request_bytes, "--max-request-bytes") if args.max_request_bytes is not None
                   else None)
    template = chat_template(args.chat_template) if args.chat_template is not None else None
    if args.record is not None:
        from fxsched.runtime.cli.bounds import record_problem

        problem = record_problem(args.record, args.force)
        if problem:
            raise UsageError(f"--record {args.record}: {problem}")
    if args.ep_ranks > 1 and not flags.prefix_caching:
        raise UsageError(f"--no-enable-prefix-caching: not under expert parallelism (--ep-ranks {args.ep_ranks}): "
                         f"the workers' replicas keep their own prefix caches")
    if args.ep_ranks > 1 and args.model is None:
        raise UsageError(f"--ep-ranks {args.ep_ranks}: needs a --model directory (the server speaks text, and the "
                         f"internal model EP runs without one has no tokenizer)")
    if args.model is not None:  # config.json, then the tokenizer, before torch (runtime/cli/checkpoint.py)
        from fxsched.runtime.cli.checkpoint import CheckpointProblem, check_checkpoint, has_tokenizer

        try:
            check_checkpoint(args.model, f"--model {args.model}")
        except CheckpointProblem as err:
            raise UsageError(str(err)) from None
        if args.tokenizer is None and not has_tokenizer(args.model):
            raise UsageError(f"--model {args.model}: no tokenizer.json, and the server speaks text (give "
                             f"--tokenizer DIR)")
    names = served_names(flags, args.model)
    from fxsched.runtime.cli.model_choice import _engine, _model_choice, _set_threads, _tokenizer, _torch_device

    args.weights = None
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise UsageError(f"needs the serve extra (pip install 'fxsched[serve]'): {err}") from None
    device = _torch_device(args.device)
    _kv_budget(flags, args, device, args.model)
    choice = _model_choice(args, dflash=spec == "dflash")
    if max_batch is not None and max_batch > 16 and choice.model is not None and not choice.default:
        # a --model checkpoint gets the slots --max-num-seqs asks (the embedded model has 16)
        choice = dataclasses.replace(choice, max_slots=max_batch)
    lora = flags.lora
    if lora is not None:
        if choice.model is None:
            raise UsageError("--enable-lora: needs a Hugging Face checkpoint (--model DIR or the default model)")
        if args.ep_ranks > 1:
            raise UsageError(f"--enable-lora: not under expert parallelism (--ep-ranks {args.ep_ranks})")
        choice = dataclasses.replace(choice, max_loras=lora.max_loras, max_lora_rank=lora.max_lora_rank)
    tokenizer = _tokenizer(args, choice)
    if tokenizer is None:
        raise UsageError(f"{choice.label}: no tokenizer.json, and the server speaks text (give --tokenizer DIR)")
    _generation_eos(flags, tokenizer, choice.model)
    if template is not None:
        from fxsched.runtime.text import TokenizerError, compile_chat_template

        try:
            compile_chat_template(template, "--chat-template")
        except TokenizerError as err:
            raise UsageError(str(err)) from None
        tokenizer.chat_template = template
    from fxsched.runtime.serve.server import ServeSettings, Serving, bind_socket

    if args.trust_remote_code:
        log.info("trust_remote_code_ignored", reason="only built-in architectures run; no checkpoint code is run")
    try:
        sock = bind_socket(args.host, port)
    except OSError as err:
        raise UsageError(f"--host {args.host} --port {port}: cannot listen there ({err.strerror or err})") from None
    try:
        engine = _engine(choice, device)
        if max_batch is not None and max_batch > engine.cfg.max_slots:
            raise UsageError(f"--max-batch {max_batch}: must be between 1 and {engine.cfg.max_slots} "
                             f"(the model's slots)")
        if spec != "none":
            from fxsched.runtime.generate import MTP_DRAFTS

            check_drafts(spec, drafts, {"mtp": MTP_DRAFTS, "dflash": engine.cfg.dflash_gamma, "ngram": 1}[spec])
        engine.prefix.enabled = flags.prefix_caching
        _set_threads(args.threads, device, checkpoint=args.model is not None)
        if seed is not None:
            import torch

            torch.manual_seed(seed)
        settings = ServeSettings(model_name=names[0], model_aliases=names[1:], spec=spec, max_batch=max_batch,
                                 max_waiting=max_waiting, drain_timeout=drain_timeout, access_log=flags.access_log,
                                 record=args.record, api_key=api_key, metrics_open=args.metrics_open,
                                 allowed_origins=allowed, max_request_bytes=max_request, seed=seed,
                                 max_batch_tokens=batch_tokens, async_scheduling=args.async_scheduling,
                                 model_root=None if choice.default else choice.model,
                                 log_requests=flags.log_requests is not False,
                                 timeout_keep_alive=flags.timeout_keep_alive,
                                 request_read_timeout=flags.request_read_timeout,
                                 uvicorn_log_level=flags.uvicorn_log_level,
                                 lora_modules=tuple((m.name, m.path, m.base_model_name)
                                                    for m in (lora.modules if lora is not None else ())))
        from fxsched.runtime.generate import GenerateError
        from fxsched.runtime.serve.lora import AdapterRefused

        with contextlib.ExitStack() as stack:
            wrap = None
            if args.ep_ranks > 1:
                from fxsched.runtime.cli.ep import print_weights
                from fxsched.runtime.ep.serve import ep_serving

                wrap = stack.enter_context(ep_serving(engine, args.ep_ranks, model_dir=args.model,
                                                      timeout_s=args.ep_timeout,
                                                      on_weights=print_weights if args.model else None))
            try:
                serving = Serving(engine, tokenizer, settings, sock,
                                  on_started=on_started or _listening(names, spec, api_key), wrap_device=wrap,
                                  record_meta={"model": choice.model or "", "served_model_name": names[0]})
            except GenerateError as err:
                raise UsageError(str(err)) from None
            except AdapterRefused as err:  # an adapter of --lora-modules: one line naming it
                raise UsageError(lora_refusal(err)) from None
            yield serving
    finally:
        sock.close()


def lora_refusal(err) -> str:
    """The one line of an adapter of ``--lora-modules`` that cannot be served."""
    detail = err.detail or err.message
    hint = " (raise --max-lora-rank)" if "above the pool's max LoRA rank" in detail else ""
    return f"--lora-modules {err.name}: {detail}{hint}"


def _configure_logs(flags: Flags) -> None:
    """The INFO events that serve's flags show: --access-log, --uvicorn-log-level info (and below),
    --enable-log-requests; debug and trace show DEBUG events too."""
    from fxsched.runtime.logs import configure_logging

    level = flags.uvicorn_log_level
    if level in ("debug", "trace"):
        import logging

        configure_logging(True, level=logging.DEBUG)
    elif flags.access_log or level == "info" or flags.log_requests:
        configure_logging(True)


def run_serve(args) -> int:
    """``fxsched serve``; raises UsageError for bad input, returns 0 once drained."""
    with open_serving(args) as serving:
        serving.run()
    print("fxsched serve: drained and stopped", file=sys.stderr, flush=True)
    return 0


def cmd_serve(args) -> int:
    return _reporting("serve", lambda: run_serve(args))
