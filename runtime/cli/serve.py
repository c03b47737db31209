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

Bad input (an unknown ``--spec`` or one the model cannot run, a missing model directory, a model
without a tokenizer, a port in use or a host that cannot be bound, an unwritable ``--record`` path,
the ``serve`` extra not installed) is one line on stderr and exit 2, before anything listens.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fxsched.runtime.cli.generate import DTYPES, UsageError, _int, _reporting, add_kv_memory_argument

DEFAULT_PORT = 8000


def add_serve_command(sub) -> None:
    """Register ``serve`` (with its own ``func``) on an ``add_subparsers`` object."""
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                       description="An OpenAI-compatible server (/v1/completions, /v1/chat/completions, /v1/models, "
                                   "/health, /metrics) on the scheduler's continuous-batching loop.")
    p.add_argument("--model", metavar="DIR", help="a Hugging Face model directory (default: the embedded default "
                                                  "model)")
    p.add_argument("--dtype", default=None, metavar="{" + ",".join(DTYPES) + "}",
                   help="weights and compute dtype of a --model checkpoint (default: the checkpoint's)")
    p.add_argument("--max-seq-len", default=None, metavar="N", help="context length to allocate for --model")
    add_kv_memory_argument(p)
    p.add_argument("--draft-model", metavar="DIR", default=None,
                   help="a DFlash drafter directory (--spec dflash; the default model has no drafter of its own)")
    p.add_argument("--tokenizer", metavar="DIR", help="a directory with tokenizer.json (default: the model's)")
    p.add_argument("--served-model-name", metavar="NAME", default=None,
                   help="the model name clients give (default: fxsched-default, or the --model directory's name)")
    p.add_argument("--spec", default="none",
                   help="speculation: none, mtp, dflash or ngram (default none); the speculative modes decode "
                        "greedily, so they refuse requests with temperature > 0 or logprobs")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", default=str(DEFAULT_PORT), help=f"port (default {DEFAULT_PORT}; 0: a free one)")
    p.add_argument("--max-batch", default=None, metavar="N",
                   help="sequences running at once (default: the model's slots)")
    p.add_argument("--max-waiting", default="1024", metavar="N",
                   help="choices waiting to start before new requests get 429 (default 1024)")
    p.add_argument("--drain-timeout", default="30", metavar="SECONDS",
                   help="on SIGTERM, how long in-flight requests may take to finish before they are cancelled "
                        "(default 30)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--threads", default=None, help="torch CPU threads (default 1: the model is tiny)")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request (structlog; turns on -v)")
    p.add_argument("--record", metavar="FILE", default=None,
                   help="write the scheduler's event log to FILE (fxsched replay FILE re-runs it without the "
                        "model; after an engine fault the next scheduler life writes FILE.1, ...)")
    p.set_defaults(func=cmd_serve)


def _seconds(text: str, name: str) -> float:
    from fxsched.runtime.cli.app import seconds_arg

    try:
        return seconds_arg(text)
    except argparse.ArgumentTypeError as err:
        raise UsageError(f"{name} {err}") from None


def run_serve(args) -> int:
    """``fxsched serve``; raises UsageError for bad input, returns 0 once drained."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise UsageError(f"needs the serve extra (pip install 'fxsched[serve]'): {err}") from None
    from fxsched.runtime.cli.generate import _engine, _model_choice, _set_threads, _tokenizer, _torch_device
    from fxsched.runtime.generate import SPECS, GenerateError

    if args.spec not in SPECS:
        raise UsageError(f"--spec {args.spec}: unknown speculation mode (choose from {', '.join(SPECS)})")
    port = _int(args.port, "--port", 0, 65535)
    max_waiting = _int(args.max_waiting, "--max-waiting", 0)
    drain_timeout = _seconds(args.drain_timeout, "--drain-timeout")
    max_batch = _int(args.max_batch, "--max-batch", 1) if args.max_batch is not None else None
    if args.record is not None:
        from fxsched.runtime.cli.app import _unwritable

        problem = "the path is empty" if not args.record else _unwritable(Path(args.record))
        if problem:
            raise UsageError(f"--record {args.record}: {problem}")
    args.weights = None
    choice = _model_choice(args)
    device = _torch_device(args.device)
    tokenizer = _tokenizer(args, choice)
    if tokenizer is None:
        raise UsageError(f"{choice.label}: no tokenizer.json, and the server speaks text (give --tokenizer DIR)")
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
        _set_threads(args.threads, device)
        name = args.served_model_name or served_name(choice.model, choice.default)
        settings = ServeSettings(model_name=name, spec=args.spec, max_batch=max_batch, max_waiting=max_waiting,
                                 drain_timeout=drain_timeout, access_log=args.access_log, record=args.record)
        def listening(serving: Serving) -> None:
            print(f"fxsched serve: listening on {serving.url} (model {name}, spec {args.spec}); SIGTERM or Ctrl-C "
                  f"drains", file=sys.stderr, flush=True)

        try:
            serving = Serving(engine, tokenizer, settings, sock, on_started=listening,
                              record_meta={"model": choice.model or "", "served_model_name": name})
        except GenerateError as err:
            raise UsageError(str(err)) from None
    except BaseException:
        sock.close()
        raise
    if args.access_log:
        from fxsched.runtime.logs import configure_logging

        configure_logging(True)
    serving.run()
    print("fxsched serve: drained and stopped", file=sys.stderr, flush=True)
    return 0


def cmd_serve(args) -> int:
    return _reporting("serve", lambda: run_serve(args))
