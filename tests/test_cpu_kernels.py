"""The CPU kernels against independent references: the bf16 matrix-vector product
(kernels/cpu_gemv.c) against an fp32 product, the GDN decode step (kernels/cpu_gdn.c) against the
delta rule written out in fp64.

The product accumulates in fp32 and rounds once, like F.linear; only the summation order differs,
so each output may differ from the fp32 product by its own bf16 rounding plus a few fp32 ulps of
the sum. Skipped (with the reason) on hosts where the kernel cannot run: no AVX2 or AVX512-BF16,
no C compiler.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from fxsched.kernels import cpu_gdn, cpu_gemv, cpu_widen
from fxsched.runtime.torch_model.ops import linear
from support.torch_testing import torch_threads

needs_kernel = pytest.mark.skipif(not cpu_gemv.ready(), reason="the CPU bf16 kernel cannot run here "
                                  "(needs AVX2 and FMA, or AVX512-BF16, and a C compiler; FXSCHED_KERNELS=torch disables it)")


def _bf16_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    ref = x.float() @ w.float().T
    # one bf16 rounding of the result (2^-8 relative) plus fp32 summation-order noise
    tol = ref.abs() * 2.0 ** -8 + (x.float().abs() @ w.float().abs().T) * 2.0 ** -20 + 1e-6
    bad = (y.float() - ref).abs() > tol
    assert not bad.any(), f"{int(bad.sum())} outputs off, worst {(y.float() - ref).abs().max().item()}"


@needs_kernel
@pytest.mark.parametrize("m", range(1, 9))
@pytest.mark.parametrize("k,n", [(1024, 64), (77, 13), (32, 5), (1, 3), (2049, 7)])
def test_kernel_matches_fp32_product(m, k, n):
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    y = torch.empty(m, n, dtype=torch.bfloat16)  # the C entry point itself takes up to 8 rows
    assert cpu_gemv._library().fx_gemv_bf16(x.data_ptr(), w.data_ptr(), y.data_ptr(), m, k, n, 0, n) == 0
    _bf16_close(y, x, w)
    if m <= cpu_gemv.MAX_ROWS:
        _bf16_close(cpu_gemv.gemv_bf16(x, w), x, w)


@needs_kernel
def test_rows_split_over_threads_give_the_same_product():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 256, generator=gen).to(torch.bfloat16)
    w = torch.randn(4099, 256, generator=gen).to(torch.bfloat16)
    with torch_threads(1):
        one = cpu_gemv.gemv_bf16(x, w)
    with torch_threads(4):
        four = cpu_gemv.gemv_bf16(x, w)
    assert torch.equal(one, four)
    _bf16_close(one, x, w)


@needs_kernel
def test_model_linear_takes_the_kernel_for_small_bf16_batches_only(monkeypatch):
    calls = []
    kernel = cpu_gemv.gemv_bf16
    monkeypatch.setattr(cpu_gemv, "gemv_bf16", lambda x, w: calls.append(x.shape) or kernel(x, w))
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(48, 64, generator=gen).to(torch.bfloat16)
    small = torch.randn(2, 2, 64, generator=gen).to(torch.bfloat16)  # 4 rows: the kernel
    out = linear(small, w)
    assert out.shape == (2, 2, 48) and out.dtype == torch.bfloat16
    _bf16_close(out.reshape(4, 48), small.reshape(4, 64), w)
    assert calls == [(4, 64)]
    large = torch.randn(20, 64, generator=gen).to(torch.bfloat16)  # 20 rows: F.linear, or widened
    if cpu_widen.wanted():  # no bf16 arithmetic here: taken in fp32 panels (cpu-kernels.md §15.6)
        _bf16_close(linear(large, w), large, w)
    else:
        assert torch.equal(linear(large, w), torch.nn.functional.linear(large, w))
    fp32 = torch.randn(2, 64, generator=gen)
    assert torch.equal(linear(fp32, w.float()), torch.nn.functional.linear(fp32, w.float()))
    assert calls == [(4, 64)]  # neither the 20-row product nor the fp32 one took the kernel


def test_operands_the_kernel_does_not_take_fall_back_to_the_reference():
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(40, 32, generator=gen).to(torch.bfloat16)
    for x in (torch.randn(9, 32, generator=gen).to(torch.bfloat16),  # too many rows
              torch.randn(2, 32, generator=gen)):  # fp32
        xw = w.to(x.dtype)
        assert torch.equal(cpu_gemv.gemv_bf16(x, xw), torch.nn.functional.linear(x, xw))
    strided = torch.randn(32, 80, generator=gen).to(torch.bfloat16).T  # [80, 32], not contiguous
    x = torch.randn(1, 32, generator=gen).to(torch.bfloat16)
    assert torch.equal(cpu_gemv.gemv_bf16(x, strided), torch.nn.functional.linear(x, strided))


def test_fxsched_kernels_torch_turns_the_kernel_off():
    code = "from fxsched.kernels import cpu_gemv; print(cpu_gemv.ready())"
    env = {**os.environ, "FXSCHED_KERNELS": "torch"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


# --- the GDN decode step (kernels/cpu_gdn.c) ------------------------------------------------------

gdn_kernel = pytest.mark.skipif(cpu_gdn._library() is None, reason="the CPU GDN kernel cannot run here "
                                "(needs AVX2 and FMA, or AVX512-BF16, and a C compiler; FXSCHED_KERNELS=torch disables it)")


def _gdn_inputs(seed: int, b: int, h: int, dk: int, dv: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, dk, generator=gen) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(b, h, dk, generator=gen), dim=-1)
    v = torch.randn(b, h, dv, generator=gen)
    g = -torch.rand(b, h, generator=gen) * 3
    beta = torch.rand(b, h, generator=gen)
    return q, k, v, g, beta


def _delta_rule_step(q, k, v, g, beta, s):
    """The recurrence written out per head in fp64 (gdn.py's module docstring), an independent form."""
    s = s.double() * torch.exp(g.double())[..., None, None]
    out = torch.empty(v.shape, dtype=torch.float64)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            u = beta[b, h].double() * (v[b, h].double() - s[b, h].T @ k[b, h].double())
            s[b, h] = s[b, h] + torch.outer(k[b, h].double(), u)
            out[b, h] = s[b, h].T @ q[b, h].double()
    return out, s


@gdn_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,h,dk,dv", [(3, 2, 16, 24), (1, 1, 8, 8), (4, 3, 128, 128)])
def test_gdn_step_kernel_matches_the_recurrence(dtype, b, h, dk, dv):
    q, k, v, g, beta = _gdn_inputs(b * 100 + dk, b, h, dk, dv)
    slots = torch.randperm(b + 3)[:b]
    state = (torch.randn(b + 3, h, dk, dv) * 0.3).to(dtype)
    before = state.clone()
    want_o, want_s = _delta_rule_step(q, k, v, g, beta, before.index_select(0, slots))
    o = cpu_gdn.gdn_step(q, k, v, g, beta, state, slots)
    torch.testing.assert_close(o.double(), want_o, atol=1e-4, rtol=1e-4)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(state.index_select(0, slots).double(), want_s.to(dtype).double(), atol=tol, rtol=tol)
    others = [i for i in range(b + 3) if i not in slots.tolist()]
    assert torch.equal(state[others], before[others])  # rows of other slots untouched


@gdn_kernel
def test_gdn_step_kernel_equals_its_torch_reference_across_threads():
    q, k, v, g, beta = _gdn_inputs(11, 5, 4, 32, 48)
    slots = torch.tensor([6, 1, 3, 0, 5])
    states = [(torch.randn(7, 4, 32, 48) * 0.3).to(torch.bfloat16) for _ in range(3)]
    states[1].copy_(states[0])
    states[2].copy_(states[0])
    with torch_threads(1):
        one = cpu_gdn.gdn_step(q, k, v, g, beta, states[0], slots)
    with torch_threads(3):
        three = cpu_gdn.gdn_step(q, k, v, g, beta, states[1], slots)
    ref = cpu_gdn.gdn_step_reference(q, k, v, g, beta, states[2], slots)
    assert torch.equal(one, three) and torch.equal(states[0], states[1])
    torch.testing.assert_close(one, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states[0].float(), states[2].float(), atol=2 ** -7, rtol=2 ** -7)
