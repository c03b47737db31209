"""Sequence management calls: a sequence's slot and KV blocks (allocate, free, cache, compact,
detach, save and restore, reclaim, truncate) (specs/recording-device.md §3.8.2).
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from .base import quick_inits
from .call_base import DeviceCall


@attrs.frozen
class AllocSequence(DeviceCall):
    CALL: ClassVar[str] = "alloc_sequence"
    QUERY: ClassVar[bool] = True
    seq: int
    session: int


@attrs.frozen
class AllocSequenceFor(DeviceCall):
    CALL: ClassVar[str] = "alloc_sequence_for"
    QUERY: ClassVar[bool] = True
    seq: int
    session: int
    budget: int


@attrs.frozen
class FreeSequence(DeviceCall):
    CALL: ClassVar[str] = "free_sequence"
    seq: int


@attrs.frozen
class CacheSequence(DeviceCall):
    CALL: ClassVar[str] = "cache_sequence"
    seq: int


@attrs.frozen
class CompactSequence(DeviceCall):
    CALL: ClassVar[str] = "compact_sequence"
    seq: int
    new_slot: int


@attrs.frozen
class DetachSlotForReuse(DeviceCall):
    CALL: ClassVar[str] = "detach_slot_for_reuse"
    seq: int


@attrs.frozen
class SaveSequenceStateCall(DeviceCall):
    CALL: ClassVar[str] = "save_sequence_state"
    seq: int


@attrs.frozen
class RestoreSequenceState(DeviceCall):
    CALL: ClassVar[str] = "restore_sequence_state"
    QUERY: ClassVar[bool] = True
    seq: int
    blocks: int


@attrs.frozen
class ReclaimPrefixBlocks(DeviceCall):
    CALL: ClassVar[str] = "reclaim_prefix_blocks"
    QUERY: ClassVar[bool] = True
    n: int


@attrs.frozen
class TruncateSequence(DeviceCall):
    """Rewind the device's KV length to ``seq_len`` (the scheduler's accepted prefix).

    It renders no line: the device never rewinds by itself, the scheduler tells it to.
    """

    CALL: ClassVar[str] = "truncate_sequence"
    seq: int
    seq_len: int


quick_inits(globals())  # every record class above: a quicker __init__ (effects/base.py)
