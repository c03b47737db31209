"""The front door of ``fxsched serve``: who may call (API key, Host, Origin), what a body may be
(JSON only, bounded in bytes), and what a request must not do to its neighbours (a prompt measured
and tokenized off the event loop, under a bound in characters). The rules: serve-security.md §14.1.

Two ASGI layers wrap the app (``install``):

* ``HostGuard`` (outermost; on a loopback bind only): a ``Host`` header that does not name this
  machine by a loopback name (``localhost``, ``127.0.0.1``, ``[::1]``...) gets 400, so a web page
  that rebinds its own DNS name to 127.0.0.1 cannot talk to the server;
* ``RequestGuard``: every route but ``/health`` (and ``/metrics`` with ``metrics_open``) needs
  ``Authorization: Bearer KEY`` when a key is set (401 otherwise; the keys are compared in
  constant time); a request that carries an ``Origin`` not in ``allowed_origins`` gets 403;
  a POST/PUT/PATCH to a route that takes it must say ``Content-Type: application/json`` (415
  otherwise: a browser sends ``text/plain`` or a form without asking first, never JSON; a method or
  path no route takes gets the app's 405 or 404, its body unread); a body over ``max_request_bytes`` gets
  413, from its ``Content-Length`` before a byte is read, or while it streams in (chunked): the
  server never holds more than the limit of one body.

With ``allowed_origins`` Starlette's ``CORSMiddleware`` sits between the two and answers the
browsers' preflights for those origins; without, no CORS header is ever sent.

``Screen`` turns a body into a plan on a worker thread (``anyio.to_thread``, at most
``PLANNERS`` at once): the JSON is decoded with bounds (integers of at most ``MAX_INT_DIGITS``
digits, ``MAX_JSON_DEPTH`` levels, no lone surrogate in any string), every problem a 400 naming
the field; then each prompt is measured in characters before anything is tokenized (at most
``max_prompt_chars``: the model's longest prompt in tokens x ``chars_per_token``, an upper bound
of the characters one token of the vocabulary covers, doubled), and a text longer than
``CHUNK_CHARS`` is first counted in chunks, letting go of the interpreter between them, and refused
as soon as the count passes twice the longest prompt; only a text that may fit is tokenized whole.
So a 10 MB prompt costs the server a ``len()`` and a 400, and neither ``/health`` nor a running
stream waits for it.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence, TypeVar

import anyio
import structlog
from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from fxsched.runtime.serve.protocol import APIError, Plan, bad_request

log = structlog.get_logger("fxsched.serve.guard")

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
MAX_INT_DIGITS = 100  # a JSON integer longer than this is refused (Python refuses 4300 digits itself)
MAX_JSON_DEPTH = 64  # levels of nesting of a request body
CHUNK_CHARS = 8192  # a text longer than this is counted in chunks before it is tokenized whole
PLANNERS = 4  # bodies decoded and tokenized at once (each holds up to max_request_bytes)
OPEN_PATHS = ("/health",)
BODY_METHODS = ("POST", "PUT", "PATCH")
RESERVED_TEMPLATE_KWARGS = ("messages", "add_generation_prompt")
_LOOPBACK_NAMES = ("localhost", "localhost.", "ip6-localhost", "ip6-loopback")
_SURROGATE = re.compile("[\ud800-\udfff]")

T = TypeVar("T")


# what the front door (specs/serve-security.md §14.1) and the engine answer a
# JSON route besides its 200, each with the OpenAI error body: documented so that a client or a
# schema-driven fuzzer (schemathesis) finds every status the route can give in /openapi.json
REFUSALS: dict[int | str, dict[str, Any]] = {
    "401": {"description": "--api-key is set and the request lacks its bearer token"},
    "403": {"description": "a browser origin not in --allowed-origins"},
    "404": {"description": "`model` names no served model (vLLM's NotFoundError), or the route is not served"},
    "413": {"description": "the body is larger than --max-request-bytes"},
    "415": {"description": "the body is not sent as application/json"},
    "429": {"description": "the waiting queue is full (--max-waiting)"},
    "503": {"description": "the server is draining or its engine stopped"},
}


def openapi_body(model: type) -> dict[str, Any]:
    """A JSON route's ``openapi_extra``: its request body (the body is parsed by the route, so
    FastAPI does not see it from the signature), its 400 and the refusals above."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}},
        "responses": {"400": {"description": "A bad field: the OpenAI error body, ``param`` names it"}, **REFUSALS}}


