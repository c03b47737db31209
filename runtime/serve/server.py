"""Running ``fxsched serve``: the engine, the app and a uvicorn server on a socket bound beforehand,
with a graceful drain.

``Serving`` puts the pieces together; ``run()`` blocks until the server has stopped (the CLI runs it
on the main thread, tests on a background thread and stop it with ``stop()``).

Drain (SIGTERM, or a first Ctrl-C; ``begin_drain()`` from code). In order:

1. the listening socket is closed (no new connections) and every new request on an open
   connection is answered 503; ``/health`` says 503 "draining";
2. the engine's inbox is closed (``InboxClosed``): the scheduler finishes everything it holds;
3. the drain waits until every generation request in flight has sent its whole response, at most
   ``drain_timeout`` seconds;
4. past the timeout, every choice still running is cancelled (``ServeEngine.abort_all``): each ends
   at its next token with a final chunk (finish reason "abort") and ``[DONE]``, so no stream is cut
   mid-token without one; the drain waits up to ``ABORT_GRACE`` seconds more for those;
5. uvicorn shuts down (idle connections closed, lifespan end: the engine thread is joined) and
   ``run`` returns; the process exits 0.

A second Ctrl-C forces the exit. The signals are caught for the whole run and never re-raised
(uvicorn's own server re-raises them after its shutdown, which would make the exit status a
signal's, not 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import structlog
import uvicorn

from fxsched.runtime.devices.device import Device
from fxsched.runtime.devices.torch import Drafter, TorchDevice
from fxsched.runtime.generate import context_limit, max_prompt_len
from fxsched.runtime.serve.app import ServeState, create_app
from fxsched.runtime.serve.engine import ServeEngine
from fxsched.runtime.serve.guard import DEFAULT_MAX_REQUEST_BYTES, Policy, is_loopback
from fxsched.runtime.serve.protocol import Limits
from fxsched.runtime.serve.timeouts import protocol_class
from fxsched.runtime.text import TextTokenizer
from fxsched.runtime.torch_model import HybridEngine

log = structlog.get_logger("fxsched.serve")

ABORT_GRACE = 10.0  # seconds the drain waits for cancelled choices' final chunks
ENGINE_JOIN = 30.0  # seconds the shutdown waits for the engine thread


@dataclass(frozen=True)
class ServeSettings:
    """The server's options (see ``fxsched serve --help``)."""

    model_name: str = "default"
    spec: str = "none"
    max_batch: Optional[int] = None
    max_waiting: int = 1024
    drain_timeout: float = 30.0
    access_log: bool = False
    record: Optional[str] = None
    api_key: Optional[str] = None
    metrics_open: bool = False
    allowed_origins: tuple[str, ...] = ()
    max_request_bytes: Optional[int] = None  # None: DEFAULT_MAX_REQUEST_BYTES
    seed: Optional[int] = None
    max_batch_tokens: Optional[int] = None  # the most rows of one forward (None: the scheduler's budget)
    async_scheduling: Optional[bool] = None  # plain decodes answered ahead (specs/async.md §16.6; None: on CUDA)
    model_aliases: tuple[str, ...] = ()  # more names the model answers to (--served-model-name A B: B)
    model_root: Optional[str] = None  # the model directory as given (/v1/models' root; None: the embedded model)
    log_requests: bool = True  # a record per finished request (runtime/serve/request_log.py)
    timeout_keep_alive: int = 5  # seconds, uvicorn's: an idle kept-alive connection is closed after it
    request_read_timeout: float = 30.0  # a request's head, or a pause in its body (runtime/serve/timeouts.py)
    uvicorn_log_level: Optional[str] = None  # uvicorn's loggers (None: warnings and errors)
    # LoRA adapters served from the start: (name, directory, base_model_name or None) each (specs/lora.md §18.7)
    lora_modules: tuple[tuple[str, str, Optional[str]], ...] = ()


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) (port 0: a free one); ``OSError`` when it cannot be."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited by accepted connections
        sock.bind((host, port))
        sock.listen(2048)  # connections made before uvicorn starts wait in the backlog
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class _AccessLog(logging.Handler):
    """uvicorn's access log records as structlog events."""

    def emit(self, record: logging.LogRecord) -> None:
        structlog.get_logger("fxsched.serve.access").info("http", line=record.getMessage())


class _UvicornErrors(logging.Handler):
    """uvicorn's own records (a cancelled task at shutdown, a bad HTTP request; with
    ``--uvicorn-log-level info`` and below its start-up lines too) as structlog events at their level."""

    def emit(self, record: logging.LogRecord) -> None:
        logger = structlog.get_logger("fxsched.serve.uvicorn")
        level = record.levelno
        write = (logger.error if level >= logging.ERROR else logger.warning if level >= logging.WARNING
                 else logger.info if level >= logging.INFO else logger.debug)
        write("uvicorn", message=record.getMessage())


UVICORN_LEVELS = {"critical": logging.CRITICAL, "error": logging.ERROR, "warning": logging.WARNING,
                  "info": logging.INFO, "debug": logging.DEBUG, "trace": 5}  # 5: uvicorn's TRACE


def _bridge(name: str, handler: logging.Handler, level: int) -> None:
    """Route a stdlib logger to ``handler`` once per process (several servers share the loggers)."""
    logger = logging.getLogger(name)
    if not any(type(h) is type(handler) for h in logger.handlers):
        logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False


