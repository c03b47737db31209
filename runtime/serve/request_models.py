"""The request bodies of ``fxsched serve`` (pydantic models), the OpenAI error body, and the field
policy of specs/serve-fields.md §13.1, in one place:

* a known field is type-checked strictly (``"max_tokens": "5"`` or ``true`` is refused, an
  integer is a number): a 400 naming it (``param``: ``messages[1].content``);
* a field the server declares but cannot honour (``REFUSED``: ``suffix``, ``best_of`` other than
  ``n``, ``functions`` / ``function_call``, ``guided_whitespace_pattern``, beam search...) is
  refused with a 400 naming it when set to anything but its neutral value, never silently dropped
  (``check_refused``);
* an unknown field is ignored, as vLLM does (pydantic ``extra="ignore"``); ``unknown_fields``
  names them so the HTTP layer counts them (``fxsched_unknown_fields_total``).

Errors. ``APIError`` carries the HTTP status and the OpenAI error body ``{"error": {"message",
"type", "param", "code"}}``; malformed JSON or a body that is not an object is a 400 without
``param``. Range checks and the plan a request becomes are runtime/serve/sampling_fields.py's and
runtime/serve/protocol.py's.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Callable, Mapping, Optional, Sequence, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError


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


class ModelNotFound(APIError):
    """vLLM's 404 for a request naming a model this server does not serve (specs/serve.md §12.9)."""

    def __init__(self, model: str):
        super().__init__(404, f"The model `{model[:200]}` does not exist.", "NotFoundError", "model")
        # vLLM's code is the status, a number; it crosses guard.Screen's worker thread as ``code``
        self.code = 404  # type: ignore[assignment]


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    """A 400 whose message starts with the field it is about."""
    return APIError(400, f"{param}: {message}" if param else message, "invalid_request_error", param, code)


# --- request models -----------------------------------------------------------------------------


def _integral(value: Any) -> Any:
    """A number with no fraction (``5.0``) is an integer, as JSON Schema counts it; anything else
    goes to the strict check as it came (``"5"`` and ``true`` are still refused)."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


# an integer field of a request body (specs/serve-fields.md §13.1)
Int = Annotated[int, BeforeValidator(_integral)]


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
    max_tokens: Optional[Int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[Int] = None
    min_p: Optional[float] = None
    seed: Optional[Int] = None
    stop: Union[str, list[str], None] = None
    n: Optional[Int] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    ignore_eos: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    min_tokens: Optional[Int] = None
    stop_token_ids: Optional[list[Int]] = None
    include_stop_str_in_output: Optional[bool] = None
    prompt_logprobs: Optional[Int] = None
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
    allowed_token_ids: Optional[list[Int]] = None
    truncate_prompt_tokens: Optional[Int] = None


class CompletionRequest(_Common):
    prompt: Union[str, list[str], list[Int], list[list[Int]]]
    logprobs: Optional[Int] = None
    suffix: Optional[str] = None
    best_of: Optional[Int] = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[Int] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[Int] = None
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


def parse_request(cls: type[BaseModel], body: bytes, on_unknown: Optional[Callable[[list[str]], None]] = None
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


def request_from_data(cls: type[BaseModel], data: Any, on_unknown: Optional[Callable[[list[str]], None]] = None
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


# fields declared but not honoured: (name, neutral value); set to anything else they get a 400
# (structured output and tools are honoured: runtime/serve/structured.py, runtime/serve/tools.py)
REFUSED: tuple[tuple[str, Any], ...] = (
    ("suffix", None), ("use_beam_search", False), ("length_penalty", 1.0), ("guided_whitespace_pattern", None),
    ("bad_words", None), ("allowed_token_ids", None), ("truncate_prompt_tokens", None), ("functions", None),
    ("function_call", None), ("continue_final_message", False),
)


def check_refused(req: _Common) -> None:
    for name, neutral in REFUSED:
        value = getattr(req, name, None)
        if value is not None and value != neutral and not (neutral is None and value in ([], {})):
            raise bad_request(f"is not supported by this server (only {json.dumps(neutral)})", name)
    if isinstance(req, CompletionRequest) and req.best_of is not None and req.best_of != (req.n or 1):
        raise bad_request("is not supported (only best_of = n)", "best_of")
