"""Where attention finds each sequence's keys in a forward: a plan built once on the host, read by
every attention layer.

A forward over B sequences writes the K/V of its new rows into the paged cache, then each query
row attends over the keys of positions 0..its own position. The plan (`SeqKeys`, one per batch
entry) says where those keys are, so that no layer gathers the whole context of the batch into a
dense, padded tensor (the cost that dominated the old path at real sizes):

* ``fresh`` -- the sequence had no committed tokens (a first prefill chunk): its keys are exactly
  the forward's own new rows, so attention runs causally on them (top-left aligned, T == S) and
  never reads the cache;
* ``run`` -- the blocks holding positions 0..ctx-1 are consecutive block ids, so the keys are a
  strided *view* of the cache: flat rows [flat_start, flat_start + ctx). The block pool places
  each sequence's blocks to keep this the common case (paged_kv.BlockPool.allocate's ``after``);
* ``gather`` -- anything else (a prefix-cache hit, a fragmented pool): one index_select of the
  sequence's own blocks (never a padded batch-wide gather).

A query row at position p may see keys 0..p. With several new rows and a committed prefix the
alignment is bottom-right, so those get an explicit boolean mask [rows, ctx]; a single row sees
every key and needs none.

On the CPU the entries that add few rows to a committed prefix (decode and verify) are served
together by one call of the C row kernel (kernels/cpu_attention.py): `RowKeys` lists their query
rows, each row's context (its position + 1) and its sequence's block table, and the kernel reads
the keys in place through the table, so "run" and "gather" cost the same there. Prefill chunks
(many rows) keep PyTorch's fused SDPA, which is compute-bound there and fast.

The plan is host data computed from the engine's bookkeeping before the forward (Python ints the
engine already holds), so building it costs no device synchronisation. The traceable path
(`attention.paged_attention`, used when a batch carries no plan) needs none of it.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .transfers import host_tensor

__all__ = ["AttnPlan", "RowKeys", "SeqKeys", "decode_plan", "plan_keys"]

# An entry adding at most this many rows to a committed prefix goes to the row kernel (decode: 1,
# verify: drafts + 1); longer chunks are prefill work for SDPA.
ROW_KERNEL_MAX_ROWS = 16


@dataclass(frozen=True)
class SeqKeys:
    """Batch entry b's attention keys: rows new rows from position start (ctx = start + rows keys)."""

    rows: int
    start: int
    source: str  # "fresh" | "run" | "gather"
    flat_start: int = 0  # "run": flat cache row of position 0
    blocks: torch.Tensor | None = None  # "gather": the block ids holding positions 0..ctx-1
    mask: torch.Tensor | None = None  # [rows, ctx] bool (True = may attend) when rows > 1 and start > 0
    offset: int = 0  # the flat row of its first new row in the forward's [B * T] rows

    @property
    def ctx(self) -> int:
        """Keys the sequence's last new row sees."""
        return self.start + self.rows


@dataclass(frozen=True)
class RowKeys:
    """The query rows one row-kernel call serves: batch entries `entries`; for kernel row r, query
    row q_rows[r] of the flattened [B * T] batch sees positions 0 .. ctx[r] - 1 through block table
    tables[r] (int32 tensors [R], [R], [R, nb])."""

    entries: frozenset[int]
    q_rows: torch.Tensor
    ctx: torch.Tensor
    tables: torch.Tensor


class AttnPlan:
    """A forward's attention plan: every entry's keys, and the rows the row kernel serves (None:
    every entry goes through SDPA). ``seqs`` may be given as a function that builds them when first
    read: a decode whose every row the row kernel serves needs them only if the kernel cannot run."""

    __slots__ = ("_seqs", "_build", "rows")

    def __init__(self, seqs: tuple[SeqKeys, ...] | Callable[[], tuple[SeqKeys, ...]],
                 rows: RowKeys | None = None) -> None:
        self._seqs: tuple[SeqKeys, ...] | None = None if callable(seqs) else seqs
        self._build: Callable[[], tuple[SeqKeys, ...]] | None = seqs if callable(seqs) else None
        self.rows = rows

    @property
    def seqs(self) -> tuple[SeqKeys, ...]:
        if self._seqs is None:
            assert self._build is not None
            self._seqs = self._build()
        return self._seqs


