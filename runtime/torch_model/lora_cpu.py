"""The CPU's LoRA product for a bf16 model on packed weights (specs/lora.md §18.2, cpu-kernels.md §15.8).

Where the model's projections are packed (`packing.packing_ready`: the AMX or the AVX512-BF16
kernel reads them), the pool's adapters of each projection are packed the same way, as two bf16
matrices over every slot at once:

* `A_all [P, in]`: the slots' A stacked (slot s in rows s R' .. s R' + R' - 1), and
* `B_all [out, P]`: the slots' B side by side (slot s in columns s R' ..), the scale already in it,

P = max_loras x R' rounded up to a multiple of 32 (zero rows and columns beyond). A batch's delta is
then `((x A_all^T) * mask) B_all^T`, mask keeping each row's own slot's R' columns (zero for a base
row): two products of the packed kernel and one multiply, rounding h and the delta to bf16 once each
(as a bf16 model's LoRA layers do), where the fp32 dense product of lora_rows.py takes six operations and
fp32 products several times slower at decode sizes. It applies while P is at most
`lora_rows.DENSE_MAX_COLUMNS`.

The packed copies are rebuilt from the pool's fp32 tensors when a slot's adapter changes (lazily,
at the next product of the projection): a rebuild of a projection is a copy of a few hundred KB.
"""

from __future__ import annotations

import torch

from fxsched.kernels import cpu_amx

from .ops import linear


class PackedDeltas:
    """Per adapted projection, `A_all` and `B_all` packed in tile order (see the module docstring)."""

    def __init__(self, max_loras: int, rank: int):
        self.rank = rank
        self.columns = -(-max_loras * rank // 32) * 32  # P
        self._a: dict[str, torch.Tensor] = {}
        self._b: dict[str, torch.Tensor] = {}
        self._stale: set[str] = set()

    def changed(self, name: str) -> None:
        """A slot's adapter of projection `name` changed: its packed copies are rebuilt when next used."""
        self._stale.add(name)

    def takes(self, a: torch.Tensor, out_dim: int) -> bool:
        """Whether the packed kernel takes a projection of pool A `a` [S, R', in] and `out_dim` outputs."""
        return a.shape[-1] % 32 == 0 and out_dim % 16 == 0

    def _packed(self, name: str, a: torch.Tensor, bt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if name in self._stale or name not in self._a:
            slots, rank, in_dim = a.shape
            out_dim = bt.shape[-1]
            a_all = torch.zeros(self.columns, in_dim, dtype=torch.bfloat16)
            a_all[:slots * rank] = a.reshape(slots * rank, in_dim)
            b_all = torch.zeros(out_dim, self.columns, dtype=torch.bfloat16)
            b_all[:, :slots * rank] = bt.reshape(slots * rank, out_dim).t()
            self._a[name], self._b[name] = cpu_amx.pack(a_all), cpu_amx.pack(b_all)
            self._stale.discard(name)
        return self._a[name], self._b[name]

    def mask(self, row_slot: torch.Tensor) -> torch.Tensor:
        """[n, P] bf16 from each flat row's adapter slot (-1: none): 1 where the row's slot owns the column."""
        cols = torch.arange(self.columns) // self.rank
        return (row_slot[:, None] == cols[None, :]).to(torch.bfloat16)

    def add(self, name: str, a: torch.Tensor, bt: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
            mask: torch.Tensor) -> torch.Tensor:
        """y [..., out] plus the delta of every row of x [..., in] (bf16) under `mask`."""
        a_all, b_all = self._packed(name, a, bt)
        flat = x.reshape(-1, x.shape[-1])
        h = linear(flat, a_all)
        h.mul_(mask)
        delta = linear(h, b_all)
        return (y.reshape(-1, y.shape[-1]) + delta).view(y.shape)
