"""A forward's adapted rows and the grouped products that add each row's adapter to a projection
(specs/lora.md §18.2): `LoraRows` (built by `lora.LoraPool.batch_rows`), the hook `project`, and the
torch grouped product `grouped_lora`; the CUDA path's Triton kernels are kernels/lora_sgmv.py, the
CPU's packed product for bf16 models lora_cpu.py.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from fxsched.kernels.lora_sgmv import lora_expand_, lora_shrink

from .kernel_paths import lora_kernels_apply
from .ops import linear

if TYPE_CHECKING:
    from .lora import LoraPool

# the CPU's dense product (LoraRows.add) takes at most this many columns (slots lo..hi x the pool's
# rank): beyond, the grouped product, whose work does not grow with the slots between the batch's
DENSE_MAX_COLUMNS = 256


@functools.lru_cache(maxsize=None)
def _cuda_grouped(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def _grouped_mm_takes(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether torch._grouped_mm takes these shapes: a CPU (any float dtype, 16-byte strides) or an
    sm_90 GPU in bf16."""
    if torch.compiler.is_compiling():
        return False
    size = x.element_size()
    if any(n * size % 16 for n in (x.shape[-1], a.shape[1], b.shape[1])):
        return False
    if x.device.type == "cpu":
        return True
    return x.device.type == "cuda" and x.dtype == torch.bfloat16 and _cuda_grouped(x.device.index or 0)


def grouped_lora(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor,
                 segments: Sequence[tuple[int, int, int]] | None = None) -> torch.Tensor:
    """(x @ A[s]^T) @ B[s]^T for rows x [N, in] sorted by slot, slot s's rows ending at ends[s]
    (int32 [S]); a [S, R, in], b [S, out, R]. Two grouped products (shrink, expand); where
    torch._grouped_mm does not take the shapes, one product pair per segment (slot, start, end),
    from `segments` or from `ends` read back."""
    if _grouped_mm_takes(x, a, b):
        h = torch._grouped_mm(x, a.transpose(-2, -1), offs=ends)
        return torch._grouped_mm(h, b.transpose(-2, -1), offs=ends)
    if segments is None:
        bounds = [0] + ends.tolist()
        segments = [(s, bounds[s], bounds[s + 1]) for s in range(len(bounds) - 1) if bounds[s + 1] > bounds[s]]
    parts = [(x[lo:hi] @ a[s].transpose(0, 1)) @ b[s].transpose(0, 1) for s, lo, hi in segments]
    return torch.cat(parts) if parts else x.new_zeros(0, b.shape[1])


