"""The engine's per-slot records: a slot's committed bookkeeping, its uncommitted rows, and the
rows its last forward captured (read lazily: a decode of 256 sequences slices nothing it is not
asked for)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .gdn import GdnSnapshot
from .model import ForwardOutput


@dataclass
class SlotState:
    """Bookkeeping of one allocated slot (see engine.py's module docstring for the invariants)."""

    adapter_id: int = 0  # the id of the LoRA adapter the sequence runs with (0: the base model)
    lora_slot: int = -1  # the adapter's slot in the engine's LoRA pool (-1: none, specs/lora.md §18.1)
    seq_len: int = 0
    tokens: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    boundary_states: dict[int, GdnSnapshot] = field(default_factory=dict)
    cached_prompt_tokens: int = 0


@dataclass
class PendingRows:
    """Uncommitted rows of a slot's last forward: row i is tokens[i] at position start + i."""

    start: int
    tokens: list[int]
    out: ForwardOutput
    batch_index: int
    features: torch.Tensor | None = None  # [rows, F]: a checkpoint DFlash drafter's context features


class Captured(NamedTuple):
    """Rows a slot's last forward produced: ``batched[b, :n]`` of a forward's [B, T, ...] output,
    or ``batched`` itself when ``b`` is None (rows already of this slot alone)."""

    batched: torch.Tensor
    b: int | None = None
    n: int = 0

    def rows(self) -> torch.Tensor:
        return self.batched if self.b is None else self.batched[self.b, :self.n]


def in_cache(out: ForwardOutput) -> bool:
    """Whether the forward committed its GDN states in the cache itself (gdn_layer's in_place)."""
    return bool(out.gdn_rows) and out.gdn_rows[0].in_cache
