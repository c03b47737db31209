"""``POST /v1/responses``: the OpenAI Responses API as vLLM serves it for a model without a harmony
format (specs/serve.md §12.6), on the chat completions machinery.

A Responses body becomes a chat completions request (``chat_request``): ``instructions`` a system
message first; ``input`` a user message (a string) or a list of items (messages with text content
parts, ``function_call`` items as an assistant's ``tool_calls``, ``function_call_output`` items as
tool replies); ``max_output_tokens`` the budget; ``temperature``, ``top_p``; function ``tools`` and
``tool_choice`` in the chat shapes (runtime/serve/tools.py); ``text.format`` as ``response_format``
(structured output, §12.1). It is then planned, constrained and submitted as a chat request is, so
everything the chat path does (template, grammars, speculation, tool-call parsing) applies as is.
A bad field is a 400 naming the Responses field (``input[2].content[0]``, ``max_output_tokens``),
not the chat field it became.

The answer is a ``response`` object: ``output`` holds a ``message`` item (one ``output_text``
part; left out when the text is empty, as vLLM does) and one ``function_call`` item per parsed tool
call; ``usage`` counts ``input_tokens`` (cached ones in ``input_tokens_details``) and
``output_tokens``; ``status`` is ``completed``, or ``incomplete`` with ``incomplete_details.reason``
``max_output_tokens`` when the budget cut the text. Streamed (``stream: true``), it is vLLM's
server-sent events (``event: <type>`` + ``data: <json>``, each with a rising ``sequence_number``):
``response.created``, ``response.in_progress``, then per output item ``response.output_item.added``,
for a message ``response.content_part.added``, ``response.output_text.delta``...,
``response.output_text.done``, ``response.content_part.done``, for a call
``response.function_call_arguments.delta``..., ``response.function_call_arguments.done``, then
``response.output_item.done``; last ``response.completed`` with the whole response.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from fxsched.runtime.serve import tools as toolcalls
from fxsched.runtime.serve.choices import ChoiceEvent
from fxsched.runtime.serve.protocol import ChatCompletionRequest, Limits, Plan, chat_plan
from fxsched.runtime.serve.request_models import APIError, Int, ModelNotFound, _Strict, bad_request, request_from_data

if TYPE_CHECKING:
    from fxsched.runtime.serve.served import Served

ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text")
# fields declared so a client learns they are not honoured: (name, its neutral values)
REFUSED: tuple[tuple[str, tuple[Any, ...]], ...] = (
    ("background", (None, False)), ("previous_response_id", (None,)), ("truncation", (None, "disabled")),
    ("reasoning", (None,)), ("include", (None, [])), ("top_logprobs", (None, 0)), ("max_tool_calls", (None,)),
    ("prompt", (None,)), ("conversation", (None,)),
)


class ResponsesRequest(_Strict):
    """The Responses API body (the fields vLLM's ``ResponsesRequest`` honours for a plain model)."""

    model: Optional[str] = None
    input: Union[str, list[Any]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[Int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stream: Optional[bool] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[dict[str, Any]] = None
    metadata: Optional[dict[str, str]] = None  # echoed back
    user: Optional[str] = None
    store: Optional[bool] = None  # accepted; nothing is kept (previous_response_id is refused)
    service_tier: Optional[str] = None  # accepted and echoed; one tier
    # declared, refused unless neutral (REFUSED)
    background: Optional[bool] = None
    previous_response_id: Optional[str] = None
    truncation: Optional[str] = None
    reasoning: Optional[Any] = None
    include: Optional[list[Any]] = None
    top_logprobs: Optional[Int] = None
    max_tool_calls: Optional[Int] = None
    prompt: Optional[Any] = None
    conversation: Optional[Any] = None


MODELS: tuple[type[BaseModel], ...] = (ResponsesRequest,)


# --- the request as a chat request ------------------------------------------------------------------


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request("expected a string or a list of content parts", where)
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(f"only text parts ({', '.join(TEXT_PARTS)}) are supported, got {json.dumps(kind)[:40]}",
                              f"{where}[{j}]")
        parts.append(part["text"])
    return "".join(parts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request("must be a string", f"{where}.{key}")
    return value


def input_messages(req: ResponsesRequest) -> tuple[list[dict[str, Any]], list[str]]:
    """The chat messages of ``instructions`` and ``input``, and for each the Responses field it came from."""
    messages: list[dict[str, Any]] = []
    origin: list[str] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
        origin.append("instructions")
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
        origin.append("input")
        return messages, origin
    if not req.input:
        raise bad_request("at least one input item is required", "input")
    merging = False  # the last message is an assistant turn of function_call items
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request("must be an object (a message or a function call item)", where)
        kind = item.get("type", "message")
        if kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
            if merging:  # one assistant turn of several calls
                messages[-1]["tool_calls"].append(call)
                continue
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            merging = True
        elif kind == "message":
            role = item.get("role")
            if not isinstance(role, str) or role not in ROLES:  # (a dict is not hashable: no membership test)
                raise bad_request(f"must be one of {', '.join(ROLES)}, got {json.dumps(role)[:40]}", f"{where}.role")
            messages.append({"role": ROLES[role], "content": _text_of(item.get("content"), f"{where}.content")})
            merging = False
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = _text_of(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": output})
            merging = False
        else:
            raise bad_request(f"input items of type {json.dumps(kind)[:40]} are not supported (message, "
                              "function_call, function_call_output)", f"{where}.type")
        origin.append(where)
    return messages, origin


def _tools(tools: Optional[list[Any]]) -> Optional[list[Any]]:
    """Responses function tools (``{"type": "function", "name", "parameters"}``) in the chat shape."""
    if tools is None:
        return None
    out: list[Any] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad_request(f"only function tools are supported, got {json.dumps(kind)[:40]}", f"tools[{i}].type")
        if isinstance(tool.get("function"), dict):  # already the chat shape
            out.append(tool)
            continue
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(text: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_schema", "json_object"):
        raise bad_request("must be {\"type\": \"text\" | \"json_schema\" | \"json_object\"}", "text.format")
    if fmt["type"] == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request("a JSON schema (an object) is required", "text.format.schema")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "response"), "schema": fmt["schema"]}}
    return {"type": fmt["type"]}


_FIELDS = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}


def _renamed(err: APIError, origin: list[str]) -> APIError:
    """The error of the chat request ``chat_request`` built, naming the Responses field instead."""
    param = err.param
    if param is None or isinstance(err, ModelNotFound):  # vLLM's 404 body, as the other routes give it
        return err
    new = param
    if param.startswith("messages["):
        index, _, rest = param[len("messages["):].partition("]")
        if index.isdigit() and int(index) < len(origin):
            new = origin[int(index)] + (rest if origin[int(index)] != "instructions" else "")
    elif param.startswith("tools[") and ".function." in param:
        new = param.replace(".function.", ".", 1)
    elif param == "tool_choice.function.name":
        new = "tool_choice.name"
    else:
        head, dot, rest = param.partition(".")
        new = _FIELDS.get(head, head) + dot + rest
    message = err.message[len(param) + 2:] if err.message.startswith(f"{param}: ") else err.message
    return APIError(err.status, f"{new}: {message}", err.type, new, err.code)


def chat_request(req: ResponsesRequest, tokenizer: Any, limits: Limits, max_chars: int
                 ) -> tuple[ChatCompletionRequest, Plan, Optional[toolcalls.ToolPlan]]:
    """The chat request, plan and tool plan of a Responses request; 400 naming the Responses field."""
    for name, neutral in REFUSED:
        if getattr(req, name) not in neutral:
            raise bad_request(f"is not supported by this server (only {json.dumps(neutral[-1])})", name)
    messages, origin = input_messages(req)
    chars = sum(len(m["content"] or "") for m in messages)
    if chars > max_chars:
        raise bad_request(f"the input has {chars} characters, more than any prompt this model takes (at most "
                          f"{max_chars})", "input", "context_length_exceeded")
    data = {"model": req.model, "messages": messages, "max_completion_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "tools": _tools(req.tools),
            "tool_choice": _tool_choice(req.tool_choice), "parallel_tool_calls": req.parallel_tool_calls,
            "response_format": _response_format(req.text)}
    try:
        chat = request_from_data(ChatCompletionRequest, {k: v for k, v in data.items() if v is not None})
        tools = toolcalls.tool_plan(chat.tools, chat.tool_choice, chat.parallel_tool_calls)
        plan = chat_plan(chat, tokenizer, limits, tools.template_tools if tools is not None else None)
    except APIError as err:
        raise _renamed(err, origin) from None
    return chat, plan, tools


# --- the answer -------------------------------------------------------------------------------------


class _Output:
    """The output items of one response as its text arrives (tool calls parsed as the chat path does)."""

    def __init__(self, parse_tools: bool):
        self.parser = toolcalls.ToolStream() if parse_tools else None
        self.items: list[dict[str, Any]] = []
        self.open: Optional[dict[str, Any]] = None  # the item receiving deltas

    def push(self, text: str, final: bool) -> list[tuple[str, dict[str, Any]]]:
        """The stream events of a piece of text (``final``: the last piece)."""
        if self.parser is None:
            deltas: list[dict[str, Any]] = [{"content": text}] if text else []
        else:
            deltas = self.parser.push(text) if text else []
            if final:
                deltas += self.parser.finish()
        events: list[tuple[str, dict[str, Any]]] = []
        for delta in deltas:
            if "content" in delta:
                events += self._text(delta["content"])
            for call in delta.get("tool_calls", ()):
                events += self._call(call)
        if final:
            events += self._close()
        return events

    def _text(self, piece: str) -> list[tuple[str, dict[str, Any]]]:
        events = []
        if self.open is None or self.open["type"] != "message":
            events += self._close()
            self.open = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                         "status": "in_progress", "content": []}
            events.append(("response.output_item.added", {"output_index": len(self.items), "item": dict(self.open)}))
            events.append(("response.content_part.added", {**self._at(), "part": _text_part("")}))
            self.open["_text"] = ""
        self.open["_text"] += piece
        events.append(("response.output_text.delta", {**self._at(), "delta": piece, "logprobs": []}))
        return events

    def _call(self, call: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        events = []
        fn = call.get("function", {})
        if "name" in fn:  # a new call
            events += self._close()
            self.open = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress",
                         "call_id": f"call_{uuid.uuid4().hex[:24]}", "name": fn["name"], "arguments": ""}
            events.append(("response.output_item.added", {"output_index": len(self.items), "item": dict(self.open)}))
        piece = fn.get("arguments", "")
        if piece and self.open is not None:
            self.open["arguments"] += piece
            events.append(("response.function_call_arguments.delta",
                           {"item_id": self.open["id"], "output_index": len(self.items), "delta": piece}))
        return events

    def _at(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.items), "content_index": 0}

    def _close(self) -> list[tuple[str, dict[str, Any]]]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.items)
        events = []
        if item["type"] == "message":
            text = item.pop("_text")
            at = {"item_id": item["id"], "output_index": index, "content_index": 0}
            events.append(("response.output_text.done", {**at, "text": text, "logprobs": []}))
            events.append(("response.content_part.done", {**at, "part": _text_part(text)}))
            item["content"] = [_text_part(text)]
        else:
            events.append(("response.function_call_arguments.done",
                           {"item_id": item["id"], "output_index": index, "arguments": item["arguments"]}))
        item["status"] = "completed"
        self.items.append(item)
        events.append(("response.output_item.done", {"output_index": index, "item": item}))
        return events


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class _Answer:
    """The response object of one request (its fields echo the request's, as vLLM's ``from_request``)."""

    def __init__(self, req: ResponsesRequest, plan: Plan, tools: Optional[toolcalls.ToolPlan]):
        self.req, self.plan = req, plan
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.output = _Output(tools is not None and tools.parse)
        self.tokens = 0
        self.cached = 0
        self.reason: Optional[str] = None

    def body(self, status: str) -> dict[str, Any]:
        req, spec = self.req, self.plan.choices[0]
        incomplete = status == "incomplete"
        usage = None
        if status not in ("in_progress", "queued"):
            usage = {"input_tokens": self.plan.prompt_tokens, "input_tokens_details": {"cached_tokens": self.cached},
                     "output_tokens": self.tokens, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": self.plan.prompt_tokens + self.tokens}
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "error": None, "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "instructions": req.instructions, "max_output_tokens": spec.max_tokens, "model": self.plan.model,
                "output": list(self.output.items), "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": None, "reasoning": None, "service_tier": req.service_tier or "auto",
                "store": False, "temperature": spec.temperature, "text": req.text or {"format": {"type": "text"}},
                "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
                "tools": req.tools or [], "top_p": spec.top_p, "truncation": "disabled", "usage": usage,
                "user": req.user, "metadata": req.metadata or {}, "background": False}

    def take(self, event: ChoiceEvent) -> list[tuple[str, dict[str, Any]]]:
        self.tokens += len(event.tokens)
        if event.final:
            self.reason = event.finish_reason
            self.cached = event.cached_tokens
            self.tokens = event.completion_tokens
        return self.output.push(event.text, event.final)

    @property
    def status(self) -> str:
        return {"length": "incomplete", "abort": "cancelled"}.get(self.reason or "", "completed")


