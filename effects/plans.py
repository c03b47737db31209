"""Step plans: work the interpreter announces with ``fx launch <label>`` and expands.

``Decode`` is the plain decode step (specs/scheduler.md §5.16): ``decode_batch`` over the rows, one
``commit_ctx`` per row (the Unified drafter context), then the readback. It is a query: the answer
is the sampled tokens, or the device fault that stopped the batch.
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from .base import Effect, int_tuple, quick_inits
from .readback_calls import HostPick, host_picks


@attrs.frozen
class Plan(Effect):
    """An effect rendered as ``fx launch <label>`` before the calls it expands into."""

    @property
    def label(self) -> str:
        raise NotImplementedError


@attrs.frozen
class Decode(Plan):
    """One plain decode step over ``seqs`` feeding ``tokens``.

    ``picks`` is empty for the device-argmax readback and holds one host pick per row for the
    host-logits readback. ``seq_lens`` are the KV lengths before the step (for ``commit_ctx``).

    Async scheduling (specs/async.md §16.6): ``ahead`` lets the device answer before it reads the
    step's tokens (a ``LATE_TOKEN`` each, kept on the device); a ``LATE_TOKEN`` in ``tokens`` feeds
    the token the sequence's last decode kept; ``resolve`` names the sequences whose kept tokens
    the answer brings back (``TokensSampled.earlier``), in order.
    """

    QUERY: ClassVar[bool] = True
    tokens: tuple[int, ...] = attrs.field(converter=int_tuple)
    seqs: tuple[int, ...] = attrs.field(converter=int_tuple)
    seq_lens: tuple[int, ...] = attrs.field(converter=int_tuple)
    picks: tuple[HostPick, ...] = attrs.field(converter=host_picks, default=())
    ctx: str = "Unified"
    ahead: bool = False
    resolve: tuple[int, ...] = attrs.field(default=(), converter=int_tuple)

    @property
    def readback(self) -> str:
        return "HostLogits" if self.picks else "Argmax"

    @property
    def label(self) -> str:
        extra = (", ahead" if self.ahead else "") + (f", resolve={len(self.resolve)}" if self.resolve else "")
        return f"Decode{{n={len(self.seqs)}, ctx={self.ctx}, readback={self.readback}{extra}}}"


quick_inits(globals())  # every record class above: a quicker __init__ (effects/base.py)
