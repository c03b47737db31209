"""GDN fold: keep the accepted verify row's recurrent and conv state, in place.

A K-row verify step of a Gated DeltaNet layer produces one intermediate state
per row. Once acceptance is known, each sequence keeps the state *after* its
accepted row and drops the rest:

* ``states_rows``: ``[B, Kmax, H, Dk, Dv]``, recurrent state after each verify row;
* ``conv_rows``: ``[B, Kmax, C, W]``, short-conv window after each verify row;
* ``accepted_index``: integer ``[B]``, 0-based verify row to keep, in
  ``[0, K_b)`` (pass ``greedy_accept``'s ``accepted`` count directly: row 0 is
  the verified input token, rows ``1..accepted`` the accepted drafts);
* ``slot_ids``: integer ``[B]``, cache slot of each sequence; a negative slot
  marks a padding entry that writes nothing. Non-negative slots must be unique.
* ``state``: ``[S, H, Dk, Dv]`` and ``conv``: ``[S, C, W]``, the per-slot caches,
  updated in place. ``W`` is whatever width the caller keeps per conv state (the
  torch model keeps the last ``conv_width - 1`` inputs); only the shapes of
  ``conv_rows[b, k]`` and ``conv[s]`` must agree.

Effect: for every ``b`` with ``slot_ids[b] >= 0``::

    state[slot_ids[b]] = states_rows[b, accepted_index[b]]
    conv[slot_ids[b]] = conv_rows[b, accepted_index[b]]

Values are cast to the destination dtype; other slots are untouched.
"""

from __future__ import annotations

import torch

from ._triton import HAVE_TRITON, cdiv, use_triton

__all__ = ["gdn_fold", "gdn_fold_reference", "gdn_fold_rows", "gdn_fold_triton"]

_COPY_BLOCK = 1024


def _check(states_rows, conv_rows, accepted_index, slot_ids, state, conv) -> None:
    if states_rows.dim() != 5 or state.dim() != 4:
        raise ValueError("states_rows must be [B, Kmax, H, Dk, Dv] and state [S, H, Dk, Dv]")
    if conv_rows.dim() != 4 or conv.dim() != 3:
        raise ValueError("conv_rows must be [B, Kmax, C, W] and conv [S, C, W]")
    batch = states_rows.shape[0]
    if conv_rows.shape[:2] != states_rows.shape[:2]:
        raise ValueError("states_rows and conv_rows disagree on [B, Kmax]")
    if states_rows.shape[2:] != state.shape[1:] or conv_rows.shape[2:] != conv.shape[1:]:
        raise ValueError("per-row and per-slot shapes disagree")
    if accepted_index.shape != (batch,) or slot_ids.shape != (batch,):
        raise ValueError("accepted_index and slot_ids must be [B]")


def gdn_fold_reference(
    states_rows: torch.Tensor,
    conv_rows: torch.Tensor,
    accepted_index: torch.Tensor,
    slot_ids: torch.Tensor,
    state: torch.Tensor,
    conv: torch.Tensor,
) -> None:
    """Plain-torch fold; writes ``state`` and ``conv`` in place."""
    _check(states_rows, conv_rows, accepted_index, slot_ids, state, conv)
    live = slot_ids >= 0
    batch_index = torch.arange(states_rows.shape[0], device=states_rows.device)[live]
    rows = accepted_index.to(torch.int64)[live]
    slots = slot_ids.to(torch.int64)[live]
    state[slots] = states_rows[batch_index, rows].to(state.dtype)
    conv[slots] = conv_rows[batch_index, rows].to(conv.dtype)



