"""The HTTP layer of ``fxsched serve``: a FastAPI app over one ``ServeEngine``.

Why FastAPI on uvicorn: it is the stack vLLM and SGLang serve the same API with, well kept, and
asyncio-native (Starlette's ``StreamingResponse`` gives SSE and tells a disconnect); uvicorn is its
reference ASGI server and lets ``fxsched serve`` own the signal handling (runtime/serve/server.py).
Bodies are decoded by ``guard.Screen`` (bounded JSON, prompts measured before they are tokenized,
on a worker thread) and validated by ``protocol.request_from_data`` rather than FastAPI's own
validation, so a bad field is a 400 with an OpenAI error body naming it, not FastAPI's 422. The
front door (API key, Host, Origin, Content-Type, body size: runtime/serve/guard.py,
serve-security.md §14.1) wraps the app as ASGI middleware.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream``: server-sent events,
one ``data: {chunk}`` per frame that brings text, a final chunk with ``finish_reason``, a usage
chunk with ``stream_options.include_usage``, then ``data: [DONE]``), ``GET /v1/models``, ``GET
/health`` (200 while serving, 503 while draining or when the engine thread has stopped), ``GET
/metrics`` (Prometheus text, runtime/serve/metrics.py), ``GET /openapi.json`` (the routes and
their request models; the bodies are still parsed by ``guard.Screen``). Unknown request fields
are ignored and counted (``fxsched_unknown_fields_total``). ``routes_extra.register`` adds vLLM's
other routes (specs/serve.md §12.5-§12.7): ``POST /tokenize``, ``POST /detokenize``, ``GET
/version``, ``GET /docs``, ``POST /v1/responses`` (on the chat path, runtime/serve/responses.py)
and ``POST /v1/embeddings`` (a 404 naming what is served). ``GET /v1/models`` and the check of a
request's ``model`` are vLLM's (runtime/serve/models.py, §12.9: a wrong model is a 404).

What the layer does, and nothing more (scheduling is the scheduler's): a request becomes a plan
(protocol.py), its choices are submitted to the engine with a sink that moves each ``ChoiceEvent``
onto the request's asyncio queue (``loop.call_soon_threadsafe``), and the events are turned into the
response. A client that goes away (a stream closed early, a non-streaming client that hangs up) has
its unfinished choices cancelled: ``ServeEngine.cancel``, a ``Cancel`` event for the scheduler.

Structured output and tool calls (specs/serve.md): the request's constraint (runtime/serve/structured.py,
or a forced tool call, runtime/serve/tools.py) is checked off the event loop and becomes each choice's
grammar; with ``tools`` the chat replies are parsed into ``tool_calls`` (streamed as deltas).

Errors: ``APIError`` as its status and body (the server's paths cut out of the message); the
front door's 400 / 401 / 403 / 413 / 415; a request of more choices than ``--max-waiting`` 400, a
full waiting queue 429, a draining server 503; a
choice the engine failed (an engine fault) 500, or, once a stream has started, an SSE ``data:
{"error": ...}`` event followed by ``data: [DONE]``. Unknown routes get the OpenAI error body too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional

import structlog
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from fxsched.runtime.serve.choices import ChoiceEvent
from fxsched.runtime.serve.engine import Draining, Overloaded, ServeEngine
from fxsched.runtime.serve.formatter import _Choice, _Formatter, _first_chunk
from fxsched.runtime.serve.guard import Policy, Screen, install, openapi_body, scrub_paths
from fxsched.runtime.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    Limits,
    Plan,
    chat_plan,
    completion_plan,
    bad_request,
    request_from_data,
)
from fxsched.runtime.serve import structured, tools as toolcalls
from fxsched.runtime.serve.lora import AdapterGone
from fxsched.runtime.serve.models import ModelNotFound, check_model, model_cards
from fxsched.runtime.serve.request_log import RequestRecord
from fxsched.runtime.serve.served import Served

log = structlog.get_logger("fxsched.serve.http")


@dataclass
class ServeState:
    """What the server's drain reads: whether it is draining, and the generation requests in flight
    (from submit until their response has been sent, or their client has gone)."""

    draining: bool = False
    active: int = 0
    created: int = field(default_factory=lambda: int(time.time()))
    model_root: Optional[str] = None  # /v1/models' root: the model directory as given (None: the embedded model)
    log_requests: bool = True  # one record per finished request (runtime/serve/request_log.py)


def _error(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


class _EventStream(StreamingResponse):
    """An SSE response that calls ``on_close`` however it ends (done, client gone, server cancel)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _sse(data: Any) -> str:
    import json

    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _engine_failed(message: str) -> APIError:
    return APIError(500, message, "server_error", None, "engine_fault")


