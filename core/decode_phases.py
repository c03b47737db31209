"""Lane 3's tasks and waiting records (rules in ``core/decode.py``): the decode dispatch, the plain
decode step and the tokens kept on the device by decodes answered ahead (specs/scheduler.md
§5.15-§5.16, specs/async.md §16.6).

``core/phases.py`` is the namespace of every task and waiting record; ``core/table.py`` maps
each to its rule.
"""

from __future__ import annotations

import attrs

from fxsched.effects.base import quick_inits


# === lane 3: dispatch and plain decode (core/decode.py) =========================================


@attrs.frozen
class DecodeLane:
    """Task: choose the decode path of this tick (n-gram, self-spec, MTP/DFlash or plain)."""


@attrs.frozen
class PlainDecode:
    """Task: one plain decode step over every active sequence in slot order."""


@attrs.frozen
class AwaitDecode:
    """Waits for ``TokensSampled`` (or a ``DeviceFault``) of the plain decode of ``seq_ids``;
    ``resolve``: the sequences whose kept tokens the answer brings (specs/async.md §16.6)."""

    seq_ids: tuple[int, ...]
    resolve: tuple[int, ...] = ()


@attrs.frozen
class ResolveAhead:
    """Task: read back the tokens kept on the device by decodes answered ahead, before work that
    needs every sequence's last token (specs/async.md §16.6)."""


@attrs.frozen
class RetireResolved:
    """Task: retire the sequences the tokens read at a tick's start finished, before admission."""


@attrs.frozen
class AwaitAhead:
    """Waits for ``TokensSampled`` with the kept tokens of ``seq_ids`` in ``earlier``."""

    seq_ids: tuple[int, ...]


quick_inits(globals())  # every record class above: a quicker __init__ (effects/base.py)
