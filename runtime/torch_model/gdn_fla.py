"""A prompt's GDN recurrence on CUDA by flash-linear-attention's chunked kernels (specs/gpu-kernels.md
§17.6 says which library serves what on CUDA, and why).

fla's `chunk_gated_delta_rule` (Triton, what vLLM and SGLang run for Qwen3-Next and Qwen3.5) computes
the same recurrence as `gdn_chunked.chunked_gated_delta`, with the same conventions (S is [Dk, Dv];
g is the log-decay; q and k come normalised, q already scaled, so scale = 1), but returns only each
sequence's final state, where a committed forward needs the states after its kept rows (each
sequence's last row and its snapshot boundaries). So the rows are cut into segments that end at the
kept rows (the union over the batch, as `chunked_gated_delta` shares them) and run one call per
segment, each starting from the state the previous one ended with: the state a segment ends with
is the kept state of its last row. The kept rows are host data (`RowBatch.gdn_keep_rows`), so the
cutting reads nothing back. A batch's rows are right-padded: a shorter sequence's states past its
last row include padding rows, and are never read for it.

`segmented_gated_delta` takes the kernel as an argument (same calling convention as fla's), so the
segmentation is checked on the CPU with fla's own naive recurrence; the kernel is checked against
`chunked_gated_delta` on CUDA.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Sequence

import torch

__all__ = ["fla_prefill_applies", "fla_chunk_kernel", "segmented_gated_delta"]

Kernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@functools.lru_cache(maxsize=1)
def fla_chunk_kernel() -> Kernel | None:
    """fla's `chunk_gated_delta_rule`, or None where flash-linear-attention is not installed."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # noqa: BLE001 -- an optional library: any import failure means "not here"
        return None
    kernel: Kernel = chunk_gated_delta_rule
    return kernel


def fla_prefill_applies(q: torch.Tensor) -> bool:
    """Whether a prompt's recurrence over q runs on fla's kernels: CUDA tensors, fla installed, and
    neither FXSCHED_KERNELS=torch (the torch code everywhere) nor FXSCHED_GDN_PREFILL=torch."""
    if q.device.type != "cuda":
        return False
    if os.environ.get("FXSCHED_KERNELS", "").strip().lower() == "torch":
        return False
    if os.environ.get("FXSCHED_GDN_PREFILL", "").strip().lower() == "torch":
        return False
    return fla_chunk_kernel() is not None


def segmented_gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          state0: torch.Tensor, keep_rows: Sequence[int],
                          kernel: Kernel | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs [B, T, H, Dv] (q's dtype) and kept states [B, R, H, Dk, Dv] (state0's dtype) of the gated
    delta rule over q, k [B, T, H, Dk], v [B, T, H, Dv], g, beta [B, T, H] from state0 [B, H, Dk, Dv]:
    kept[:, i] is the state after row keep_rows[i] (any order, repeats allowed), as
    `chunked_gated_delta` returns them. `kernel`: fla's calling convention (default: fla's chunk
    kernel)."""
    run = kernel if kernel is not None else fla_chunk_kernel()
    if run is None:
        raise RuntimeError("flash-linear-attention is not installed")
    b, t = q.shape[:2]
    if t == 0:
        return q.new_empty(b, 0, *v.shape[2:]), state0.new_empty(b, len(keep_rows), *state0.shape[1:])
    bad = [r for r in keep_rows if not 0 <= r < t]
    if bad:
        raise ValueError(f"keep_rows must lie in [0, {t}), got {bad[:4]}")
    ends = sorted({r + 1 for r in keep_rows} | {t})
    state = state0.float()
    outs: list[torch.Tensor] = []
    after: dict[int, torch.Tensor] = {}
    start = 0
    for end in ends:
        o, state = _call(run, q[:, start:end], k[:, start:end], v[:, start:end], g[:, start:end],
                         beta[:, start:end], state)
        outs.append(o)
        after[end - 1] = state
        start = end
    out = torch.cat(outs, dim=1).to(q.dtype)
    if not keep_rows:
        return out, state0.new_empty(b, 0, *state0.shape[1:])
    kept = torch.stack([after[r] for r in keep_rows], dim=1).to(state0.dtype)
    return out, kept


def _call(run: Kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
          state: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """One segment through the kernel: (outputs, the state after its last row, fp32)."""
    o, final = run(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), scale=1.0,
                   initial_state=state, output_final_state=True)
    return o, final.float()
