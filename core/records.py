"""A fast ``replace`` for the hot records (sequences, the scheduler state).

``attrs.evolve`` re-runs every converter and validator and costs several microseconds per call;
``step`` rebuilds sequences many times per tick, so the hot records are dict-backed frozen attrs
classes that ``replace`` copies directly. Callers pass final values (tuples, not lists): nothing is
converted. The result is a new frozen record equal to ``attrs.evolve(record, **changes)``.
"""

from __future__ import annotations

from typing import TypeVar

import attrs

T = TypeVar("T")


def replace(record: T, **changes) -> T:
    """A copy of ``record`` with ``changes`` applied; ``record`` is left as it was."""
    if not hasattr(record, "__dict__"):  # slotted records are small and rare: evolve them
        return attrs.evolve(record, **changes)
    new = object.__new__(type(record))
    fields = new.__dict__
    fields.update(record.__dict__)
    fields.update(changes)
    return new


def with_fields(record: T, changes: dict) -> T:
    """``replace`` taking the changes as a dict (no keyword packing on the hot path)."""
    new = object.__new__(type(record))
    fields = new.__dict__
    fields.update(record.__dict__)
    fields.update(changes)
    return new
