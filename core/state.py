"""The scheduler state: one frozen record that says everything about where the engine is.

``agenda`` is the work still to do in this tick (tasks, front first); ``waiting`` is the answer the
engine waits for, with what it needs to go on (or ``None`` while it runs). Printing a state shows
exactly which phase of which tick the engine is in.

The active sequences are ``active``: the records ``rows`` with, after a batched step that every
sequence went on from, the step's hot fields as columns (``settled``) over them, and the drafts
they hold as one table (``drafts``). A steady tick so copies no sequence record
(specs/scheduler.md §5.2).
"""

from __future__ import annotations

from array import array
from operator import sub
from typing import Any, Optional

import attrs

from fxsched.core.config import ModelInfo, SchedulerConfig
from fxsched.core.request import Request
from fxsched.core.records import copy_fields
from fxsched.core.sequence import Sequence
from fxsched.core.token_log import TokenLog, view


class DraftTable(dict[int, tuple[int, ...]]):
    """The drafts the active sequences hold: ``seq_id -> drafts`` (never an empty tuple; a
    sequence without drafts has no entry). One column for the whole batch, so a batched proposal
    is one table built from the device's answer, not one record copy per sequence
    (specs/scheduler.md §5.2). Immutable and hashable like the records around it; entries of
    sequences that left the batch may linger until the next rebuild and mean nothing."""

    __slots__ = ()

    @staticmethod
    def of_batch(ids: tuple[int, ...], drafts: tuple[tuple[int, ...], ...]) -> "DraftTable":
        """The table of a batched proposal: row ``i``'s sequence ``ids[i]`` holds ``drafts[i]``
        (each non-empty). It keeps the two columns, so the rules of the next verify read the drafts
        of the same batch as one tuple (``column_for``), not one look-up per sequence."""
        return BatchDraftTable(ids, drafts)

    def column_for(self, ids: tuple[int, ...]) -> Optional[tuple[tuple[int, ...], ...]]:
        """The drafts of ``ids`` in order, when this table is a batch's (``of_batch``) of exactly
        those sequences; else None (look them up one by one)."""
        return None

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(frozenset(self.items()))

    def _immutable(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a DraftTable is immutable; build a new one")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = __ior__ = _immutable

    def __reduce__(self) -> tuple[type, tuple[dict[int, tuple[int, ...]]]]:
        return (DraftTable, (dict(self),))

    def __copy__(self) -> "DraftTable":
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> "DraftTable":
        return self

    def __repr__(self) -> str:
        return f"DraftTable({dict.__repr__(self)})"


class BatchDraftTable(DraftTable):
    """A ``DraftTable`` made by ``DraftTable.of_batch``: the same value, with the ids and drafts
    columns it was built from."""

    __slots__ = ("_ids", "_column")

    def __init__(self, ids: tuple[int, ...], drafts: tuple[tuple[int, ...], ...]) -> None:
        super().__init__(zip(ids, drafts, strict=True))
        self._ids, self._column = ids, drafts

    def column_for(self, ids: tuple[int, ...]) -> Optional[tuple[tuple[int, ...], ...]]:
        mine = self._ids
        return self._column if mine is ids or mine == ids else None


NO_DRAFTS = DraftTable()


@attrs.frozen
class PrefillEntry:
    """A chunked prompt partly fed: ``offset`` prompt tokens are in the KV."""

    seq_id: int
    request: Request
    slot: int
    offset: int
    first_token: Optional[int] = None
    first_logprobs: int = 0


@attrs.frozen
class Preempted:
    """A sequence dropped from the KV, waiting to be re-prefilled from its whole history."""

    sequence: Sequence
    tokens: tuple[int, ...]


@attrs.frozen
class Swapped:
    """A sequence spilled to the swap pool (its state saved by the device under ``seq_id``)."""

    sequence: Sequence


# the columns of ``Settled``: the fields a batched verify or plain decode changes on every row that
# goes on (``seq_len``, ``blocks``, ``acc``, ``output``, ``remaining``, ``content_count``,
# ``last_token``). ``output`` is two columns, its array and ``out_base``; ``out_base``, ``end`` and
# ``content_base`` are the output length, budget and content count as offsets from ``seq_len``, which
# a row that goes on the common way moves in step with them, so those columns stay as they are
HOT_COLUMNS = ("seq_len", "blocks", "acc", "out_buf", "out_base", "end", "content_base", "last_token")


def hot_fields(seq_len: int, blocks: int, acc: int, out_buf: "array[int]", out_base: int, end: int,
               content_base: int, last_token: int) -> dict[str, Any]:
    """A row of the hot columns (``HOT_COLUMNS``, in order) as the record fields they stand for."""
    return {"seq_len": seq_len, "blocks": blocks, "acc": acc, "output": view(out_buf, seq_len - out_base),
            "remaining": end - seq_len, "content_count": seq_len - content_base, "last_token": last_token}


def hot_row(seq: Sequence) -> tuple[Any, ...]:
    """A record's hot fields as a row of the hot columns (``HOT_COLUMNS``, in order)."""
    fields = seq.__dict__
    seq_len = fields["seq_len"]
    buf, length = fields["output"].parts()
    return (seq_len, fields["blocks"], fields["acc"], buf, seq_len - length, seq_len + fields["remaining"],
            seq_len - fields["content_count"], fields["last_token"])


@attrs.frozen(slots=False)
class Settled:
    """The hot fields of every active sequence after a batched DFlash verify or a plain decode, as
    columns over the records ``base`` (specs/scheduler.md §5.2): row ``i`` of each column stands
    for the field of ``base[i]``. The records keep their other fields exact; only these seven are
    newer in the columns. A step that every sequence goes on from the common way thus writes a few
    tuples instead of a record per sequence; whoever reads ``state.active`` gets the records rebuilt
    once (``records()``). A row's output is its token array and its length (a ``TokenLog`` view of
    it, ``output``), so a steady row adds tokens to its array and makes no new object.

    The output length, the budget left and the content count are held as offsets from ``seq_len``
    (``out_base = seq_len - len(output)``, ``end = seq_len + remaining``, ``content_base = seq_len -
    content_count``): a row that goes on the common way grows all of them by the tokens it takes,
    so these offsets stay and their columns pass from one step to the next unchanged. A steady row
    so writes two new numbers per step (``seq_len``, and ``acc`` when a draft was accepted), not
    five; on a wide batch of long sequences each new number is an object of its own in memory."""

    base: tuple[Sequence, ...]
    seq_len: tuple[int, ...]
    blocks: tuple[int, ...]
    acc: tuple[int, ...]
    out_buf: tuple["array[int]", ...]
    out_base: tuple[int, ...]
    end: tuple[int, ...]
    content_base: tuple[int, ...]
    last_token: tuple[int, ...]

    @property
    def out_len(self) -> tuple[int, ...]:
        """Each row's output length."""
        return tuple(map(sub, self.seq_len, self.out_base))

    @property
    def output(self) -> tuple[TokenLog, ...]:
        """Each row's output, as a log."""
        return tuple(map(view, self.out_buf, self.out_len))

    def columns(self) -> tuple[tuple[Any, ...], ...]:
        """The hot columns, in the order of ``HOT_COLUMNS``."""
        return (self.seq_len, self.blocks, self.acc, self.out_buf, self.out_base, self.end,
                self.content_base, self.last_token)

    def facts(self) -> "RowFacts":
        """What a tick reads of the records ``base`` besides the hot fields (worked out on the first
        call, then kept: like ``records``, a pure function of ``base``, and carried to the next
        columns over the same records by ``agenda.keep_batch``)."""
        facts = self.__dict__.get("_facts")
        if facts is None:
            facts = row_facts(self.base)
            object.__setattr__(self, "_facts", facts)
        return facts

    def records(self) -> tuple[Sequence, ...]:
        """The sequences with the columns applied (built on the first call, then kept: it is the
        same value every time, like the columns it comes from)."""
        built = self.__dict__.get("_records")
        if built is None:
            rebuilt = []
            for seq, *hot in zip(self.base, *self.columns(), strict=True):
                new, fields = copy_fields(seq)
                fields.update(hot_fields(*hot))
                rebuilt.append(new)
            built = tuple(rebuilt)
            object.__setattr__(self, "_records", built)  # a cache of a pure function of the fields
        return built


@attrs.frozen
class RowFacts:
    """The fields of the active records a steady tick reads besides the hot ones, for the whole
    batch: ids and slots in order, whether any record is finished, whether none has a guard set,
    the earliest deadline of an unfinished one (None: none has a deadline), whether every one goes
    on (none finished, none with its cancel flag set), whether every request is greedy from its
    first token (``Request.greedy``), and what a streamed row sends its client: which rows stream,
    the request ids of those (in order) and their record sizes (empty when every one is 0), and
    whether any request asks for logprob records at all. A
    batched verify or plain decode whose rows all go on reads these instead of every record and
    request (specs/scheduler.md §5.2)."""

    ids: tuple[int, ...]
    slots: tuple[int, ...]
    any_finished: bool
    all_unguarded: bool
    next_deadline: Optional[float]
    all_going: bool = False
    all_greedy: bool = False
    streaming: tuple[bool, ...] = ()
    stream_ids: tuple[int, ...] = ()
    stream_logprobs: tuple[int, ...] = ()
    any_top_logprobs: bool = False  # some request asks for logprob records


def row_facts(rows: tuple[Sequence, ...]) -> RowFacts:
    """The ``RowFacts`` of ``rows``, in one pass over the records."""
    ids, slots, streaming, stream_ids, stream_logprobs = [], [], [], [], []
    finished = guarded = cancel = sampled = records = False
    deadline: Optional[float] = None
    for seq in rows:
        fields = seq.__dict__
        ids.append(fields["seq_id"])
        slots.append(fields["slot"])
        request = fields["request"]
        if fields["finished"]:
            finished = True
        else:
            due = request.deadline_ms
            if due is not None and (deadline is None or due < deadline):
                deadline = due
        if fields["guard"] is not None:
            guarded = True
        if fields["cancel_requested"]:
            cancel = True
        if not request.greedy:
            sampled = True
        if request.top_logprobs:
            records = True
        streaming.append(request.streaming)
        if request.streaming:
            stream_ids.append(request.id)
            stream_logprobs.append(request.top_logprobs if fields["logprob_records"] else 0)
    return RowFacts(tuple(ids), tuple(slots), finished, not guarded, deadline, not (finished or cancel), not sampled,
                    tuple(streaming), tuple(stream_ids), tuple(stream_logprobs) if any(stream_logprobs) else (), records)


def kept_facts(state: "SchedulerState") -> Optional[RowFacts]:
    """The ``RowFacts`` of the active records kept with the hot columns, while those apply (None
    otherwise: a state whose records a rule just made reads them from the records)."""
    settled = state.settled
    return settled.facts() if settled is not None and settled.base is state.rows else None


@attrs.frozen(slots=False)
class SchedulerState:
    config: SchedulerConfig
    model: ModelInfo
    tick: int = 0
    now_ms: float = 0.0
    # inputs not yet drained
    inbox: tuple[Request, ...] = ()
    inbox_rotations: tuple[str, ...] = ()
    inbox_closed: bool = False
    # drained
    closed: bool = False
    pending: tuple[Request, ...] = ()
    rotations: tuple[str, ...] = ()
    new_requests: tuple[Request, ...] = ()
    # in flight
    prefilling: tuple[PrefillEntry, ...] = ()
    rows: tuple[Sequence, ...] = attrs.field(default=(), alias="active")  # read ``active``
    settled: Optional[Settled] = None
    drafts: DraftTable = NO_DRAFTS
    swapped: tuple[Swapped, ...] = ()
    preempted: tuple[Preempted, ...] = ()
    restoring: tuple[Sequence, ...] = ()
    prefix_hits: tuple[tuple[int, int], ...] = ()
    cancels: frozenset[int] = frozenset()
    # the loop
    agenda: tuple[Any, ...] = ()
    waiting: Any = None
    next_seq_id: int = 1
    prefill_stream: int = 1
    prefill_event: int = 2
    mixed_step_ran: bool = False
    last_decode_ms: float = 0.0
    stopped: bool = False

    @property
    def active(self) -> tuple[Sequence, ...]:
        """The active sequences, in order (**the order matters**, specs/scheduler.md §5.2): the
        records ``rows``, with the columns of ``settled`` applied when a batched step left them
        there. The rules of a steady tick read ``rows`` for what the columns never hold (ids, slots,
        requests, flags) and ``hot_columns`` for the rest; everything else reads ``active``."""
        settled, rows = self.settled, self.rows
        if settled is None or settled.base is not rows:
            return rows
        return settled.records()

    @staticmethod
    def _renamed(changes: dict[str, Any]) -> dict[str, Any]:
        """``records.replace``'s hook: ``active=`` sets the records and drops any columns."""
        if "active" in changes:
            changes["rows"] = changes.pop("active")
            changes["settled"] = None
        return changes

    def describe(self) -> str:
        """A one-line account of where the engine is (for errors and logs)."""
        waiting = type(self.waiting).__name__ if self.waiting is not None else "running"
        head = type(self.agenda[0]).__name__ if self.agenda else "-"
        return f"tick {self.tick}, {waiting}, next task {head}"


def hot_columns(state: SchedulerState) -> Optional[Settled]:
    """The columns of the last batched step, when they still apply to the records ``rows``."""
    settled = state.settled
    return settled if settled is not None and settled.base is state.rows else None


def queue_idle(state: SchedulerState) -> bool:
    """Nothing pending, no rotation asked for, the inbox still open."""
    return not state.pending and not state.rotations and not state.closed


def in_flight(state: SchedulerState) -> bool:
    """Some sequence is active or prefilling."""
    return bool(state.rows or state.prefilling)


def quiescent(state: SchedulerState) -> bool:
    """Nothing active, prefilling, newly admitted, swapped or preempted."""
    return not (state.rows or state.prefilling or state.new_requests or state.swapped or state.preempted)


def initial_state(config: SchedulerConfig, model: ModelInfo) -> SchedulerState:
    """A scheduler that has not booted yet; ``Boot`` starts it."""
    return SchedulerState(config=config, model=model)
