"""The OpenAI wire protocol of ``fxsched serve``: request models, error bodies, and the plan a
request becomes (the scheduler requests of its choices). No HTTP framework here: pydantic only.

Requests. ``CompletionRequest`` (``POST /v1/completions``) and ``ChatCompletionRequest`` (``POST
/v1/chat/completions``) take the fields the OpenAI API and vLLM accept (see the classes). Known
fields are type-checked strictly (``"max_tokens": "5"`` or ``true`` is refused, an integer is a
number); unknown fields are allowed and ignored, as vLLM does. Fields the server cannot honour
(``echo``, ``suffix``, penalties, ``logit_bias``, ``best_of`` > ``n``, ``ignore_eos``) are refused
when set to anything but their neutral value, never silently dropped. Structured output
(``response_format``, ``structured_outputs``, ``guided_*``) is runtime/serve/structured.py's, tool
calling (``tools``, ``tool_choice``) runtime/serve/tools.py's: the HTTP layer applies both to the plan.

Defaults that differ from OpenAI's: ``temperature`` defaults to 0 (greedy: the scheduler's
default), and ``model`` may be left out (the served model). With a speculative ``--spec`` mode (mtp,
dflash, ngram) a sampling request is verified by rejection sampling (specs/speculation.md §6.16: the
output keeps the target's distribution); logprobs are the target's, as without speculation.

Errors. ``APIError`` carries the HTTP status and the OpenAI error body ``{"error": {"message",
"type", "param", "code"}}``; ``param`` names the offending field (``messages[1].content``).
Malformed JSON, a body that is not an object, a field of the wrong type or out of range, an unknown
model, a prompt longer than the context, or a prompt plus ``max_tokens`` beyond it: 400.

Plans (``completion_plan`` / ``chat_plan``). A request with P prompts and ``n`` choices becomes
P x n ``ChoiceSpec`` (choice index ``p * n + j``, as OpenAI numbers them), each one scheduler
``Request`` later. Choice k draws with ``seed`` + k x ``REQUEST_SEED_STRIDE`` (a random seed when
none is given), like ``fxsched generate``'s requests. Logprobs: the scheduler gives a record only
when asked for at least one top entry, so ``logprobs: 0`` (completions) or ``logprobs: true``
without ``top_logprobs`` (chat) asks it for one and reports none of them; the first token of every
choice gets its record from the device row the scheduler picked it from (``LogprobWitness``; the
scheduler itself keeps none for it, specs/scheduler.md §5.11), and speculative tokens theirs from
the verify rows (specs/speculation.md §6.16).
"""

from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional, Sequence, Union

from pydantic import BaseModel, ConfigDict, ValidationError

MAX_N = 128  # choices of one request
MAX_TOP_LOGPROBS = 20  # as vLLM (OpenAI: 5 for completions, 20 for chat)
MAX_STOP_STRINGS = 16
REQUEST_SEED_STRIDE = 2**20  # choice k seeds its picks with seed + k * stride (runtime/generate.py's rule)
MAX_SEED = 2**62


class APIError(Exception):
    """An error answered with ``status`` and the OpenAI error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    """A 400 whose message starts with the field it is about."""
    return APIError(400, f"{param}: {message}" if param else message, "invalid_request_error", param, code)


# --- request models -----------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class ContentPart(_Strict):
    type: str
    text: Optional[str] = None


class ChatMessage(_Strict):
    role: str
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None


class _Common(_Strict):
    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    n: Optional[int] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    ignore_eos: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None


class CompletionRequest(_Common):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = None
    echo: Optional[bool] = None
    suffix: Optional[str] = None
    best_of: Optional[int] = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    response_format: Optional[dict[str, Any]] = None
    add_generation_prompt: Optional[bool] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None


# what a field of several shapes expects, for the error message
_EXPECTED = {
    "prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": "a string or a list of strings",
    "content": "a string or a list of content parts",
}
_NESTED_FIELDS = {"content", "role", "name", "type", "text", "include_usage"}


def _param(loc: Sequence[Any]) -> str:
    """``('messages', 1, 'content', 'str')`` -> ``messages[1].content`` (union-member tags dropped)."""
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif i == 0:
            out = str(part)
        elif part in _NESTED_FIELDS:
            out += f".{part}"
        else:
            break
    return out


def _validation_error(err: ValidationError) -> APIError:
    errors = err.errors()
    first = errors[0]
    param = _param(first["loc"])
    field = param.rsplit(".", 1)[-1].split("[", 1)[0]
    shapes = {e["type"] for e in errors if _param(e["loc"]) == param}
    if first["type"] == "missing":
        return bad_request("this field is required", param)
    if len(shapes) > 1 and field in _EXPECTED:
        return bad_request(f"expected {_EXPECTED[field]}", param)
    return bad_request(f"{first['msg'][0].lower()}{first['msg'][1:]}, got {_brief(first.get('input'))}", param)


def _brief(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, BaseModel) else type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def parse_request(cls: type[_Common], body: bytes) -> Any:
    """The request of a JSON body; ``APIError`` (400) for malformed JSON or a bad field."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        where = f", line {err.lineno} column {err.colno}" if isinstance(err, json.JSONDecodeError) else ""
        reason = err.msg if isinstance(err, json.JSONDecodeError) else "not UTF-8"
        raise APIError(400, f"the request body is not valid JSON ({reason}{where})") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise _validation_error(err) from None


