"""``gdn_step``: one gated-delta-rule decode step per sequence, on the state cache in place.

Semantics (``gdn_step_reference``, plain torch): for each batch entry b and value head h, with
S = state[slots[b], h] read in fp32 and a = exp(g[b, h]),
    S' = a S,   u = beta[b, h] (v[b, h] - S'^T k[b, h]),   S = S' + k u^T,   o[b, h] = S^T q[b, h],
then S is stored back into state[slots[b], h] in the state's dtype. That is the recurrence of
runtime/torch_model/gdn.py for one row, followed by the commit's copy of the row's state into the
slot: a decode commits its only row at once, so the state never needs to leave the cache.

`kernels/cpu_gdn.c` does it reading and writing each state once (the torch form makes about eight
passes: gather, decay, two contractions, the update, the stored row, the commit's scatter); it is
compiled and loaded by `_cpu.load` and used where it is ready (CPU tensors, state in bf16 or fp32),
the reference otherwise.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from ._cpu import load

__all__ = ["gdn_step", "gdn_step_reference", "ready"]


def gdn_step_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """q, k [B, H, Dk], v [B, H, Dv], g, beta [B, H] (fp32); state [slots, H, Dk, Dv] updated in place
    at rows slots [B]; returns o [B, H, Dv] fp32."""
    s = state.index_select(0, slots).float() * torch.exp(g)[..., None, None]
    u = (v - torch.einsum("bhk,bhkv->bhv", k, s)) * beta[..., None]
    s = s + k[..., :, None] * u[..., None, :]
    state.index_copy_(0, slots, s.to(state.dtype))
    return torch.einsum("bhk,bhkv->bhv", q, s)


@functools.cache
def _library() -> ctypes.CDLL | None:
    args = [ctypes.c_void_p] * 6 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 6
    symbols = {"fx_gdn_step": args, "fx_gdn_step_run": args}
    # threads by OpenMP, as every CPU kernel's (cpu_simd.h); a compiler without it: one thread a call
    return load("cpu_gdn", symbols, extra_flags=("-fopenmp",)) or load("cpu_gdn", symbols)


def ready() -> bool:
    """Whether the compiled kernel is in use on this host (compiles it on the first call)."""
    return _library() is not None


def gdn_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`gdn_step_reference`'s result and state update, by the C kernel where it applies."""
    if torch.compiler.is_compiling():  # traced: the reference's ops are the graph
        return gdn_step_reference(q, k, v, g, beta, state, slots)
    lib = _library()
    if (lib is None or state.device.type != "cpu" or state.dtype not in (torch.bfloat16, torch.float32)
            or not state.is_contiguous() or state.dim() != 4 or v.shape[-1] > 1024):
        return gdn_step_reference(q, k, v, g, beta, state, slots)
    b, h, dk = k.shape
    dv = v.shape[-1]
    q, k, v = (t.float().contiguous() for t in (q, k, v))
    g, beta = g.float().contiguous(), beta.float().contiguous()
    slots = slots.to(torch.int64).contiguous()
    o = torch.empty(b, h, dv, dtype=torch.float32)
    args = (q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(), state.data_ptr(),
            int(state.dtype == torch.bfloat16), slots.data_ptr(), o.data_ptr(), b, h, dk, dv)
    pairs = b * h
    threads = min(torch.get_num_threads(), pairs)
    rc = lib.fx_gdn_step_run(*args, pairs, threads) if threads > 1 else lib.fx_gdn_step(*args, 0, pairs)
    if rc != 0:
        raise RuntimeError(f"cpu_gdn kernel failed (code {rc})")
    return o
