"""A client request as the scheduler sees it: immutable from arrival to its final frame."""

from __future__ import annotations

from typing import Optional

import attrs

from fxsched.effects.base import int_tuple


def _non_empty(instance: "Request", attribute: object, value: tuple[int, ...]) -> None:
    if not value:
        raise ValueError(f"request {instance.id}: the prompt is empty")


@attrs.frozen
class Request:
    """Prompt, budgets and sampling fields. ``id`` doubles as the session number."""

    id: int
    prompt: tuple[int, ...] = attrs.field(converter=int_tuple, validator=_non_empty)
    max_tokens: int
    min_tokens: int = 0
    streaming: bool = True
    temperature: float = 0.0
    top_logprobs: int = 0
    num_beams: int = 1
    adapter_slot: int = -1
    seed: int = 42
    deadline_ms: Optional[float] = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def greedy(self) -> bool:
        """Greedy fast path: the device argmax is the pick (specs/scheduler.md §5.11)."""
        return self.temperature == 0 and self.top_logprobs == 0 and self.min_tokens == 0
