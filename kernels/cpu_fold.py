"""``gdn_fold_layers``: the GDN fold (kernels/gdn_fold.py) of every GDN layer of a forward in one C
call, on the CPU.

The fold keeps, per committed sequence and per GDN layer, the recurrent state and conv window
after its last accepted verify row. Its torch form is four small operations a layer; on a CPU each
costs microseconds of dispatch for a few kilobytes of copying, which made the fold most of a
speculative commit's host time (specs/async.md §16.7: host work per tick). `kernels/cpu_fold.c`
copies the same bytes in one loop; the result is the torch fold's exactly (a copy, same dtype).

It applies where every layer's tensors are on the CPU, the rows share the caches' dtype (bf16,
fp16 or fp32), each row's recurrent state is contiguous, the caches are contiguous, and every layer
has the first layer's shapes and strides; otherwise it returns False and the caller folds in torch.
"""

from __future__ import annotations

import ctypes
import functools
from array import array
from typing import Sequence

import torch

from ._cpu import load

__all__ = ["gdn_fold_layers", "ready"]

_ITEMS = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4}


@functools.cache
def _library() -> ctypes.CDLL | None:
    args = [ctypes.c_int64] + [ctypes.c_void_p] * 4 + [ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 10
    return load("cpu_fold", {"fx_gdn_fold": args})


def ready() -> bool:
    """Whether the compiled fold is in use on this host (compiles it on the first call)."""
    return _library() is not None


def _applies(states_rows: Sequence[torch.Tensor], windows: Sequence[torch.Tensor], state: Sequence[torch.Tensor],
             conv: Sequence[torch.Tensor]) -> bool:
    first, window, cache, conv0 = states_rows[0], windows[0], state[0], conv[0]
    if first.device.type != "cpu" or first.dim() != 5 or window.dim() != 4 or cache.dim() != 4 or conv0.dim() != 3:
        return False
    dtype = first.dtype
    if dtype not in _ITEMS:
        return False
    b, r, h, dk, dv = first.shape
    if first.stride()[2:] != (dk * dv, dv, 1) or window.shape[0] != b or window.shape[2] != r:
        return False
    if cache.shape[1:] != (h, dk, dv) or conv0.shape[1:] != (window.shape[1], window.shape[3] - 1):
        return False
    layout = (dtype, first.shape, first.stride(), window.shape, window.stride(), cache.shape, conv0.shape)
    cpu = first.device
    for rows, win, rec, cv in zip(states_rows, windows, state, conv, strict=True):
        if ((rows.dtype, rows.shape, rows.stride(), win.shape, win.stride(), rec.shape, cv.shape) != layout
                or win.dtype != dtype or rec.dtype != dtype or cv.dtype != dtype or not rec.is_contiguous()
                or not cv.is_contiguous() or win.device != cpu or rec.device != cpu or cv.device != cpu):
            return False
    return True


def gdn_fold_layers(states_rows: Sequence[torch.Tensor], windows: Sequence[torch.Tensor],
                    state: Sequence[torch.Tensor], conv: Sequence[torch.Tensor], batch: Sequence[int],
                    rows: Sequence[int], slots: Sequence[int]) -> bool:
    """For each layer l and entry i: ``state[l][slots[i]] = states_rows[l][batch[i], rows[i]]`` and
    ``conv[l][slots[i]] = windows[l][batch[i], :, rows[i], 1:]`` (states_rows [B, R, Hv, Dk, Dv],
    windows [B, C, R, W], state [S, Hv, Dk, Dv], conv [S, C, W - 1]; the caller keeps the entries'
    slots distinct).
    True when the kernel did it; False when it does not apply here (nothing written: fold in
    torch). Raises IndexError on an entry outside the tensors."""
    lib = _library()
    if lib is None or not states_rows or torch.compiler.is_compiling():
        return False
    if not len(states_rows) == len(windows) == len(state) == len(conv):
        raise ValueError(f"{len(states_rows)} row sets, {len(windows)} windows, {len(state)} and {len(conv)} caches")
    if not _applies(states_rows, windows, state, conv):
        return False
    n = len(batch)
    if len(rows) != n or len(slots) != n:
        raise ValueError(f"{n} batch entries, {len(rows)} rows, {len(slots)} slots")
    if not n:
        return True
    first, window = states_rows[0], windows[0]
    for name, values, bound in (("batch entry", batch, first.shape[0]), ("row", rows, first.shape[1]),
                                ("slot", slots, state[0].shape[0])):
        if min(values) < 0 or max(values) >= bound:
            raise IndexError(f"gdn fold: a {name} outside [0, {bound}): {list(values)}")
    layers = len(states_rows)
    pointers = (ctypes.c_void_p * (4 * layers))(*[t.data_ptr() for group in (states_rows, windows, state, conv)
                                                  for t in group])
    at_pointers = ctypes.addressof(pointers)
    index = array("q", batch)
    index.extend(rows)
    index.extend(slots)
    at = index.buffer_info()[0]
    _, _, h, dk, dv = first.shape
    sb, sr = first.stride()[:2]
    wb, wc, wr, ww = window.stride()
    rc = lib.fx_gdn_fold(layers, at_pointers, at_pointers + 8 * layers, at_pointers + 16 * layers,
                         at_pointers + 24 * layers, n, at, at + 8 * n, at + 16 * n,
                         _ITEMS[first.dtype], sb, sr, h * dk * dv, wb, wc, wr, ww, window.shape[1], window.shape[3])
    if rc != 0:
        raise RuntimeError(f"cpu_fold kernel failed (code {rc})")
    return True
