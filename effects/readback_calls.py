"""Reading tokens out of logits rows: on the device (argmax, kept tokens) or on the host, by the
``HostPick`` rule of each row (specs/recording-device.md §3.8.7, specs/scheduler.md §5.11).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import attrs

from .base import int_tuple, quick_inits
from .call_base import DeviceCall


@attrs.frozen
class HostPick:
    """How one logits row becomes a token (specs/scheduler.md §5.11): EOS masked while
    ``mask_eos``, then (temperature > 0) temperature, min-p, top-k (0: off) and top-p (1.0: off),
    one draw seeded by ``seed``. ``top_logprobs`` is the row's logprob record size. The filters
    print nothing in a trace; their defaults leave every pick as it was."""

    temperature: float
    seed: int
    mask_eos: bool
    top_logprobs: int = 0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0


def host_picks(value: Iterable[HostPick]) -> tuple[HostPick, ...]:
    """Converter: the host picks of a logits readback, as a tuple."""
    return tuple(value)


# --- logits readers --------------------------------------------------------------------------


@attrs.frozen
class ArgmaxOnDevice(DeviceCall):
    CALL: ClassVar[str] = "argmax_on_device"
    QUERY: ClassVar[bool] = True
    row: int
    stream: int = 0


@attrs.frozen
class ReadAhead(DeviceCall):
    """Read back the tokens the last decodes of ``seqs`` kept on the device (decodes answered ahead,
    specs/async.md §16.6); answered by ``TokensSampled`` with them in ``earlier``, in order."""

    CALL: ClassVar[str] = "read_ahead"
    QUERY: ClassVar[bool] = True
    seqs: tuple[int, ...] = attrs.field(converter=int_tuple)


@attrs.frozen
class ArgmaxBatch(DeviceCall):
    CALL: ClassVar[str] = "argmax_batch"
    QUERY: ClassVar[bool] = True
    row: int
    n: int
    stream: int = 0


@attrs.frozen
class CopyLogitsToHost(DeviceCall):
    """Copy ``n`` rows to the host; answered with one pick per row, made by the rule in ``picks``."""

    CALL: ClassVar[str] = "copy_logits_to_host"
    QUERY: ClassVar[bool] = True
    row: int
    n: int
    picks: tuple[HostPick, ...] = attrs.field(converter=host_picks)


quick_inits(globals())  # every record class above: a quicker __init__ (effects/base.py)