def gdn_fold_rows(
    states_rows: torch.Tensor,
    conv_rows: torch.Tensor,
    batch_index: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    state: torch.Tensor,
    conv: torch.Tensor,
) -> None:
    """The fold of the live entries only (the caller dropped the padding ones on the host): slot
    slots[i] gets row rows[i] of batch entry batch_index[i]; writes ``state`` and ``conv`` in place.
    gdn_fold_reference's result with no boolean mask, so nothing waits for the device and nothing
    has a data-dependent shape (it runs on the meta device too)."""
    state.index_copy_(0, slots, states_rows[batch_index, rows].to(state.dtype))
    conv.index_copy_(0, slots, conv_rows[batch_index, rows].to(conv.dtype))

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _gather_rows_to_slots_kernel(
        src_ptr,
        dst_ptr,
        row_index_ptr,
        slot_ptr,
        numel_per_row,
        src_stride_batch,
        src_stride_row,
        dst_stride_slot,
        COPY_BLOCK: tl.constexpr,
    ):
        # Program (b, chunk) copies one COPY_BLOCK chunk of the contiguous
        # per-row block src[b, row_index[b]] into dst[slot[b]].
        seq = tl.program_id(0)
        chunk = tl.program_id(1)
        slot = tl.load(slot_ptr + seq).to(tl.int64)
        if slot >= 0:
            row = tl.load(row_index_ptr + seq).to(tl.int64)
            offsets = chunk.to(tl.int64) * COPY_BLOCK + tl.arange(0, COPY_BLOCK)
            in_range = offsets < numel_per_row
            src = src_ptr + seq.to(tl.int64) * src_stride_batch + row * src_stride_row
            values = tl.load(src + offsets, mask=in_range)
            dst = dst_ptr + slot * dst_stride_slot
            tl.store(dst + offsets, values.to(dst_ptr.dtype.element_ty), mask=in_range)
else:  # pragma: no cover
    _gather_rows_to_slots_kernel = None


def _inner_contiguous(t: torch.Tensor, leading: int) -> bool:
    """Whether dims ``leading..`` of ``t`` form one contiguous block."""
    expected = 1
    for size, stride in zip(reversed(t.shape[leading:]), reversed(t.stride()[leading:]), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _copy_rows(src: torch.Tensor, dst: torch.Tensor, row_index: torch.Tensor, slot_ids: torch.Tensor) -> None:
    if not _inner_contiguous(src, 2):
        src = src.contiguous()
    numel_per_row = 1
    for size in dst.shape[1:]:
        numel_per_row *= size
    batch = src.shape[0]
    if batch == 0 or numel_per_row == 0:
        return
    grid = (batch, cdiv(numel_per_row, _COPY_BLOCK))
    _gather_rows_to_slots_kernel[grid](
        src,
        dst,
        row_index,
        slot_ids,
        numel_per_row,
        src.stride(0),
        src.stride(1),
        dst.stride(0),
        COPY_BLOCK=_COPY_BLOCK,
    )


def gdn_fold_triton(
    states_rows: torch.Tensor,
    conv_rows: torch.Tensor,
    accepted_index: torch.Tensor,
    slot_ids: torch.Tensor,
    state: torch.Tensor,
    conv: torch.Tensor,
) -> None:
    """Triton fold: one gather-copy launch for ``state``, one for ``conv``.

    ``state[s]`` and ``conv[s]`` must each be one contiguous block (any slot stride).
    """
    _check(states_rows, conv_rows, accepted_index, slot_ids, state, conv)
    if not (_inner_contiguous(state, 1) and _inner_contiguous(conv, 1)):
        raise ValueError("gdn_fold_triton needs contiguous per-slot blocks in state and conv")
    accepted_index = accepted_index.contiguous()
    slot_ids = slot_ids.contiguous()
    _copy_rows(states_rows, state, accepted_index, slot_ids)
    _copy_rows(conv_rows, conv, accepted_index, slot_ids)


def gdn_fold(
    states_rows: torch.Tensor,
    conv_rows: torch.Tensor,
    accepted_index: torch.Tensor,
    slot_ids: torch.Tensor,
    state: torch.Tensor,
    conv: torch.Tensor,
) -> None:
    """In-place fold: Triton when it can run for these tensors, else the reference."""
    tensors = (states_rows, conv_rows, accepted_index, slot_ids, state, conv)
    if (
        use_triton(*tensors, kernel=_gather_rows_to_slots_kernel)
        and _inner_contiguous(state, 1)
        and _inner_contiguous(conv, 1)
    ):
        gdn_fold_triton(*tensors)
    else:
        gdn_fold_reference(*tensors)
