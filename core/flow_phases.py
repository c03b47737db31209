"""Generic control flow on the agenda (rules in ``core/flow.py``): waiting for a forward, emitting
fire-and-forget effects, asking a query with a continuation written as data
(specs/scheduler.md §5.2, specs/faults.md §8.1).

``core/phases.py`` is the namespace of every task and waiting record; ``core/table.py`` maps
each to its rule.
"""

from __future__ import annotations

from typing import Any, Optional

import attrs

from fxsched.core.request import Request
from fxsched.effects.base import Effect, quick_inits


# === generic control flow (core/flow.py) ========================================================


@attrs.frozen
class AwaitForward:
    """Waits for ``ForwardDone`` of a forward over ``seq_ids``; ``then`` are the tasks that follow.

    ``request`` and ``slot`` name a request that is not yet a sequence anywhere (its first
    prefill), so that a fault can fail it.
    """

    seq_ids: tuple[int, ...]
    then: tuple[Any, ...] = ()
    request: Optional[Request] = None
    slot: Optional[int] = None


@attrs.frozen
class EmitEffects:
    """Task: emit ``effects`` (fire-and-forget) at this point of the agenda."""

    effects: tuple[Effect, ...]


@attrs.frozen
class AskQuery:
    """Task: ask ``query`` and park ``waiting`` (a continuation written as data)."""

    query: Effect
    waiting: Any


quick_inits(globals())  # every record class above: a quicker __init__ (effects/base.py)
