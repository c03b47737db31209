"""The two instruction-set levels of the CPU kernels and the widened bf16 product of CPUs without
bf16 arithmetic (cpu-kernels.md §15.6).

- `host_isa` picks the highest level the CPU's flags allow, and ``FXSCHED_CPU_ISA`` only lowers it;
- on a host whose own build is the AVX512 one, the kernel tests run again in a process built for
  AVX2 (on an AVX2 host those tests already run the AVX2 build);
- `widened_linear` against an fp64 product, across panel boundaries and row counts on both sides
  of the row-kernel slices, and `ops.linear` taking it where it is wanted.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fxsched.kernels import _cpu, cpu_amx, cpu_gemv, cpu_widen
from fxsched.runtime.torch_model import ops

AVX512 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx2", "fma", "f16c"})
AVX2 = frozenset({"avx2", "fma", "f16c", "avx", "sse4_2"})


@pytest.mark.parametrize("flags,asked,want", [
    (AVX512, "", "avx512"),
    (AVX512, "avx2", "avx2"),
    (AVX512, "AVX2 ", "avx2"),
    (AVX2, "", "avx2"),
    (AVX2, "avx512", "avx2"),  # asking for more than the CPU has changes nothing
    (AVX512 - {"avx512_bf16"}, "", "avx2"),  # Skylake/Cascade Lake: AVX512 without its bf16 instructions
    (AVX2 - {"fma"}, "", None),
    (frozenset({"sse4_2", "avx"}), "", None),
    (frozenset(), "avx2", None),
])
def test_host_isa_is_the_highest_level_the_flags_allow_and_the_env_only_lowers_it(monkeypatch, flags, asked, want):
    monkeypatch.setattr(_cpu, "_cpu_flags", lambda: flags)
    monkeypatch.setenv("FXSCHED_CPU_ISA", asked)
    assert _cpu.host_isa() == want


AMX = frozenset({"amx_tile", "amx_bf16"})


@pytest.mark.parametrize("flags,asked,want", [
    (AVX512 | AMX, "", True),
    (AVX512 | AMX, "amx", True),
    (AVX512 | AMX, "AVX512", False),  # the AVX512-BF16 path of an AMX host, tested and measured there
    (AVX512 | AMX, "avx2", False),
    (AVX512 | AMX, "sse", True),  # a name that is no level lowers nothing
    (AVX512, "", False),
    (AVX512 | {"amx_tile"}, "", False),  # tiles without their bf16 products
    (AVX2 | AMX, "", False),  # no AVX512 build to hold the AMX kernels
])
def test_amx_runs_only_on_an_amx_cpu_at_the_amx_level(monkeypatch, flags, asked, want):
    monkeypatch.setattr(_cpu, "_cpu_flags", lambda: flags)
    monkeypatch.setenv("FXSCHED_CPU_ISA", asked)
    assert _cpu.amx_allowed() is want
    assert cpu_amx.has_amx() is want


@pytest.mark.parametrize("flags,want", [(AVX512, True), (AVX2, False), (AVX2 | {"amx_bf16", "amx_tile"}, True),
                                        (AVX512 - {"avx512_bf16"}, False)])
def test_bf16_arithmetic_means_avx512_bf16_or_amx(monkeypatch, flags, want):
    monkeypatch.setattr(_cpu, "_cpu_flags", lambda: flags)
    assert _cpu.bf16_arithmetic() is want


def test_a_kernel_outside_the_host_level_is_not_loaded(monkeypatch):
    monkeypatch.setattr(_cpu, "_cpu_flags", lambda: AVX2)
    monkeypatch.delenv("FXSCHED_CPU_ISA", raising=False)
    monkeypatch.delenv("FXSCHED_KERNELS", raising=False)
    assert _cpu.load("cpu_amx", {}, isas=("avx512",)) is None


def _kernel_tests_pass_at(level: str, files: list[str]) -> None:
    """The kernel test files run in a process whose kernels are built at ``level``
    (FXSCHED_CPU_ISA): they pass, and none is skipped for want of a kernel."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "FXSCHED_CPU_ISA": level}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *files],
                         cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "skipped" not in out.stdout.splitlines()[-1], out.stdout[-2000:]


