"""Device faults by declaration: each waiting phase says what a ``DeviceFault`` there fails
(specs/faults.md §8.1–8.4).

A fault on a query about specific sequences fails exactly those: device-held ones are released
without caching (``ReleaseSeq{cache=false, send_error}``) and every affected client gets one
``Error(<message>)``; the rest of the tick goes on without them. The declarations are data, used
by ``core/table.py``:

- ``FailSeqs(fields)``: the sequences named by the waiting record's fields (ids wherever they are:
  active, prefilling, restoring, preempted); with ``request``, a request not yet held anywhere (its
  first prefill) is failed by itself; with ``all_prefilling``, every prefilling prompt too (a mixed
  step feeds them all).
- ``FailRequests(field)``: requests that hold no device sequence (a beam group, the admissions of
  an adapter check) each get an ``Error`` and leave the tick's new requests.
- ``FailActive()``: every active sequence (a query over all active slots).
- ``FailRotation(field)``: the rotation is acknowledged with the fault as its error.
- ``RuleTakesFault()``: the phase's own rule takes the fault (e.g. a KV-full decode preempts).
- ``Halt(reason)``: the fault concerns no sequence and the loop cannot go on; ``step`` raises
  ``PhaseError`` naming the reason, and the host decides.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import attrs

from fxsched.core.records import replace
from fxsched.core.request import Request
from fxsched.core.state import SchedulerState
from fxsched.effects.base import Effect
from fxsched.effects.client import ErrorOut, RotationAck
from fxsched.effects.lifecycle import ReleaseReason, ReleaseSeq

SHUTDOWN_ABORT = "aborted: the scheduler shut down"


@attrs.frozen
class FailSeqs:
    fields: tuple[str, ...]
    request: Optional[str] = None
    slot: Optional[str] = None
    all_prefilling: bool = False

    def describe(self) -> str:
        what = "the sequences in " + ", ".join(self.fields)
        if self.request:
            what += f" (or {self.request}, not yet held)"
        if self.all_prefilling:
            what += " and every prefilling prompt"
        return what


@attrs.frozen
class FailRequests:
    field: str

    def describe(self) -> str:
        return f"the requests in {self.field} (no slot held)"


@attrs.frozen
class FailActive:
    def describe(self) -> str:
        return "every active sequence"


@attrs.frozen
class FailRotation:
    field: str

    def describe(self) -> str:
        return f"the rotation to {self.field} (acknowledged with the error)"


@attrs.frozen
class RuleTakesFault:
    def describe(self) -> str:
        return "decided by the rule (it accepts DeviceFault)"


@attrs.frozen
class Halt:
    reason: str

    def describe(self) -> str:
        return f"nothing: the loop cannot go on ({self.reason})"


FaultScope = FailSeqs | FailRequests | FailActive | FailRotation | RuleTakesFault | Halt


# --- failing ------------------------------------------------------------------------------------


def fail_request(request: Request, seq_id: int, slot: Optional[int], message: str, out: list[Effect]) -> None:
    """Fail a request that holds a device sequence in ``slot`` (or none, when ``slot`` is None)."""
    if slot is not None:
        out.append(ReleaseSeq(seq_id, slot, cache=False, reason=ReleaseReason.SEND_ERROR))
    out.append(ErrorOut(request.id, message, request.streaming))


def fail_sequences(state: SchedulerState, seq_ids: Iterable[int], message: str, out: list[Effect],
                   also_prefilling: bool = False) -> SchedulerState:
    """Fail every listed sequence wherever it is; device-held ones are released without caching."""
    ids = set(seq_ids)
    for seq in state.active:
        if seq.seq_id in ids:
            fail_request(seq.request, seq.seq_id, seq.slot, message, out)
    for entry in state.prefilling:
        if entry.seq_id in ids or also_prefilling:
            fail_request(entry.request, entry.seq_id, entry.slot, message, out)
    for restoring in state.restoring:
        if restoring.seq_id in ids:
            fail_request(restoring.request, restoring.seq_id, None, message, out)
    for held in state.preempted:
        if held.sequence.seq_id in ids:
            fail_request(held.sequence.request, held.sequence.seq_id, None, message, out)
    return replace(
        state,
        active=tuple(s for s in state.active if s.seq_id not in ids),
        prefilling=() if also_prefilling else tuple(e for e in state.prefilling if e.seq_id not in ids),
        restoring=tuple(s for s in state.restoring if s.seq_id not in ids),
        preempted=tuple(p for p in state.preempted if p.sequence.seq_id not in ids),
        prefix_hits=tuple(h for h in state.prefix_hits if h[0] not in ids),
    )


def _get(record: Any, path: str) -> Any:
    for name in path.split("."):
        record = getattr(record, name)
    return record


def _ids(waiting: Any, fields: tuple[str, ...]) -> tuple[int, ...]:
    ids: list[int] = []
    for path in fields:
        value = _get(waiting, path)
        ids.extend(value if isinstance(value, tuple) else (value,))
    return tuple(ids)


def held_ids(state: SchedulerState) -> set[int]:
    """Every sequence id the scheduler holds anywhere."""
    return ({s.seq_id for s in state.active} | {e.seq_id for e in state.prefilling}
            | {s.seq_id for s in state.restoring} | {p.sequence.seq_id for p in state.preempted})


def apply_fault(scope: FaultScope, state: SchedulerState, waiting: Any, message: str,
                out: list[Effect]) -> Optional[SchedulerState]:
    """Fail what ``scope`` declares for ``waiting``; ``None`` for ``Halt`` and ``RuleTakesFault``."""
    if isinstance(scope, FailSeqs):
        ids = _ids(waiting, scope.fields)
        request = _get(waiting, scope.request) if scope.request else None
        if request is not None and not (set(ids) & held_ids(state)):
            slot = _get(waiting, scope.slot) if scope.slot else None
            fail_request(request, ids[0], slot, message, out)
            return replace(state, prefix_hits=tuple(h for h in state.prefix_hits if h[0] not in ids))
        return fail_sequences(state, ids, message, out, also_prefilling=scope.all_prefilling)
    if isinstance(scope, FailRequests):
        requests: tuple[Request, ...] = _get(waiting, scope.field)
        for request in requests:
            out.append(ErrorOut(request.id, message, request.streaming))
        gone = {r.id for r in requests}
        return replace(state, new_requests=tuple(r for r in state.new_requests if r.id not in gone))
    if isinstance(scope, FailActive):
        return fail_sequences(state, [s.seq_id for s in state.active], message, out)
    if isinstance(scope, FailRotation):
        out.append(RotationAck(_get(waiting, scope.field), message))
        return state
    return None
