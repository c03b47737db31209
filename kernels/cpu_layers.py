"""A dense model's decoder layers over a few rows in one call (kernels/cpu_layers.c; specs/cpu-kernels.md
§15.11): the packed products, the q/k norm and rotation, the K/V write, the row attention kernel,
the residual add-norms and SwiGLU, each by its own kernel, sequenced in C so that a decode step
crosses from Python into C once instead of about ten times a layer.

The file has no arithmetic of its own: it calls the kernels through function pointers taken from
their libraries (``kernel_table``), so each output has the bits the step-by-step forward gives.
Compiled on first use like every CPU kernel (``_cpu.load``); ``ready()`` is False where it cannot be,
or where a kernel it sequences is not loaded, and callers keep the step-by-step forward.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from . import cpu_amx, cpu_attention, cpu_pairs, cpu_pointwise
from ._cpu import load

__all__ = ["N_PTRS", "decode_layers", "kernel_table", "ready"]

N_PTRS = 10  # pointers a layer takes (cpu_layers.c's P_* order)


@functools.cache
def _library() -> ctypes.CDLL | None:
    args = ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_float]
            + [ctypes.c_void_p] * 8)
    return load("cpu_layers", {"fx_decode_layers": args})


def _address(fn: Any) -> int:
    """A loaded kernel's address (a ctypes function of a CDLL)."""
    return ctypes.cast(fn, ctypes.c_void_p).value or 0


def kernel_table() -> torch.Tensor | None:
    """The kernels' addresses in cpu_layers.c's OP_* order, the packed product being the one
    `ops.linear` takes on this host (AMX's, else AVX512-BF16's in `cpu_pairs.arithmetic()`); None
    where one of them is not loaded."""
    pointwise, attention = cpu_pointwise._library(), cpu_attention._library()
    if pointwise is None or attention is None:
        return None
    if cpu_amx.ready():
        amx = cpu_amx._library()
        assert amx is not None
        product = amx.fx_amx_run
    elif cpu_pairs.ready():
        pairs = cpu_pairs._library()
        assert pairs is not None
        product = getattr(pairs, f"fx_pairs_run_{cpu_pairs.arithmetic()}")
    else:
        return None
    fns = (product, attention.fx_paged_attention_run, pointwise.fx_add_rms_norm_bf16,
           pointwise.fx_qk_norm_rope_bf16, pointwise.fx_kv_scatter_bf16, pointwise.fx_silu_mul_rows_bf16)
    return torch.tensor([_address(f) for f in fns], dtype=torch.int64)


def ready() -> bool:
    """Whether the sequencer is compiled and every kernel it calls is loaded."""
    return _library() is not None and kernel_table() is not None


def decode_layers(table: torch.Tensor, ptrs: torch.Tensor, dims: torch.Tensor, eps: float, scale: float,
                  h: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, write_index: torch.Tensor,
                  q_rows: torch.Tensor, ctx: torch.Tensor, tables: torch.Tensor) -> None:
    """Run the layers (ptrs: N_PTRS addresses a layer, int64) over rows h [m, D] (the residual,
    updated in place) and x [m, D] (its first input norm; clobbered); dims: cpu_layers.c's D_*
    values; cos / sin [m, rot] bf16; write_index [m] int64 cache rows; q_rows / ctx / tables the row
    attention kernel's int32 plan. Every operand contiguous on the CPU (the caller checks)."""
    lib = _library()
    assert lib is not None
    rc = lib.fx_decode_layers(table.data_ptr(), ptrs.data_ptr(), ptrs.shape[0] // N_PTRS, dims.data_ptr(), eps,
                              scale, h.data_ptr(), x.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                              write_index.data_ptr(), q_rows.data_ptr(), ctx.data_ptr(), tables.data_ptr())
    if rc != 0:
        raise RuntimeError(f"cpu_layers: a kernel refused a layer (code {rc})")
