"""Who a device fault fails, by the rule book (specs/faults.md §8.3, §8.4): the checker's own copy of
the table, written from the rule book and not read from ``core/table.py``, so a wrong scope there is
a violation here (``fault_scope``), and tests/test_faults.py's expectations are this table too.

``RULE_BOOK`` maps each waiting phase's name to its scope: ``("halt", reason or None)``,
``("requests", field)`` (requests that hold no device sequence), ``("rotation",)``, ``("active",)``,
``("rule",)`` (the phase's own rule takes the fault, §8.4), or ``("seqs", fields, request field or
None, every prefilling prompt too)``.
"""

from __future__ import annotations

from typing import Any

from fxsched.runtime.check.violation import Violation

_NO_COUNT = "the device cannot count its free blocks"
_NO_RECLAIM = "the device cannot reclaim prefix-cache blocks"

_ONE = ("seqs", ("seq_id",), None, False)
_MANY = ("seqs", ("seq_ids",), None, False)
_STARTING = ("seqs", ("seq_id",), "request", False)  # a request starting: its sequence, else itself

RULE_BOOK: dict[str, tuple] = {
    "AwaitStream": ("halt", None), "AwaitEvent": ("halt", None), "AwaitInput": ("halt", None),
    "AwaitPublishBlocks": ("halt", _NO_COUNT), "AwaitSwapOutFree": ("halt", _NO_COUNT),
    "AwaitSwapInFree": ("halt", _NO_COUNT), "AwaitSwapOutReclaim": ("halt", _NO_RECLAIM),
    "AwaitSwapInReclaim": ("halt", _NO_RECLAIM),
    "AwaitAdapterIds": ("requests", "new"),
    "AwaitRotation": ("rotation",),
    "AwaitForward": ("seqs", ("seq_ids",), "request", False),
    "AwaitSlot": _STARTING, "AwaitLaneAdapter": _STARTING, "AwaitFirstToken": _STARTING, "AwaitBeam": _STARTING,
    "AwaitBeamGroup": ("requests", "requests"),
    "AwaitPrefillToken": _ONE,
    "AwaitMixedReadback": ("seqs", ("seq_ids",), None, True),
    "AwaitDecode": ("rule",),
    "AwaitCapacity": ("active",), "AwaitSelfCapacity": ("active",),
    "AwaitProposal": _ONE, "AwaitKVerify": _ONE, "AwaitMtpDecode": _ONE, "AwaitDflashDrafts": _ONE,
    "AwaitDflashVerify": _ONE, "AwaitNgramDecode": _ONE, "AwaitNgramVerify": _ONE, "AwaitSelfToken": _ONE,
    "AwaitSelfVerify": _ONE,
    "AwaitBatchedProposal": _MANY, "AwaitBatchedDflash": _MANY, "AwaitMtpBatch": _MANY, "AwaitAhead": _MANY,
    "AwaitDflashGate": ("seqs", ("batchable", "rest"), None, False),
    "AwaitMtpGate": ("seqs", ("batch.seq_ids",), None, False),
    "AwaitSwapInSlot": _ONE,
    "AwaitRestore": ("rule",),
    "AwaitResumeFree": _ONE, "AwaitResumeReclaim": _ONE, "AwaitResumeSlot": _ONE,
}


def _get(record: Any, path: str) -> Any:
    for name in path.split("."):
        record = getattr(record, name)
    return record


def requests_held(state: Any) -> dict[int, int]:
    """seq id -> request id of every sequence the scheduler holds (active, prefilling, being
    restored, preempted)."""
    held = {s.seq_id: s.request.id for s in state.active}
    held.update({e.seq_id: e.request.id for e in state.prefilling})
    held.update({s.seq_id: s.request.id for s in state.restoring})
    held.update({p.sequence.seq_id: p.sequence.request.id for p in state.preempted})
    return held


def finishes_on(state: Any, seq_id: int, token: int) -> bool:
    """Whether sequence ``seq_id`` ends on taking ``token`` (the decode sink's rule, specs/scheduler.md
    §5.17): EOS, its budget spent, the context full, or a cancel asked for."""
    config = state.config
    for seq in state.active:
        if seq.seq_id == seq_id:
            return (token in config.eos_ids or seq.remaining <= 1 or seq.seq_len + 1 >= config.max_seq_len
                    or seq.cancel_requested)
    return False


def declared(state: Any, kv_exhausted: bool = False, earlier: tuple[int, ...] = ()) -> tuple[set[int], set[int]]:
    """(request ids that must get an ``Error``, seq ids that must be gone) for a fault answering the
    query ``state`` waits on. A KV-exhausted plain decode of several rows preempts one instead
    (§8.4): nobody fails. A pipelined decode's fault (specs/async.md §16.6 rule 6): with the kept
    tokens it was to resolve (``earlier``), they are taken first and the fault is the decode's own
    over the rows whose sequence goes on; without them, every sequence of both decodes fails."""
    waiting = state.waiting
    scope = RULE_BOOK[type(waiting).__name__]
    held = requests_held(state)
    kind = scope[0]
    resolve = getattr(waiting, "resolve", ())
    if kind == "rule" and resolve:
        if len(earlier) != len(resolve):
            gone = set(resolve) | set(waiting.seq_ids)
            return {held[i] for i in gone if i in held}, gone
        done = {s for s, t in zip(resolve, earlier, strict=True) if finishes_on(state, s, t)}
        going = [s for s in waiting.seq_ids if s not in done]
        if kv_exhausted and len(going) > 1:
            return set(), set()
        return {held[i] for i in going if i in held}, set(going)
    if kind == "seqs":
        _, fields, request_field, all_prefilling = scope
        ids: list[int] = []
        for path in fields:
            value = _get(waiting, path)
            ids.extend(value if isinstance(value, tuple) else (value,))
        request = _get(waiting, request_field) if request_field else None
        if request is not None and not set(ids) & set(held):
            return {request.id}, set()
        gone = set(ids) & set(held)
        if all_prefilling:
            gone |= {e.seq_id for e in state.prefilling}
        return {held[i] for i in gone}, gone
    if kind == "requests":
        return {r.id for r in _get(waiting, scope[1])}, set()
    if kind == "active":
        return {s.request.id for s in state.active}, {s.seq_id for s in state.active}
    if kind == "rule":
        seqs = tuple(getattr(waiting, "seq_ids", None) or (waiting.seq_id,))
        if kv_exhausted and len(seqs) > 1 and type(waiting).__name__ == "AwaitDecode":
            return set(), set()
        return {held[i] for i in seqs if i in held}, set(seqs)
    return set(), set()


def fault_scope(expected: set[int], errors: set[int], phase: str) -> None:
    """fault scope (specs/faults.md §8.3): a fault in ``phase`` gives every request its scope names
    an ``Error`` in the step that takes the fault."""
    missing = sorted(expected - errors)
    if missing:
        raise Violation("fault_scope", f"a fault in {phase} must fail requests {sorted(expected)} (specs/faults.md "
                                       f"§8.3); {missing} got no Error")