@dataclass(frozen=True)
class LoraRows:
    """The adapted rows of one forward (specs/lora.md §18.2): `rows` [M] flat indices of x's rows
    (b * T + i) sorted by adapter slot, `ends` [max_loras] int32 each slot's end offset among them,
    `present` the slots the batch uses (host), `segments` (slot, start, end) of each non-empty slot
    when the host knows them (the per-segment fallback then reads nothing back)."""

    pool: LoraPool
    rows: torch.Tensor
    ends: torch.Tensor
    present: frozenset[int]
    segments: tuple[tuple[int, int, int], ...] = ()
    _masks: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    _slots: list[torch.Tensor] = dataclasses.field(default_factory=list, compare=False, repr=False)
    _packed_masks: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def row_slots(self) -> torch.Tensor:
        """int32 [M]: each adapted row's adapter slot (from `ends`, on the device; once per forward)."""
        if not self._slots:
            index = torch.arange(self.rows.shape[0], dtype=torch.int32, device=self.ends.device)
            self._slots.append(torch.bucketize(index, self.ends, out_int32=True, right=True))
        return self._slots[0]

    def _dense_span(self) -> tuple[int, int] | None:
        """The slots lo..hi of the CPU's dense product, when it applies (see ``add``)."""
        if self.pool.device.type != "cpu" or not self.present or not self.segments:
            return None
        lo, hi = min(self.present), max(self.present)
        return (lo, hi) if (hi - lo + 1) * self.pool.rank <= DENSE_MAX_COLUMNS else None

    def _row_slot(self, n: int) -> torch.Tensor:
        """[n] each flat row's adapter slot (-1: none), from the host's segments."""
        row_slot = torch.full((n,), -1, dtype=torch.long)
        for slot, start, end in self.segments:
            row_slot.index_fill_(0, self.rows[start:end].long(), slot)
        return row_slot

    def _mask(self, n: int, lo: int, hi: int) -> torch.Tensor:
        """[n, (hi - lo + 1) * rank] fp32: 1 where the flat row's adapter slot owns the column."""
        mask = self._masks.get(n)
        if mask is None:
            cols = torch.arange(lo, hi + 1).repeat_interleave(self.pool.rank)
            mask = (self._row_slot(n)[:, None] == cols[None, :]).to(self.pool.dtype)
            self._masks[n] = mask
        return mask

    def _packed_mask(self, n: int) -> torch.Tensor:
        """The packed product's [n, P] bf16 mask (lora_cpu.PackedDeltas.mask), once per forward."""
        mask = self._packed_masks.get(n)
        if mask is None:
            assert self.pool.packed is not None
            mask = self._packed_masks[n] = self.pool.packed.mask(self._row_slot(n))
        return mask

    def add(self, name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base projection `name` of x [..., in], [..., out]) plus each adapted row's delta (on
        the Triton path added into y in place: callers pass a fresh product)."""
        slots = self.pool.targets.get(name)
        if not slots or slots.isdisjoint(self.present):
            return y
        a, b = self.pool.a[name], self.pool.b[name]
        if lora_kernels_apply(x, a):  # CUDA (the CPU by opt-in): the Triton shrink, then expand into y
            row_slots = self.row_slots()
            h = lora_shrink(x.reshape(-1, x.shape[-1]), self.rows, row_slots, a)
            out = y.reshape(-1, y.shape[-1])
            if out.stride(-1) != 1:
                out = out.contiguous()
            lora_expand_(h, self.rows, row_slots, b, out)
            return y if out.data_ptr() == y.data_ptr() else out.view(y.shape)
        packed = self.pool.packed
        if packed is not None and self.segments and x.dtype == torch.bfloat16 and packed.takes(a, b.shape[1]):
            n = x.numel() // x.shape[-1]  # a bf16 model on packed weights: two packed products (lora_cpu.py)
            return packed.add(name, a, self.pool.bt[name], x, y, self._packed_mask(n))
        span = self._dense_span()
        if span is not None:  # the CPU: every row against the slots lo..hi at once, masked to its own
            lo, hi = span
            flat = x.reshape(-1, x.shape[-1])
            h = torch.mm(flat.to(a.dtype), a[lo:hi + 1].reshape(-1, a.shape[-1]).t())
            h.mul_(self._mask(flat.shape[0], lo, hi))
            delta = torch.mm(h, self.pool.bt[name][lo:hi + 1].reshape(-1, b.shape[1]))
            return (y.reshape(-1, y.shape[-1]) + delta.to(y.dtype)).view(y.shape)
        xs = x.reshape(-1, x.shape[-1]).index_select(0, self.rows)
        delta = grouped_lora(xs.to(a.dtype), a, b, self.ends, self.segments or None)
        flat = y.reshape(-1, y.shape[-1]).index_add(0, self.rows, delta.to(y.dtype))
        return flat.view(y.shape)


def project(x: torch.Tensor, w: dict[str, torch.Tensor], name: str, lora: LoraRows | None) -> torch.Tensor:
    """linear(x, w[name]) plus the batch's adapters of projection `name` (the hook of §18.2)."""
    y = linear(x, w[name])
    return y if lora is None else lora.add(name, x, y)
