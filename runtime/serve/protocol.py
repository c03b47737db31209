"""The OpenAI wire protocol of ``fxsched serve``: request models, error bodies, and the plan a
request becomes (the scheduler requests of its choices). No HTTP framework here: pydantic only.

Requests. ``CompletionRequest`` (``POST /v1/completions``) and ``ChatCompletionRequest`` (``POST
/v1/chat/completions``) take the fields the OpenAI API and vLLM accept (see the classes). The
field policy (specs/serve-fields.md §13.1), in one place:

* a known field is type-checked strictly (``"max_tokens": "5"`` or ``true`` is refused, an
  integer is a number) and range-checked: a 400 naming it;
* a field the server declares but cannot honour (``REFUSED``: ``suffix``, ``best_of`` other than
  ``n``, ``functions`` / ``function_call``, ``guided_whitespace_pattern``, beam search...) is
  refused with a 400 naming it when set to anything but its neutral value, never silently dropped;
* an unknown field is ignored, as vLLM does (pydantic ``extra="ignore"``); ``unknown_fields``
  names them so the HTTP layer counts them (``fxsched_unknown_fields_total``).

Honoured beyond the sampling basics: ``echo`` (completions: the prompt's text before the
completion, with ``logprobs`` the prompt tokens' records first, the first one null, as vLLM and
OpenAI return them, and ``max_tokens: 0`` for the prompt alone; chat: vLLM's, the last message's
content before the reply when it is the assistant's), ``prompt_logprobs`` (vLLM's extension),
``ignore_eos`` (EOS masked so the choice runs to its budget), ``min_tokens``, ``stop_token_ids``,
``include_stop_str_in_output``, ``skip_special_tokens``, presence / frequency / repetition
penalties and ``logit_bias`` (vLLM's semantics, specs/serve-fields.md §13.2–4). Structured output
(``response_format``, ``structured_outputs``, ``guided_*``; ``guided_decoding_backend`` is accepted
and ignored: there is one backend) is runtime/serve/structured.py's, tool calling (``tools``,
``tool_choice``, ``parallel_tool_calls``, and the messages' ``tool_calls`` / ``tool_call_id``)
runtime/serve/tools.py's: the HTTP layer checks both and applies them to the plan (specs/serve.md
§12.1–4). Structured output stacks with penalties and ``logit_bias`` (the grammar's mask first); with
``ignore_eos`` or ``min_tokens`` > 0 it is a 400 (a complete grammar allows EOS alone).

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
from dataclasses import dataclass, replace
from typing import Any, Callable, Literal, Mapping, Optional, Sequence, Union

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
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class ContentPart(_Strict):
    type: str
    text: Optional[str] = None


class ChatMessage(_Strict):
    role: str
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[Any]] = None  # an assistant's earlier calls (runtime/serve/tools.py)
    tool_call_id: Optional[str] = None  # a tool reply's call


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
    min_tokens: Optional[int] = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: Optional[bool] = None
    prompt_logprobs: Optional[int] = None
    echo: Optional[bool] = None
    # structured output (runtime/serve/structured.py checks their shapes)
    response_format: Optional[dict[str, Any]] = None
    structured_outputs: Optional[Any] = None
    guided_json: Optional[Any] = None
    guided_regex: Optional[Any] = None
    guided_choice: Optional[Any] = None
    guided_grammar: Optional[Any] = None
    guided_decoding_backend: Optional[str] = None  # accepted and ignored: there is one backend
    # declared so a client learns they are not honoured (REFUSED), never dropped silently
    guided_whitespace_pattern: Optional[str] = None
    use_beam_search: Optional[bool] = None
    length_penalty: Optional[float] = None
    bad_words: Optional[list[str]] = None
    allowed_token_ids: Optional[list[int]] = None
    truncate_prompt_tokens: Optional[int] = None


class CompletionRequest(_Common):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = None
    suffix: Optional[str] = None
    best_of: Optional[int] = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[bool] = None
    functions: Optional[list[Any]] = None
    function_call: Optional[Any] = None
    add_generation_prompt: Optional[bool] = None
    continue_final_message: Optional[bool] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None


def unknown_fields(cls: type[BaseModel], data: Mapping[str, Any]) -> list[str]:
    """The top-level keys of a request body its model does not declare (ignored, counted)."""
    return [k for k in data if k not in cls.model_fields]


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


def parse_request(cls: type[_Common], body: bytes, on_unknown: Optional[Callable[[list[str]], None]] = None
                  ) -> Any:
    """The request of a JSON body; ``APIError`` (400) for malformed JSON or a bad field;
    ``on_unknown`` gets the names of the fields ignored (when there are any)."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        where = f", line {err.lineno} column {err.colno}" if isinstance(err, json.JSONDecodeError) else ""
        reason = err.msg if isinstance(err, json.JSONDecodeError) else "not UTF-8"
        raise APIError(400, f"the request body is not valid JSON ({reason}{where})") from None
    return request_from_data(cls, data, on_unknown)


