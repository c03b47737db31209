"""Base record of every effect.

An effect is a description, never a callback: two runs that make the same decisions produce equal
effect lists. ``QUERY`` marks effects whose answer ``step`` needs before it can decide anything
else; their answer comes back as an event.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import attrs


@attrs.frozen
class Effect:
    """A frozen, hashable record of something the core wants done."""

    QUERY: ClassVar[bool] = False


def expand_batched(effects: Iterable[Effect]) -> list[Effect]:
    """``effects`` with each batched record (one that has ``split``: ``StreamOut``,
    ``MarconiCheckpoints``) replaced by the per-request or per-sequence records it stands for."""
    out: list[Effect] = []
    for effect in effects:
        split = getattr(effect, "split", None)
        if split is None:
            out.append(effect)
        else:
            out.extend(split())
    return out


def is_query(effect: Effect) -> bool:
    """True when the interpreter must answer ``effect`` with an event."""
    return effect.QUERY


def int_tuple(value: Iterable[int]) -> tuple[int, ...]:
    """Converter: any iterable of ints becomes a tuple (records stay hashable).

    A tuple is taken as is: records are rebuilt on every step, and re-converting long tuples
    (a sequence's output) would make each step linear in the output length.
    """
    if type(value) is tuple:
        return value
    return tuple(int(v) for v in value)


def int_tuples(value: Iterable[Iterable[int]]) -> tuple[tuple[int, ...], ...]:
    """Converter: an iterable of iterables of ints becomes a tuple of ``int_tuple``s."""
    return tuple(int_tuple(x) for x in value)


def int_pairs(value: Iterable[Iterable[int]]) -> tuple[tuple[int, int], ...]:
    """Converter: an iterable of ``(a, b)`` pairs becomes a tuple of int pairs."""
    return tuple((int(a), int(b)) for a, b in value)
