"""The AVX512-BF16 product over tile-order packed weights (kernels/cpu_pairs.c, cpu-kernels.md §15.8)
against an fp64 product, in both of its arithmetics (``bf16``: VDPBF16PS; ``fp32``: the packing
widened to fp32 FMAs; `cpu_pairs.arithmetic`): every row count a pass takes (1-12) and more (row blocks over one weight
panel), odd and even numbers of 16-column blocks (pairs of blocks and a last single one), leading
dimensions, threads splitting the blocks; and which kernel `ops.linear` gives a packed weight.

The kernel accumulates exact bf16 products in fp32 and rounds each output once to bf16, so an output
may differ from the fp64 product by its own bf16 rounding plus fp32 summation noise (the same bound
as tests/test_cpu_amx.py's). Skipped (with the reason) where it cannot run: a host below the AVX512
kernel level (_cpu.host_isa), no C compiler; on an AMX host the kernel is tested but `ops.linear` takes
AMX's (the dispatch test is skipped there).
"""

from __future__ import annotations

import pytest
import torch

from fxsched.kernels import cpu_amx, cpu_pairs
from fxsched.runtime.torch_model.ops import linear
from support.torch_testing import torch_threads

needs_pairs = pytest.mark.skipif(not cpu_pairs.loads(), reason="the AVX512-BF16 packed kernel cannot run here "
                                 "(needs AVX512-BF16 and a C compiler; FXSCHED_KERNELS=torch disables it)")
in_use = pytest.mark.skipif(not cpu_pairs.ready(), reason="the AVX512-BF16 packed kernel is not in use here "
                            "(an AMX host: the AMX kernel reads packed weights)")


def _close_to_fp64(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    ref = x.double() @ w.double().T
    tol = ref.abs() * 2.0 ** -8 + (x.double().abs() @ w.double().abs().T) * 2.0 ** -20 + 1e-6
    err = (y.double() - ref).abs()
    assert not (err > tol).any(), f"{int((err > tol).sum())} outputs off, worst {err.max().item()}"


@pytest.fixture(params=cpu_pairs.ARITHMETICS)
def arith(request, monkeypatch):
    monkeypatch.setenv("FXSCHED_PAIRS_ARITH", request.param)
    assert cpu_pairs.arithmetic() == request.param
    return request.param


@needs_pairs
@pytest.mark.parametrize("m", [1, 2, 5, 11, 12, 13, 24, 37])
@pytest.mark.parametrize("k,n", [(32, 16), (96, 48), (256, 80), (1024, 272)])
def test_packed_product_matches_fp64(arith, m, k, n):
    gen = torch.Generator().manual_seed(m * 7919 + k * 31 + n)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    y = cpu_pairs.pairs_linear(x, cpu_amx.pack(w))
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    _close_to_fp64(y, x, w)


@needs_pairs
def test_a_row_gets_the_same_bits_whatever_rows_run_beside_it(arith):
    # greedy tokens must not depend on the batch: every row block and every span of rows the fp32
    # form converts at a time (here 8,192 inputs: 24 rows per span) sums each output in one order
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(75, 8192, generator=gen).to(torch.bfloat16)
    w = torch.randn(48, 8192, generator=gen).to(torch.bfloat16)
    p = cpu_amx.pack(w)
    whole = cpu_pairs.pairs_linear(x, p)
    for lo, hi in ((0, 1), (3, 4), (5, 17), (40, 75), (74, 75)):
        assert torch.equal(cpu_pairs.pairs_linear(x[lo:hi], p), whole[lo:hi]), (lo, hi)
    _close_to_fp64(whole, x, w)


def test_the_arithmetic_follows_the_vendor_unless_asked(monkeypatch):
    monkeypatch.delenv("FXSCHED_PAIRS_ARITH", raising=False)
    monkeypatch.setattr(cpu_pairs, "_vendor", lambda: "GenuineIntel")
    assert cpu_pairs.arithmetic() == "fp32"
    monkeypatch.setattr(cpu_pairs, "_vendor", lambda: "AuthenticAMD")
    assert cpu_pairs.arithmetic() == "bf16"
    monkeypatch.setenv("FXSCHED_PAIRS_ARITH", "fp32")
    assert cpu_pairs.arithmetic() == "fp32"
    monkeypatch.setenv("FXSCHED_PAIRS_ARITH", "nonsense")
    assert cpu_pairs.arithmetic() == "bf16"


@needs_pairs
def test_leading_dimensions_and_threads_give_the_same_product(arith):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 5, 128, generator=gen).to(torch.bfloat16)
    w = torch.randn(4096 + 48, 128, generator=gen).to(torch.bfloat16)  # enough blocks to split, an odd count
    p = cpu_amx.pack(w)
    with torch_threads(1):
        one = cpu_pairs.pairs_linear(x, p)
    with torch_threads(3):
        three = cpu_pairs.pairs_linear(x, p)
    assert one.shape == (3, 5, 4096 + 48)
    assert torch.equal(one, three)  # each output is summed in the same order whatever the split
    _close_to_fp64(one.reshape(15, -1), x.reshape(15, 128), w)


@in_use
def test_linear_takes_the_packed_kernel():
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(64, 96, generator=gen).to(torch.bfloat16)
    x = torch.randn(9, 96, generator=gen).to(torch.bfloat16)
    p = cpu_amx.pack(w)
    assert torch.equal(linear(x, p), cpu_pairs.pairs_linear(x, p))
    _close_to_fp64(linear(x, p), x, w)
    # (without a kernel, F.linear on the matrix it holds: tests/test_cpu_amx.py)