def request_from_data(cls: type[_Common], data: Any, on_unknown: Optional[Callable[[list[str]], None]] = None
                      ) -> Any:
    """The request of a decoded JSON body; ``APIError`` (400) for a bad field; ``on_unknown`` as
    ``parse_request``'s."""
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    unknown = unknown_fields(cls, data)
    if unknown and on_unknown is not None:
        on_unknown(unknown)
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
    """One choice: the fields of its scheduler ``Request``, its per-request logits processing
    (penalties, ``logit_bias``), its text options and what it reports of its prompt.

    ``max_tokens`` 0 (``echo`` with ``max_tokens: 0``) generates nothing: the choice reports its
    prompt only. ``prompt_logprobs``: the width of the prompt tokens' records (None: none)."""

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
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    include_stop: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    prompt_logprobs: Optional[int] = None
    grammar: Optional[str] = None  # llguidance grammar the tokens must follow (runtime/serve/structured.py)

    @property
    def processed(self) -> bool:
        """Whether the rows of this choice go through a logits processor before the pick."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
                or bool(self.logit_bias))

    @property
    def scheduler_min_tokens(self) -> int:
        """``ignore_eos``: EOS masked at every position (the scheduler's ``min_tokens`` rule)."""
        return self.max_tokens if self.ignore_eos else self.min_tokens


@dataclass(frozen=True)
class Plan:
    """A request's choices and how to answer it. ``logprobs`` is the number of top entries to
    report per token (None: no logprobs); ``echo`` each choice's text shown before its completion
    (None: no echo), with ``echo_logprobs`` its prompt tokens' records in ``logprobs`` too;
    ``prompt_logprobs`` the width of vLLM's ``prompt_logprobs`` field (None: not asked)."""

    kind: Literal["completion", "chat"]
    model: str
    choices: tuple[ChoiceSpec, ...]
    prompt_tokens: int
    stream: bool
    include_usage: bool
    logprobs: Optional[int]
    echo: Optional[tuple[str, ...]] = None
    echo_logprobs: bool = False
    prompt_logprobs: Optional[int] = None


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


# fields declared but not honoured: (name, neutral value); set to anything else they get a 400
# (structured output and tools are honoured: runtime/serve/structured.py, runtime/serve/tools.py)
REFUSED: tuple[tuple[str, Any], ...] = (
    ("suffix", None), ("use_beam_search", False), ("length_penalty", 1.0), ("guided_whitespace_pattern", None),
    ("bad_words", None), ("allowed_token_ids", None), ("truncate_prompt_tokens", None), ("functions", None),
    ("function_call", None), ("continue_final_message", False),
)
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 1024


def _unsupported(req: _Common) -> None:
    for name, neutral in REFUSED:
        value = getattr(req, name, None)
        if value is not None and value != neutral and not (neutral is None and value in ([], {})):
            raise bad_request(f"is not supported by this server (only {json.dumps(neutral)})", name)
    if isinstance(req, CompletionRequest) and req.best_of is not None and req.best_of != (req.n or 1):
        raise bad_request("is not supported (only best_of = n)", "best_of")


def _stops(stop: Union[str, list[str], None]) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", "stop")
    if any(not s for s in stops):
        raise bad_request("a stop string must not be empty", "stop")
    return stops


def _token_ids(values: Optional[list[int]], name: str, limits: Limits, most: int) -> tuple[int, ...]:
    ids = tuple(values or ())
    if len(ids) > most:
        raise bad_request(f"at most {most} token ids, got {len(ids)}", name)
    bad = [t for t in ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {limits.vocab_size})", name)
    return ids


def _logit_bias(bias: Optional[dict[str, float]], limits: Limits) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: token id (a decimal string) -> bias in [-100, 100]."""
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad_request(f"at most {MAX_LOGIT_BIAS} entries, got {len(bias)}", "logit_bias")
    out = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()) or not 0 <= int(key) < limits.vocab_size:
            raise bad_request(f"keys are token ids in [0, {limits.vocab_size}), got {_brief(key)}", "logit_bias")
        if not (math.isfinite(value) and -100 <= value <= 100):
            raise bad_request(f"biases are between -100 and 100, got {value!r} for {key}", "logit_bias")
        out.append((int(key), float(value)))
    return tuple(sorted(out))


def _choices(req: _Common, prompts: list[list[int]], max_tokens: int, top: int, limits: Limits,
             prompt_logprobs: Optional[int]) -> tuple[ChoiceSpec, ...]:
    """The P x n choices (sampling fields checked)."""
    temperature = _number(req.temperature, "temperature", 0.0, 0.0, 2.0)
    top_p = _number(req.top_p, "top_p", 1.0, 0.0, 1.0, open_low=True)
    min_p = _number(req.min_p, "min_p", 0.0, 0.0, 1.0)
    presence = _number(req.presence_penalty, "presence_penalty", 0.0, -2.0, 2.0)
    frequency = _number(req.frequency_penalty, "frequency_penalty", 0.0, -2.0, 2.0)
    repetition = _number(req.repetition_penalty, "repetition_penalty", 1.0, 0.0, 2.0, open_low=True)
    bias = _logit_bias(req.logit_bias, limits)
    top_k = 0 if req.top_k is None or req.top_k == -1 else req.top_k
    if top_k < 0:
        raise bad_request(f"must be at least 0 (0 or -1: off), got {req.top_k}", "top_k")
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_N:
        raise bad_request(f"must be between 1 and {MAX_N}, got {n}", "n")
    if req.seed is not None and not -MAX_SEED <= req.seed <= MAX_SEED:
        raise bad_request(f"must be between -2**62 and 2**62, got {req.seed}", "seed")
    min_tokens = req.min_tokens or 0
    if not 0 <= min_tokens <= max_tokens:
        raise bad_request(f"must be between 0 and max_tokens ({max_tokens}), got {min_tokens}", "min_tokens")
    stop_ids = _token_ids(req.stop_token_ids, "stop_token_ids", limits, MAX_STOP_TOKEN_IDS)
    seed = req.seed if req.seed is not None else secrets.randbits(40)
    stops = _stops(req.stop)
    skip = True if req.skip_special_tokens is None else req.skip_special_tokens
    fields = dict(stop=stops, skip_special_tokens=skip, min_tokens=min_tokens, ignore_eos=bool(req.ignore_eos),
                  stop_token_ids=stop_ids, include_stop=bool(req.include_stop_str_in_output),
                  presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition,
                  logit_bias=bias, prompt_logprobs=prompt_logprobs)
    out = []
    for p, prompt in enumerate(prompts):
        for j in range(n):
            k = p * n + j
            spec = ChoiceSpec(tuple(prompt), max_tokens, temperature, top_p, top_k, min_p,
                              seed + k * REQUEST_SEED_STRIDE, top, **fields)  # type: ignore[arg-type]
            if spec.processed and not spec.top_logprobs:
                # a processed row must be picked on the host path (a greedy row is the raw argmax)
                spec = replace(spec, top_logprobs=1)
            out.append(spec)
    return tuple(out)


def _prompt_logprobs(value: Optional[int]) -> Optional[int]:
    if value is None:
        return None
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise bad_request(f"must be between 0 and {MAX_TOP_LOGPROBS}, got {value}", "prompt_logprobs")
    return value


def _max_tokens(value: Optional[int], name: str, longest: int, default: Optional[int], limits: Limits,
                low: int = 1) -> int:
    room = limits.context - longest
    if value is None:
        return max(1, min(default, room) if default is not None else room)
    if value < low:
        raise bad_request(f"must be at least {low}{' (0: with echo only)' if low == 1 else ''}, got {value}", name)
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
    echo = bool(req.echo)
    longest = max(len(p) for p in prompts)
    max_tokens = _max_tokens(req.max_tokens, "max_tokens", longest, 16, limits, low=0 if echo else 1)
    asked = _prompt_logprobs(req.prompt_logprobs)
    width = None if asked is None and not (echo and top is not None) else max(asked or 0, top or 0)
    choices = _choices(req, prompts, max_tokens, 0 if top is None else max(top, 1), limits, width)
    stream, usage = _stream_flags(req)
    echoes = None
    if echo:
        n = len(choices) // len(prompts)
        texts_of = [item if isinstance(item, str) else tokenizer.decode(list(item), skip_special_tokens=False)
                    for item in texts]
        echoes = tuple(texts_of[k // n] for k in range(len(choices)))
    return Plan("completion", model, choices, sum(len(p) for p in prompts), stream, usage, top, echoes,
                echo and top is not None, asked)


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
    asked = _prompt_logprobs(req.prompt_logprobs)
    choices = _choices(req, [tokens], max_tokens, 0 if top is None else max(top, 1), limits, asked)
    stream, usage = _stream_flags(req)
    echoes = None
    if req.echo:  # vLLM: the last message's content, when the reply continues the assistant's turn
        last = messages[-1]
        echoed = last["content"] if last["role"] == "assistant" else ""
        echoes = (echoed,) * len(choices)
    return Plan("chat", model, choices, len(tokens), stream, usage, top, echoes, False, asked)