def register(app: FastAPI, served: "Served", body: Callable[[type[BaseModel]], dict[str, Any]]) -> None:
    """Add ``POST /v1/responses`` to ``app`` (runtime/serve/routes_extra.py ``register``)."""
    engine, limits, screen, state = served.engine, served.limits, served.screen, served.state

    @app.post("/v1/responses", openapi_extra=body(ResponsesRequest))
    async def responses(request: Request) -> Response:
        def build(data: Any, tok: Any) -> tuple[ResponsesRequest, Any, Plan, Optional[toolcalls.ToolPlan]]:
            req = request_from_data(ResponsesRequest, data, served.unknown("responses"))
            chat, plan, tools = chat_request(req, tok, limits, screen.max_prompt_chars)
            return (req, chat, plan, tools)

        req, chat, plan, tools = await screen.plan(await request.body(), False, build)
        plan = await served.constrained(chat, plan, tools)
        screen.check_fits(plan, engine.max_waiting)
        answer = _Answer(req, plan, tools)
        ids, q = served.submit(plan, asyncio.get_running_loop(), answer.id)
        state.active += 1
        if req.stream:
            def closed() -> None:
                if answer.reason is None:
                    engine.cancel(ids)
                state.active -= 1

            return served.event_stream(_stream(answer, q), closed)
        try:
            return await _whole(request, answer, ids, q)
        finally:
            state.active -= 1

    async def _whole(request: Request, answer: _Answer, ids: list[int], q: asyncio.Queue[ChoiceEvent]) -> Response:
        gone = asyncio.ensure_future(served.disconnected(request))
        try:
            while answer.reason is None:
                getter = asyncio.ensure_future(q.get())
                done, _ = await asyncio.wait({getter, gone}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    engine.cancel(ids)
                    return Response(status_code=499)  # nobody will read it
                event = getter.result()
                if event.error is not None:
                    answer.reason = "error"
                    raise APIError(500, event.error, "server_error", None, "engine_fault")
                answer.take(event)
        finally:
            gone.cancel()
        return JSONResponse(answer.body(answer.status))

    async def _stream(answer: _Answer, q: asyncio.Queue[ChoiceEvent]) -> AsyncIterator[str]:
        number = 0

        def sse(kind: str, data: dict[str, Any]) -> str:
            nonlocal number
            payload = {"type": kind, "sequence_number": number, **data}
            number += 1
            return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"

        yield sse("response.created", {"response": answer.body("in_progress")})
        yield sse("response.in_progress", {"response": answer.body("in_progress")})
        while answer.reason is None:
            event = await q.get()
            if event.error is not None:
                answer.reason = "error"
                yield sse("error", {"code": "engine_fault", "message": event.error, "param": None})
                failed = answer.body("failed")
                failed["error"] = {"code": "server_error", "message": event.error}
                yield sse("response.failed", {"response": failed})
                return
            for kind, data in answer.take(event):
                yield sse(kind, data)
        yield sse("response.completed", {"response": answer.body(answer.status)})
