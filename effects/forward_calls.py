"""Prefill and decode forwards: whole and chunked prefills, mixed and batched forwards with their
prompt slices, plain and draft decodes (specs/recording-device.md §3.8.3, §3.8.4).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import attrs

from .base import int_tuple, quick_inits
from .call_base import DeviceCall


@attrs.frozen
class Prefill(DeviceCall):
    CALL: ClassVar[str] = "prefill"
    QUERY: ClassVar[bool] = True
    seq: int
    tokens: tuple[int, ...] = attrs.field(converter=int_tuple)
    stream: int = 0


@attrs.frozen
class PrefillChunk(DeviceCall):
    CALL: ClassVar[str] = "prefill_chunk"
    QUERY: ClassVar[bool] = True
    seq: int
    prompt: tuple[int, ...] = attrs.field(converter=int_tuple)
    start: int
    length: int
    last: bool
    stream: int


@attrs.frozen
class PrefillSlice:
    """One prompt slice of a mixed forward."""

    seq: int
    prompt: tuple[int, ...] = attrs.field(converter=int_tuple)
    start: int
    length: int
    last: bool


def prefill_slices(value: Iterable[PrefillSlice]) -> tuple[PrefillSlice, ...]:
    """Converter: the slices of a batched forward, as a tuple."""
    return tuple(value)


@attrs.frozen
class MixedForward(DeviceCall):
    CALL: ClassVar[str] = "mixed_forward"
    QUERY: ClassVar[bool] = True
    decode_tokens: tuple[int, ...] = attrs.field(converter=int_tuple)
    decode_seqs: tuple[int, ...] = attrs.field(converter=int_tuple)
    prefill: PrefillSlice
    stream: int


@attrs.frozen
class MixedForwardBatch(DeviceCall):
    CALL: ClassVar[str] = "mixed_forward_batch"
    QUERY: ClassVar[bool] = True
    decode_tokens: tuple[int, ...] = attrs.field(converter=int_tuple)
    decode_seqs: tuple[int, ...] = attrs.field(converter=int_tuple)
    prefills: tuple[PrefillSlice, ...] = attrs.field(converter=prefill_slices)
    stream: int


@attrs.frozen
class PrefillBatchChunk(DeviceCall):
    """Chunks of several prompts in one forward (no decode rows); slice r answers at row r."""

    CALL: ClassVar[str] = "prefill_batch_chunk"
    QUERY: ClassVar[bool] = True
    prefills: tuple[PrefillSlice, ...] = attrs.field(converter=prefill_slices)
    stream: int


@attrs.frozen
class NormalizeSsmStates(DeviceCall):
    CALL: ClassVar[str] = "normalize_ssm_states"
    seq: int
    stream: int


@attrs.frozen
class DecodeCall(DeviceCall):
    CALL: ClassVar[str] = "decode"
    QUERY: ClassVar[bool] = True
    token: int
    seq: int
    stream: int = 0


@attrs.frozen
class DecodeDraft(DeviceCall):
    CALL: ClassVar[str] = "decode_draft"
    QUERY: ClassVar[bool] = True
    token: int
    seq: int
    stream: int = 0


quick_inits(globals())  # every record class above: a quicker __init__ (effects/base.py)
