"""The CPU elementwise kernels (kernels/cpu_pointwise.c) against the same math in fp64, and the
model's ops taking them only where they apply. Each kernel rounds once to bf16, so it may differ
from the fp64 value by one bf16 rounding (2^-8 relative) plus fp32 noise. Skipped (with the
reason) where the kernels cannot run: no AVX2 or AVX512-BF16, no C compiler."""

from __future__ import annotations

import pytest
import torch

from fxsched.kernels import cpu_pointwise
from fxsched.runtime.torch_model import ops
from support.torch_testing import torch_threads

needs_kernel = pytest.mark.skipif(not cpu_pointwise.ready(), reason="the CPU pointwise kernels cannot run here "
                                  "(needs AVX2 and FMA, or AVX512-BF16, and a C compiler; FXSCHED_KERNELS=torch disables it)")


def _within_one_rounding(y: torch.Tensor, ref: torch.Tensor) -> None:
    tol = ref.abs() * 2.0 ** -8 + 1e-6
    bad = (y.double() - ref).abs() > tol
    assert not bad.any(), f"{int(bad.sum())} off, worst {(y.double() - ref).abs().max().item()}"


@needs_kernel
@pytest.mark.parametrize("rows,d", [(1, 16), (7, 1024), (33, 128)])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_rms_norm_matches_fp64(rows, d, weight_dtype, threads):
    gen = torch.Generator().manual_seed(rows * d)
    x = (torch.randn(rows, d, generator=gen) * 4).to(torch.bfloat16)
    w = (1 + torch.randn(d, generator=gen) * 0.1).to(weight_dtype)
    with torch_threads(threads):
        y = cpu_pointwise.rms_norm_bf16(x, w, 1e-6)
    xd = x.double()
    ref = xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + 1e-6) * w.double()
    _within_one_rounding(y, ref)


@needs_kernel
@pytest.mark.parametrize("n", [1, 15, 16, 17, 100_003])
def test_silu_mul_matches_fp64(n):
    gen = torch.Generator().manual_seed(n)
    a = (torch.randn(n, generator=gen) * 6).to(torch.bfloat16)
    a[0] = -100.0  # exp saturates: silu(-100) is -0.0 to bf16 precision
    b = torch.randn(n, generator=gen).to(torch.bfloat16)
    y = cpu_pointwise.silu_mul_bf16(a, b)
    ad = a.double()
    _within_one_rounding(y, ad / (1 + torch.exp(-ad)) * b.double())


@needs_kernel
def test_model_ops_take_the_kernels_for_bf16_cpu_tensors_only(monkeypatch):
    calls: list[str] = []
    norm, product = cpu_pointwise.rms_norm_bf16, cpu_pointwise.silu_mul_bf16
    monkeypatch.setattr(cpu_pointwise, "rms_norm_bf16", lambda *a: calls.append("norm") or norm(*a))
    monkeypatch.setattr(cpu_pointwise, "silu_mul_bf16", lambda *a: calls.append("silu") or product(*a))
    w = {"m.gate_proj": torch.randn(32, 16), "m.up_proj": torch.randn(32, 16), "m.down_proj": torch.randn(16, 32)}
    x = torch.randn(3, 16)
    fp32 = ops.swiglu_mlp(x, w, "m"), ops.rms_norm(x, torch.ones(16), 1e-6)
    assert calls == []
    wb = {k: v.to(torch.bfloat16) for k, v in w.items()}
    bf16 = ops.swiglu_mlp(x.to(torch.bfloat16), wb, "m"), ops.rms_norm(x.to(torch.bfloat16), torch.ones(16), 1e-6)
    assert calls == ["silu", "norm"]
    assert ops.rms_norm(x.to(torch.bfloat16)[:, :15], torch.ones(15), 1e-6).shape == (3, 15)  # d % 16: torch
    assert calls == ["silu", "norm"]
    for a, b in zip(fp32, bf16, strict=True):
        torch.testing.assert_close(b.float(), a, rtol=0.05, atol=0.05 * a.abs().max().item())


# The fused steps of a layer whose projections are fused (specs/cpu-kernels.md §15.10): each must give
# the bits of the separate steps it replaces, written out here in torch's own bf16 ops.


@needs_kernel
@pytest.mark.parametrize("rows,d", [(1, 16), (5, 1024), (3, 48)])
@pytest.mark.parametrize("threads", [1, 2])
def test_add_rms_norm_is_torchs_add_then_the_norm(rows, d, threads):
    gen = torch.Generator().manual_seed(rows + d)
    h = (torch.randn(rows, d, generator=gen) * 4).to(torch.bfloat16)
    delta = (torch.randn(rows, d, generator=gen) * 3).to(torch.bfloat16)
    w = 1 + torch.randn(d, generator=gen) * 0.1
    with torch_threads(threads):
        out, y = cpu_pointwise.add_rms_norm_bf16(h, delta, w, 1e-6)
    assert torch.equal(out, h + delta)  # PyTorch's bf16 add: fp32 sum, one rounding
    od = out.double()
    _within_one_rounding(y, od / torch.sqrt((od * od).mean(-1, keepdim=True) + 1e-6) * w.double())


