"""The loop's tasks and waiting records (rules in ``core/tick.py``): start-up, the tick's
opening (inbox, admission, snapshot publish), LoRA rotation, the idle check, the empty-batch
exit, the end of tick and shutdown (specs/scheduler.md §5.3-§5.8, §5.14, §5.19, §5.21).

``core/phases.py`` is the namespace of every task and waiting record; ``core/table.py`` maps
each to its rule.
"""

from __future__ import annotations

import attrs

from fxsched.core.request import Request
from fxsched.effects.base import quick_inits


# === the loop (core/tick.py) ====================================================================


@attrs.frozen
class StartUp:
    """Task: bind the device thread and create the prefill stream and event."""


@attrs.frozen
class TickStart:
    """Task: drain the inbox, block on it when idle, admit, and lay out the tick's tasks."""


@attrs.frozen
class Admit:
    """Task: ask the adapter ids of the cohort and of this tick's new requests."""


@attrs.frozen
class Publish:
    """Task: publish the snapshot (free-block count), which opens the tick."""


@attrs.frozen
class Rotate:
    """Task: apply one pending LoRA rotation, only when nothing is in flight."""


@attrs.frozen
class IdleCheck:
    """Task: with nothing in flight and the inbox closed, shut the loop down."""


@attrs.frozen
class EmptyBatchExit:
    """Task after lane 2: with nothing active, try swap-in and requeue resume first."""


@attrs.frozen
class EmptyBatchSkip:
    """Task: still nothing active, so skip lane 3 and the end of tick."""


@attrs.frozen
class EndOfTick:
    """Task: expire deadlines, retire finished sequences, compact, swap in, resume."""


@attrs.frozen
class Shutdown:
    """Task: fail or finish everything still owed an answer and tear down."""


@attrs.frozen
class AwaitStream:
    """Waits for ``StreamCreated``: the prefill stream."""


@attrs.frozen
class AwaitEvent:
    """Waits for ``EventCreated``: the event that orders the prefill stream before decode."""


@attrs.frozen
class AwaitInput:
    """Waits for ``InputReady``: blocked on the inbox, nothing in flight and nothing pending."""


@attrs.frozen
class AwaitAdapterIds:
    """Waits for ``AdapterIds`` of the cohort slot then of each of ``new`` (this tick's
    admissions, not yet in any collection)."""

    new: tuple[Request, ...]


@attrs.frozen
class AwaitPublishBlocks:
    """Waits for ``FreeBlocks``: the snapshot publish that opens the tick."""


@attrs.frozen
class AwaitRotation:
    """Waits for ``LoraApplied`` of the rotation to adapter ``name``."""

    name: str


quick_inits(globals())  # every record class above: a quicker __init__ (effects/base.py)
