"""Per-request logits processing before a pick: penalties and ``logit_bias`` (vLLM's semantics,
specs/serve-fields.md §13.3). A grammar's token mask is not one of them: the torch device masks
the rows when a forward's logits are stored (runtime/devices/grammar_mask.py, specs/serve.md
§12.2), so the processors see masked rows and a refused token stays at -inf.

A ``RowProcessor`` changes one logits row in place, given the request's prompt length and the
row's context (every token before the position the row fills: the prompt, then the output so
far, speculative drafts included for a verify row). ``RowProcessors`` holds the processors of
each request (by the device sequence's ``session``, the request id); ``TorchDevice`` reads it in
``sample_rows`` and ``sample_verify`` and hands the processed rows to the pick, so a penalty
changes the target's distribution in a speculative verify exactly as in a plain decode
(specs/speculation.md §6.16: the rejection test then keeps the processed distribution).
Logprob records stay the raw ``log_softmax`` of the model (vLLM's default ``raw_logprobs``).

``Penalties`` (in this order, as vLLM V1 applies them):

1. ``logit_bias``: ``logit[id] += bias`` for each listed id;
2. ``repetition`` r (1: off): every id in the prompt or the output so far: a positive logit is
   divided by r, a negative one multiplied by r;
3. ``frequency`` f and ``presence`` p (0: off): ``logit[id] -= f * count(id) + p * (count(id) > 0)``
   with ``count`` over the output so far (not the prompt).

Nothing here crosses rows: a row's result depends on its logits, its context and its request's
processors alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Sequence as Seq

import torch

from fxsched.runtime.torch_model.transfers import send_values


class RowProcessor(Protocol):
    """Changes ``row [V]`` (float32) in place; ``context`` holds the prompt (its first
    ``prompt_len`` tokens), then the output so far."""

    def __call__(self, row: torch.Tensor, prompt_len: int, context: Seq[int]) -> None: ...


@dataclass(frozen=True)
class Penalties:
    """vLLM's presence, frequency and repetition penalties and OpenAI's ``logit_bias``."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def neutral(self) -> bool:
        return self.presence == 0 and self.frequency == 0 and self.repetition == 1 and not self.logit_bias

    def __call__(self, row: torch.Tensor, prompt_len: int, context: Seq[int]) -> None:
        output = list(context[prompt_len:])
        repeat = self.repetition != 1 and bool(context)
        count = bool(self.frequency or self.presence) and bool(output)
        # the ids and biases in one packed copy that does not block the host (specs/async.md §16.2)
        (ids, seen, out_ids), (biases,) = send_values(
            [[i for i, _ in self.logit_bias], sorted(set(context)) if repeat else [], output if count else []],
            [[b for _, b in self.logit_bias]], row.device)
        if self.logit_bias:
            row.index_add_(0, ids, biases.to(row.dtype))
        if repeat:
            values = row[seen]
            row[seen] = torch.where(values > 0, values / self.repetition, values * self.repetition)
        if count:
            counts = torch.zeros_like(row).index_add_(0, out_ids, torch.ones(len(output), device=row.device))
            row -= self.frequency * counts + self.presence * (counts > 0).to(row.dtype)


@dataclass
class _Entry:
    prompt_len: int
    processors: tuple[RowProcessor, ...]


@dataclass
class RowProcessors:
    """The processors of each request id (thread-unsafe: the engine thread owns it)."""

    entries: dict[int, _Entry] = field(default_factory=dict)

    def set(self, request_id: int, prompt_len: int, processors: Seq[RowProcessor]) -> None:
        if processors:
            self.entries[request_id] = _Entry(prompt_len, tuple(processors))

    def drop(self, request_id: int) -> None:
        self.entries.pop(request_id, None)

    def __bool__(self) -> bool:
        return bool(self.entries)

    def process(self, logits: torch.Tensor, sessions: Seq[Optional[int]],
                context: Callable[[int], list[int]]) -> Optional[torch.Tensor]:
        """``logits [R, V]`` with each row of a request that has processors processed (a float32
        copy), or None when no row has any. ``sessions[r]`` is row r's request id (None: none);
        ``context(r)`` its context."""
        rows = [r for r, s in enumerate(sessions) if s is not None and s in self.entries]
        if not rows:
            return None
        out = logits.to(torch.float32, copy=True)
        for r in rows:
            session = sessions[r]
            assert session is not None
            entry = self.entries[session]
            ctx = context(r)
            for processor in entry.processors:
                processor(out[r], entry.prompt_len, ctx)
        return out
