"""Agenda operations every rule uses: end the batch with a query, push tasks, and look up or
replace active sequences. Pure functions of the state."""

from __future__ import annotations

from collections.abc import Sequence as Sequence_
from typing import Any, Iterable, Mapping, Optional

from fxsched.core.phases import AwaitForward
from fxsched.core.records import copy_fields, with_fields
from fxsched.core.request import Request
from fxsched.core.sequence import Sequence
from fxsched.core.state import (HOT_COLUMNS, NO_DRAFTS, DraftTable, RowFacts, SchedulerState, Settled, hot_columns, hot_fields,
                                hot_row, kept_facts)
from fxsched.effects.base import Effect


class PhaseError(Exception):
    """An event that does not fit the phase the engine is in. The state is left unchanged."""


class Batch(list[Effect]):
    """The effects one step emits, in order, and the state that step was called with (``caller``).

    Ownership (see core/machine.py): every other state a rule meets during the step is a copy made
    in that step, which nobody else can see yet. ``ask`` and ``update`` write such a state in place
    instead of copying all of it: each is a rule's last write, whose result goes straight back to
    the engine (tests/test_house.py keeps every call so). A plain list (a test calling a rule
    directly) owns nothing: every write copies."""

    __slots__ = ("caller",)

    def __init__(self, caller: SchedulerState) -> None:  # (a new list is empty: no ``list.__init__``)
        self.caller = caller


def update(state: SchedulerState, out: list[Effect], changes: dict[str, Any]) -> SchedulerState:
    """A rule's last write: ``state`` with ``changes`` (final values, as ``with_fields`` takes
    them), in place when ``state`` is this step's own copy (``Batch``). Only ever the value a
    rule returns."""
    if state is not getattr(out, "caller", state):  # a copy this step made (a plain list owns nothing)
        state.__dict__.update(changes)
        return state
    return with_fields(state, changes)


def ask(state: SchedulerState, out: list[Effect], query: Effect, waiting: Any,
        put: Optional[Sequence] = None, consumed: bool = False) -> SchedulerState:
    """End the batch with ``query`` and park ``waiting`` until its answer comes; with ``put``, that
    sequence replaces its active record in the same copy (``put_seq``), and with ``consumed`` the
    drafts it held are taken away too (the verify it starts consumes them)."""
    out.append(query)
    if put is None:
        return update(state, out, {"waiting": waiting})
    seq_id = put.seq_id
    changes: dict[str, Any] = {"waiting": waiting, "settled": None,
                               "rows": tuple([put if s.seq_id == seq_id else s for s in state.active])}
    if consumed and seq_id in state.drafts:
        changes["drafts"] = _without(state.drafts, (seq_id,))
    return update(state, out, changes)


def push(state: SchedulerState, *tasks: Any) -> SchedulerState:
    """Put ``tasks`` at the front of the agenda, in order."""
    return with_fields(state, {"agenda": tasks + state.agenda})


def forward(state: SchedulerState, out: list[Effect], query: Effect, seq_ids: Iterable[int], *then: Any,
            request: Optional[Request] = None, slot: Optional[int] = None) -> SchedulerState:
    """Run a forward and continue with the tasks ``then`` once it is done."""
    return ask(state, out, query, AwaitForward(tuple(seq_ids), tuple(then), request, slot))


def find_seq(state: SchedulerState, seq_id: int) -> Sequence:
    for seq in state.active:
        if seq.seq_id == seq_id:
            return seq
    raise KeyError(f"sequence {seq_id} is not active ({state.describe()})")


def has_seq(state: SchedulerState, seq_id: int) -> bool:
    """Whether ``seq_id`` is still active (a fault may have failed it since a task was planned)."""
    return any(s.seq_id == seq_id for s in state.active)


def in_order(rows: Sequence_[Sequence], ids: tuple[int, ...]) -> bool:
    """Whether ``ids`` are the ids of ``rows``, in order (a batch of every active sequence)."""
    return len(rows) == len(ids) and all(s.seq_id == i for s, i in zip(rows, ids, strict=True))


def by_id(state: SchedulerState) -> dict[int, Sequence]:
    """The active sequences by id (build once per rule, not per row)."""
    return {s.seq_id: s for s in state.active}


def put_seqs(state: SchedulerState, updated: dict[int, Sequence]) -> SchedulerState:
    """Replace active sequences by id, keeping the active order (one rebuild for many)."""
    if not updated:
        return state
    get = updated.get
    return with_fields(state, {"rows": tuple([get(s.seq_id, s) for s in state.active]), "settled": None})