@dataclass(frozen=True)
class Policy:
    """What the front door lets in (see the module docstring); ``seed`` seeds the requests that give
    none (``--seed``: a server started twice answers the same requests alike)."""

    api_key: Optional[str] = None
    metrics_open: bool = False
    allowed_origins: tuple[str, ...] = ()
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    check_host: bool = False
    seed: Optional[int] = None


def is_loopback(host: str) -> bool:
    """Whether a bind address (or a Host header's name) is this machine's loopback."""
    name = host.strip().lower()
    if name in _LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name of a ``Host`` header (``[::1]:8000`` -> ``::1``, ``localhost:80`` -> ``localhost``)."""
    value = header.strip()
    if value.startswith("["):
        return value[1:].split("]", 1)[0]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def _refusal(status: int, message: str, code: str, kind: str = "invalid_request_error",
             headers: Optional[dict[str, str]] = None) -> JSONResponse:
    return JSONResponse(APIError(status, message, kind, None, code).body(), status_code=status, headers=headers)


# --- ASGI layers ------------------------------------------------------------------------------------


class HostGuard:
    """400 for a ``Host`` that is not a loopback name (installed on a loopback bind only)."""

    def __init__(self, app: Any, policy: Policy):
        self.app = app
        self.policy = policy

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.policy.check_host:
            host = Headers(scope=scope).get("host")
            if host is not None and not is_loopback(host_name(host)):
                response = _refusal(400, f"Host {host[:100]!r}: this server listens on loopback and answers "
                                         f"only localhost, 127.0.0.1 or [::1]", "invalid_host")
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


class RequestGuard:
    """API key, Origin, Content-Type and body size (see the module docstring)."""

    def __init__(self, app: Any, policy: Policy, router: Any = None):
        self.app = app
        self.policy = policy
        self.router = router  # the app's router: a body is checked only for a route that takes it
        self._key = hashlib.sha256(policy.api_key.encode()).digest() if policy.api_key else None
        self._open = OPEN_PATHS + (("/metrics",) if policy.metrics_open else ())

    def authorized(self, headers: Headers) -> bool:
        if self._key is None:
            return True
        scheme, _, token = headers.get("authorization", "").strip().partition(" ")
        given = hashlib.sha256(token.strip().encode("utf-8", "surrogateescape")).digest()
        return hmac.compare_digest(given, self._key) and scheme.lower() == "bearer"

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        takes_body = scope["method"] in BODY_METHODS and self._routed(scope)
        refusal = self._check(scope, headers, takes_body)
        if refusal is None and takes_body:
            body, refusal = await self._read(receive, headers)
            if body is not None:
                return await self.app(scope, _replay(body, receive), send)
            if refusal is None:
                return  # the client went away
        if refusal is not None:
            return await refusal(scope, receive, send)
        await self.app(scope, receive, send)

    def _routed(self, scope) -> bool:
        """Whether a route takes this method at this path; else the app answers its 404 or 405
        (with ``Allow``) without the body being read or its type judged."""
        if self.router is None:
            return True
        from starlette.routing import Match

        return any(route.matches(scope)[0] == Match.FULL for route in self.router.routes)

    def _check(self, scope, headers: Headers, takes_body: bool) -> Optional[JSONResponse]:
        if scope["path"] not in self._open and not self.authorized(headers):
            return _refusal(401, "a valid API key is needed: send the header 'Authorization: Bearer KEY'",
                            "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        origin = headers.get("origin")
        if origin is not None and origin not in self.policy.allowed_origins and "*" not in self.policy.allowed_origins:
            return _refusal(403, f"Origin {origin[:100]!r}: cross-origin requests are refused (start the server "
                                 f"with --allowed-origins to let a web page call it)", "origin_not_allowed")
        if takes_body:
            kind = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if kind != "application/json":
                shown = f"Content-Type {kind!r}" if kind else "no Content-Type"
                return _refusal(415, f"{shown}: the body must be JSON, sent with Content-Type: application/json",
                                "unsupported_media_type")
            length = headers.get("content-length")
            if length is not None and (not length.isdigit() or len(length) > 18):
                return _refusal(400, f"Content-Length {length[:40]!r}: not a number of bytes", "invalid_length")
            if length is not None and int(length) > self.policy.max_request_bytes:
                return self._too_large(int(length))
        return None

    def _too_large(self, size: Optional[int]) -> JSONResponse:
        what = f"of {size} bytes" if size is not None else "sent"
        return _refusal(413, f"the request body {what} is larger than this server takes (at most "
                             f"{self.policy.max_request_bytes} bytes: --max-request-bytes)", "request_too_large",
                        headers={"Connection": "close"})

    async def _read(self, receive, headers: Headers) -> tuple[Optional[bytes], Optional[JSONResponse]]:
        """The whole body, or a 413 once it passes the limit (nothing more is read)."""
        limit = self.policy.max_request_bytes
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None, None
            body += message.get("body", b"")
            if len(body) > limit:
                del body
                return None, self._too_large(None)
            if not message.get("more_body", False):
                return bytes(body), None


def _replay(body: bytes, receive):
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def install(app: Any, policy: Policy) -> None:
    """Wrap a Starlette/FastAPI ``app`` in the layers of the module docstring."""
    from starlette.middleware.cors import CORSMiddleware

    app.add_middleware(RequestGuard, policy=policy, router=app.router)  # innermost: added first
    if policy.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(policy.allowed_origins),
                           allow_methods=["GET", "POST"], allow_headers=["authorization", "content-type"])
    app.add_middleware(HostGuard, policy=policy)


# --- bodies and prompts -------------------------------------------------------------------------------


class _Digits:
    """A JSON integer too long to convert (its digit count), found again by ``_walk``."""

    def __init__(self, text: str):
        self.digits = len(text.lstrip("-"))


def _parse_int(text: str) -> Any:
    return _Digits(text) if len(text) > MAX_INT_DIGITS else int(text)


def decode_body(body: bytes) -> Any:
    """The JSON of a body, or a 400 naming the field: malformed JSON, an integer of more than
    ``MAX_INT_DIGITS`` digits, more than ``MAX_JSON_DEPTH`` levels, a string with a lone surrogate."""
    try:
        data = json.loads(body, parse_int=_parse_int)
    except json.JSONDecodeError as err:
        raise APIError(400, f"the request body is not valid JSON ({err.msg}, line {err.lineno} column "
                            f"{err.colno})") from None
    except UnicodeDecodeError:
        raise APIError(400, "the request body is not valid JSON (not UTF-8)") from None
    except RecursionError:
        where = _deep_path(body)
        raise bad_request(f"nested too deeply (at most {MAX_JSON_DEPTH} levels in a request)", where) from None
    _walk(data)
    return data


_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}:,]')
MAX_SCAN_TOKENS = 1_000_000


def _deep_path(body: bytes) -> Optional[str]:
    """The field where a body too deep for ``json.loads`` passes ``MAX_JSON_DEPTH`` levels (None
    when it cannot be told within ``MAX_SCAN_TOKENS`` tokens)."""
    stack: list[list[Any]] = []  # [opener, key or index]
    key: Any = None
    for n, match in enumerate(_TOKENS.finditer(body)):
        if n > MAX_SCAN_TOKENS:
            return None
        token = match.group()
        if token in (b"{", b"["):
            stack.append([token, None if token == b"{" else 0])
            if len(stack) > MAX_JSON_DEPTH:
                path = ""
                for _, k in stack[:-1]:
                    path = _path(path, k)
                return path or None
        elif token in (b"}", b"]"):
            if stack:
                stack.pop()
        elif token == b",":
            if stack and stack[-1][0] == b"[":
                stack[-1][1] += 1
        elif token == b":":
            if stack:
                stack[-1][1] = key
        else:
            try:
                key = json.loads(token)
            except ValueError:
                key = "?"
    return None


def _path(parent: str, key: Any) -> str:
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}.{key}" if parent else str(key)


def _walk(data: Any) -> None:
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise bad_request(f"nested too deeply (at most {MAX_JSON_DEPTH} levels in a request)", path or None)
        if isinstance(value, str):
            if not value.isascii() and _SURROGATE.search(value):
                raise bad_request("the text contains a lone surrogate (an escape such as \\ud800 that is not "
                                  "half of a pair): not valid Unicode", path or None)
        elif isinstance(value, _Digits):
            raise bad_request(f"a number of {value.digits} digits (at most {MAX_INT_DIGITS})", path or None)
        elif isinstance(value, dict):
            for key, item in value.items():
                where = _path(path, key)
                if not key.isascii() and _SURROGATE.search(key):
                    raise bad_request("the key contains a lone surrogate: not valid Unicode", path or None)
                stack.append((item, where, depth + 1))
        elif isinstance(value, list):
            stack.extend((item, _path(path, i), depth + 1) for i, item in enumerate(value))


def chars_per_token(tokenizer: Any) -> int:
    """An upper bound of the characters one token covers: the longest entry of the vocabulary
    (a byte-level BPE token of n symbols covers at most n bytes, so at most n characters), doubled
    for normalizers that fold characters together; 64 when the vocabulary cannot be read."""
    try:
        vocab = tokenizer.tokenizer.get_vocab(with_added_tokens=True)
        longest = max((len(token) for token in vocab), default=0)
    except Exception:  # noqa: BLE001 — a tokenizer without the tokenizers API
        return 64
    return 2 * max(longest, 1)


def _texts(data: dict[str, Any]) -> Iterable[tuple[str, str]]:
    """(field, text) of the prompt texts of a decoded completions body (of any shape: the protocol
    checks the types)."""
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        yield "prompt", prompt
    elif isinstance(prompt, list):
        for i, item in enumerate(prompt):
            if isinstance(item, str):
                yield f"prompt[{i}]", item


def _chat_chars(data: dict[str, Any]) -> int:
    messages = data.get("messages")
    total = 0
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return total


class BoundedTokenizer:
    """A tokenizer whose ``encode`` counts a long text in chunks first and refuses it (400 naming
    ``param``) once the count passes ``2 x max_tokens``, without tokenizing it whole."""

    def __init__(self, inner: Any, max_tokens: int, param: str):
        self.inner = inner
        self.max_tokens = max_tokens
        self.param = param

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > CHUNK_CHARS:
            self._count(text)
        return self.inner.encode(text, add_special_tokens)

    def encode_chat(self, messages: Sequence[Any], add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        text = self.inner.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)

    def _count(self, text: str) -> None:
        ceiling = 2 * self.max_tokens
        count = start = 0
        while start < len(text):
            end = min(start + CHUNK_CHARS, len(text))
            if end < len(text):
                cut = text.rfind(" ", end - 256, end)  # a piece ends before a space, where BPE splits too
                end = cut if cut > start else end
            count += len(self.inner.encode(text[start:end], add_special_tokens=False))
            if count > ceiling:
                raise bad_request(f"the prompt has more than {ceiling} tokens (counted in pieces), more than the "
                                  f"context allows (at most {self.max_tokens} prompt tokens for this model)",
                                  self.param, "context_length_exceeded")
            start = end
            time.sleep(0)  # let the event loop and the engine thread run between pieces


class Screen:
    """Bodies into plans off the event loop (see the module docstring)."""

    def __init__(self, policy: Policy, tokenizer: Any, max_prompt_len: int):
        self.policy = policy
        self.tokenizer = tokenizer
        self.max_prompt_len = max_prompt_len
        self.chars_per_token = chars_per_token(tokenizer)
        self.max_prompt_chars = max_prompt_len * self.chars_per_token
        self._limiter = anyio.CapacityLimiter(PLANNERS)
        self._seeds = random.Random(policy.seed) if policy.seed is not None else None

    async def plan(self, body: bytes, chat: Optional[bool], build: Callable[[dict[str, Any], Any], T]) -> T:
        """``build(data, tokenizer)`` of the decoded body, on a worker thread, after the checks;
        an ``APIError`` of the checks or of ``build`` is raised here without the request's data.
        ``chat``: whether the body's prompt is ``messages`` (None: when the body has that key)."""
        outcome = await anyio.to_thread.run_sync(self._plan, body, chat, build, limiter=self._limiter)
        del body
        if isinstance(outcome, _Refused):
            raise APIError(outcome.status, outcome.message, outcome.type, outcome.param, outcome.code)
        return outcome

    def _plan(self, body: bytes, chat: Optional[bool], build: Callable[[dict[str, Any], Any], T]) -> Any:
        try:
            data = decode_body(body)
            del body
            if chat is None:
                chat = isinstance(data, dict) and "messages" in data
            if isinstance(data, dict):
                self._measure(data, chat)
                if self._seeds is not None and data.get("seed") is None:
                    data["seed"] = self._seeds.getrandbits(40)
            tokenizer = BoundedTokenizer(self.tokenizer, self.max_prompt_len, "messages" if chat else "prompt")
            return build(data, tokenizer)
        except APIError as err:  # only the fields cross back: no traceback holds the body
            return _Refused(err.status, err.message, err.type, err.param, err.code)

    def _measure(self, data: dict[str, Any], chat: bool) -> None:
        if chat:
            kwargs = data.get("chat_template_kwargs")
            for key in RESERVED_TEMPLATE_KWARGS:
                if isinstance(kwargs, dict) and key in kwargs:
                    raise bad_request(f"is set by the server (give {key} as a request field, not a template "
                                      f"argument)", f"chat_template_kwargs.{key}")
            texts: list[tuple[str, int]] = [("messages", _chat_chars(data))]
        else:
            texts = [(param, len(text)) for param, text in _texts(data)]
            prompt = data.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], int) and len(prompt) > self.max_prompt_len:
                raise bad_request(f"the prompt has {len(prompt)} tokens, more than the context allows (at most "
                                  f"{self.max_prompt_len} prompt tokens for this model)", "prompt",
                                  "context_length_exceeded")
        for param, chars in texts:
            if chars > self.max_prompt_chars:
                raise bad_request(f"the prompt has {chars} characters, more than any prompt this model takes (at "
                                  f"most {self.max_prompt_chars}: {self.max_prompt_len} tokens of at most "
                                  f"{self.chars_per_token} characters)", param, "context_length_exceeded")

    def check_fits(self, plan: Plan, max_waiting: int) -> None:
        """A request of more choices than the waiting queue ever holds can never be served: 400."""
        if len(plan.choices) > max_waiting:
            raise bad_request(f"the request has {len(plan.choices)} choices (prompts x n), more than this server "
                              f"ever queues (at most {max_waiting}: --max-waiting)", "n")


@dataclass(frozen=True)
class _Refused:
    status: int
    message: str
    type: str
    param: Optional[str]
    code: Optional[str]


def scrub_paths(message: str, paths: Iterable[str]) -> str:
    """``message`` without the server's paths in it (a ``PATH: `` prefix dropped, other mentions
    replaced by ``<model>``)."""
    for raw in paths:
        for path in {raw, str(Path(raw).resolve())} if raw else ():
            message = message.replace(f"{path}: ", "").replace(path, "<model>")
    return message
