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

vLLM's names work too (serve-security.md §14.2): the model as the positional ``MODEL``, ``--max-model-len``
(``--max-seq-len``), ``--max-num-seqs`` (``--max-batch``), ``--max-num-batched-tokens``,
``--speculative-config JSON`` (``--spec``), ``--seed``, ``--chat-template``, ``--dtype
auto|bf16|half|float``; ``--ep-ranks N`` runs the engine on expert-parallel ranks
(runtime/ep/serve.py). The front door's flags (serve-security.md §14.1): ``--api-key`` (or
``FXSCHED_API_KEY``), ``--metrics-open``, ``--allowed-origins``, ``--max-request-bytes``.

Bad input (an unknown ``--spec`` or one the model cannot run, a missing model directory, a model
without a tokenizer, a port in use or a host that cannot be bound, an unwritable or existing
``--record`` path without ``--force``, the ``serve`` extra not installed) is one line on stderr and
exit 2, before anything listens; what needs no model (numbers, JSON, origins, sizes, files) before
torch is imported.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Optional

from fxsched.runtime.cli.generate import DTYPES, SPECS, UsageError, _int, _reporting, add_kv_memory_argument

DEFAULT_PORT = 8000
API_KEY_ENV = "FXSCHED_API_KEY"
MAX_TEMPLATE_BYTES = 1024 * 1024


def add_serve_command(sub) -> None:
    """Register ``serve`` (with its own ``func``) on an ``add_subparsers`` object."""
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                       description="An OpenAI-compatible server (/v1/completions, /v1/chat/completions, /v1/models, "
                                   "/health, /metrics) on the scheduler's continuous-batching loop.")
    p.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                   help="a Hugging Face model directory, as `vllm serve MODEL` takes it (the same as --model)")
    p.add_argument("--model", metavar="DIR", help="a Hugging Face model directory (default: the embedded default "
                                                  "model)")
    p.add_argument("--dtype", default=None, metavar="{auto," + ",".join(DTYPES) + ",bf16,half,float}",
                   help="weights and compute dtype of a --model checkpoint (default, or auto: the checkpoint's)")
    p.add_argument("--max-seq-len", "--max-model-len", dest="max_seq_len", default=None, metavar="N",
                   help="context length to allocate for --model")
    add_kv_memory_argument(p)
    p.add_argument("--draft-model", metavar="DIR", default=None,
                   help="a DFlash drafter directory (--spec dflash; the default model has no drafter of its own)")
    p.add_argument("--tokenizer", metavar="DIR", help="a directory with tokenizer.json (default: the model's)")
    p.add_argument("--served-model-name", metavar="NAME", default=None,
                   help="the model name clients give (default: fxsched-default, or the --model directory's name)")
    p.add_argument("--spec", default=None,
                   help="speculation: none, mtp, dflash or ngram (default none); sampled requests are verified by "
                        "rejection sampling, which keeps the model's distribution")
    p.add_argument("--speculative-config", metavar="JSON", default=None,
                   help='vLLM\'s form of --spec: \'{"method": "mtp", "num_speculative_tokens": 3}\' (method: mtp, '
                        'dflash (with "model": DRAFTER_DIR) or ngram; num_speculative_tokens: the drafts the mode '
                        'runs)')
    p.add_argument("--seed", default=None, metavar="N",
                   help="seed of the requests that give none (default: a random one each), so a restarted server "
                        "answers the same requests alike")
    p.add_argument("--chat-template", metavar="FILE|TEMPLATE", default=None,
                   help="a Jinja chat template (a file, or the template itself) in place of the model's")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", default=str(DEFAULT_PORT), help=f"port (default {DEFAULT_PORT}; 0: a free one)")
    p.add_argument("--max-batch", "--max-num-seqs", dest="max_batch", default=None, metavar="N",
                   help="sequences running at once (default: the model's slots)")
    p.add_argument("--max-num-batched-tokens", default=None, metavar="N",
                   help="the most tokens one forward takes, prompt chunks and decodes together (default: the "
                        "scheduler's prefill budget, 8192)")
    p.add_argument("--max-waiting", default="1024", metavar="N",
                   help="choices waiting to start before new requests get 429 (default 1024)")
    p.add_argument("--drain-timeout", default="30", metavar="SECONDS",
                   help="on SIGTERM, how long in-flight requests may take to finish before they are cancelled "
                        "(default 30)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--async-scheduling", dest="async_scheduling", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="plain decodes answered ahead: the next tick is planned and launched before this one's "
                        "tokens are read (specs/async.md §16.6; default: on with --device cuda, off on the CPU)")
    p.add_argument("--threads", default=None, help="torch CPU threads (default 1: the model is tiny)")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request (structlog; turns on -v)")
    p.add_argument("--record", metavar="FILE", default=None,
                   help="write the scheduler's event log to FILE (fxsched replay FILE re-runs it without the "
                        "model; after an engine fault the next scheduler life writes FILE.1, ...); an existing FILE "
                        "is refused unless --force")
    p.add_argument("--force", action="store_true", help="let --record overwrite an existing file")
    from fxsched.runtime.cli.ep import add_ep_ranks_argument

    add_ep_ranks_argument(p)
    sec = p.add_argument_group("security (specs/serve-security.md, the front door)")
    sec.add_argument("--api-key", metavar="KEY", default=None,
                     help=f"require 'Authorization: Bearer KEY' on every route but /health (default: the "
                          f"{API_KEY_ENV} environment variable; none: no key)")
    sec.add_argument("--metrics-open", action="store_true", help="serve /metrics without the API key")
    sec.add_argument("--allowed-origins", metavar="ORIGINS", default=None,
                     help='web origins allowed to call the server (CORS), comma-separated or a JSON list such as '
                          '\'["http://localhost:3000"]\'; "*": any (default: none, cross-origin requests are refused)')
    sec.add_argument("--max-request-bytes", metavar="SIZE", default=None,
                     help="the largest request body taken, e.g. 8MiB (default 8 MiB); a larger one gets 413")
    p.set_defaults(func=cmd_serve)


