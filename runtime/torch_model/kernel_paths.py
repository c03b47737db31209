"""Where the torch model runs the Triton kernels of `fxsched.kernels`, and when.

Rule: a kernel runs when `fxsched.kernels._triton.use_triton` says Triton can run for the tensors
at hand -- CUDA tensors with Triton installed, or CPU tensors when the kernels were built for the
interpreter (TRITON_INTERPRET=1 set before `fxsched.kernels` was first imported) -- with two
environment switches, read at every call (so they can be flipped at run time):

* FXSCHED_KERNELS=torch forces the torch code everywhere (use_triton's own rule);
* on CPU the model takes the *interpreted* kernels only with FXSCHED_KERNELS=triton. The Triton
  interpreter is ~40x slower than torch even at toy sizes, and TRITON_INTERPRET=1 leaks easily
  into a whole process (tests/test_kernels.py sets it at import, so every later test of the same
  pytest run would get interpreted kernels): a CPU engine keeps the torch path unless asked.
  CUDA engines need no opt-in.

Wired hot spots (the torch code stays as the fallback and is what runs on a plain CPU):

* `gated_delta` -- `gdn.gdn_layer`'s recurrence, every batch (rows are independent per sequence, so
  right padding is harmless); the torch loop otherwise.
* `paged_kv_append` + `paged_attention` -- `attention.attention_layer` for *uniform* batches (every
  sequence has the same number T of new rows: decode, uniform-K verify, single-slot prefill); ragged
  batches keep the torch path (masked dense attention over the gathered blocks).
* `gdn_fold` -- `HybridEngine.gdn_fold_accepted`, i.e. every commit (prefill chunks, decode, verify +
  fold, `commit_accepted_prefix`); `gdn_fold_reference` (the same gather/scatter copy) otherwise.
* `lora_sgmv` -- `lora_rows.LoraRows.add`, every adapted projection of a batch with adapters (specs/lora.md
  §18.2); `torch._grouped_mm` or the CPU's dense product otherwise.

The CPU kernels (C, `fxsched.kernels.cpu_gemv` / `cpu_gdn`) follow the opposite rule: they serve CPU
engines unless Triton was asked for there (FXSCHED_KERNELS=triton) or FXSCHED_KERNELS=torch. A
decode on such an engine updates the GDN states in place (`gdn_decode_in_place`: gdn.gdn_layer's
in_place, by `cpu_gdn.gdn_step`) instead of the recurrence above plus `gdn_fold`.
"""

from __future__ import annotations

import os

import torch

from fxsched.kernels import cpu_gdn
from fxsched.kernels import gated_delta as _gated_delta
from fxsched.kernels import gdn_fold as _gdn_fold
from fxsched.kernels import lora_sgmv as _lora_sgmv
from fxsched.kernels import paged_attention as _paged_attention
from fxsched.kernels import paged_kv_append as _paged_kv_append
from fxsched.kernels._triton import use_triton

__all__ = ["attention_kernels_apply", "gdn_decode_in_place", "gdn_fold_kernel_applies",
           "gdn_recurrence_kernel_applies", "kernels_opted_in", "lora_kernels_apply"]


def _device_opted_in(tensor: torch.Tensor) -> bool:
    """CUDA (or any non-CPU) tensors always; CPU tensors only with FXSCHED_KERNELS=triton."""
    return tensor.device.type != "cpu" or os.environ.get("FXSCHED_KERNELS", "").strip().lower() == "triton"


def kernels_opted_in(tensor: torch.Tensor) -> bool:
    """Whether the Triton kernels may run on `tensor`'s device at all (CUDA; the CPU by opt-in):
    False means every ``*_kernel_applies`` is False there, without building their arguments."""
    return _device_opted_in(tensor)


def attention_kernels_apply(*tensors: torch.Tensor) -> bool:
    """Whether `paged_kv_append` and `paged_attention` run as Triton kernels for these tensors."""
    return (_device_opted_in(tensors[0])
            and use_triton(*tensors, kernel=_paged_kv_append._paged_kv_append_kernel)
            and use_triton(*tensors, kernel=_paged_attention._paged_attention_kernel))


def gdn_recurrence_kernel_applies(*tensors: torch.Tensor) -> bool:
    """Whether `gated_delta` runs as a Triton kernel for these tensors."""
    return _device_opted_in(tensors[0]) and use_triton(*tensors, kernel=_gated_delta._gated_delta_kernel)


def gdn_fold_kernel_applies(*tensors: torch.Tensor) -> bool:
    """Whether `gdn_fold` runs as a Triton kernel for these tensors."""
    return _device_opted_in(tensors[0]) and use_triton(*tensors, kernel=_gdn_fold._gather_rows_to_slots_kernel)


def lora_kernels_apply(*tensors: torch.Tensor) -> bool:
    """Whether the LoRA shrink and expand run as Triton kernels for these tensors."""
    return (_device_opted_in(tensors[0]) and use_triton(*tensors, kernel=_lora_sgmv._lora_shrink_kernel)
            and use_triton(*tensors, kernel=_lora_sgmv._lora_expand_kernel))


def gdn_decode_in_place(device: torch.device) -> bool:
    """Whether a decode on an engine on `device` updates its GDN states in place (the CPU kernel)."""
    return device.type == "cpu" and not _device_opted_in(torch.empty(0)) and cpu_gdn.ready()
