"""Rules of the batched MTP verify across sequences: the gate, D-Cut depths, the verify, catch-up
and batched propose (specs/speculation.md §6.10–6.11).

Invariants kept: the GDN fold of the batch comes before any per-sequence commit; each sequence's
verdict is the serial verdict with proposing deferred; only unfinished sequences catch up and
re-propose.
"""

from __future__ import annotations

from typing import Optional

from fxsched.core.agenda import ask, by_id, drop_drafts, push, put_seqs
from fxsched.core.events import BatchVerifyAllowed, VerifyRows
from fxsched.core.phases import AwaitMtpBatch, AwaitMtpGate, MtpBatch, MtpGate, MtpGateCheck, SerialVerify
from fxsched.core.rows import batch_picks, grow
from fxsched.core.sequence import Sequence
from fxsched.core.state import SchedulerState
from fxsched.core.verdict import accepted_prefix
from fxsched.core.verifying import propose_after_batch, shared_verdict
from fxsched.effects import device_calls as dc
from fxsched.effects.base import Effect

DCUT_WIDTH_CAP = 8
DCUT_KEEP_RATIO = 0.75
ROW_BUDGET = 160
CHUNK_SEQS = 32
CANONICAL_ORDER_FROM = 8
CATCHUP_STRIDE = 4


def round_half_up(x: float) -> int:
    return int(x + 0.5)


def dcut_depths(confidences: list[tuple[float, ...]], draft_count: int) -> list[int]:
    """Verify depths (rows) per sequence after D-Cut pruning.

    Candidates ``(i, j)`` (sequence i, depth j = 1 .. draft_count - 1) are scored by the sum of
    sequence i's confidences for drafts 0 .. j, best first, ties by i then j; the first
    ``min(round(prunable * 0.75), 160 - 2n, prunable)`` are kept. With equal scores the last
    sequences lose depth first.
    """
    n = len(confidences)
    prunable = n * (draft_count - 1)
    candidates: list[tuple[float, int, int]] = []
    for i, conf in enumerate(confidences):
        for j in range(1, draft_count):
            score = sum(conf[: j + 1]) if conf else 0.0
            candidates.append((-score, i, j))
    candidates.sort()
    keep = min(round_half_up(prunable * DCUT_KEEP_RATIO), ROW_BUDGET - 2 * n, prunable)
    deepest = [0] * n
    for _, i, j in candidates[:max(keep, 0)]:
        deepest[i] = max(deepest[i], j)
    return [min(1 + d, draft_count) + 1 for d in deepest]


def batch_depths(count: int, draft_count: int,
                 confidences: Optional[list[tuple[float, ...]]] = None) -> list[int]:
    """Rows per sequence: D-Cut for 2+ drafts and 1..8 sequences, else the full depth."""
    if draft_count >= 2 and 1 <= count <= DCUT_WIDTH_CAP:
        return dcut_depths(confidences or [()] * count, draft_count)
    return [draft_count + 1] * count


