"""The AMX prompt attention (kernels/cpu_amx_attention.c) against an fp64 softmax attention, a
bf16 engine's prompt logits with it against the same engine on SDPA, and the row kernel's AMX build
in use on AMX hosts (its scores as tiles; tests/test_cpu_attention.py checks its results).

The kernel takes exact bf16 products with fp32 sums, the softmax in fp32, rounds the weights to bf16
before the second product and the output once, so an output may differ from the fp64 result by its
own bf16 rounding plus the weights' rounding, which moves it by at most 2^-8 of the weighted mean of
|v|. Skipped (with the reason) where the kernel cannot run: no AMX-BF16, no C compiler, or an OS that
does not grant the tile state.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fxsched.kernels import cpu_amx, cpu_amx_attention, cpu_attention
from fxsched.runtime.bench.prompts import random_prompts
from fxsched.runtime.torch_model.config import default_config
from fxsched.runtime.torch_model.engine import HybridEngine
from support.torch_testing import torch_threads

needs_kernel = pytest.mark.skipif(cpu_amx_attention.compiled() is None, reason="the AMX attention cannot run here (needs "
                                  "AMX-BF16, a C compiler and the OS's tile state; FXSCHED_KERNELS=torch disables it)")


@needs_kernel
def test_the_kernel_passes_its_self_check():
    """Where it compiles it is in use: a kernel that fails its check would leave prompts on SDPA unseen."""
    assert cpu_amx_attention.ready()


def _fp64_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, spread) in fp64: query row i at position ctx - n + i sees keys 0 .. ctx - n + i; spread is
    the softmax-weighted mean of |v|, the scale of the weights' rounding error."""
    n, hq, d = q.shape
    ctx, hkv = k.shape[:2]
    kk = k.double().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)  # [hq, ctx, d]
    vv = v.double().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ kk.transpose(1, 2) * d ** -0.5  # [hq, n, ctx]
    allowed = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return (weights @ vv).transpose(0, 1), (weights @ vv.abs()).transpose(0, 1)


def _operands(n: int, ctx: int, hq: int, hkv: int, d: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, hq, d, generator=gen).to(torch.bfloat16)
    k = torch.randn(ctx, hkv, d, generator=gen).to(torch.bfloat16)
    v = torch.randn(ctx, hkv, d, generator=gen).to(torch.bfloat16)
    return q, k, v


def _assert_close_to_fp64(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    ref, spread = _fp64_attention(q, k, v)
    tol = ref.abs() * 2.0 ** -8 + spread * 2.0 ** -8 + 1e-6
    err = (out.double() - ref).abs()
    assert not (err > tol).any(), f"{int((err > tol).sum())} outputs off, worst {err.max().item()}"


@needs_kernel
@pytest.mark.parametrize("n,ctx", [(1, 1), (1, 77), (16, 16), (17, 17), (40, 40), (33, 100), (100, 300), (300, 300)])
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 64), (16, 8, 128), (3, 1, 256), (2, 2, 128)])
def test_prompt_attention_matches_fp64(n, ctx, hq, hkv, d):
    q, k, v = _operands(n, ctx, hq, hkv, d, seed=n * 7919 + ctx * 31 + hq * 7 + d)
    out = cpu_amx_attention.prefill_attention(q, k, v)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    _assert_close_to_fp64(out, q, k, v)


@needs_kernel
def test_strided_rows_in_and_out_and_threads_give_the_same_result():
    """q, k and v as views of a fused projection (rows strided past their heads), the output written
    into a wider buffer; one thread and two give the same bits (a row's sums do not depend on who
    computes it), and the buffer's other columns are left alone."""
    n, hq, hkv, d = 70, 4, 2, 64
    gen = torch.Generator().manual_seed(3)
    fused = torch.randn(n, hq + 2 * hkv, d, generator=gen).to(torch.bfloat16)
    q, k, v = fused[:, :hq], fused[:, hq:hq + hkv], fused[:, hq + hkv:]
    assert cpu_amx_attention.fits(q, k, v) and not q.is_contiguous()
    wide = torch.full((n, hq + 1, d), 7.0, dtype=torch.bfloat16)
    with torch_threads(1):
        one = cpu_amx_attention.prefill_attention(q, k, v, out=wide[:, :hq]).clone()
    with torch_threads(2):
        two = cpu_amx_attention.prefill_attention(q, k, v)
    assert torch.equal(one, two)
    assert (wide[:, hq] == 7.0).all()
    _assert_close_to_fp64(one, q, k, v)


