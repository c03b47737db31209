"""``widened_linear``: a bf16 product on a CPU without bf16 arithmetic, taken in fp32.

Where the CPU has neither AVX512-BF16 nor AMX-BF16 (most AVX2 servers: Zen 2 and 3, Intel before
Cooper Lake), PyTorch's bf16 matrix product runs a generic path at about 9 GFLOP/s on one core
whatever the shape, against 50-75 GFLOP/s for its fp32 product of the same size: a 512-token prompt
through Qwen3-0.6B's linears takes seconds. Keeping an fp32 copy of the weights would double the
model's memory, so the product here widens the weights one panel of rows at a time into a reused
fp32 buffer of about a megabyte (it stays in cache while fp32 GEMM reads it) and rounds each panel
of outputs once to bf16: the same products and fp32 sums as F.linear's bf16 path, up to the order
of the additions. A few rows (up to 2 x the row kernel's 8) are faster through the row kernel in
slices, each slice streaming the weights once (kernels/cpu_gemv.py). cpu-kernels.md §15.6.
"""

from __future__ import annotations

import torch

from . import cpu_gemv
from ._cpu import bf16_arithmetic, torch_only

__all__ = ["PANEL_BYTES", "wanted", "widened_linear"]

PANEL_BYTES = 1 << 20  # an fp32 weight panel: large enough for GEMM's blocking, small enough for L2/L3
_ROW_SLICES = 2  # up to this many row-kernel passes beat widening (measured: 16 rows 2.9 ms vs 4.2)


def wanted() -> bool:
    """Whether bf16 products on this host should be widened: no bf16 arithmetic in the CPU, and
    not ``FXSCHED_KERNELS=torch``."""
    return not bf16_arithmetic() and not torch_only()


def widened_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K].T for bf16 CPU tensors, [M, N] bf16 (fp32 arithmetic, one rounding)."""
    m, k = x.shape
    n = w.shape[0]
    rows = cpu_gemv.max_rows()
    if m <= rows * _ROW_SLICES and cpu_gemv.ready():
        return torch.cat([cpu_gemv.gemv_bf16(x[i:i + rows], w) for i in range(0, m, rows)])
    xf = x.float()
    out = torch.empty(m, n, dtype=torch.bfloat16)
    panel = max(16, min(n, PANEL_BYTES // (4 * k)) // 16 * 16)
    buf = torch.empty(panel, k)
    for n0 in range(0, n, panel):
        n1 = min(n, n0 + panel)
        wf = buf[: n1 - n0]
        wf.copy_(w[n0:n1])
        out[:, n0:n1].copy_(torch.mm(xf, wf.T))
    return out