def batch_order(entries: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Order ``(k, slot, index)`` entries: below 8 by (k desc, slot, index); from 8 up by (slot, index)."""
    if len(entries) >= CANONICAL_ORDER_FROM:
        return sorted(entries, key=lambda e: (e[1], e[2]))
    return sorted(entries, key=lambda e: (-e[0], e[1], e[2]))


def chunk_by_rows(ks: list[int]) -> list[tuple[int, int]]:
    """Consecutive ``(start, end)`` runs of at most 32 sequences with at most 160 rows."""
    runs: list[tuple[int, int]] = []
    start, rows = 0, 0
    for index, k in enumerate(ks):
        if index > start and (index - start >= CHUNK_SEQS or rows + k > ROW_BUDGET):
            runs.append((start, index))
            start, rows = index, 0
        rows += k
    if ks:
        runs.append((start, len(ks)))
    return runs


def gate(state: SchedulerState, task: MtpGate, out: list[Effect]) -> SchedulerState:
    """Split the verify sequences into batched chunks and serial verifies (specs/speculation.md §6.10)."""
    seq_ids, draft_count = task.seq_ids, task.draft_count
    active = by_id(state)
    drafts = state.drafts
    batchable = [i for i in seq_ids if len(drafts.get(i, ())) >= draft_count]
    serial = [i for i in seq_ids if len(drafts.get(i, ())) < draft_count]
    ks = batch_depths(len(batchable), draft_count)
    ordered = batch_order([(k, active[i].slot, n) for n, (i, k) in enumerate(zip(batchable, ks, strict=True))])
    order_ids = [batchable[n] for _, _, n in ordered]
    order_ks = [k for k, _, _ in ordered]
    tasks: list[object] = []
    for start, end in chunk_by_rows(order_ks):
        if end - start >= 2:
            tasks.append(MtpGateCheck(MtpBatch(tuple(order_ids[start:end]), tuple(order_ks[start:end]), draft_count)))
        else:
            serial.extend(order_ids[start:end])
    chosen = set(serial)
    tail = [SerialVerify(i, draft_count) for i in seq_ids if i in chosen]
    return push(state, *tasks, *tail)


def gate_check(state: SchedulerState, task: MtpGateCheck, out: list[Effect]) -> SchedulerState:
    live = {s.seq_id for s in state.active}
    if any(i not in live for i in task.batch.seq_ids):  # a fault failed some since the gate
        return push(state, *(SerialVerify(i, task.batch.draft_count) for i in task.batch.seq_ids if i in live))
    return ask(state, out, dc.CanBatchVerify(task.batch.ks), AwaitMtpGate(task.batch))


def gate_answer(state: SchedulerState, waiting: AwaitMtpGate, event: BatchVerifyAllowed,
                out: list[Effect]) -> SchedulerState:
    batch = waiting.batch
    if not event.allowed:
        members = set(batch.seq_ids)
        order = [s.seq_id for s in state.active if s.seq_id in members]
        return push(state, *(SerialVerify(i, batch.draft_count) for i in order))
    return _start_batch(state, batch, out)


def _start_batch(state: SchedulerState, batch: MtpBatch, out: list[Effect]) -> SchedulerState:
    active = by_id(state)
    held_drafts = state.drafts
    tokens: list[int] = []
    drafts, pre_lens = [], []
    grown: dict[int, Sequence] = {}
    for seq_id, k in zip(batch.seq_ids, batch.ks, strict=True):
        seq = active[seq_id]
        mine = held_drafts.get(seq_id, ())[: k - 1]
        tokens.append(seq.last_token)
        tokens.extend(mine)
        drafts.append(mine)
        pre_lens.append(seq.seq_len)
        grown[seq_id] = grow(seq, seq.seq_len + k, state.model.block_size)
    out.append(dc.SyncSecondaryCall())
    seqs = [active[i] for i in batch.seq_ids]
    picks = batch_picks([s.request for s in seqs], [len(s.output) for s in seqs], batch.ks)
    query = dc.DecodeVerifyBatched(tokens=tokens, ks=batch.ks, seqs=batch.seq_ids, stream=0, woa=True, picks=picks)
    waiting = AwaitMtpBatch(batch.seq_ids, batch.ks, tuple(drafts), tuple(pre_lens), batch.draft_count)
    return ask(drop_drafts(put_seqs(state, grown), batch.seq_ids), out, query, waiting)


def batch_verified(state: SchedulerState, waiting: AwaitMtpBatch, event: VerifyRows,
                   out: list[Effect]) -> SchedulerState:
    offsets, off = [], 0
    for k in waiting.ks:
        offsets.append(off)
        off += k
    nas = []
    for i, k in enumerate(waiting.ks):
        rows = event.rows[offsets[i]:offsets[i] + k]
        nd = min(len(waiting.drafts[i]), k - 1)
        nas.append(min(accepted_prefix(waiting.drafts[i][:nd], rows), nd))
    out.append(dc.StashVerifyHiddenRows(tuple(o + na for o, na in zip(offsets, nas, strict=True))))
    pairs = [(CATCHUP_STRIDE * i + j, offsets[i] + j) for i, na in enumerate(nas) for j in range(min(na, CATCHUP_STRIDE))]
    if pairs:
        out.append(dc.StashVerifyCatchupRows(tuple(pairs)))
    active = by_id(state)
    out.append(dc.GdnFoldAccepted(tuple(active[i].slot for i in waiting.seq_ids), tuple(na + 1 for na in nas),
                                  max(waiting.ks)))
    for i, (seq_id, k) in enumerate(zip(waiting.seq_ids, waiting.ks, strict=True)):
        rows = event.rows[offsets[i]:offsets[i] + k]
        nd = min(len(waiting.drafts[i]), k - 1)
        state = shared_verdict(state, active[seq_id], waiting.drafts[i], rows, k, nas[i], nd, waiting.pre_lens[i],
                               waiting.draft_count, out, deferred=True)
    active = by_id(state)
    pending = [(i, seq_id) for i, seq_id in enumerate(waiting.seq_ids) if not active[seq_id].finished]
    if not pending:
        return state
    if any(nas[i] for i, _ in pending):
        caught = [waiting.drafts[i][: min(nas[i], CATCHUP_STRIDE)] for i, _ in pending]
        out.append(dc.CatchupBatched(
            tokens=caught,
            slots=tuple(CATCHUP_STRIDE * i for i, _ in pending),
            pos=tuple(active[seq_id].seq_len - len(c) for (_, seq_id), c in zip(pending, caught, strict=True)),
        ))
    return propose_after_batch(state, pending, waiting.draft_count, out)