@needs_kernel
def test_a_row_gets_the_same_bits_in_a_chunk_as_in_the_whole_prompt():
    """Rows 50-89 attended as a chunk after 50 earlier positions equal the same rows of the whole
    90-row prompt: a row's sums run over its own keys in key order, whichever block holds it."""
    q, k, v = _operands(90, 90, 4, 2, 128, seed=11)
    whole = cpu_amx_attention.prefill_attention(q, k, v)
    chunk = cpu_amx_attention.prefill_attention(q[50:], k, v)
    assert torch.equal(whole[50:], chunk)


@pytest.mark.skipif(not cpu_amx.ready(), reason="no AMX product here (no AMX-BF16, no compiler, or turned off)")
def test_an_amx_host_takes_the_row_kernels_amx_build():
    """Where the CPU has AMX the row kernel in use is the build with AMX scores: one that failed its
    self-check would leave decode on the plain build unseen."""
    assert cpu_attention.build() == "amx"


def test_fits_refuses_what_the_kernel_does_not_take():
    q = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    kv = torch.zeros(4, 1, 64, dtype=torch.bfloat16)
    assert not cpu_amx_attention.fits(q.float(), kv.float(), kv.float())  # fp32
    assert not cpu_amx_attention.fits(torch.zeros(4, 2, 32, dtype=torch.bfloat16), kv[..., :32], kv[..., :32])  # d 32
    assert not cpu_amx_attention.fits(torch.zeros(5, 2, 64, dtype=torch.bfloat16), kv, kv)  # more rows than keys
    assert not cpu_amx_attention.fits(torch.zeros(4, 3, 64, dtype=torch.bfloat16), torch.zeros(4, 2, 64,
                                      dtype=torch.bfloat16), torch.zeros(4, 2, 64, dtype=torch.bfloat16))  # 3 % 2


@needs_kernel
def test_bf16_engine_prefills_as_on_sdpa(monkeypatch):
    """A bf16 engine (head dim 64, so the kernel takes its prompts) gives for whole prompts, a prompt
    in two chunks and the decode after them the logits of the same engine on SDPA, within bf16 noise."""
    cfg = dataclasses.replace(default_config(), head_dim=64, dtype="bfloat16")
    prompts = random_prompts(5, 3, cfg.vocab_size, 20, 60)
    calls = []
    kernel_fn = cpu_amx_attention.prefill_attention

    def spy(q, k, v, out=None):
        calls.append((q.shape[0], k.shape[0]))
        return kernel_fn(q, k, v, out=out)

    def run(kernel: bool) -> list[torch.Tensor]:
        if kernel:
            monkeypatch.setattr(cpu_amx_attention, "prefill_attention", spy)
        else:
            monkeypatch.setattr(cpu_amx_attention, "fits", lambda *a: False)
        torch.manual_seed(0)
        engine = HybridEngine(cfg)
        seen = []
        for slot, prompt in enumerate(prompts[:2]):
            engine.alloc(slot)
            seen.append(engine.prefill(slot, prompt).float())
        engine.alloc(2)
        cut = len(prompts[2]) // 2
        engine.prefill_chunk(2, prompts[2][:cut], 0)
        seen.append(engine.prefill_chunk(2, prompts[2][cut:], cut).float())
        seen.append(engine.decode_batch([0, 1, 2], [5, 6, 7]).float())
        monkeypatch.undo()
        return seen

    with_kernel, on_sdpa = run(True), run(False)
    cut = len(prompts[2]) // 2
    assert (len(prompts[2]) - cut, len(prompts[2])) in calls  # the second chunk over its earlier keys
    for a, b in zip(with_kernel, on_sdpa, strict=True):
        scale = b.abs().max().item()
        assert (a - b).abs().max().item() <= 0.02 * scale + 1e-3