# --- plans ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """What the served model allows (``context`` counts prompt + completion tokens)."""

    model_names: tuple[str, ...]
    vocab_size: int
    max_prompt_len: int
    context: int
    speculative: bool


@dataclass(frozen=True)
class ChoiceSpec:
    """One choice: the fields of its scheduler ``Request`` and its text options."""

    prompt: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0
    top_logprobs: int = 0  # top entries asked of the scheduler (0: no records)
    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    grammar: Optional[str] = None  # llguidance grammar the tokens must follow (runtime/serve/structured.py)


@dataclass(frozen=True)
class Plan:
    """A request's choices and how to answer it. ``logprobs`` is the number of top entries to
    report per token (None: no logprobs)."""

    kind: Literal["completion", "chat"]
    model: str
    choices: tuple[ChoiceSpec, ...]
    prompt_tokens: int
    stream: bool
    include_usage: bool
    logprobs: Optional[int]


def _check_model(model: Optional[str], limits: Limits) -> str:
    if model is None:
        return limits.model_names[0]
    if model not in limits.model_names:
        raise APIError(400, f"model: the model {model!r} does not exist (this server serves "
                            f"{', '.join(repr(m) for m in limits.model_names[:1])})", param="model",
                       code="model_not_found")
    return limits.model_names[0]


def _number(value: Optional[float], name: str, default: float, low: float, high: float, open_low: bool = False,
            what: str = "") -> float:
    if value is None:
        return default
    if not math.isfinite(value) or value > high or value < low or (open_low and value == low):
        rng = what or (f"{'above' if open_low else 'at least'} {low:g} and at most {high:g}")
        raise bad_request(f"must be {rng}, got {value!r}", name)
    return float(value)


def _unsupported(req: _Common) -> None:
    neutral: list[tuple[str, Any, Any]] = [
        ("presence_penalty", req.presence_penalty, 0.0), ("frequency_penalty", req.frequency_penalty, 0.0),
        ("repetition_penalty", req.repetition_penalty, 1.0), ("ignore_eos", req.ignore_eos, False),
    ]
    if isinstance(req, CompletionRequest):
        neutral += [("echo", req.echo, False), ("suffix", req.suffix, None)]
        if req.best_of is not None and req.best_of != (req.n or 1):
            raise bad_request("is not supported (only best_of = n)", "best_of")
    for name, value, default in neutral:
        if value is not None and value != default:
            raise bad_request(f"is not supported by this server (only {json.dumps(default)})", name)
    if req.logit_bias:
        raise bad_request("is not supported by this server", "logit_bias")


def _stops(stop: Union[str, list[str], None]) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", "stop")
    if any(not s for s in stops):
        raise bad_request("a stop string must not be empty", "stop")
    return stops


def _choices(req: _Common, prompts: list[list[int]], max_tokens: int, top: int, limits: Limits
             ) -> tuple[ChoiceSpec, ...]:
    """The P x n choices (sampling fields checked)."""
    temperature = _number(req.temperature, "temperature", 0.0, 0.0, 2.0)
    top_p = _number(req.top_p, "top_p", 1.0, 0.0, 1.0, open_low=True)
    min_p = _number(req.min_p, "min_p", 0.0, 0.0, 1.0)
    top_k = 0 if req.top_k is None or req.top_k == -1 else req.top_k
    if top_k < 0:
        raise bad_request(f"must be at least 0 (0 or -1: off), got {req.top_k}", "top_k")
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_N:
        raise bad_request(f"must be between 1 and {MAX_N}, got {n}", "n")
    if req.seed is not None and not -MAX_SEED <= req.seed <= MAX_SEED:
        raise bad_request(f"must be between -2**62 and 2**62, got {req.seed}", "seed")
    seed = req.seed if req.seed is not None else secrets.randbits(40)
    stops = _stops(req.stop)
    skip = True if req.skip_special_tokens is None else req.skip_special_tokens
    out = []
    for p, prompt in enumerate(prompts):
        for j in range(n):
            k = p * n + j
            out.append(ChoiceSpec(tuple(prompt), max_tokens, temperature, top_p, top_k, min_p,
                                  seed + k * REQUEST_SEED_STRIDE, top, stops, skip))
    return tuple(out)


