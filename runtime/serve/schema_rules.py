"""What ``/openapi.json`` says a request may hold (specs/serve-fields.md §13.5): the request models'
schemas narrowed to the values the server accepts, field by field, so that a client generated from
the document, a reader of ``/docs`` or a schema-driven fuzzer (schemathesis) learns the rules the
plan checks instead of discovering them as 400s.

What is stated, each from the constant or table the check itself reads (runtime/serve/
sampling_fields.py, request_models.py, responses.py): the sampling numbers' ranges, ``n``, ``seed``,
``top_k``, the logprob widths, the budgets' floors; stop strings (non-empty, at most
``MAX_STOP_STRINGS``); token ids inside the served vocabulary (prompts, ``stop_token_ids``,
``/detokenize``); ``logit_bias`` keys and values; prompts and message lists that are not empty;
a field declared but not honoured (``REFUSED``) takes only its neutral values; ``/tokenize`` takes
``prompt`` or ``messages``, one of them; the Responses API's input items are the three shapes it
maps (a message of a known role with text content, a function call, a function call's output).

What a schema cannot say, and stays a 400 the document describes in words: rules between two
fields or between a field and the tokenized prompt (``max_tokens`` against the context the prompt
leaves, ``min_tokens`` <= ``max_tokens``, ``best_of`` = ``n``, ``top_logprobs`` needs
``logprobs``, ``stream_options`` needs ``stream``, ``max_tokens`` 0 only with ``echo``).
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from fxsched.runtime.serve.guard import RESERVED_TEMPLATE_KWARGS
from fxsched.runtime.serve.request_models import REFUSED
from fxsched.runtime.serve.sampling_fields import (
    FLOAT_BOUNDS,
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_SEED,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    Limits,
)

_SAMPLED = ("CompletionRequest", "ChatCompletionRequest")


def _branches(prop: dict[str, Any]) -> list[dict[str, Any]]:
    """The schemas a property's value may take other than null (an Optional is ``anyOf [T, null]``)."""
    if "anyOf" in prop:
        return [b for b in prop["anyOf"] if b.get("type") != "null"]
    return [prop]


def _narrow(schema: dict[str, Any], field: str, **rules: Any) -> None:
    """Add ``rules`` to every non-null shape of ``field`` (skipped where the model lacks it)."""
    prop = schema.get("properties", {}).get(field)
    if prop is None:
        return
    for branch in _branches(prop):
        branch.update(rules)


def _only(schema: dict[str, Any], field: str, values: Sequence[Any], empties: bool = False) -> None:
    """``field`` takes only ``values`` (a declared field the server does not honour); with ``empties``
    a neutral None admits the empty list or object too where the field's type is one
    (``check_refused``'s rule)."""
    prop = schema.get("properties", {}).get(field)
    if prop is None:
        return
    shapes = {b.get("type", "any") for b in _branches(prop)}
    allowed = [v for v in values if v is not None]
    if empties and None in values:
        allowed += [[]] * bool(shapes & {"array", "any"}) + [{}] * bool(shapes & {"object", "any"})
    kept = {k: prop[k] for k in ("title", "default") if k in prop}
    prop.clear()
    prop.update(kept, enum=[*allowed, None], description="declared so a client learns it is not honoured: "
                "any other value is a 400 naming this field")