def put_seq(state: SchedulerState, seq: Sequence) -> SchedulerState:
    return put_seqs(state, {seq.seq_id: seq})


# --- a batch's hot columns (state.settled) -----------------------------------------------------


def batch_rows(state: SchedulerState, ids: tuple[int, ...]) -> tuple[bool, Sequence_[Sequence], tuple[Sequence_[Any], ...]]:
    """The records of the batch ``ids`` and their hot fields (one column per name of ``HOT_COLUMNS``),
    newest first from the columns of the last batched step; ``ordered`` says whether the batch is
    every active sequence in order (only then do the columns and the records ``rows`` serve)."""
    facts = kept_facts(state)
    ordered = facts.ids == ids if facts is not None else in_order(state.rows, ids)
    columns = hot_columns(state) if ordered else None
    if columns is not None:
        return True, state.rows, columns.columns()
    rows = state.rows if ordered else [by_id(state)[i] for i in ids]
    return ordered, rows, tuple(zip(*map(hot_row, rows), strict=True)) if rows else ((),) * len(HOT_COLUMNS)


def keep_batch(state: SchedulerState, ordered: bool, rows: Sequence_[Sequence], hot: Sequence_[Sequence_[Any]],
               rebuilt: Mapping[int, Sequence], more: Optional[dict[str, Any]] = None,
               facts: Optional[RowFacts] = None) -> SchedulerState:
    """The state after a batched step over ``rows`` (from ``batch_rows``): the new hot columns
    ``hot``, except rows ``rebuilt`` (by index) whose records a sink already made. When the batch
    is every active sequence and no row was rebuilt, the records stay and the columns are kept as
    ``state.settled`` (specs/scheduler.md §5.2); otherwise each record is copied once. ``more``:
    other fields of the state to set in the same copy; ``facts``: the records' ``RowFacts``, when
    the caller worked them out (else those of the columns it started from, if any)."""
    extra = more or {}
    if ordered and not rebuilt:
        settled = Settled(state.rows, *[tuple(c) for c in hot])
        facts = facts if facts is not None else kept_facts(state)
        if facts is not None:  # the same records: their facts carry over to the new columns
            object.__setattr__(settled, "_facts", facts)
        return with_fields(state, {"settled": settled, **extra})
    records = []
    for i, (seq, *values) in enumerate(zip(rows, *hot, strict=True)):
        if i in rebuilt:
            records.append(rebuilt[i])
        else:
            record, changes = copy_fields(seq)
            changes.update(hot_fields(*values))
            records.append(record)
    if ordered:
        return with_fields(state, {"rows": tuple(records), "settled": None, **extra})
    state = put_seqs(state, {s.seq_id: s for s in records})
    return with_fields(state, extra) if extra else state


# --- held drafts (state.drafts) -------------------------------------------------------------------


def held(state: SchedulerState, seq_id: int) -> tuple[int, ...]:
    """The drafts ``seq_id`` holds (``()`` for none)."""
    return state.drafts.get(seq_id, ())


def set_drafts(state: SchedulerState, changes: Mapping[int, tuple[int, ...]]) -> SchedulerState:
    """``state`` with the drafts of some sequences replaced (``()`` takes a sequence's away).
    Entries of sequences no longer active are dropped in the same rebuild."""
    table = state.drafts
    if not table and len(changes) == 1:  # one sequence's proposal (or a no-op drop): nothing to merge
        ((seq_id, drafts),) = changes.items()
        return with_fields(state, {"drafts": DraftTable(changes)}) if drafts else state
    if len(table) + len(changes) > len(state.rows):
        live = {s.seq_id for s in state.rows}
        kept = {i: d for i, d in table.items() if i in live and i not in changes}
    else:
        kept = dict(table)
    for seq_id, drafts in changes.items():
        if drafts:
            kept[seq_id] = drafts
        else:
            kept.pop(seq_id, None)
    return with_fields(state, {"drafts": DraftTable(kept) if kept else NO_DRAFTS})


def _without(table: DraftTable, gone: Iterable[int]) -> DraftTable:
    """``table`` less the entries of ``gone``."""
    dropped = set(gone)
    kept = {i: d for i, d in table.items() if i not in dropped}
    return DraftTable(kept) if kept else NO_DRAFTS


def drop_drafts(state: SchedulerState, seq_ids: Iterable[int]) -> SchedulerState:
    """``state`` with the drafts of ``seq_ids`` taken away (consumed by a verify, or the sequence
    left the batch)."""
    table = state.drafts
    gone = [i for i in seq_ids if i in table]
    return with_fields(state, {"drafts": _without(table, gone)}) if gone else state