def _row_keys(block_tables: Sequence[Sequence[int]], starts: Sequence[int], rows: Sequence[int],
              block_size: int, firsts: Sequence[int]) -> RowKeys | None:
    """The row kernel's rows of the entries it serves (decode and verify rows over cached keys),
    as three views of one int32 host buffer (no per-value conversion)."""
    entries: list[int] = []
    q_rows = array("i")
    ctx = array("i")
    tables = array("i")
    nb = max(-(-(start + n) // block_size) for start, n in zip(starts, rows, strict=True))
    for b, (table, start, n) in enumerate(zip(block_tables, starts, rows, strict=True)):
        if start == 0 or n > ROW_KERNEL_MAX_ROWS:
            continue
        entries.append(b)
        padded = array("i", table[:nb])
        padded.extend([0] * (nb - len(padded)))
        q_rows.extend(range(firsts[b], firsts[b] + n))
        ctx.extend(range(start + 1, start + n + 1))
        for _ in range(n):
            tables.extend(padded)
    if not entries:
        return None
    r = len(q_rows)
    flat = host_tensor(q_rows + ctx + tables, torch.int32)
    return RowKeys(frozenset(entries), flat[:r], flat[r:2 * r], flat[2 * r:].view(r, nb))


def _consecutive(table: Sequence[int], blocks: int) -> bool:
    first = table[0]
    return all(table[i] == first + i for i in range(1, blocks))


def plan_keys(block_tables: Sequence[Sequence[int]], starts: Sequence[int], rows: Sequence[int],
              block_size: int, device: torch.device, row_kernel: bool = False,
              firsts: Sequence[int] | None = None) -> AttnPlan:
    """The plan of a forward whose entry b adds rows[b] rows at starts[b] to a sequence whose
    block table (covering start + rows positions) is block_tables[b]; row_kernel: list the
    decode and verify rows for the CPU row kernel (host tensors). When the row kernel serves every
    entry, the per-entry keys are built only if read (the kernel cannot run). firsts: each entry's
    first row in the forward's flat rows (default b * T, a right-padded [B, T] batch; a packed
    forward's entries lie one after another)."""
    at = firsts if firsts is not None else [b * max(rows) for b in range(len(rows))]
    kernel_rows = _row_keys(block_tables, starts, rows, block_size, at) if row_kernel else None
    if kernel_rows is not None and len(kernel_rows.entries) == len(starts):
        return AttnPlan(lambda: _seq_keys(block_tables, starts, rows, block_size, device, at), kernel_rows)
    return AttnPlan(_seq_keys(block_tables, starts, rows, block_size, device, at), kernel_rows)


def _seq_keys(block_tables: Sequence[Sequence[int]], starts: Sequence[int], rows: Sequence[int],
              block_size: int, device: torch.device, firsts: Sequence[int]) -> tuple[SeqKeys, ...]:
    plan = []
    for table, start, n, offset in zip(block_tables, starts, rows, firsts, strict=True):
        ctx = start + n
        if start == 0:
            plan.append(SeqKeys(n, 0, "fresh", offset=offset))
            continue
        mask = None
        if n > 1:
            mask = (torch.arange(ctx, device=device)[None, :]
                    <= torch.arange(start, ctx, device=device)[:, None])
        blocks = -(-ctx // block_size)
        if _consecutive(table, blocks):
            plan.append(SeqKeys(n, start, "run", flat_start=table[0] * block_size, mask=mask, offset=offset))
        else:
            ids = torch.tensor(list(table[:blocks]), dtype=torch.long, device=device)
            plan.append(SeqKeys(n, start, "gather", blocks=ids, mask=mask, offset=offset))
    return tuple(plan)


def decode_plan(block_tables: Sequence[Sequence[int]], starts: Sequence[int], tables: torch.Tensor,
                block_size: int, device: torch.device) -> AttnPlan:
    """``plan_keys`` of a decode on the CPU row kernel (one row per entry, every entry at a start
    above 0), its kernel rows made from the batch's own tensors: ``tables`` [B, nb] the block tables
    as sent with the batch. The per-entry keys are built only if read (the kernel cannot run)."""
    b = len(starts)
    rows = RowKeys(frozenset(range(b)), torch.arange(b, dtype=torch.int32),
                   torch.tensor(starts, dtype=torch.int32).add_(1), tables.to(torch.int32))
    return AttnPlan(lambda: _seq_keys(block_tables, starts, [1] * b, block_size, device, range(b)), rows)
