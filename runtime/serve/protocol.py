"""The OpenAI wire protocol of ``fxsched serve``: the plan a request becomes (the scheduler requests
of its choices). No HTTP framework here: pydantic only. In three modules, by concern:

* runtime/serve/request_models.py: the request models, ``APIError`` and the field policy
  (``REFUSED``, unknown fields), ``parse_request`` / ``request_from_data``;
* runtime/serve/sampling_fields.py: ``Limits``, ``ChoiceSpec`` and the range checks of the sampling,
  stopping and logprob fields;
* this module: ``Plan``, ``completion_plan`` and ``chat_plan`` (prompts, chat messages, the model
  name), and every public name of the other two, re-exported (``from ...protocol import APIError``
  keeps working).

Requests. ``CompletionRequest`` (``POST /v1/completions``) and ``ChatCompletionRequest`` (``POST
/v1/chat/completions``) take the fields the OpenAI API and vLLM accept (see the classes); the field
policy (specs/serve-fields.md §13.1: strict types, ``REFUSED`` fields, unknown fields ignored and
counted) is request_models.py's.

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

from dataclasses import dataclass, replace
from typing import Any, Literal, Mapping, Optional, Union

from fxsched.runtime.serve.request_models import (
    REFUSED,
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ContentPart,
    ModelNotFound,
    StreamOptions,
    _Common,
    bad_request,
    check_refused,
    parse_request,
    request_from_data,
    unknown_fields,
)
from fxsched.runtime.serve.sampling_fields import (
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_SEED,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    REQUEST_SEED_STRIDE,
    ChoiceSpec,
    Limits,
    _choices,
    _max_tokens,
    _prompt_logprobs,
)
from fxsched.runtime.serve.tools import template_message_fields

__all__ = [
    "APIError", "ChatCompletionRequest", "ChatMessage", "ChoiceSpec", "CompletionRequest", "ContentPart", "Limits",
    "MAX_LOGIT_BIAS", "MAX_N", "MAX_SEED", "MAX_STOP_STRINGS", "MAX_STOP_TOKEN_IDS", "MAX_TOP_LOGPROBS", "Plan",
    "REFUSED", "REQUEST_SEED_STRIDE", "StreamOptions", "bad_request", "chat_messages", "chat_plan",
    "completion_plan", "parse_request", "request_from_data", "unknown_fields",
]


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
    """The model name a response reports: the first served name (no ``model``, or an empty one, as
    vLLM), or the LoRA adapter the request names (specs/lora.md §18.7); vLLM's 404 for another."""
    if not model:
        return limits.model_names[0]
    if model in limits.adapters and model not in limits.model_names:
        return model
    if model not in limits.model_names:
        raise ModelNotFound(model)
    return limits.model_names[0]


def _with_adapter(choices: tuple[ChoiceSpec, ...], model: str, limits: Limits) -> tuple[ChoiceSpec, ...]:
    """The choices run with the LoRA adapter ``model`` when the request names one."""
    if model in limits.model_names:
        return choices
    return tuple(replace(c, adapter=model) for c in choices)


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
    check_refused(req)
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
    choices = _with_adapter(_choices(req, prompts, max_tokens, 0 if top is None else max(top, 1), limits, width),
                            model, limits)
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
    check_refused(req)
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
    choices = _with_adapter(_choices(req, [tokens], max_tokens, 0 if top is None else max(top, 1), limits, asked),
                            model, limits)
    stream, usage = _stream_flags(req)
    echoes = None
    if req.echo:  # vLLM: the last message's content, when the reply continues the assistant's turn
        last = messages[-1]
        echoed = last["content"] if last["role"] == "assistant" else ""
        echoes = (echoed,) * len(choices)
    return Plan("chat", model, choices, len(tokens), stream, usage, top, echoes, False, asked)
