"""The routes of ``fxsched serve`` beyond completions and chat (specs/serve.md §12.5–7): vLLM's
``POST /tokenize`` and ``POST /detokenize``, ``GET /version``, ``GET /docs`` (FastAPI's Swagger UI
over ``/openapi.json``), ``POST /v1/responses`` (runtime/serve/responses.py) and ``POST
/v1/embeddings``, which answers 404 (this server generates; it serves no embeddings: §12.7).

They hang off the app through ``register(app, served)``: ``Served`` hands them what the app's own
routes use (the engine, the limits, the drain state, the body screen, the submit path), so a
Responses request goes down the same road as a chat completion: the body is screened and planned
off the event loop, constrained (structured output, forced tool calls), submitted, and its choice
events are formatted. Bodies are parsed by the field policy of specs/serve-fields.md §13.1 (a bad
field is a 400 naming it; unknown fields are ignored and counted under the route's name).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version as package_version
from typing import Any, Optional

import structlog
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import BaseModel

from fxsched.runtime.serve.guard import REFUSALS, openapi_body
from fxsched.runtime.serve.protocol import ChatCompletionRequest, Limits, _check_model, chat_messages
from fxsched.runtime.serve.served import Served
from fxsched.runtime.serve.request_models import (
    APIError,
    ChatMessage,
    Int,
    _Strict,
    bad_request,
    request_from_data,
)
from fxsched.runtime.serve.tools import tool_plan

log = structlog.get_logger("fxsched.serve.http")

EMBEDDINGS_NOT_SERVED = "embeddings_not_served"


# --- request models -----------------------------------------------------------------------------


class TokenizeRequest(_Strict):
    """vLLM's ``/tokenize`` body: ``prompt`` (a string) or ``messages`` (a chat, through the template)."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: Optional[bool] = None  # default: true with prompt, false with messages (vLLM's)
    add_generation_prompt: Optional[bool] = None  # messages only; default true
    continue_final_message: Optional[bool] = None  # refused when true, as on chat
    return_token_strs: Optional[bool] = None
    tools: Optional[list[Any]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None


class DetokenizeRequest(_Strict):
    """vLLM's ``/detokenize`` body."""

    model: Optional[str] = None
    tokens: list[Int]


def tokenize(req: TokenizeRequest, tokenizer: Any, limits: Limits) -> dict[str, Any]:
    """vLLM's ``TokenizeResponse`` of a request (``tokenizer``: the screen's bounded tokenizer)."""
    from fxsched.runtime.text import TokenizerError

    _check_model(req.model, limits)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give either prompt or messages", "prompt" if req.prompt is not None else "messages")
    if req.prompt is not None:
        if req.add_generation_prompt is not None or req.tools is not None or req.chat_template_kwargs is not None:
            field = next(f for f in ("add_generation_prompt", "tools", "chat_template_kwargs")
                         if getattr(req, f) is not None)
            raise bad_request("only with messages", field)
        special = True if req.add_special_tokens is None else req.add_special_tokens
        tokens = tokenizer.encode(req.prompt, add_special_tokens=special)
    else:
        if req.continue_final_message:
            raise bad_request("is not supported by this server (only false)", "continue_final_message")
        plan = tool_plan(req.tools, None)
        messages = chat_messages(ChatCompletionRequest.model_construct(messages=req.messages))
        kwargs = dict(req.chat_template_kwargs or {})
        for key in ("messages", "add_generation_prompt", "tools"):
            if key in kwargs:
                raise bad_request("is set by the request's own field", f"chat_template_kwargs.{key}")
        generation = True if req.add_generation_prompt is None else req.add_generation_prompt
        try:
            text = tokenizer.apply_chat_template(messages, generation,
                                                 tools=plan.template_tools if plan is not None else None, **kwargs)
        except TokenizerError as err:
            raise bad_request(str(err), "messages") from None
        tokens = tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))
    strs = [tokenizer.tokenizer.id_to_token(t) for t in tokens] if req.return_token_strs else None
    return {"count": len(tokens), "max_model_len": limits.context, "tokens": tokens, "token_strs": strs}


def detokenize(req: DetokenizeRequest, tokenizer: Any, limits: Limits) -> dict[str, Any]:
    """vLLM's ``DetokenizeResponse``: the ids' text, special tokens kept (vLLM decodes with
    ``skip_special_tokens`` false)."""
    _check_model(req.model, limits)
    for i, token in enumerate(req.tokens):
        if not 0 <= token < tokenizer.vocab_size:
            raise bad_request(f"token id {token} is outside the vocabulary [0, {tokenizer.vocab_size})",
                              f"tokens[{i}]")
    return {"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)}


def fxsched_version() -> str:
    try:
        return package_version("fxsched")
    except PackageNotFoundError:
        return "unknown"


# --- the routes -----------------------------------------------------------------------------------

MODELS: tuple[type[BaseModel], ...] = (TokenizeRequest, DetokenizeRequest)


def register(app: FastAPI, served: Served) -> None:
    """Add the routes of this module and runtime/serve/responses.py to ``app`` (their request models,
    ``MODELS``, join the OpenAPI document in runtime/serve/app.py), and the served model's name to
    the ``vllm:*`` metrics (§12.8)."""
    from fxsched.runtime.serve import responses

    engine, limits, screen = served.engine, served.limits, served.screen
    engine.metrics.name_model(limits.model_names[0])

    _body = openapi_body

    @app.post("/tokenize", openapi_extra=_body(TokenizeRequest))
    async def tokenize_route(request: Request) -> JSONResponse:
        def build(data: Any, tok: Any) -> dict[str, Any]:
            return tokenize(request_from_data(TokenizeRequest, data, served.unknown("tokenize")), tok, limits)

        return JSONResponse(await screen.plan(await request.body(), None, build))

    @app.post("/detokenize", openapi_extra=_body(DetokenizeRequest))
    async def detokenize_route(request: Request) -> JSONResponse:
        def build(data: Any, tok: Any) -> dict[str, Any]:
            return detokenize(request_from_data(DetokenizeRequest, data, served.unknown("detokenize")), tok, limits)

        return JSONResponse(await screen.plan(await request.body(), False, build))

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": fxsched_version()})

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=app.openapi_url or "/openapi.json", title=f"{app.title} - Swagger UI")

    @app.post("/v1/embeddings", openapi_extra={
        "requestBody": {"required": True, "content": {"application/json": {"schema": {"type": "object"}}}},
        "responses": {**REFUSALS, "404": {"description": "embeddings are not served"}}})
    async def embeddings(request: Request) -> JSONResponse:
        raise APIError(404, f"/v1/embeddings is not served: {limits.model_names[0]!r} is served as a generative "
                            "model (vLLM, too, serves embeddings of a decoder model only with --runner pooling). "
                            "This server serves /v1/completions, /v1/chat/completions, /v1/responses, /tokenize "
                            "and /detokenize", "not_found_error", None, EMBEDDINGS_NOT_SERVED)

    responses.register(app, served, _body)