class _Server(uvicorn.Server):
    """uvicorn's server with the drain of the module docstring in place of its own signal handling."""

    def __init__(self, config: uvicorn.Config, serving: "Serving"):
        super().__init__(config)
        self.serving = serving
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._drain_task: Optional[asyncio.Task[None]] = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._drain_task is not None or self._loop is None:
            if sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._start_drain, f"signal {signal.Signals(sig).name}")

    def _start_drain(self, why: str) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain(why))

    async def startup(self, sockets: Optional[list[socket.socket]] = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started and self.serving.on_started is not None:
            self.serving.on_started(self.serving)

    async def _drain(self, why: str) -> None:
        serving = self.serving
        state, engine = serving.state, serving.engine
        timeout = serving.settings.drain_timeout
        log.info("drain_started", reason=why, in_flight=state.active, timeout_s=timeout)
        state.draining = True
        for server in getattr(self, "servers", []):
            server.close()
        engine.close()
        start = time.monotonic()
        if not await _wait(lambda: state.active == 0, timeout):
            log.warning("drain_timeout", in_flight=state.active, cancelling=engine.live)
            engine.abort_all()
            await _wait(lambda: state.active == 0, ABORT_GRACE)
        log.info("drain_done", seconds=round(time.monotonic() - start, 3), left=state.active)
        self.should_exit = True


async def _wait(done: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.02)
    return True


class Serving:
    """The engine, the app and the uvicorn server of one ``fxsched serve`` (see the module docstring);
    ``on_started(serving)`` is called once the server accepts connections."""

    def __init__(self, engine: HybridEngine, tokenizer: TextTokenizer, settings: ServeSettings,
                 sock: socket.socket, drafter: Optional[Drafter] = None,
                 wrap_device: Optional[Callable[[TorchDevice], Device]] = None,
                 record_meta: Optional[dict[str, Any]] = None,
                 on_started: Optional[Callable[["Serving"], None]] = None):
        cfg = engine.cfg
        self.on_started = on_started
        self.settings = settings
        self.sock = sock
        self.engine = ServeEngine(engine, tokenizer, settings.spec, settings.max_batch, settings.max_waiting,
                                  drafter=drafter, wrap_device=wrap_device, record=settings.record,
                                  record_meta=record_meta, max_batch_tokens=settings.max_batch_tokens,
                                  late_drafts=wrap_device is None,  # the EP words carry every input
                                  async_scheduling=settings.async_scheduling)
        names = (settings.model_name, *settings.model_aliases)
        self.limits = Limits(names, cfg.vocab_size, max_prompt_len(cfg), context_limit(cfg), self.engine.speculative,
                             adapters=self.engine.adapters)
        self.engine.adapters.reserved_names = frozenset(names)
        for name, path, base in settings.lora_modules:  # AdapterRefused: the CLI's one line
            self.engine.load_adapter(name, path, base)
        self.state = ServeState(model_root=settings.model_root, log_requests=settings.log_requests)
        policy = Policy(api_key=settings.api_key, metrics_open=settings.metrics_open,
                        allowed_origins=settings.allowed_origins,
                        max_request_bytes=settings.max_request_bytes or DEFAULT_MAX_REQUEST_BYTES,
                        check_host=is_loopback(str(sock.getsockname()[0])), seed=settings.seed)
        paths = tuple(str(v) for k, v in (record_meta or {}).items() if k == "model" and v)
        self.app = create_app(self.engine, self.limits, self.state, lifespan=self._lifespan, policy=policy,
                              server_paths=paths)
        level = UVICORN_LEVELS[settings.uvicorn_log_level or "warning"]
        _bridge("uvicorn.error", _UvicornErrors(), level)
        if settings.access_log:
            _bridge("uvicorn.access", _AccessLog(), logging.INFO)
        config = uvicorn.Config(self.app, log_config=None, access_log=settings.access_log, lifespan="on",
                                timeout_graceful_shutdown=5, timeout_keep_alive=settings.timeout_keep_alive,
                                http=protocol_class(settings.request_read_timeout))
        self.server = _Server(config, self)
        self._started = threading.Event()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.sock.getsockname()[:2]
        return host, port

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{'[' + host + ']' if ':' in host else host}:{port}"

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Any):
        self.engine.start()
        self._started.set()
        try:
            yield
        finally:
            if not await asyncio.to_thread(self.engine.stop, ENGINE_JOIN):
                log.error("engine_thread_still_running", timeout_s=ENGINE_JOIN)

    def run(self) -> None:
        """Serve until drained or stopped (blocks)."""
        self.server.run(sockets=[self.sock])

    def wait_started(self, timeout: float = 60.0) -> bool:
        return self._started.wait(timeout) and _until(lambda: self.server.started, timeout)

    def begin_drain(self) -> None:
        """The drain of the module docstring, from any thread (as SIGTERM does)."""
        loop = self.server._loop
        if loop is not None:
            loop.call_soon_threadsafe(self.server._start_drain, "begin_drain")

    def stop(self) -> None:
        """Stop at once (tests): in-flight requests are not waited for."""
        self.server.should_exit = True


def _until(done: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def served_name(model_dir: Optional[str], default: bool) -> str:
    """The model name clients use (specs/serve.md §12.9): ``fxsched-default`` for the embedded model,
    else the model argument as given, as vLLM names it (``fxsched serve ./ckpt`` serves "./ckpt")."""
    if default or model_dir is None:
        return "fxsched-default"
    return str(model_dir)
