"""What clients receive. The interpreter delivers these; the trace prints them at the end."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Optional

import attrs

from .base import Effect, int_tuple, quick_inits


class FinishReason(enum.StrEnum):
    """Why a request finished, as its final frame (``Done`` / ``Response``) names it.

    The members are strings: a record built with the plain string (``"stop"``) is equal to one
    built with the member, and both render the bare value.
    """

    STOP = "stop"
    LENGTH = "length"
    TIMEOUT = "timeout"
    TOOL_CALLS = "tool_calls"


@attrs.frozen
class ClientOutput(Effect):
    """Something sent to the client of ``request_id``."""

    request_id: int


@attrs.frozen
class TokenOut(ClientOutput):
    """One streamed token; ``logprobs`` is the number of top entries of its record (0: none)."""

    token: int
    logprobs: int = 0

    def render(self) -> str:
        return f"TL{self.token}:{self.logprobs}" if self.logprobs else f"T{self.token}"


@attrs.frozen
class TokensOut(ClientOutput):
    """Several streamed tokens in one frame (a verify's accepted drafts and bonus)."""

    tokens: tuple[int, ...] = attrs.field(converter=int_tuple)
    logprobs: int = 0

    def render(self) -> str:
        if self.logprobs:
            return " ".join(f"TL{t}:{self.logprobs}" for t in self.tokens)
        return " ".join(f"T{t}" for t in self.tokens)


@attrs.frozen
class StreamOut(Effect):
    """The streamed tokens of one forward for several requests in one record.

    Row i sends ``counts[i]`` tokens (one each when ``counts`` is empty) from ``tokens``, in order,
    to request ``request_ids[i]``, with record size ``logprobs[i]`` (0 each when empty). It stands
    for the per-request frames ``split`` returns (``TokenOut`` for one token, else ``TokensOut``),
    which is what a client receives. The fields are built as tuples by the core; no converter runs.
    """

    request_ids: tuple[int, ...]
    tokens: tuple[int, ...]
    counts: tuple[int, ...] = ()
    logprobs: tuple[int, ...] = ()

    def split(self) -> "list[TokenOut | TokensOut]":
        ids, tokens, logprobs = self.request_ids, self.tokens, self.logprobs or (0,) * len(self.request_ids)
        if not self.counts:
            return [TokenOut(rid, token, k) for rid, token, k in zip(ids, tokens, logprobs, strict=True)]
        frames: list[TokenOut | TokensOut] = []
        at = 0
        for rid, n, k in zip(ids, self.counts, logprobs, strict=True):
            frames.append(TokenOut(rid, tokens[at], k) if n == 1 else TokensOut(rid, tokens[at:at + n], k))
            at += n
        return frames


def client_frames(effects: "Iterable[Effect]") -> "list[ClientOutput]":
    """The client outputs among ``effects``, per request, in order (a ``StreamOut`` split)."""
    frames: list[ClientOutput] = []
    for effect in effects:
        if isinstance(effect, StreamOut):
            frames.extend(effect.split())
        elif isinstance(effect, ClientOutput):
            frames.append(effect)
    return frames


def render_guard(guard: Optional[str]) -> str:
    return "None" if guard is None else f'Some("{guard}")'


@attrs.frozen
class DoneOut(ClientOutput):
    """The final frame of a streaming request."""

    reason: FinishReason
    n: int
    think: int
    cached: int
    acc: int
    guard: Optional[str]

    def render(self) -> str:
        return (
            f"Done({self.reason}, n={self.n}, think={self.think}, cached={self.cached}, "
            f"acc={self.acc}, guard={render_guard(self.guard)})"
        )


@attrs.frozen
class ResponseOut(ClientOutput):
    """The single answer of a blocking request."""

    tokens: tuple[int, ...] = attrs.field(converter=int_tuple)
    reason: FinishReason = FinishReason.STOP
    think: int = 0
    cached: int = 0
    acc: int = 0
    logprobs: int = 0

    def render(self) -> str:
        toks = ", ".join(str(t) for t in self.tokens)
        return (
            f"Response(tokens=[{toks}], {self.reason}, think={self.think}, cached={self.cached}, "
            f"acc={self.acc}, logprobs={self.logprobs})"
        )


@attrs.frozen
class ErrorOut(ClientOutput):
    """A failure frame (streaming: ``Error(msg)``; blocking: ``Err(msg)``)."""

    message: str
    streaming: bool = True

    def render(self) -> str:
        return f"Error({self.message})" if self.streaming else f"Err({self.message})"


@attrs.frozen
class RotationAck(Effect):
    """The answer to a LoRA rotation command: ``Done`` or ``Err(<message>)``."""

    name: str
    error: Optional[str] = None

    def render(self) -> str:
        return "Done" if self.error is None else f"Err({self.error})"


TERMINAL_OUTPUTS = (DoneOut, ResponseOut, ErrorOut)


quick_inits(globals())  # every record class above: a quicker __init__ (effects/base.py)
