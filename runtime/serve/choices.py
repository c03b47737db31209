"""The choices of ``fxsched serve``'s requests as its HTTP layer and its engine thread
(runtime/serve/engine.py) pass them: ``ChoiceEvent``, what one client frame of a choice brought
(handed to the choice's sink); ``_Choice``, a submitted choice as the engine thread tracks it;
``FinalRecord``, a finished one; and the items of the engine's inbox.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from fxsched.runtime.serve.protocol import ChoiceSpec

ABORT = "abort"  # the finish reason of a choice cancelled by its client or by the drain timeout


@dataclass(frozen=True)
class ChoiceEvent:
    """What one client frame of a choice brought: its new text (safe to show), the token ids and
    (with logprobs) their records; a final event has ``finish_reason`` ("stop", "length", "abort",
    "error"), ``error`` for a failed choice, and the choice's totals."""

    index: int
    text: str
    tokens: tuple[int, ...]
    logprobs: Optional[tuple[Optional[dict[str, Any]], ...]] = None
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    prompt_logprobs: Optional[tuple[Optional[dict[str, Any]], ...]] = None  # the first event, when asked
    stop_reason: Union[str, int, None] = None  # the stop string or stop token id that ended the choice
    accepted_tokens: Optional[int] = None  # final event, with speculation: drafted tokens the target accepted

    @property
    def final(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _Choice:
    """A submitted choice, as the engine thread tracks it."""

    id: int
    index: int
    spec: ChoiceSpec
    sink: Callable[[ChoiceEvent], None]
    submitted: float
    scheduled: Optional[float] = None  # when the scheduler first allocated its sequence
    first_token: Optional[float] = None
    last_frame: Optional[float] = None
    started: bool = False
    cancelled: bool = False
    adapter_slot: int = -1  # the LoRA pool slot of the adapter its request names (-1: the base model)

    def deliver(self, event: ChoiceEvent) -> None:
        try:
            self.sink(event)
        except RuntimeError:  # the HTTP loop is closed (the server is going away): nobody listens
            pass


@dataclass(frozen=True)
class FinalRecord:
    """A finished choice, kept in ``ServeEngine.recent`` (tests and debugging)."""

    request_id: int
    finish_reason: str
    completion_tokens: int
    cancelled: bool
    error: Optional[str] = None
    accepted_tokens: Optional[int] = None  # with speculation: drafted tokens the target accepted


@dataclass(frozen=True)
class _Submit:
    choices: tuple[_Choice, ...]


@dataclass(frozen=True)
class _Cancel:
    ids: tuple[int, ...]


_CLOSE = "close"
_CANCEL_ALL = "cancel-all"