def _ids(vocab: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": 0, "maximum": vocab - 1}


def _float_bound(schema: dict[str, Any], field: str) -> None:
    bound = FLOAT_BOUNDS[field]
    low = {"exclusiveMinimum": bound.low} if bound.open_low else {"minimum": bound.low}
    _narrow(schema, field, maximum=bound.high, **low)


def _sampling(schema: dict[str, Any], limits: Limits) -> None:
    for field in FLOAT_BOUNDS:
        _float_bound(schema, field)
    _narrow(schema, "n", minimum=1, maximum=MAX_N)
    _narrow(schema, "seed", minimum=-MAX_SEED, maximum=MAX_SEED)
    _narrow(schema, "top_k", minimum=-1, description="-1 or 0: off")
    _narrow(schema, "min_tokens", minimum=0, description="at most max_tokens")
    _narrow(schema, "prompt_logprobs", minimum=0, maximum=MAX_TOP_LOGPROBS)
    _narrow(schema, "top_logprobs", minimum=0, maximum=MAX_TOP_LOGPROBS, description="needs logprobs: true")
    _narrow(schema, "max_completion_tokens", minimum=1, description="at most the context the prompt leaves")
    prop = schema["properties"].get("stop")
    if prop is not None:
        for branch in _branches(prop):
            if branch.get("type") == "string":
                branch["minLength"] = 1
            elif branch.get("type") == "array":
                branch.update(maxItems=MAX_STOP_STRINGS, items={"type": "string", "minLength": 1})
    _narrow(schema, "stop_token_ids", maxItems=MAX_STOP_TOKEN_IDS, items=_ids(limits.vocab_size))
    _narrow(schema, "logit_bias", maxProperties=MAX_LOGIT_BIAS, propertyNames={"pattern": "^[0-9]+$"},
            additionalProperties={"type": "number", "minimum": -100, "maximum": 100},
            description=f"token id (a decimal string below {limits.vocab_size}) -> bias")
    _narrow(schema, "stream_options", description="only with stream: true")
    for field, neutral in REFUSED:
        _only(schema, field, [neutral], empties=True)
    _narrow(schema, "chat_template_kwargs", propertyNames={"not": {"enum": list(RESERVED_TEMPLATE_KWARGS)}})


def _completion(schema: dict[str, Any], limits: Limits) -> None:
    _narrow(schema, "logprobs", minimum=0, maximum=MAX_TOP_LOGPROBS)
    _narrow(schema, "max_tokens", minimum=0, description="0 only with echo; at most the context the prompt leaves")
    _narrow(schema, "best_of", minimum=1, maximum=MAX_N, description="only equal to n")
    ids = _ids(limits.vocab_size)
    for branch in _branches(schema["properties"]["prompt"]):
        if branch.get("type") == "string":
            branch["minLength"] = 1
            continue
        items = branch["items"]
        if items.get("type") == "string":
            items["minLength"] = 1
        elif items.get("type") == "integer":
            items.update(ids)
        else:
            items.update(minItems=1, items=ids)
        branch["minItems"] = 1


def _chat(schema: dict[str, Any]) -> None:
    _narrow(schema, "messages", minItems=1)
    _narrow(schema, "max_tokens", minimum=1, description="at most the context the prompt leaves")


def _tokenize(schema: dict[str, Any]) -> None:
    """``prompt`` (a string) or ``messages`` (at least one), never both; the template's fields only
    with ``messages``."""
    _narrow(schema, "messages", minItems=1)
    _narrow(schema, "chat_template_kwargs",
            propertyNames={"not": {"enum": ["messages", "add_generation_prompt", "tools"]}})
    template_only = {f: {"type": "null"} for f in ("add_generation_prompt", "tools", "chat_template_kwargs")}
    schema["oneOf"] = [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"},
                                                **template_only}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}, "prompt": {"type": "null"},
                                                  "continue_final_message": {"enum": [False, None]}}},
    ]


def _input_items(roles: Iterable[str], text_parts: Iterable[str]) -> dict[str, Any]:
    """The Responses input items the server takes (responses.py ``input_messages``): a message of
    a role it maps, with text content; a function call; a function call's output."""
    part = {"type": "object", "required": ["type", "text"],
            "properties": {"type": {"enum": list(text_parts)}, "text": {"type": "string"}}}
    text = {"anyOf": [{"type": "string"}, {"type": "array", "items": part}]}
    string = {"type": "string"}
    return {"oneOf": [
        {"type": "object", "required": ["role", "content"],
         "properties": {"type": {"enum": ["message"]}, "role": {"enum": list(roles)}, "content": text}},
        {"type": "object", "required": ["type", "call_id", "name", "arguments"],
         "properties": {"type": {"enum": ["function_call"]}, "call_id": string, "name": string, "arguments": string}},
        {"type": "object", "required": ["type", "call_id", "output"],
         "properties": {"type": {"enum": ["function_call_output"]}, "call_id": string, "output": text}},
    ]}


def _responses(schema: dict[str, Any], refused: Iterable[tuple[str, tuple[Any, ...]]], roles: Iterable[str],
               text_parts: Iterable[str]) -> None:
    for field in ("temperature", "top_p"):
        _float_bound(schema, field)
    _narrow(schema, "max_output_tokens", minimum=1, description="at most the context the input leaves")
    for branch in _branches(schema["properties"]["input"]):
        if branch.get("type") == "array":
            branch.update(minItems=1, items=_input_items(roles, text_parts))
    for field, neutral in refused:
        _only(schema, field, neutral)


def narrow(schemas: dict[str, Any], limits: Limits) -> None:
    """Narrow the request models' schemas in ``schemas`` (``components.schemas`` of the document,
    with every request model already in it) to what a request to this server may hold."""
    from fxsched.runtime.serve.responses import REFUSED as RESPONSES_REFUSED, ROLES, TEXT_PARTS

    for name in _SAMPLED:
        _sampling(schemas[name], limits)
    _completion(schemas["CompletionRequest"], limits)
    _chat(schemas["ChatCompletionRequest"])
    _tokenize(schemas["TokenizeRequest"])
    _narrow(schemas["DetokenizeRequest"], "tokens", items=_ids(limits.vocab_size))
    _responses(schemas["ResponsesRequest"], RESPONSES_REFUSED, ROLES, TEXT_PARTS)
