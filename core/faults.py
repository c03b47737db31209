"""Device faults: a failed forward fails only the sequences it was working on.

A ``DeviceFault`` that answers a query on specific sequences (a forward, a readback, a proposal)
releases those sequences without caching them (``ReleaseSeq{cache=false, send_error}``) and sends
their clients ``Error(<message>)``; the rest of the tick goes on without them. A fault on a query
that concerns no sequence (the free-block count, the adapter table) cannot be pinned on anyone
and stays a phase error for the host to handle.
"""

from __future__ import annotations

from typing import Any, Optional

from fxsched.core.records import replace
from fxsched.core.request import Request
from fxsched.core.state import SchedulerState
from fxsched.effects.client import ErrorOut
from fxsched.effects.lifecycle import ReleaseSeq


def fault_scope(waiting: Any) -> Optional[tuple[tuple[int, ...], Optional[Request]]]:
    """(sequence ids in flight, request not yet in any collection) of a waiting record, or None."""
    request = getattr(waiting, "request", None)
    if hasattr(waiting, "seq_ids"):
        return tuple(waiting.seq_ids), request
    if hasattr(waiting, "seq_id"):
        return (waiting.seq_id,), request
    if hasattr(waiting, "batch"):
        return tuple(waiting.batch.seq_ids), request
    return None


def fail_request(request: Request, seq_id: int, slot: Optional[int], message: str, out: list) -> None:
    """Fail a request that holds a device sequence in ``slot`` (or none, when ``slot`` is None)."""
    if slot is not None:
        out.append(ReleaseSeq(seq_id, slot, cache=False, reason="send_error"))
    out.append(ErrorOut(request.id, message, request.streaming))


def fail_sequences(state: SchedulerState, seq_ids, message: str, out: list,
                   also_prefilling: bool = False) -> SchedulerState:
    """Fail every listed sequence wherever it is; device-held ones are released without caching."""
    ids = set(seq_ids)
    for seq in state.active:
        if seq.seq_id in ids:
            fail_request(seq.request, seq.seq_id, seq.slot, message, out)
    for entry in state.prefilling:
        if entry.seq_id in ids or also_prefilling:
            fail_request(entry.request, entry.seq_id, entry.slot, message, out)
    for seq in state.restoring:
        if seq.seq_id in ids:
            fail_request(seq.request, seq.seq_id, None, message, out)
    for entry in state.preempted:
        if entry.sequence.seq_id in ids:
            fail_request(entry.sequence.request, entry.sequence.seq_id, None, message, out)
    return replace(
        state,
        active=tuple(s for s in state.active if s.seq_id not in ids),
        prefilling=() if also_prefilling else tuple(e for e in state.prefilling if e.seq_id not in ids),
        restoring=tuple(s for s in state.restoring if s.seq_id not in ids),
        preempted=tuple(p for p in state.preempted if p.sequence.seq_id not in ids),
        prefix_hits=tuple(h for h in state.prefix_hits if h[0] not in ids),
    )


def fail_in_flight(state: SchedulerState, waiting: Any, message: str, out: list) -> Optional[SchedulerState]:
    """Fail what ``waiting`` was working on; ``None`` when the fault concerns no sequence."""
    scope = fault_scope(waiting)
    if scope is None:
        return None
    ids, request = scope
    held = {s.seq_id for s in state.active} | {e.seq_id for e in state.prefilling} | \
        {s.seq_id for s in state.restoring} | {p.sequence.seq_id for p in state.preempted}
    if request is not None and not (set(ids) & held):
        slot = getattr(waiting, "slot", None)
        fail_request(request, ids[0], slot, message, out)
        return replace(state, prefix_hits=tuple(h for h in state.prefix_hits if h[0] not in ids))
    mixed = type(waiting).__name__ == "AwaitMixedReadback"
    return fail_sequences(state, ids, message, out, also_prefilling=mixed)
