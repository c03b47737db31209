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
