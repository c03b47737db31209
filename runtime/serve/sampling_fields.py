"""The sampling and stopping fields of a request, range-checked, and the choices they make
(specs/serve-fields.md §13.2–4): ``Limits`` (what the served model allows), ``ChoiceSpec`` (one
choice: the fields of its scheduler ``Request``, its logits processing, its text options) and the
checks that turn a request's fields into them. A bad value is a 400 naming the field.

Choice k of a request draws with ``seed`` + k x ``REQUEST_SEED_STRIDE`` (a random seed when none
is given), like ``fxsched generate``'s requests. A choice with a penalty or a bias asks the
scheduler for one top logprob entry, so its rows are picked on the host path where the row
processors run (specs/serve-fields.md §13.3).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, replace
from typing import Container, Optional, Union

from fxsched.runtime.serve.request_models import _Common, _brief, bad_request

MAX_N = 128  # choices of one request
MAX_TOP_LOGPROBS = 20  # as vLLM (OpenAI: 5 for completions, 20 for chat)
MAX_STOP_STRINGS = 16
REQUEST_SEED_STRIDE = 2**20  # choice k seeds its picks with seed + k * stride (runtime/generate.py's rule)
MAX_SEED = 2**62
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 1024


@dataclass(frozen=True)
class Bound:
    """A sampling number's accepted range: checked when a request is planned and stated in
    ``/openapi.json`` (runtime/serve/schema_rules.py), so the two cannot drift apart."""

    low: float
    high: float
    open_low: bool = False  # ``low`` itself refused (``top_p``: 0 keeps no token)


FLOAT_BOUNDS: dict[str, Bound] = {
    "temperature": Bound(0.0, 2.0), "top_p": Bound(0.0, 1.0, open_low=True), "min_p": Bound(0.0, 1.0),
    "presence_penalty": Bound(-2.0, 2.0), "frequency_penalty": Bound(-2.0, 2.0),
    "repetition_penalty": Bound(0.0, 2.0, open_low=True),
}


@dataclass(frozen=True)
class Limits:
    """What the served model allows (``context`` counts prompt + completion tokens)."""

    model_names: tuple[str, ...]
    vocab_size: int
    max_prompt_len: int
    context: int
    speculative: bool
    adapters: Container[str] = frozenset()  # the LoRA adapters served by name (runtime/serve/lora.py's book)


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
    adapter: Optional[str] = None  # the LoRA adapter the request names (None: the base model)

    @property
    def processed(self) -> bool:
        """Whether the rows of this choice go through a logits processor before the pick."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
                or bool(self.logit_bias))

    @property
    def scheduler_min_tokens(self) -> int:
        """``ignore_eos``: EOS masked at every position (the scheduler's ``min_tokens`` rule)."""
        return self.max_tokens if self.ignore_eos else self.min_tokens


def _number(value: Optional[float], name: str, default: float) -> float:
    if value is None:
        return default
    b = FLOAT_BOUNDS[name]
    if not math.isfinite(value) or value > b.high or value < b.low or (b.open_low and value == b.low):
        raise bad_request(f"must be {'above' if b.open_low else 'at least'} {b.low:g} and at most {b.high:g}, "
                          f"got {value!r}", name)
    return float(value)


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
    temperature = _number(req.temperature, "temperature", 0.0)
    top_p = _number(req.top_p, "top_p", 1.0)
    min_p = _number(req.min_p, "min_p", 0.0)
    presence = _number(req.presence_penalty, "presence_penalty", 0.0)
    frequency = _number(req.frequency_penalty, "frequency_penalty", 0.0)
    repetition = _number(req.repetition_penalty, "repetition_penalty", 1.0)
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