def _seconds(text: str, name: str) -> float:
    from fxsched.runtime.cli.app import seconds_arg

    try:
        return seconds_arg(text)
    except argparse.ArgumentTypeError as err:
        raise UsageError(f"{name} {err}") from None


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


def run_serve(args) -> int:
    """``fxsched serve``; raises UsageError for bad input, returns 0 once drained."""
    from fxsched.runtime.cli.generate import parse_size

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise UsageError(f"MODEL {args.model_tag} and --model {args.model}: give one of them, not both")
        args.model = args.model_tag
    from fxsched.runtime.cli.generate import normalize_dtype

    args.dtype = normalize_dtype(args.dtype)
    spec, drafts = speculation(args)
    if spec not in SPECS:
        raise UsageError(f"--spec {spec}: unknown speculation mode (choose from {', '.join(SPECS)})")
    port = _int(args.port, "--port", 0, 65535)
    max_waiting = _int(args.max_waiting, "--max-waiting", 0)
    drain_timeout = _seconds(args.drain_timeout, "--drain-timeout")
    max_batch = _int(args.max_batch, "--max-batch", 1) if args.max_batch is not None else None
    batch_tokens = (_int(args.max_num_batched_tokens, "--max-num-batched-tokens", 1, 1 << 24)
                    if args.max_num_batched_tokens is not None else None)
    seed = _int(args.seed, "--seed", 0, 2**63 - 1) if args.seed is not None else None
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    if api_key is not None and (not api_key.strip() or any(c.isspace() for c in api_key) or not api_key.isprintable()):
        raise UsageError("--api-key: the key must be printable characters without spaces")
    allowed = origins(args.allowed_origins)
    max_request = (parse_size(args.max_request_bytes, "--max-request-bytes") if args.max_request_bytes is not None
                   else None)
    template = chat_template(args.chat_template) if args.chat_template is not None else None
    if args.record is not None:
        from fxsched.runtime.cli.bounds import record_problem

        problem = record_problem(args.record, args.force)
        if problem:
            raise UsageError(f"--record {args.record}: {problem}")
    from fxsched.runtime.cli.generate import _engine, _model_choice, _set_threads, _tokenizer, _torch_device

    args.weights = None
    if args.ep_ranks > 1 and args.model is None:
        raise UsageError(f"--ep-ranks {args.ep_ranks}: needs a --model directory (the server speaks text, and the "
                         f"internal model EP runs without one has no tokenizer)")
    choice = _model_choice(args)
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise UsageError(f"needs the serve extra (pip install 'fxsched[serve]'): {err}") from None
    device = _torch_device(args.device)
    tokenizer = _tokenizer(args, choice)
    if tokenizer is None:
        raise UsageError(f"{choice.label}: no tokenizer.json, and the server speaks text (give --tokenizer DIR)")
    if template is not None:
        from fxsched.runtime.text import TokenizerError, compile_chat_template

        try:
            compile_chat_template(template, "--chat-template")
        except TokenizerError as err:
            raise UsageError(str(err)) from None
        tokenizer.chat_template = template
    from fxsched.runtime.serve.server import ServeSettings, Serving, bind_socket, served_name

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
        _set_threads(args.threads, device)
        if seed is not None:
            import torch

            torch.manual_seed(seed)
        name = args.served_model_name or served_name(choice.model, choice.default)
        settings = ServeSettings(model_name=name, spec=spec, max_batch=max_batch, max_waiting=max_waiting,
                                 drain_timeout=drain_timeout, access_log=args.access_log, record=args.record,
                                 api_key=api_key, metrics_open=args.metrics_open, allowed_origins=allowed,
                                 max_request_bytes=max_request, seed=seed, max_batch_tokens=batch_tokens,
                                 async_scheduling=args.async_scheduling)

        def listening(serving: Serving) -> None:
            print(f"fxsched serve: listening on {serving.url} (model {name}, spec {spec}"
                  f"{', API key required' if api_key else ''}); SIGTERM or Ctrl-C drains", file=sys.stderr, flush=True)

        from fxsched.runtime.generate import GenerateError

        with contextlib.ExitStack() as stack:
            wrap = None
            if args.ep_ranks > 1:
                from fxsched.runtime.cli.ep import print_weights
                from fxsched.runtime.ep.serve import ep_serving

                wrap = stack.enter_context(ep_serving(engine, args.ep_ranks, model_dir=args.model,
                                                      timeout_s=args.ep_timeout,
                                                      on_weights=print_weights if args.model else None))
            try:
                serving = Serving(engine, tokenizer, settings, sock, on_started=listening, wrap_device=wrap,
                                  record_meta={"model": choice.model or "", "served_model_name": name})
            except GenerateError as err:
                raise UsageError(str(err)) from None
            if args.access_log:
                from fxsched.runtime.logs import configure_logging

                configure_logging(True)
            serving.run()
    finally:
        sock.close()
    print("fxsched serve: drained and stopped", file=sys.stderr, flush=True)
    return 0


def cmd_serve(args) -> int:
    return _reporting("serve", lambda: run_serve(args))
