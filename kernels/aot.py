"""Ahead-of-time compiles of every Triton kernel for an sm_90 GPU, with no GPU (gpu-kernels.md §17.4).

``compile_all()`` compiles each kernel of this package for ``GPUTarget("cuda", 90, 32)`` (Triton
ships ``ptxas``) at the launches the model shapes of ``SHAPES`` make, in bf16 and fp32, verify rows
K = 1..8 for the attention kernels, and returns one dict per (kernel, shape, dtype[, K]):

* ``kernel``, ``shape``, ``dtype``, ``k`` (query rows per sequence, ``None`` where K is no input);
* ``constexprs`` (``"NAME=value ..."``), ``num_warps``, ``num_stages``;
* ``n_regs``: registers per thread; ``n_spills``: per-thread local memory (stack) in 4-byte words,
  Triton's ``compiled.n_spills`` unit; ``stack_bytes``: the same in bytes; ``shared``: bytes of
  shared memory (``compiled.metadata.shared``).

Registers and stack come from the cubin's ``.nv.info`` attributes (what the CUDA driver reports as
``compiled.n_regs`` / ``compiled.n_spills`` once the kernel is loaded, which needs a GPU); where the
compiled object already carries those attributes they are used instead. Arguments are specialised
as Triton's launcher does: pointers 16-byte aligned, an int equal to 1 a constant, an int divisible
by 16 marked so. Identical compiles are made once. Only APIs that Triton 3.6 and 3.9 share are used.

Import this module before anything else imports ``fxsched.kernels``, in a process without
``TRITON_INTERPRET``: the kernel modules define their kernels only when triton is imported first.
No printing here; callers format the rows.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import triton  # noqa: F401  (before the kernel modules: see the module docstring)
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import gated_delta, gdn_fold, greedy_accept, lora_sgmv, paged_attention, paged_kv_append, row_argmax
from ._triton import kernel_is_interpreted, next_power_of_2

__all__ = ["ModelShape", "SHAPES", "TARGET", "VERIFY_ROWS", "compile_all", "cubin_resources"]

TARGET = GPUTarget("cuda", 90, 32)
VERIFY_ROWS = tuple(range(1, 9))
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
BLOCK_SIZE = 16  # KV cache block size (the engine default)
MAX_BLOCKS = 2560  # block-table width: a 40960-token context
VOCAB = 151936  # Qwen3 vocabulary
CONV_KERNEL = 4  # GDN short convolution width


@dataclass(frozen=True)
class ModelShape:
    """Attention and GDN geometry of one model (``gdn_heads`` 0: no GDN layers)."""

    name: str
    q_heads: int
    kv_heads: int
    head_dim: int
    gdn_heads: int = 0
    gdn_key_dim: int = 0
    gdn_value_dim: int = 0


# GDN heads enter the kernels only as a runtime int (divisible by 16 in both models).
SHAPES = (
    ModelShape("qwen3-0.6b", q_heads=16, kv_heads=8, head_dim=128),
    ModelShape("qwen3.5-hybrid", q_heads=8, kv_heads=2, head_dim=256, gdn_heads=16, gdn_key_dim=128,
               gdn_value_dim=128),
    ModelShape("qwen3-next", q_heads=16, kv_heads=2, head_dim=256, gdn_heads=32, gdn_key_dim=128,
               gdn_value_dim=128),
)


@dataclass(frozen=True)
class _Launch:
    kernel: Any  # the @triton.jit object
    name: str
    args: dict[str, Any]  # non-constexpr arguments: "*dtype" for a pointer, else an example value
    constexprs: dict[str, Any]
    num_warps: int | None = None  # None: Triton's default, as a launch without the option gets
    num_stages: int | None = None
    k: int | None = None


# ----------------------------------------------------------------------------- compiling


def _specialise(launch: _Launch) -> tuple[dict[str, str], dict[str, Any], dict[tuple[int, ...], list]]:
    signature: dict[str, str] = {}
    constants = dict(launch.constexprs)
    attrs: dict[tuple[int, ...], list] = {}
    for index, name in enumerate(launch.kernel.arg_names):
        if name in constants:
            signature[name] = "constexpr"
            continue
        value = launch.args[name]
        if isinstance(value, str):  # a pointer; torch allocations are 16-byte aligned
            signature[name] = value
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value == 1:  # the launcher turns an int 1 into a constant
            signature[name] = "constexpr"
            constants[name] = 1
        else:
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, constants, attrs


def cubin_resources(cubin: bytes) -> tuple[int, int]:
    """(registers per thread, stack bytes per thread) from a cubin's ``.nv.info`` section.

    The section is a run of entries ``format:u8 attribute:u8`` then a ``u16`` value, or for format
    4 a ``u16`` size and that many bytes; REGCOUNT (0x2f) and FRAME_SIZE (0x11) hold ``(symbol:u32,
    value:u32)``. With several functions the largest value is returned.
    """
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not a 64-bit ELF cubin")
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names_at = sections[shstrndx][4]

    def name_of(offset: int) -> bytes:
        start = names_at + offset
        return cubin[start:cubin.index(b"\0", start)]

    regs = stack = -1
    for name, _type, _flags, _addr, offset, size in sections:
        if name_of(name) != b".nv.info":
            continue
        at = offset
        while at + 4 <= offset + size:
            fmt, attribute, length = cubin[at], cubin[at + 1], struct.unpack_from("<H", cubin, at + 2)[0]
            if fmt == 4:
                if attribute in (0x2F, 0x11) and length == 8:
                    value = struct.unpack_from("<I", cubin, at + 8)[0]
                    if attribute == 0x2F:
                        regs = max(regs, value)
                    else:
                        stack = max(stack, value)
                at += 4 + length
            else:
                at += 4
    if regs < 0:
        raise ValueError("the cubin has no REGCOUNT attribute")
    return regs, max(stack, 0)


def _compile(launch: _Launch) -> dict:
    signature, constants, attrs = _specialise(launch)
    options = {k: v for k, v in (("num_warps", launch.num_warps), ("num_stages", launch.num_stages)) if v}
    compiled = triton.compile(
        ASTSource(fn=launch.kernel, signature=signature, constexprs=constants, attrs=attrs),
        target=TARGET,
        options=options,
    )
    regs, stack = cubin_resources(compiled.asm["cubin"])
    regs = getattr(compiled, "n_regs", None) or regs  # set once loaded on a GPU (Triton >= 3.0)
    spills = getattr(compiled, "n_spills", None)
    metadata = compiled.metadata
    return {
        "constexprs": " ".join(f"{k}={v}" for k, v in launch.constexprs.items()),
        "num_warps": metadata.num_warps,
        "num_stages": metadata.num_stages,
        "n_regs": regs,
        "n_spills": spills if spills is not None else stack // 4,
        "stack_bytes": stack,
        "shared": metadata.shared,
    }


# ----------------------------------------------------------------------------- launches per kernel


PREFILL_ROWS = 512  # the ragged launch's padded rows per sequence (a prefill chunk)


def _attention_launches(shape: ModelShape, dt: str) -> Iterator[_Launch]:
    pa = paged_attention
    p, group, dim = "*" + dt, shape.q_heads // shape.kv_heads, shape.head_dim
    # the model's block tables and lengths are int64 (sent in one packed copy, specs/async.md §16.2)
    for k, ragged in [(k, False) for k in VERIFY_ROWS] + [(PREFILL_ROWS, True)]:
        config = pa.launch_config(k, group, dim, DTYPES[dt])
        warps, stages = config.pop("num_warps"), config.pop("num_stages")
        common = dict(
            q_ptr=p, k_cache_ptr=p, v_cache_ptr=p, block_tables_ptr="*i64", context_lens_ptr="*i64",
            query_lens_ptr="*i64", scale=dim**-0.5, rows_per_seq=k, group_size=group, head_dim=dim,
            block_size=BLOCK_SIZE, q_stride_b=k * shape.q_heads * dim, q_stride_row=shape.q_heads * dim,
            q_stride_head=dim, cache_stride_block=BLOCK_SIZE * shape.kv_heads * dim,
            cache_stride_slot=shape.kv_heads * dim, cache_stride_head=dim, table_stride_b=MAX_BLOCKS,
        )
        config = dict(config, RAGGED=ragged)
        name = "_ragged" if ragged else ""
        rows = None if ragged else k
        yield _Launch(pa._paged_attention_kernel, f"paged_attention{name}", dict(common, out_ptr=p), config, warps,
                      stages, rows)
        split = dict(common, part_max_ptr="*fp32", part_sum_ptr="*fp32", part_acc_ptr="*fp32", num_splits=66)
        yield _Launch(pa._paged_attention_split_kernel, f"paged_attention_split{name}", split, config, warps, stages,
                      rows)
    reduce = dict(pa.REDUCE_CONFIG)
    warps = reduce.pop("num_warps")
    args = dict(part_max_ptr="*fp32", part_sum_ptr="*fp32", part_acc_ptr="*fp32", out_ptr=p, num_splits=66,
                head_dim=dim)
    yield _Launch(pa._paged_attention_reduce_kernel, "paged_attention_reduce", args,
                  dict(reduce, BLOCK_D=next_power_of_2(dim)), warps)


def _append_launches(shape: ModelShape, dt: str) -> Iterator[_Launch]:
    p, head_numel = "*" + dt, shape.kv_heads * shape.head_dim
    for k in (1, VERIFY_ROWS[-1]):
        args = dict(
            k_new_ptr=p, v_new_ptr=p, k_cache_ptr=p, v_cache_ptr=p, block_tables_ptr="*i32",
            start_positions_ptr="*i32", rows_per_seq=k, block_size=BLOCK_SIZE, max_blocks=MAX_BLOCKS,
            head_numel=head_numel, new_stride_b=k * head_numel, new_stride_row=head_numel,
            cache_stride_block=BLOCK_SIZE * head_numel, cache_stride_slot=head_numel, table_stride_b=MAX_BLOCKS,
        )
        block = min(paged_kv_append._MAX_HEAD_BLOCK, next_power_of_2(head_numel))
        yield _Launch(paged_kv_append._paged_kv_append_kernel, "paged_kv_append", args, dict(HEAD_BLOCK=block), k=k)


def _gdn_launches(shape: ModelShape, dt: str) -> Iterator[_Launch]:
    if not shape.gdn_heads:
        return
    p, heads, dk, dv = "*" + dt, shape.gdn_heads, shape.gdn_key_dim, shape.gdn_value_dim
    for has_state in (True, False):
        for k in (1, VERIFY_ROWS[-1]):
            args = dict(q_ptr=p, k_ptr=p, v_ptr=p, g_ptr="*fp32", beta_ptr=p, initial_state_ptr="*fp32", out_ptr=p,
                        states_ptr="*fp32", scale=dk**-0.5, steps=k, heads=heads, key_dim=dk, value_dim=dv)
            constexprs = dict(HAS_INITIAL_STATE=has_state, BLOCK_K=next_power_of_2(dk),
                              BLOCK_V=next_power_of_2(min(gated_delta._MAX_VALUE_BLOCK, dv)))
            yield _Launch(gated_delta._gated_delta_kernel, f"gated_delta[init={has_state}]", args, constexprs, k=k)
    kmax = VERIFY_ROWS[-1]
    conv_numel = (2 * dk + dv) * heads * (CONV_KERNEL - 1)
    for what, numel in (("state", heads * dk * dv), ("conv", conv_numel)):
        args = dict(src_ptr="*fp32", dst_ptr=p, row_index_ptr="*i64", slot_ptr="*i64", numel_per_row=numel,
                    src_stride_batch=kmax * numel, src_stride_row=numel, dst_stride_slot=numel)
        yield _Launch(gdn_fold._gather_rows_to_slots_kernel, f"gdn_fold[{what}]", args,
                      dict(COPY_BLOCK=gdn_fold._COPY_BLOCK))


def _sampling_launches(shape: ModelShape, dt: str) -> Iterator[_Launch]:
    args: dict[str, Any] = dict(logits_ptr="*" + dt, out_ptr="*i64", vocab_size=VOCAB, stride_row=VOCAB, stride_col=1)
    yield _Launch(row_argmax._row_argmax_kernel, "row_argmax", args,
                  dict(VOCAB_BLOCK=min(row_argmax._MAX_VOCAB_BLOCK, next_power_of_2(VOCAB))))
    if dt == "bf16":  # token ids only: one dtype
        args = dict(target_ptr="*i64", draft_ptr="*i32", row_offsets_ptr="*i32", accepted_ptr="*i64", bonus_ptr="*i64")
        yield _Launch(greedy_accept._greedy_accept_kernel, "greedy_accept", args,
                      dict(DRAFT_BLOCK=greedy_accept._DRAFT_BLOCK))


LORA_RANKS = (16, 64)  # vLLM's default --max-lora-rank and a large one (the pool's rank, padded)


def _lora_launches(shape: ModelShape, dt: str) -> Iterator[_Launch]:
    p, width = "*" + dt, shape.q_heads * shape.head_dim  # a projection's width (runtime ints)
    for rank in LORA_RANKS:
        config = lora_sgmv.shrink_config(rank, DTYPES[dt])
        warps, stages = config.pop("num_warps"), config.pop("num_stages")
        args = dict(x_ptr=p, rows_ptr="*i64", slots_ptr="*i32", a_ptr=p, h_ptr="*fp32", m=8, in_dim=width,
                    rank=rank, x_stride_row=width, a_stride_slot=rank * width, a_stride_rank=width, h_stride_row=rank)
        yield _Launch(lora_sgmv._lora_shrink_kernel, f"lora_shrink[r={rank}]", args, config, warps, stages)
        config = lora_sgmv.expand_config(rank, DTYPES[dt])
        warps, stages = config.pop("num_warps"), config.pop("num_stages")
        args = dict(h_ptr="*fp32", rows_ptr="*i64", slots_ptr="*i32", b_ptr=p, y_ptr=p, m=8, out_dim=width,
                    rank=rank, h_stride_row=rank, b_stride_slot=rank * width, b_stride_out=rank, y_stride_row=width)
        yield _Launch(lora_sgmv._lora_expand_kernel, f"lora_expand[r={rank}]", args, config, warps, stages)


_LAUNCHES: tuple[Callable[[ModelShape, str], Iterator[_Launch]], ...] = (
    _attention_launches,
    _append_launches,
    _gdn_launches,
    _sampling_launches,
    _lora_launches,
)


def _check_kernels() -> None:
    kernels = [paged_attention._paged_attention_kernel, paged_kv_append._paged_kv_append_kernel,
               gated_delta._gated_delta_kernel, gdn_fold._gather_rows_to_slots_kernel,
               greedy_accept._greedy_accept_kernel, row_argmax._row_argmax_kernel, lora_sgmv._lora_shrink_kernel,
               lora_sgmv._lora_expand_kernel]
    if any(k is None for k in kernels):
        raise RuntimeError("fxsched.kernels was imported before triton: no kernels to compile in this process")
    if any(kernel_is_interpreted(k) for k in kernels):
        raise RuntimeError("the kernels were built for the Triton interpreter (TRITON_INTERPRET); "
                           "compile in a process without it")


def compile_all(shapes: tuple[ModelShape, ...] = SHAPES, dtypes: tuple[str, ...] = ("bf16", "fp32")) -> list[dict]:
    """One row per (kernel, shape, dtype[, K]), in that order of loops; see the module docstring."""
    _check_kernels()
    done: dict[str, dict] = {}
    rows = []
    for shape in shapes:
        for dt in dtypes:
            for launches in _LAUNCHES:
                for launch in launches(shape, dt):
                    signature, constants, attrs = _specialise(launch)
                    key = repr((launch.name, sorted(signature.items()), sorted(constants.items()),
                                sorted(attrs), launch.num_warps, launch.num_stages))
                    if key not in done:
                        done[key] = _compile(launch)
                    rows.append({"kernel": launch.name, "shape": shape.name, "dtype": dt, "k": launch.k,
                                 **done[key]})
    return rows
