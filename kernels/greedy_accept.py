"""Greedy acceptance of speculative drafts against the target's argmax rows.

Layout (ragged, sequence-major, like ``cu_seqlens``):

* ``row_offsets``: int32/int64 ``[B + 1]``, ``row_offsets[0] == 0``, non-decreasing,
  ``K_b = row_offsets[b + 1] - row_offsets[b] >= 1``. Sequence ``b`` owns verify
  rows ``row_offsets[b] .. row_offsets[b + 1] - 1``; ``R = row_offsets[B]``.
* ``target_ids``: integer ``[R]``, the target model's argmax at every verify row
  (``row_argmax`` of the verify logits). Row ``i`` of sequence ``b`` predicts the
  token after the sequence's ``i``-th input of the verify step.
* ``draft_ids``: integer ``[R - B]``; sequence ``b`` owns the ``K_b - 1`` drafts
  starting at ``row_offsets[b] - b``. Draft ``i`` of ``b`` is checked against
  ``target_ids[row_offsets[b] + i]``.

Result, per sequence ``b`` (both int64 ``[B]``):

* ``accepted[b]``: number of leading drafts equal to the target argmax at the
  same row, so ``0 <= accepted[b] <= K_b - 1``;
* ``bonus[b] = target_ids[row_offsets[b] + accepted[b]]``: the target's token at
  the first rejected row, or after the last draft when all were accepted.

``accepted[b]`` is also the 0-based verify row whose recurrent state survives
(see ``gdn_fold``).
"""

from __future__ import annotations

import torch

from ._triton import HAVE_TRITON, use_triton

__all__ = [
    "greedy_accept",
    "greedy_accept_reference",
    "greedy_accept_triton",
    "row_offsets_from_counts",
]

_DRAFT_BLOCK = 32


def row_offsets_from_counts(rows_per_sequence: torch.Tensor) -> torch.Tensor:
    """``[K_0, ..., K_{B-1}]`` -> int32 ``[0, K_0, K_0 + K_1, ...]`` (``[B + 1]``)."""
    counts = rows_per_sequence.to(torch.int64)
    offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=counts.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    return offsets.to(torch.int32)


def _check(target_ids: torch.Tensor, draft_ids: torch.Tensor, row_offsets: torch.Tensor) -> None:
    if target_ids.dim() != 1 or draft_ids.dim() != 1 or row_offsets.dim() != 1:
        raise ValueError("target_ids, draft_ids and row_offsets must be 1-D")
    if row_offsets.numel() < 1:
        raise ValueError("row_offsets needs B + 1 >= 1 entries")
    if draft_ids.numel() != target_ids.numel() - (row_offsets.numel() - 1):
        raise ValueError("draft_ids must hold sum(K_b) - B entries")


def greedy_accept_reference(
    target_ids: torch.Tensor, draft_ids: torch.Tensor, row_offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch greedy acceptance; see the module docstring for the layout."""
    _check(target_ids, draft_ids, row_offsets)
    device = target_ids.device
    starts = row_offsets[:-1].to(torch.int64)
    num_seqs = starts.numel()
    drafts_per_seq = row_offsets[1:].to(torch.int64) - starts - 1
    seq_of_draft = torch.repeat_interleave(
        torch.arange(num_seqs, device=device), drafts_per_seq, output_size=draft_ids.numel()
    )
    draft_starts = starts - torch.arange(num_seqs, device=device)
    pos_in_seq = torch.arange(draft_ids.numel(), device=device) - draft_starts[seq_of_draft]
    target_at_draft = target_ids[starts[seq_of_draft] + pos_in_seq]
    mismatch = draft_ids.to(torch.int64) != target_at_draft.to(torch.int64)
    # a matching draft stands for "no mismatch" (K_b - 1), so no data-dependent selection is needed
    first = torch.where(mismatch, pos_in_seq, drafts_per_seq[seq_of_draft])
    accepted = drafts_per_seq.clone()
    accepted.scatter_reduce_(0, seq_of_draft, first, reduce="amin")
    bonus = target_ids[starts + accepted].to(torch.int64)
    return accepted, bonus


if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _greedy_accept_kernel(
        target_ptr,
        draft_ptr,
        row_offsets_ptr,
        accepted_ptr,
        bonus_ptr,
        DRAFT_BLOCK: tl.constexpr,
    ):
        # One program per sequence: accepted = first mismatch position, or K - 1.
        seq = tl.program_id(0)
        row_start = tl.load(row_offsets_ptr + seq).to(tl.int64)
        row_end = tl.load(row_offsets_ptr + seq + 1).to(tl.int64)
        num_drafts = row_end - row_start - 1
        draft_start = row_start - seq
        first_mismatch = num_drafts
        for block_start in range(0, num_drafts, DRAFT_BLOCK):
            pos = block_start + tl.arange(0, DRAFT_BLOCK)
            in_range = pos < num_drafts
            draft = tl.load(draft_ptr + draft_start + pos, mask=in_range, other=0).to(tl.int64)
            target = tl.load(target_ptr + row_start + pos, mask=in_range, other=0).to(tl.int64)
            mismatch_pos = tl.where(in_range & (draft != target), pos, num_drafts)
            first_mismatch = tl.minimum(first_mismatch, tl.min(mismatch_pos, axis=0))
        bonus = tl.load(target_ptr + row_start + first_mismatch).to(tl.int64)
        tl.store(accepted_ptr + seq, first_mismatch)
        tl.store(bonus_ptr + seq, bonus)
else:  # pragma: no cover
    _greedy_accept_kernel = None


def greedy_accept_triton(
    target_ids: torch.Tensor, draft_ids: torch.Tensor, row_offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton greedy acceptance (one program per sequence); no host sync."""
    _check(target_ids, draft_ids, row_offsets)
    num_seqs = row_offsets.numel() - 1
    accepted = torch.empty(num_seqs, dtype=torch.int64, device=target_ids.device)
    bonus = torch.empty(num_seqs, dtype=torch.int64, device=target_ids.device)
    if num_seqs == 0:
        return accepted, bonus
    _greedy_accept_kernel[(num_seqs,)](
        target_ids.contiguous(),
        draft_ids.contiguous(),
        row_offsets.contiguous(),
        accepted,
        bonus,
        DRAFT_BLOCK=_DRAFT_BLOCK,
    )
    return accepted, bonus


def greedy_accept(
    target_ids: torch.Tensor, draft_ids: torch.Tensor, row_offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance: Triton when it can run for these tensors, else the reference."""
    if use_triton(target_ids, draft_ids, row_offsets, kernel=_greedy_accept_kernel):
        return greedy_accept_triton(target_ids, draft_ids, row_offsets)
    return greedy_accept_reference(target_ids, draft_ids, row_offsets)