@needs_kernel
@pytest.mark.parametrize("rows,n", [(1, 3072), (4, 17), (2, 1)])
def test_silu_mul_rows_takes_the_halves_of_each_row(rows, n):
    gen = torch.Generator().manual_seed(rows * n)
    gu = (torch.randn(rows, 2 * n, generator=gen) * 5).to(torch.bfloat16)
    y = cpu_pointwise.silu_mul_rows_bf16(gu)
    assert y.shape == (rows, n)
    g, u = gu[:, :n].double(), gu[:, n:].double()
    _within_one_rounding(y, g / (1 + torch.exp(-g)) * u)


def _rope_bf16(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half over the tables' first rot dims in bf16 torch ops (each op rounds): x [R, H, d]."""
    rot = cos.shape[-1]
    half = rot // 2
    c, s = cos[:, None, :], sin[:, None, :]
    xr = x[..., :rot]
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], -1)
    return torch.cat([xr * c + rotated * s, x[..., rot:]], -1)


@needs_kernel
@pytest.mark.parametrize("hq,hkv,d,rot", [(16, 8, 128, 128), (4, 2, 16, 16), (8, 2, 256, 64), (2, 1, 32, 12)])
@pytest.mark.parametrize("normed", [True, False])
@pytest.mark.parametrize("rows", [1, 7])
def test_qk_norm_rope_is_the_norm_then_torchs_rotation(hq, hkv, d, rot, normed, rows):
    gen = torch.Generator().manual_seed(hq * d + rot + rows)
    extra = 3 * d  # v and more columns past q and k: the kernel reads only its own
    qkv = (torch.randn(rows, (hq + hkv) * d + extra, generator=gen) * 3).to(torch.bfloat16)
    qn, kn = 1 + torch.randn(d, generator=gen) * 0.1, 1 + torch.randn(d, generator=gen) * 0.1
    angles = torch.randint(0, 4000, (rows, 1), generator=gen).float() * torch.rand(rot // 2, generator=gen)
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(torch.bfloat16)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(torch.bfloat16)
    q, k = cpu_pointwise.qk_norm_rope_bf16(qkv, hq, hkv, d, qn if normed else None, kn if normed else None, 1e-6,
                                           cos, sin)
    q_in = qkv[:, :hq * d].reshape(rows, hq, d).contiguous()
    k_in = qkv[:, hq * d:(hq + hkv) * d].reshape(rows, hkv, d).contiguous()
    if normed:  # the norm kernel itself is held to fp64 above
        q_in, k_in = cpu_pointwise.rms_norm_bf16(q_in, qn, 1e-6), cpu_pointwise.rms_norm_bf16(k_in, kn, 1e-6)
    assert torch.equal(q, _rope_bf16(q_in, cos, sin))
    assert torch.equal(k, _rope_bf16(k_in, cos, sin))


@needs_kernel
def test_kv_scatter_copies_the_named_rows_to_the_cache_rows():
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(6, 32, generator=gen).to(torch.bfloat16)
    wide = torch.randn(6, 80, generator=gen).to(torch.bfloat16)
    v = wide[:, 40:72]  # a column slice of a wider row, as a fused product's v
    kc, vc = torch.zeros(10, 32, dtype=torch.bfloat16), torch.zeros(10, 32, dtype=torch.bfloat16)
    src, dst = torch.tensor([4, 0, 5]), torch.tensor([9, 2, 3])
    cpu_pointwise.kv_scatter_bf16(k, v, kc, vc, src, dst)
    assert torch.equal(kc[dst], k[src]) and torch.equal(vc[dst], v[src])
    untouched = [i for i in range(10) if i not in dst.tolist()]
    assert not kc[untouched].any() and not vc[untouched].any()
    cpu_pointwise.kv_scatter_bf16(k[:2], v[:2], kc, vc, None, torch.tensor([0, 1]))  # no src: rows in order
    assert torch.equal(kc[:2], k[:2]) and torch.equal(vc[:2], v[:2])


@needs_kernel
def test_each_kernel_gives_the_same_bits_on_a_team_of_threads():
    """Inputs large enough that the threads engage (an OpenMP team over row ranges): every output as
    one thread computes it (the one-thread results are held to fp64 and torch above)."""
    gen = torch.Generator().manual_seed(9)
    rows, d = 300, 1024  # 300k elements: past the per-thread minimum twice over
    h = (torch.randn(rows, d, generator=gen) * 3).to(torch.bfloat16)
    delta = torch.randn(rows, d, generator=gen).to(torch.bfloat16)
    w = 1 + torch.randn(d, generator=gen) * 0.1
    gu = torch.randn(rows, 2 * d, generator=gen).to(torch.bfloat16)
    qkv = torch.randn(rows, 24 * 128 + 64, generator=gen).to(torch.bfloat16)
    cos, sin = torch.rand(rows, 64, generator=gen).to(torch.bfloat16), torch.rand(rows, 64, generator=gen).to(torch.bfloat16)

    def every() -> list[torch.Tensor]:
        return [cpu_pointwise.rms_norm_bf16(h, w, 1e-6), *cpu_pointwise.add_rms_norm_bf16(h, delta, w, 1e-6),
                cpu_pointwise.silu_mul_bf16(h, delta), cpu_pointwise.silu_mul_rows_bf16(gu),
                *cpu_pointwise.qk_norm_rope_bf16(qkv, 16, 8, 128, w[:128], w[128:256], 1e-6, cos, sin)]

    with torch_threads(1):
        one = every()
    with torch_threads(2):
        team = every()
    for a, b in zip(one, team, strict=True):
        assert torch.equal(a, b)
