"""Memory pressure's tasks and waiting records (rules in ``core/lifecycle.py``): admission-time
swap-out, swap-in and the requeue of preempted sequences (specs/scheduler.md §5.9, §5.18,
§5.19).

``core/phases.py`` is the namespace of every task and waiting record; ``core/table.py`` maps
each to its rule.
"""

from __future__ import annotations

import enum

import attrs

from fxsched.effects.base import quick_inits


# === memory pressure (core/lifecycle.py) ========================================================


class SwapOutStage(enum.Enum):
    """Where an admission-time swap-out is: reclaiming prefix blocks, or spilling victims."""

    RECLAIM = "reclaim"
    SWAP = "swap"


@attrs.frozen
class SwapOutRoom:
    """Task: before lane 1, with a spill pool, make room for each new request's prompt."""


@attrs.frozen
class SwapOutFor:
    """Task: make ``need`` blocks free (reclaim first, then spill victims)."""

    need: int


@attrs.frozen
class AwaitSwapOutFree:
    """Waits for ``FreeBlocks`` while making ``need`` blocks free at ``stage``."""

    need: int
    stage: SwapOutStage


@attrs.frozen
class AwaitSwapOutReclaim:
    """Waits for ``BlocksReclaimed`` while making ``need`` blocks free."""

    need: int


@attrs.frozen
class SwapIn:
    """Task: bring back the first spilled sequence whose blocks fit."""


@attrs.frozen
class AwaitSwapInFree:
    """Waits for ``FreeBlocks`` before a swap-in."""


@attrs.frozen
class AwaitSwapInReclaim:
    """Waits for ``BlocksReclaimed`` (or ``FreeBlocks``) until the ``smallest`` spilled table fits."""

    smallest: int


@attrs.frozen
class AwaitSwapInSlot:
    """Waits for ``SlotAllocated`` of the restoring sequence ``seq_id`` (no slot held yet)."""

    seq_id: int


@attrs.frozen
class AwaitRestore:
    """Waits for ``StateRestored`` (or a ``DeviceFault``) of ``seq_id`` into ``slot``."""

    seq_id: int
    slot: int


@attrs.frozen
class RequeueResume:
    """Task: re-prefill the preempted sequence with the smallest history, when it fits."""


@attrs.frozen
class AwaitResumeFree:
    """Waits for ``FreeBlocks`` before resuming ``seq_id``, which wants ``want`` blocks."""

    seq_id: int
    want: int
    reclaimed: bool = False


@attrs.frozen
class AwaitResumeReclaim:
    """Waits for ``BlocksReclaimed`` before resuming ``seq_id``."""

    seq_id: int
    want: int


@attrs.frozen
class AwaitResumeSlot:
    """Waits for ``SlotAllocated`` of the preempted sequence ``seq_id``."""

    seq_id: int


quick_inits(globals())  # every record class above: a quicker __init__ (effects/base.py)
