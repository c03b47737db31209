"""Batched row argmax over logits.

``logits``: floating ``[R, V]`` (fp32, fp16 or bf16; any row stride, unit column
stride preferred) -> int64 ``[R]`` with ``torch.argmax(logits, dim=-1)``
semantics exactly:

* ties go to the lowest column index;
* NaN counts as larger than everything, so a row holding NaN returns its first
  NaN column;
* a row of all ``-inf`` returns 0.

Values are compared after an exact upcast to fp32, so the result does not depend
on the block size used to sweep the vocabulary.
"""

from __future__ import annotations

import torch

from ._triton import HAVE_TRITON, next_power_of_2, use_triton

__all__ = ["row_argmax", "row_argmax_reference", "row_argmax_triton"]

_MAX_VOCAB_BLOCK = 2048


def _check(logits: torch.Tensor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [R, V], got {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError("logits must be floating point")
    if logits.shape[1] == 0:
        raise ValueError("argmax over an empty vocabulary")


def row_argmax_reference(logits: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(logits, -1)`` as int64 ``[R]``."""
    _check(logits)
    return torch.argmax(logits, dim=-1).to(torch.int64)


if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _row_argmax_kernel(
        logits_ptr,
        out_ptr,
        vocab_size,
        stride_row,
        stride_col,
        VOCAB_BLOCK: tl.constexpr,
    ):
        # One program per row. Invariant after each block: best_value is the
        # largest non-NaN value so far, best_index its lowest column, and
        # first_nan the lowest NaN column so far (vocab_size when none).
        row = tl.program_id(0).to(tl.int64)
        row_ptr = logits_ptr + row * stride_row
        best_value = tl.full((), -float("inf"), tl.float32)
        best_index = tl.zeros((), dtype=tl.int64)
        first_nan = tl.zeros((), dtype=tl.int64) + vocab_size
        for block_start in range(0, vocab_size, VOCAB_BLOCK):
            cols = block_start + tl.arange(0, VOCAB_BLOCK).to(tl.int64)
            in_range = cols < vocab_size
            values = tl.load(row_ptr + cols * stride_col, mask=in_range, other=-float("inf")).to(tl.float32)
            is_nan = values != values
            first_nan = tl.minimum(first_nan, tl.min(tl.where(is_nan, cols, vocab_size), axis=0))
            clean = tl.where(is_nan, -float("inf"), values)
            block_max = tl.max(clean, axis=0)
            block_index = tl.min(tl.where(in_range & (clean == block_max), cols, vocab_size), axis=0)
            improves = block_max > best_value
            best_index = tl.where(improves, block_index, best_index)
            best_value = tl.where(improves, block_max, best_value)
        result = tl.where(first_nan < vocab_size, first_nan, best_index)
        tl.store(out_ptr + row, result)
else:  # pragma: no cover
    _row_argmax_kernel = None


def row_argmax_triton(logits: torch.Tensor, vocab_block: int | None = None) -> torch.Tensor:
    """Triton row argmax: one program per row sweeping the vocabulary in blocks."""
    _check(logits)
    num_rows, vocab_size = logits.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    block = vocab_block or min(_MAX_VOCAB_BLOCK, next_power_of_2(vocab_size))
    _row_argmax_kernel[(num_rows,)](
        logits,
        out,
        vocab_size,
        logits.stride(0),
        logits.stride(1),
        VOCAB_BLOCK=next_power_of_2(block),
    )
    return out


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row argmax: Triton when it can run for ``logits``, else the reference."""
    if use_triton(logits, kernel=_row_argmax_kernel):
        return row_argmax_triton(logits)
    return row_argmax_reference(logits)
