"""Structured output for ``fxsched serve``: the request fields that constrain a choice's tokens to
a grammar, and the grammar each becomes (llguidance's grammar format); serve.md §12.1.

Fields (one of them per request; two are a 400 naming the second):

* ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` (any
  JSON object), ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``;
* vLLM's ``structured_outputs``: ``{"json": schema, "regex": str, "choice": [str, ...],
  "grammar": str, "json_object": true}`` (one key), and its older top-level spellings
  ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` (``guided_decoding_backend``
  is accepted and ignored: there is one backend; ``guided_whitespace_pattern`` is refused,
  request_models.REFUSED). All are declared request fields (request_models.py's field policy);
* ``tool_choice`` ``"required"`` or a named function (runtime/serve/tools.py makes the grammar).

Why llguidance (not xgrammar): it computes each mask lazily from the grammar (an Earley parser over
a lexer; no ahead-of-time compilation of the schema against the whole vocabulary), so a new schema
costs microseconds to milliseconds at the first token rather than a compile step, and a
speculative verify's path masks cost one mask per row; it has no Python dependencies (one Rust
wheel, no torch build step), takes JSON schema, regex, Lark and GBNF (``guided_grammar`` is either,
as vLLM's llguidance backend takes it), and its matcher rolls back consumed tokens, which is what
rejected drafts need.

JSON whitespace: compact (``whitespace_flexible`` off, as OpenAI's strict outputs read) unless the
schema's ``x-guidance`` asks otherwise: a small model given free whitespace can spend its whole
budget on it.

Checks: the shape of each field (400 naming it), then the grammar itself against the served
tokenizer (``check``: an invalid schema, regex or grammar is a 400 naming the field, with
llguidance's first error line). ``check`` builds a matcher, which can take a while for a large
grammar: the HTTP layer runs it off the event loop.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from fxsched.runtime.serve.request_models import APIError, bad_request

JSON_DEFAULTS: Any = {"whitespace_flexible": False}  # llguidance's JsonCompileOptions (a TypedDict)
MAX_GRAMMAR_CHARS = 1 << 20  # a grammar or schema of more characters is refused
MAX_CHOICES = 1024


@dataclass(frozen=True)
class Constraint:
    """A choice's grammar: ``grammar`` is llguidance's grammar text; ``param`` the field it came from."""

    kind: str
    param: str
    grammar: str


def _schema_text(value: Any, param: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise bad_request(f"is not valid JSON ({err.msg})", param) from None
    if not isinstance(value, (dict, bool)):
        raise bad_request(f"must be a JSON schema (an object), got {type(value).__name__}", param)
    text = json.dumps(value)
    if len(text) > MAX_GRAMMAR_CHARS:
        raise bad_request(f"is too large ({len(text)} characters, at most {MAX_GRAMMAR_CHARS})", param)
    return text


def json_grammar(schema: Any, param: str) -> str:
    """The llguidance grammar of a JSON schema (compact whitespace unless the schema says otherwise)."""
    from llguidance import LLMatcher

    text = _schema_text(schema, param)
    try:
        return LLMatcher.grammar_from_json_schema(text, defaults=JSON_DEFAULTS)
    except ValueError as err:
        raise bad_request(f"is not a valid JSON schema: {_first_line(err)}", param) from None


def _text(value: Any, param: str, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise bad_request(f"must be a non-empty string ({what})", param)
    if len(value) > MAX_GRAMMAR_CHARS:
        raise bad_request(f"is too large ({len(value)} characters, at most {MAX_GRAMMAR_CHARS})", param)
    return value


def _choice_grammar(value: Any, param: str) -> str:
    from llguidance import LLMatcher

    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise bad_request("must be a non-empty list of non-empty strings", param)
    if len(value) > MAX_CHOICES:
        raise bad_request(f"at most {MAX_CHOICES} choices, got {len(value)}", param)
    return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))


def _grammar_text(value: Any, param: str) -> str:
    from llguidance import grammar_from

    text = _text(value, param, "a Lark or GBNF grammar")
    try:
        return grammar_from("grammar", text)
    except ValueError as err:
        raise bad_request(f"is not a valid grammar: {_first_line(err)}", param) from None


def _regex(value: Any, param: str) -> str:
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_regex(_text(value, param, "a regular expression"))


def _response_format(value: Any) -> Optional[Constraint]:
    param = "response_format"
    if not isinstance(value, Mapping):
        raise bad_request(f"must be an object, got {type(value).__name__}", param)
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object", param, json_grammar({"type": "object"}, param))
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, Mapping):
            raise bad_request("must be an object with a \"schema\"", "response_format.json_schema")
        schema = spec.get("schema", {"type": "object"})
        return Constraint("json", "response_format.json_schema.schema",
                          json_grammar(schema, "response_format.json_schema.schema"))
    raise bad_request(f"type must be \"text\", \"json_object\" or \"json_schema\", got {json.dumps(kind)[:60]}",
                      "response_format.type")


_MAKERS = {"json": json_grammar, "regex": _regex, "choice": _choice_grammar, "grammar": _grammar_text}


def _structured_outputs(value: Any) -> Optional[Constraint]:
    param = "structured_outputs"
    if not isinstance(value, Mapping):
        raise bad_request(f"must be an object, got {type(value).__name__}", param)
    given = [k for k in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
             if value.get(k) not in (None, False)]
    if len(given) > 1:
        raise bad_request(f"give one of json, regex, choice, grammar, json_object; got {', '.join(given)}", param)
    if not given:
        return None
    key = given[0]
    if key == "structural_tag":
        raise bad_request("is not supported by this server", "structured_outputs.structural_tag")
    if key == "json_object":
        return Constraint("json_object", f"{param}.json_object", json_grammar({"type": "object"}, param))
    return Constraint(key, f"{param}.{key}", _MAKERS[key](value[key], f"{param}.{key}"))


def constraint_of(req: Any) -> Optional[Constraint]:
    """The grammar a request's fields ask for (None: unconstrained); 400 for a malformed field or
    for two constraints at once."""
    found: list[Constraint] = []
    rf = req.response_format
    if rf is not None:
        c = _response_format(rf)
        if c is not None:
            found.append(c)
    so = req.structured_outputs
    if so is not None:
        c = _structured_outputs(so)
        if c is not None:
            found.append(c)
    for key in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{key}")
        if value is not None:
            found.append(Constraint(key, f"guided_{key}", _MAKERS[key](value, f"guided_{key}")))
    if len(found) > 1:
        raise bad_request(f"only one structured output constraint per request ({found[0].param} is given too)",
                          found[1].param)
    return found[0] if found else None


def check_compatible(req: Any) -> None:
    """400 for fields a grammar cannot honour: ``ignore_eos`` and ``min_tokens`` would mask the EOS a
    complete grammar allows alone, leaving a row with no token to pick."""
    if req.ignore_eos:
        raise bad_request("cannot be combined with structured output or a forced tool call", "ignore_eos")
    min_tokens = req.min_tokens
    if isinstance(min_tokens, int) and min_tokens > 0:
        raise bad_request("cannot be combined with structured output or a forced tool call", "min_tokens")


def grammar_tokenizer(tokenizer: Any, vocab_size: int, eos_ids: tuple[int, ...]) -> Any:
    """llguidance's view of the served tokenizer (``tokenizer``: a ``TextTokenizer``), with the
    model's logits width as its vocabulary and the scheduler's EOS ids as the grammar's end."""
    from llguidance import LLTokenizer

    return LLTokenizer(tokenizer.tokenizer.to_str(), n_vocab=vocab_size, eos_token=list(eos_ids))


def matcher(ll_tokenizer: Any, grammar: str) -> Any:
    """A fresh matcher of ``grammar`` (checked before by ``check``)."""
    from llguidance import LLMatcher

    return LLMatcher(ll_tokenizer, grammar, log_level=0)


def check(constraint: Constraint, ll_tokenizer: Any) -> None:
    """400 naming the field when the grammar is invalid for the served tokenizer."""
    from llguidance import LLMatcher

    try:
        error = LLMatcher.validate_grammar(constraint.grammar, ll_tokenizer)
    except (ValueError, RuntimeError, TypeError) as err:
        error = str(err) or type(err).__name__
    if error and not error.startswith("WARNING"):
        raise bad_request(f"invalid {constraint.kind}: {_first_line(error)}", constraint.param)


def _first_line(err: object) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    text = " ".join(lines[:3]) if lines else "invalid"
    return text if len(text) <= 300 else text[:297] + "..."


__all__ = ["APIError", "Constraint", "check", "constraint_of", "grammar_tokenizer", "json_grammar", "matcher"]
