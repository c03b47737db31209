"""The prefill lanes' tasks and waiting records (rules in ``core/prefill.py``): lane 1, new requests
and beam groups, and lane 2, chunked prefill, the mixed readback and promotion
(specs/scheduler.md §5.10-§5.14).

``core/phases.py`` is the namespace of every task and waiting record; ``core/table.py`` maps
each to its rule.
"""

from __future__ import annotations

import attrs

from fxsched.core.request import Request
from fxsched.effects.base import quick_inits


# === lane 1: new requests (core/prefill.py) =====================================================


@attrs.frozen
class StartRequests:
    """Task: lane 1 for this tick's new requests (beam groups first, then one by one)."""


@attrs.frozen
class StartRequest:
    """Task: allocate a sequence for ``request`` and start its prefill."""

    request: Request


@attrs.frozen
class BeamGroup:
    """Task: two or more blocking beam requests answered by one ``generate_beam_batch``."""

    requests: tuple[Request, ...]


@attrs.frozen
class AwaitSlot:
    """Waits for ``SlotAllocated`` for ``request`` as sequence ``seq_id`` (no slot held yet)."""

    request: Request
    seq_id: int


@attrs.frozen
class AwaitLaneAdapter:
    """Waits for the ``AdapterIds`` of ``request``, which holds ``slot`` as ``seq_id``."""

    request: Request
    seq_id: int
    slot: int


@attrs.frozen
class AwaitFirstToken:
    """Waits for the first token (``TokenSampled`` or ``TokensSampled``) of a whole prefill."""

    request: Request
    seq_id: int
    slot: int


@attrs.frozen
class AwaitBeam:
    """Waits for ``BeamHypotheses`` of one beam request holding ``slot``."""

    request: Request
    seq_id: int
    slot: int


@attrs.frozen
class AwaitBeamGroup:
    """Waits for ``BeamHypotheses`` of a beam group; its requests hold no slot."""

    requests: tuple[Request, ...]


@attrs.frozen
class Chunk0Done:
    """Task: chunk 0 of ``request`` ran; read its first token or keep prefilling."""

    request: Request
    seq_id: int
    slot: int
    chunk: int
    last: bool


# === lane 2: chunked prefill (core/prefill.py) ==================================================


@attrs.frozen
class ContinuePrefills:
    """Task: lane 2, the next chunk of every prefilling prompt (mixed with decode rows or not)."""


@attrs.frozen
class PickPrefillToken:
    """Task: read the first token of a prompt whose last chunk ran, from ``row`` of the forward."""

    seq_id: int
    row: int


@attrs.frozen
class AwaitPrefillToken:
    """Waits for the first token of the prefilling prompt ``seq_id``."""

    seq_id: int


@attrs.frozen
class Barrier:
    """Task: the decode stream waits for the prefill stream's work so far."""


@attrs.frozen
class MixedReadback:
    """Task: read the decode rows of a mixed step and hand each token to the plain sink."""

    seq_ids: tuple[int, ...]


@attrs.frozen
class AwaitMixedReadback:
    """Waits for ``TokensSampled`` of a mixed step's decode rows ``seq_ids``."""

    seq_ids: tuple[int, ...]


@attrs.frozen
class Promote:
    """Task: every prompt whose first token is known becomes an active sequence."""


quick_inits(globals())  # every record class above: a quicker __init__ (effects/base.py)
