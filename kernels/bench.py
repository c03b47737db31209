"""Micro-benchmark of every kernel against its plain-torch reference.

``run_kernel_bench(device, repeats)`` builds one representative speculative-
decoding shape per kernel (smaller on CPU), times the torch reference and, when
compiled Triton can run on ``device``, the Triton kernel, and returns one dict
per kernel:

* ``name``, ``shape`` (str), ``device``, ``dtype``;
* ``ms_median_torch`` / ``ms_median_triton``: median wall time of one call
  (device-synchronised), ``None`` when not timed;
* ``gbytes_per_s_torch`` / ``gbytes_per_s_triton``: minimum bytes the op must
  move divided by its median time;
* ``speedup``: ``ms_median_torch / ms_median_triton`` or ``None``;
* ``max_abs_diff``: largest |triton - torch| over the outputs (for integer
  outputs, the number of mismatching entries), or ``None`` when not timed;
* ``note``: why Triton was not timed, or ``""``.

The Triton interpreter (``TRITON_INTERPRET=1``) is never timed: its speed says
nothing about the kernel. No printing here; callers format the rows.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from . import gated_delta as gated_delta_mod
from . import gdn_fold as gdn_fold_mod
from . import greedy_accept as greedy_accept_mod
from . import lora_sgmv as lora_mod
from . import paged_attention as paged_attention_mod
from . import paged_kv_append as paged_kv_append_mod
from . import row_argmax as row_argmax_mod
from ._triton import HAVE_TRITON, forced_reference, kernel_is_interpreted

__all__ = ["run_kernel_bench"]


@dataclass
class _Case:
    name: str
    shape: str
    dtype: str
    kernel: Any  # the @triton.jit object, or None
    torch_fn: Callable[[], Any]
    triton_fn: Callable[[], Any]
    bytes_moved: int
    mutated: tuple[torch.Tensor, ...] = ()  # in-place outputs, compared instead of return values


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn: Callable[[], Any], repeats: int, device: torch.device) -> float:
    fn()  # warm-up: compilation, caches, allocator
    _sync(device)
    samples = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _gbps(bytes_moved: int, ms: float | None) -> float | None:
    if ms is None or ms <= 0:
        return None
    return bytes_moved / (ms * 1e-3) / 1e9


def _max_abs_diff(a: Any, b: Any) -> float:
    if isinstance(a, torch.Tensor):
        if a.is_floating_point():
            return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0
        return float((a != b).sum())  # integer outputs: count of mismatches
    return max((_max_abs_diff(x, y) for x, y in zip(a, b, strict=True)), default=0.0)


def _compare(case: _Case) -> float:
    """Max |triton - torch| over the outputs (in-place ones restored afterwards)."""
    if not case.mutated:
        return _max_abs_diff(case.triton_fn(), case.torch_fn())
    before = [t.clone() for t in case.mutated]
    case.triton_fn()
    from_triton = [t.clone() for t in case.mutated]
    for t, saved in zip(case.mutated, before, strict=True):
        t.copy_(saved)
    case.torch_fn()
    diff = _max_abs_diff(from_triton, list(case.mutated))
    for t, saved in zip(case.mutated, before, strict=True):
        t.copy_(saved)
    return diff


def _esize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _cases(device: torch.device, large: bool | None = None) -> list[_Case]:
    """One case per kernel; ``large`` (default: on CUDA) picks the serving-sized shapes."""
    big = device.type == "cuda" if large is None else large
    gen = torch.Generator(device="cpu").manual_seed(0)
    act_dtype = torch.bfloat16 if big else torch.float32

    def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    def randint(high: int, *shape: int) -> torch.Tensor:
        return torch.randint(0, high, shape, generator=gen).to(device)

    cases: list[_Case] = []

    # greedy accept: B sequences of K rows, ~half the drafts match.
    batch, rows = (256, 8) if big else (64, 8)
    target = randint(4, batch * rows)
    row_offsets = greedy_accept_mod.row_offsets_from_counts(torch.full((batch,), rows, device=device))
    starts = row_offsets[:-1].long()
    draft_rows = (starts[:, None] + torch.arange(rows - 1, device=device)).reshape(-1)
    drafts = torch.where(randint(2, draft_rows.numel()) > 0, target[draft_rows], randint(4, draft_rows.numel()))
    cases.append(
        _Case(
            "greedy_accept",
            f"B={batch} K={rows}",
            "int64",
            greedy_accept_mod._greedy_accept_kernel,
            lambda: greedy_accept_mod.greedy_accept_reference(target, drafts, row_offsets),
            lambda: greedy_accept_mod.greedy_accept_triton(target, drafts, row_offsets),
            8 * (target.numel() + drafts.numel() + 2 * batch) + 4 * (batch + 1),
        )
    )

    # row argmax over verify logits.
    num_rows, vocab = (256, 151936) if big else (32, 32000)
    logits = randn(num_rows, vocab, dtype=act_dtype)
    cases.append(
        _Case(
            "row_argmax",
            f"R={num_rows} V={vocab}",
            str(act_dtype).removeprefix("torch."),
            row_argmax_mod._row_argmax_kernel,
            lambda: row_argmax_mod.row_argmax_reference(logits),
            lambda: row_argmax_mod.row_argmax_triton(logits),
            logits.numel() * _esize(act_dtype) + 8 * num_rows,
        )
    )

    # GDN fold: fp32 recurrent state, activation-dtype conv window.
    batch, kmax, heads, dk, dv, conv_ch, width, slots = (
        (64, 8, 16, 128, 128, 6144, 4, 256) if big else (8, 8, 4, 64, 64, 768, 4, 16)
    )
    states_rows = randn(batch, kmax, heads, dk, dv)
    conv_rows = randn(batch, kmax, conv_ch, width, dtype=act_dtype)
    accepted_index = randint(kmax, batch)
    slot_ids = torch.randperm(slots, generator=gen)[:batch].to(device)
    state = torch.zeros(slots, heads, dk, dv, device=device)
    conv = torch.zeros(slots, conv_ch, width, device=device, dtype=act_dtype)
    fold_args = (states_rows, conv_rows, accepted_index, slot_ids, state, conv)
    cases.append(
        _Case(
            "gdn_fold",
            f"B={batch} Kmax={kmax} H={heads} Dk={dk} Dv={dv} C={conv_ch} W={width} S={slots}",
            f"state=float32 conv={str(act_dtype).removeprefix('torch.')}",
            gdn_fold_mod._gather_rows_to_slots_kernel,
            lambda: gdn_fold_mod.gdn_fold_reference(*fold_args),
            lambda: gdn_fold_mod.gdn_fold_triton(*fold_args),
            2 * batch * (heads * dk * dv * 4 + conv_ch * width * _esize(act_dtype)),
            mutated=(state, conv),
        )
    )

    # Paged KV append and paged attention share one cache geometry.
    batch, rows, q_heads, kv_heads, dim, block_size, context = (
        (32, 8, 32, 8, 128, 16, 2048) if big else (4, 4, 8, 2, 64, 16, 512)
    )
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq + 8
    k_cache = randn(num_blocks, block_size, kv_heads, dim, dtype=act_dtype)
    v_cache = randn(num_blocks, block_size, kv_heads, dim, dtype=act_dtype)
    block_tables = torch.randperm(num_blocks, generator=gen)[: batch * blocks_per_seq]
    block_tables = block_tables.view(batch, blocks_per_seq).to(device=device, dtype=torch.int32)
    context_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    start_positions = context_lens - rows
    k_new = randn(batch, rows, kv_heads, dim, dtype=act_dtype)
    v_new = randn(batch, rows, kv_heads, dim, dtype=act_dtype)
    append_args = (k_new, v_new, k_cache, v_cache, block_tables, start_positions)
    cases.append(
        _Case(
            "paged_kv_append",
            f"B={batch} K={rows} H={kv_heads} D={dim} block={block_size}",
            str(act_dtype).removeprefix("torch."),
            paged_kv_append_mod._paged_kv_append_kernel,
            lambda: paged_kv_append_mod.paged_kv_append_reference(*append_args),
            lambda: paged_kv_append_mod.paged_kv_append_triton(*append_args),
            2 * 2 * k_new.numel() * _esize(act_dtype),
            mutated=(k_cache, v_cache),
        )
    )
    query = randn(batch, rows, q_heads, dim, dtype=act_dtype)
    attn_args = (query, k_cache, v_cache, block_tables, context_lens, dim**-0.5)
    cases.append(
        _Case(
            "paged_attention",
            f"B={batch} K={rows} Hq={q_heads} Hkv={kv_heads} D={dim} ctx={context} block={block_size}",
            str(act_dtype).removeprefix("torch."),
            paged_attention_mod._paged_attention_kernel,
            lambda: paged_attention_mod.paged_attention_reference(*attn_args),
            lambda: paged_attention_mod.paged_attention_triton(*attn_args),
            (2 * batch * context * kv_heads * dim + 2 * query.numel()) * _esize(act_dtype),
        )
    )

    # Gated delta rule over a K-row verify, emitting per-token fp32 states.
    batch, steps, heads, dk, dv = (32, 8, 16, 128, 128) if big else (4, 4, 4, 64, 64)
    q = randn(batch, steps, heads, dk, dtype=act_dtype)
    k = torch.nn.functional.normalize(randn(batch, steps, heads, dk), dim=-1).to(act_dtype)
    v = randn(batch, steps, heads, dv, dtype=act_dtype)
    g = -torch.rand(batch, steps, heads, generator=gen).to(device)
    beta = torch.rand(batch, steps, heads, generator=gen).to(device)
    initial_state = randn(batch, heads, dk, dv)
    delta_args = (q, k, v, g, beta, initial_state, dk**-0.5)
    cases.append(
        _Case(
            "gated_delta",
            f"B={batch} T={steps} H={heads} Dk={dk} Dv={dv}",
            f"qkv={str(act_dtype).removeprefix('torch.')} state=float32",
            gated_delta_mod._gated_delta_kernel,
            lambda: gated_delta_mod.gated_delta_reference(*delta_args),
            lambda: gated_delta_mod.gated_delta_triton(*delta_args),
            (2 * q.numel() + 2 * v.numel()) * _esize(act_dtype)
            + 8 * g.numel()
            + 4 * initial_state.numel() * (1 + steps),
        )
    )

    # LoRA shrink + expand of one projection: a batch's rows over 4 adapter slots of rank 16.
    rows_n, slots_n, width, out_dim, rank = (64, 4, 1024, 3072, 16) if big else (8, 4, 64, 96, 16)
    x = randn(rows_n, width, dtype=act_dtype)
    a = randn(slots_n, rank, width, dtype=act_dtype) * width**-0.5
    b = randn(slots_n, out_dim, rank, dtype=act_dtype) * 0.01
    lora_rows = torch.arange(rows_n, device=device)
    lora_slots = (torch.arange(rows_n, device=device) * slots_n // rows_n).to(torch.int32)
    y = randn(rows_n, out_dim, dtype=act_dtype)
    cases.append(
        _Case(
            "lora_sgmv",
            f"M={rows_n} S={slots_n} in={width} out={out_dim} r={rank}",
            str(act_dtype).removeprefix("torch."),
            lora_mod._lora_shrink_kernel,
            lambda: lora_mod.lora_expand_reference(lora_mod.lora_shrink_reference(x, lora_rows, lora_slots, a),
                                                   lora_rows, lora_slots, b, y),
            lambda: lora_mod.lora_expand_triton(lora_mod.lora_shrink_triton(x, lora_rows, lora_slots, a),
                                                lora_rows, lora_slots, b, y),
            (x.numel() + a.numel() + b.numel() + 2 * y.numel()) * _esize(act_dtype),
            mutated=(y,),
        )
    )
    return cases


def _triton_skip_reason(device: torch.device, kernel: Any) -> str:
    """Empty string when compiled Triton can be timed on ``device``, else why not."""
    if not HAVE_TRITON or kernel is None:
        # a CPU process without the interpreter never imports triton (_triton.py): say which case
        why = "no CUDA device and no TRITON_INTERPRET" if device.type != "cuda" else "triton is not importable"
        return f"triton not timed: {why}"
    if forced_reference():
        return "triton not timed: FXSCHED_KERNELS=torch forces the references"
    if device.type != "cuda":
        return f"triton not timed: compiled Triton needs CUDA tensors, device is {device.type} (torch reference only)"
    if kernel_is_interpreted(kernel):
        return "triton not timed: kernels were built for TRITON_INTERPRET=1, which is not benchmarked"
    return ""


def run_kernel_bench(device: str = "cpu", repeats: int = 10) -> list[dict]:
    """Time every kernel and its torch reference on ``device``; one row per kernel."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("run_kernel_bench: CUDA requested but not available")
    rows = []
    for case in _cases(dev):
        ms_torch = _median_ms(case.torch_fn, repeats, dev)
        reason = _triton_skip_reason(dev, case.kernel)
        ms_triton = None
        diff = None
        if not reason:
            ms_triton = _median_ms(case.triton_fn, repeats, dev)
            diff = _compare(case)
        rows.append(
            {
                "name": case.name,
                "shape": case.shape,
                "device": str(dev),
                "dtype": case.dtype,
                "ms_median_triton": ms_triton,
                "ms_median_torch": ms_torch,
                "gbytes_per_s_triton": _gbps(case.bytes_moved, ms_triton),
                "gbytes_per_s_torch": _gbps(case.bytes_moved, ms_torch),
                "speedup": (ms_torch / ms_triton) if ms_triton else None,
                "max_abs_diff": diff,
                "note": reason,
            }
        )
    return rows