@pytest.mark.skipif(_cpu.host_isa() != "avx512" or not cpu_gemv.ready(),
                    reason="this host's own build is not the AVX512 one (the kernel tests already run its build)")
def test_the_avx2_build_passes_the_kernel_tests_on_an_avx512_host():
    _kernel_tests_pass_at("avx2", ["tests/test_cpu_kernels.py", "tests/test_cpu_attention.py",
                                   "tests/test_cpu_pointwise.py", "tests/test_cpu_fold.py"])


@pytest.mark.skipif(not cpu_amx.ready(), reason="not an AMX host in use (elsewhere the AVX512 path is the host's "
                    "own, which the kernel tests run)")
def test_the_avx512_path_passes_the_kernel_tests_on_an_amx_host():
    """FXSCHED_CPU_ISA=avx512 turns AMX off: the packed weights go to the AVX512-BF16 product, the
    row kernel is its plain AVX512 build, and the engine's fused layers still give the step-by-step
    logits, with nothing skipped for want of a kernel."""
    _kernel_tests_pass_at("avx512", ["tests/test_cpu_pairs.py", "tests/test_cpu_attention.py",
                                     "tests/test_fused_layer.py"])


def _fp64_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    ref = x.double() @ w.double().T
    # one bf16 rounding of the result plus fp32 summation-order noise
    tol = ref.abs() * 2.0 ** -8 + (x.double().abs() @ w.double().abs().T) * 2.0 ** -20 + 1e-6
    bad = (y.double() - ref).abs() > tol
    assert not bad.any(), f"{int(bad.sum())} outputs off, worst {(y.double() - ref).abs().max().item()}"


@pytest.mark.parametrize("m", [1, 8, 9, 16, 17, 40])
@pytest.mark.parametrize("k,n", [(64, 100), (77, 33), (256, 16)])
def test_widened_linear_matches_an_fp64_product_across_panels(monkeypatch, m, k, n):
    monkeypatch.setattr(cpu_widen, "PANEL_BYTES", 4 * k * 16)  # 16-row panels: several per product
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    y = cpu_widen.widened_linear(x, w)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    _fp64_close(y, x, w)


def test_model_linear_widens_large_bf16_products_where_wanted(monkeypatch):
    calls: list[tuple[int, ...]] = []
    widened = cpu_widen.widened_linear
    monkeypatch.setattr(cpu_widen, "wanted", lambda: True)
    monkeypatch.setattr(cpu_widen, "widened_linear", lambda x, w: calls.append(tuple(x.shape)) or widened(x, w))
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(48, 64, generator=gen).to(torch.bfloat16)
    x = torch.randn(3, 20, 64, generator=gen).to(torch.bfloat16)  # 60 rows: beyond the row kernel
    y = ops.linear(x, w)
    assert calls == [(60, 64)] and y.shape == (3, 20, 48)
    _fp64_close(y.reshape(60, 48), x.reshape(60, 64), w)
    fp32 = torch.randn(30, 64, generator=gen)
    assert torch.equal(ops.linear(fp32, w.float()), torch.nn.functional.linear(fp32, w.float()))
    assert calls == [(60, 64)]  # an fp32 product is never widened


def test_fxsched_kernels_torch_turns_widening_off(monkeypatch):
    monkeypatch.setattr(_cpu, "_cpu_flags", lambda: AVX2)
    monkeypatch.delenv("FXSCHED_KERNELS", raising=False)
    assert cpu_widen.wanted()
    monkeypatch.setenv("FXSCHED_KERNELS", "torch")
    assert not cpu_widen.wanted()
    monkeypatch.setattr(_cpu, "_cpu_flags", lambda: AVX512)
    monkeypatch.delenv("FXSCHED_KERNELS")
    assert not cpu_widen.wanted()  # bf16 arithmetic in the CPU: F.linear's own bf16 path is fast