def create_app(engine: ServeEngine, limits: Limits, state: Optional[ServeState] = None,
               lifespan: Optional[Callable[[Any], Any]] = None, policy: Optional[Policy] = None,
               server_paths: tuple[str, ...] = ()) -> FastAPI:
    """The app serving ``engine`` (which the caller, or ``lifespan``, starts and stops); ``state``
    is shared with the server's drain; ``policy`` is the front door's (runtime/serve/guard.py);
    ``server_paths`` never appear in an error message."""
    state = state if state is not None else ServeState()
    policy = policy if policy is not None else Policy()
    app = FastAPI(title="fxsched", docs_url=None, redoc_url=None, openapi_url="/openapi.json", lifespan=lifespan)
    app.state.serve = state
    app.state.engine = engine
    install(app, policy)
    tokenizer = engine.tokenizer
    screen = Screen(policy, tokenizer, limits.max_prompt_len)
    hidden = tuple(p for p in (*server_paths, getattr(tokenizer, "source", "")) if p)

    @functools.lru_cache(maxsize=65536)
    def token_text(token: int) -> str:
        return tokenizer.decode([token], skip_special_tokens=False)

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        if err.type != "NotFoundError":  # a wrong model's 404 shows only the client's own `model` (models.py)
            err.message = scrub_paths(err.message, hidden)
        return _error(err)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        response = _error(APIError(err.status_code, f"{request.method} {request.url.path}: {err.detail}", kind))
        if err.headers:  # a 405's Allow (RFC 9110 requires it), as Starlette's own answer has it
            response.headers.update(err.headers)
        return response

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception) -> JSONResponse:
        log.error("http_internal_error", path=request.url.path, error=f"{type(err).__name__}: {err}")
        return _error(APIError(500, f"internal error: {type(err).__name__}", "server_error", None, "internal_error"))

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not engine.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=PlainTextResponse)  # Prometheus text, so documented
    async def metrics() -> Response:
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(model_cards(limits.model_names, state.model_root, state.created, limits.context,
                                        engine.adapters.adapters(), spec=engine.spec))

    def _submit(plan: Plan, loop: asyncio.AbstractEventLoop, request_id: str
                ) -> tuple[list[int], asyncio.Queue[ChoiceEvent]]:
        """Hand ``plan``'s choices to the engine; with ``log_requests`` its events pass through the
        record of ``request_id`` (the response's id: specs/serve.md §12.10)."""
        q: asyncio.Queue[ChoiceEvent] = asyncio.Queue()
        record = RequestRecord(request_id, plan.model, plan.prompt_tokens, len(plan.choices), loop) \
            if state.log_requests else None

        def sink(event: ChoiceEvent) -> None:
            if record is not None:
                record.watch(event)
            loop.call_soon_threadsafe(q.put_nowait, event)

        if state.draining:
            engine.metrics.rejected.labels("503").inc()
            raise APIError(503, "the server is shutting down; retry on another server", "server_error", None,
                           "server_shutting_down")
        try:
            ids = engine.submit(plan.choices, sink)
        except AdapterGone as err:  # unloaded since the request's model was checked
            raise ModelNotFound(err.name) from None
        except Overloaded as err:
            engine.metrics.rejected.labels("429").inc()
            raise APIError(429, str(err), "rate_limit_error", None, "rate_limit_exceeded") from None
        except Draining as err:
            engine.metrics.rejected.labels("503").inc()
            code = "server_shutting_down" if engine.closed and not engine.gave_up else "engine_stopped"
            raise APIError(503, str(err), "server_error", None, code) from None
        return ids, q

    async def _constrained(req: Any, plan: Plan, tools: Optional[toolcalls.ToolPlan]) -> Plan:
        """The plan with its choices' grammar (structured output, a forced tool call), checked off
        the event loop."""
        try:
            constraint = structured.constraint_of(req)
            if tools is not None and tools.forced is not None:
                if constraint is not None:
                    raise bad_request(f"cannot be combined with tool_choice {json.dumps(tools.forced)[:60]}",
                                      constraint.param)
                grammar = toolcalls.tool_grammar(tools)
                assert grammar is not None
                constraint = structured.Constraint("tool_calls", "tool_choice", grammar)
            if constraint is None:
                return plan
            structured.check_compatible(req)
            await asyncio.to_thread(lambda: structured.check(constraint, engine.grammar_tokenizer))
        except ImportError:
            raise bad_request("structured output needs the llguidance package on the server "
                              "(pip install 'fxsched[serve]')", "response_format") from None
        return dataclasses.replace(plan, choices=tuple(dataclasses.replace(c, grammar=constraint.grammar)
                                                       for c in plan.choices))

    async def _serve(request: Request, plan: Plan, tools: Optional[toolcalls.ToolPlan] = None) -> Response:
        screen.check_fits(plan, engine.max_waiting)
        loop = asyncio.get_running_loop()
        fmt = _Formatter(plan, int(time.time()), token_text, tools)
        ids, q = _submit(plan, loop, fmt.id)
        state.active += 1
        choices = [_Choice() for _ in plan.choices]
        if plan.stream:
            return _EventStream(_stream(fmt, choices, q), lambda: _closed(ids, choices))
        try:
            return await _whole(request, fmt, ids, choices, q)
        finally:
            state.active -= 1

    def _closed(ids: list[int], choices: list[_Choice]) -> None:
        engine.cancel([rid for rid, c in zip(ids, choices, strict=True) if c.final is None])
        state.active -= 1

    async def _whole(request: Request, fmt: _Formatter, ids: list[int], choices: list[_Choice],
                     q: asyncio.Queue[ChoiceEvent]) -> Response:
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            remaining = len(choices)
            while remaining:
                getter = asyncio.ensure_future(q.get())
                done, _ = await asyncio.wait({getter, gone}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    engine.cancel([rid for rid, c in zip(ids, choices, strict=True) if c.final is None])
                    return Response(status_code=499)  # nobody will read it
                event = getter.result()
                choices[event.index].take(event)
                remaining -= event.final
        finally:
            gone.cancel()
        failed = [c.final.error for c in choices if c.final is not None and c.final.error is not None]
        if failed:
            return _error(_engine_failed(failed[0]))
        return JSONResponse(fmt.response(choices))

    async def _stream(fmt: _Formatter, choices: list[_Choice], q: asyncio.Queue[ChoiceEvent]) -> AsyncIterator[str]:
        if fmt.chat:
            for index in range(len(choices)):
                yield _sse(fmt.chunk(index, "", None, role=True))
        remaining = len(choices)
        parsers = [toolcalls.ToolStream() if fmt.parse_tools else None for _ in choices]
        while remaining:
            event = await q.get()
            choice = choices[event.index]
            choice.take(event)
            if not choice.started and event.error is None:
                choice.started = True
                first = _first_chunk(fmt, choice, event.index)
                if first is not None:
                    yield _sse(first)
            if event.error is not None:
                yield _sse(_engine_failed(event.error).body())
                yield "data: [DONE]\n\n"
                return
            parser = parsers[event.index]
            if parser is not None:
                deltas = parser.push(event.text) if event.text else []
                if event.final:
                    deltas += parser.finish()
                if deltas:
                    tokens, records = choice.flush_pending()
                    lp = fmt.logprobs(choice, tokens, records)
                    for j, delta in enumerate(deltas):
                        yield _sse(fmt.delta_chunk(event.index, delta, lp if j == 0 else None))
                if event.final:
                    remaining -= 1
                    tokens, records = choice.flush_pending()
                    lp = fmt.logprobs(choice, tokens, records) if tokens else None
                    reason = "tool_calls" if parser.calls and event.finish_reason == "stop" else event.finish_reason
                    yield _sse(fmt.chunk(event.index, None, lp, reason, stop_reason=event.stop_reason))
                continue
            if event.text or (event.tokens and not event.final):
                # a chunk per frame that brought tokens, its text empty while the detokenizer holds
                # it back (an incomplete character, a possible stop string), as vLLM streams: a
                # client timing chunks (TTFT, inter-token latency) sees every token arrive
                tokens, records = choice.flush_pending()
                yield _sse(fmt.chunk(event.index, event.text, fmt.logprobs(choice, tokens, records)))
            if event.final:
                remaining -= 1
                tokens, records = choice.flush_pending()
                lp = fmt.logprobs(choice, tokens, records) if tokens else None
                yield _sse(fmt.chunk(event.index, None if fmt.chat else "", lp, event.finish_reason,
                                     stop_reason=event.stop_reason))
        if fmt.plan.include_usage:
            yield _sse(fmt.usage_chunk(choices))
        yield "data: [DONE]\n\n"

    def _unknown(endpoint: str) -> Callable[[list[str]], None]:
        def count(names: list[str]) -> None:
            engine.metrics.unknown_fields.labels(endpoint).inc(len(names))
            log.debug("unknown_fields_ignored", endpoint=endpoint, fields=[n[:40] for n in names[:8]])
        return count

    @app.post("/v1/completions", openapi_extra=_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        def build(data: Any, tok: Any) -> tuple[Any, Plan]:
            check_model(data, limits.model_names, limits.adapters)
            req = request_from_data(CompletionRequest, data, _unknown("completions"))
            return req, completion_plan(req, tok, limits)

        req, plan = await screen.plan(await request.body(), False, build)
        plan = await _constrained(req, plan, None)
        return await _serve(request, plan)

    @app.post("/v1/chat/completions", openapi_extra=_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        def build(data: Any, tok: Any) -> tuple[Any, Plan, Optional[toolcalls.ToolPlan]]:
            check_model(data, limits.model_names, limits.adapters)
            req = request_from_data(ChatCompletionRequest, data, _unknown("chat_completions"))
            tools = toolcalls.tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls)
            return req, chat_plan(req, tok, limits, tools.template_tools if tools is not None else None), tools

        req, plan, tools = await screen.plan(await request.body(), True, build)
        plan = await _constrained(req, plan, tools)
        return await _serve(request, plan, tools)

    app.openapi = functools.partial(_openapi, app, limits)  # type: ignore[method-assign]
    # /tokenize, /detokenize, /version, /docs, /v1/responses, /v1/embeddings (specs/serve.md §12.5–8)
    from fxsched.runtime.serve import routes_extra

    from fxsched.runtime.serve import lora_routes  # /v1/load_lora_adapter, /v1/unload_lora_adapter

    lora_routes.register(app, engine, screen)
    routes_extra.register(app, Served(engine, limits, state, screen, _submit, _constrained, _unknown,
                                                   _EventStream, _disconnected))
    return app


_SCHEMAS = (CompletionRequest, ChatCompletionRequest)


_body = openapi_body


def _openapi(app: FastAPI, limits: Limits) -> dict[str, Any]:
    """FastAPI's document with every route's request model under ``components``, narrowed to what
    this server accepts (runtime/serve/schema_rules.py)."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        from pydantic import BaseModel

        from fxsched.runtime.serve import lora_routes, responses, routes_extra, schema_rules

        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        models: tuple[type[BaseModel], ...] = (*_SCHEMAS, *routes_extra.MODELS, *responses.MODELS, *lora_routes.MODELS)
        for model in models:
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
        schema_rules.narrow(schemas, limits)
        app.openapi_schema = doc
    return app.openapi_schema


async def _disconnected(request: Request) -> None:
    """Returns when the client of ``request`` (whose body has been read) has gone away."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
