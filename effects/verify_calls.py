"""Verify forwards: the serial K-row verifies of one sequence and the batched verify
(specs/recording-device.md §3.8.5, specs/speculation.md §6.5-§6.12, §6.16).
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from .base import int_tuple, quick_inits
from .call_base import DeviceCall
from .readback_calls import HostPick, host_picks


@attrs.frozen
class SerialVerify(DeviceCall):
    """A per-sequence verify over ``tokens`` (anchor + drafts); answered with its rows. ``picks``
    (one per row, empty when every row is greedy) make the rows a rejection-sampled verify's
    (specs/speculation.md §6.16); they print nothing in a trace."""

    QUERY: ClassVar[bool] = True
    seq: int
    tokens: tuple[int, ...] = attrs.field(converter=int_tuple)
    picks: tuple[HostPick, ...] = attrs.field(default=(), converter=host_picks)


@attrs.frozen
class DecodeVerify(SerialVerify):
    CALL: ClassVar[str] = "decode_verify"
    QUERY: ClassVar[bool] = True


@attrs.frozen
class DecodeVerifyGraphed(SerialVerify):
    CALL: ClassVar[str] = "decode_verify_graphed"
    QUERY: ClassVar[bool] = True


@attrs.frozen
class DecodeVerifyGraphedK3(SerialVerify):
    CALL: ClassVar[str] = "decode_verify_graphed_k3"
    QUERY: ClassVar[bool] = True


@attrs.frozen
class DecodeVerifyGraphedK4(SerialVerify):
    CALL: ClassVar[str] = "decode_verify_graphed_k4"
    QUERY: ClassVar[bool] = True


@attrs.frozen
class DecodeVerifyDflash(SerialVerify):
    CALL: ClassVar[str] = "decode_verify_dflash"
    QUERY: ClassVar[bool] = True


@attrs.frozen
class DecodeAndVerifyFused(SerialVerify):
    CALL: ClassVar[str] = "decode_and_verify_fused"
    QUERY: ClassVar[bool] = True


@attrs.frozen
class DecodeVerifyBatched(DeviceCall):
    CALL: ClassVar[str] = "decode_verify_batched"
    QUERY: ClassVar[bool] = True
    tokens: tuple[int, ...] = attrs.field(converter=int_tuple)
    ks: tuple[int, ...] = attrs.field(converter=int_tuple)
    seqs: tuple[int, ...] = attrs.field(converter=int_tuple)
    stream: int = 0
    woa: bool = True
    picks: tuple[HostPick, ...] = attrs.field(default=(), converter=host_picks)  # as SerialVerify's, row order


quick_inits(globals())  # every record class above: a quicker __init__ (effects/base.py)