def _max_tokens(value: Optional[int], name: str, longest: int, default: Optional[int], limits: Limits) -> int:
    room = limits.context - longest
    if value is None:
        return max(1, min(default, room) if default is not None else room)
    if value < 1:
        raise bad_request(f"must be at least 1, got {value}", name)
    if value > room:
        raise bad_request(f"{value} is more than the context leaves: the prompt has {longest} tokens and the "
                          f"model's context is {limits.context} tokens (prompt and completion)", name)
    return value


def _check_prompt(tokens: list[int], param: str, limits: Limits) -> None:
    if not tokens:
        raise bad_request("the prompt is empty (encodes to no tokens)", param)
    bad = [t for t in tokens if not 0 <= t < limits.vocab_size]
    if bad:
        raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {limits.vocab_size})", param)
    if len(tokens) > limits.max_prompt_len:
        raise bad_request(f"the prompt has {len(tokens)} tokens, more than the context allows (at most "
                          f"{limits.max_prompt_len} prompt tokens for this model)", param, "context_length_exceeded")


def _stream_flags(req: _Common) -> tuple[bool, bool]:
    stream = bool(req.stream)
    if req.stream_options is not None and not stream:
        raise bad_request("only allowed with stream: true", "stream_options")
    return stream, bool(req.stream_options and req.stream_options.include_usage)


def completion_plan(req: CompletionRequest, tokenizer: Any, limits: Limits) -> Plan:
    """The plan of a completions request (``tokenizer``: a ``TextTokenizer``)."""
    model = _check_model(req.model, limits)
    _unsupported(req)
    raw = req.prompt
    if isinstance(raw, list) and not raw:
        raise bad_request("the prompt is empty", "prompt")
    texts: list[Union[str, list[int]]]
    if isinstance(raw, str):
        texts = [raw]
    elif isinstance(raw[0], int):
        texts = [list(raw)]
    else:
        texts = list(raw)
    prompts: list[list[int]] = []
    for i, item in enumerate(texts):
        param = "prompt" if len(texts) == 1 else f"prompt[{i}]"
        tokens = tokenizer.encode(item) if isinstance(item, str) else list(item)
        _check_prompt(tokens, param, limits)
        prompts.append(tokens)
    top: Optional[int] = None
    if req.logprobs is not None:
        if not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(f"must be between 0 and {MAX_TOP_LOGPROBS}, got {req.logprobs}", "logprobs")
        top = req.logprobs
    max_tokens = _max_tokens(req.max_tokens, "max_tokens", max(len(p) for p in prompts), 16, limits)
    choices = _choices(req, prompts, max_tokens, 0 if top is None else max(top, 1), limits)
    stream, usage = _stream_flags(req)
    return Plan("completion", model, choices, sum(len(p) for p in prompts), stream, usage, top)


def _message_text(message: ChatMessage, i: int) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise bad_request(f"only text parts are supported, got type {part.type!r}",
                              f"messages[{i}].content[{j}]")
        parts.append(part.text)
    return "".join(parts)


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The conversation as the chat template takes it (content parts joined into text; an
    assistant's ``tool_calls`` and a tool reply's ``tool_call_id`` kept, runtime/serve/tools.py)."""
    from fxsched.runtime.serve.tools import template_message_fields

    if not req.messages:
        raise bad_request("at least one message is required", "messages")
    out = []
    for i, message in enumerate(req.messages):
        entry = {"role": message.role, "content": _message_text(message, i)}
        if message.name is not None:
            entry["name"] = message.name
        entry.update(template_message_fields(message))
        out.append(entry)
    return out


def chat_plan(req: ChatCompletionRequest, tokenizer: Any, limits: Limits,
              tools: Optional[list[dict[str, Any]]] = None) -> Plan:
    """The plan of a chat completions request (the prompt through the model's chat template, which
    gets ``tools``: runtime/serve/tools.py)."""
    from fxsched.runtime.text import TokenizerError

    model = _check_model(req.model, limits)
    _unsupported(req)
    messages = chat_messages(req)
    kwargs: Mapping[str, Any] = req.chat_template_kwargs or {}
    generation_prompt = True if req.add_generation_prompt is None else req.add_generation_prompt
    try:
        tokens = tokenizer.encode_chat(messages, generation_prompt, **{**kwargs, **({"tools": tools} if tools else {})})
    except TokenizerError as err:
        raise bad_request(str(err), "messages") from None
    _check_prompt(tokens, "messages", limits)
    top: Optional[int] = None
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"must be between 0 and {MAX_TOP_LOGPROBS}, got {req.top_logprobs}", "top_logprobs")
    if req.top_logprobs and not req.logprobs:
        raise bad_request("needs logprobs: true", "top_logprobs")
    if req.logprobs:
        top = req.top_logprobs or 0
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise bad_request("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
    name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    value = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = _max_tokens(value, name, len(tokens), None, limits)
    choices = _choices(req, [tokens], max_tokens, 0 if top is None else max(top, 1), limits)
    stream, usage = _stream_flags(req)
    return Plan("chat", model, choices, len(tokens), stream, usage, top)
