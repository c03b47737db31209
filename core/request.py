"""A client request as the scheduler sees it: immutable from arrival to its final frame."""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import attrs

from fxsched.effects.base import int_tuple


def _non_empty(instance: "Request", attribute: object, value: tuple[int, ...]) -> None:
    if not value:
        raise ValueError(f"request {instance.id}: the prompt is empty")


def _bad(instance: "Request", name: str, value: object, expected: str) -> ValueError:
    return ValueError(f"request {instance.id}: {name} = {value!r} is out of range ({expected})")


def _finite(value: object) -> bool:
    try:
        return math.isfinite(value)  # type: ignore[arg-type]
    except (TypeError, OverflowError):  # not a number, or an integer too large for a float
        return False


def _temperature(instance: "Request", attribute: object, value: float) -> None:
    if not (_finite(value) and value >= 0):
        raise _bad(instance, "temperature", value, "a finite number >= 0")


def _top_p(instance: "Request", attribute: object, value: float) -> None:
    if not 0 < value <= 1:
        raise _bad(instance, "top_p", value, "0 < top_p <= 1")


def _top_k(instance: "Request", attribute: object, value: int) -> None:
    if value < 0:
        raise _bad(instance, "top_k", value, "top_k >= 0, 0 turns it off")


def _min_p(instance: "Request", attribute: object, value: float) -> None:
    if not 0 <= value <= 1:
        raise _bad(instance, "min_p", value, "0 <= min_p <= 1")


def _at_least(low: int) -> Callable[["Request", Any, int], None]:
    """A validator: an integer of at least ``low`` (budgets, counts)."""

    def check(instance: "Request", attribute: Any, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise _bad(instance, attribute.name, value, f"an integer >= {low}")

    return check


@attrs.frozen
class Request:
    """Prompt, budgets and sampling fields. ``id`` doubles as the session number.

    Sampling (specs/scheduler.md §5.11): ``temperature`` 0 is greedy; above it the row's
    distribution is cut by ``min_p`` (0: off), ``top_k`` (0: off) and ``top_p`` (1: off) and drawn
    with ``seed`` (+ the output length). Out-of-range values raise ``ValueError`` naming the
    request and the field; so do a budget ``max_tokens`` below 1, ``num_beams`` below 1 and a
    negative ``min_tokens`` or ``top_logprobs``.
    """

    id: int
    prompt: tuple[int, ...] = attrs.field(converter=int_tuple, validator=_non_empty)
    max_tokens: int = attrs.field(validator=_at_least(1))
    min_tokens: int = attrs.field(default=0, validator=_at_least(0))
    streaming: bool = True
    temperature: float = attrs.field(default=0.0, validator=_temperature)
    top_logprobs: int = attrs.field(default=0, validator=_at_least(0))
    num_beams: int = attrs.field(default=1, validator=_at_least(1))
    adapter_slot: int = -1
    seed: int = 42
    deadline_ms: Optional[float] = None
    top_p: float = attrs.field(default=1.0, validator=_top_p)
    top_k: int = attrs.field(default=0, validator=_top_k)
    min_p: float = attrs.field(default=0.0, validator=_min_p)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def greedy(self) -> bool:
        """Greedy fast path: the device argmax is the pick (specs/scheduler.md §5.11)."""
        return self.temperature == 0 and self.top_logprobs == 0 and self.min_tokens == 0
