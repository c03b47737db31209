"""The AMX product over packed weights (kernels/cpu_amx.c) against an fp64 product, the packing
against the matrix it came from, `pack_for_cpu` on real weight sets, and a bf16 engine with packed
weights against the same engine unpacked (the last two wherever a kernel reads packed weights: AMX,
or AVX512-BF16's kernels/cpu_pairs.c, whose own product is tested in tests/test_cpu_pairs.py).

The kernel accumulates exact bf16 products in fp32 and rounds each output once to bf16, so an
output may differ from the fp64 product by its own bf16 rounding plus fp32 summation noise. Skipped
(with the reason) on hosts where the kernel cannot run: no AMX-BF16, no C compiler, or an OS that
does not grant the tile state.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fxsched.kernels import cpu_amx, cpu_pairs
from fxsched.runtime.bench.prompts import random_prompts
from fxsched.runtime.torch_model.config import default_config
from fxsched.runtime.torch_model.engine import HybridEngine
from fxsched.runtime.torch_model.ops import embed_rows, linear
from fxsched.runtime.torch_model import packing
from fxsched.runtime.torch_model.packing import pack_for_cpu
from support.torch_testing import torch_threads

needs_amx = pytest.mark.skipif(not cpu_amx.ready(), reason="the AMX kernel cannot run here (needs AMX-BF16, "
                               "a C compiler and the OS's tile state; FXSCHED_KERNELS=torch disables it)")
needs_packing = pytest.mark.skipif(not packing.packing_ready(), reason="no kernel reads packed weights here (needs "
                                   "AMX-BF16 or AVX512-BF16 and a C compiler; FXSCHED_KERNELS=torch disables them)")


def _close_to_fp64(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    ref = x.double() @ w.double().T
    tol = ref.abs() * 2.0 ** -8 + (x.double().abs() @ w.double().abs().T) * 2.0 ** -20 + 1e-6
    err = (y.double() - ref).abs()
    assert not (err > tol).any(), f"{int((err > tol).sum())} outputs off, worst {err.max().item()}"


@needs_amx
@pytest.mark.parametrize("m", [1, 7, 16, 17, 33, 48, 100, 600])  # 600: two row chunks at K 1024
@pytest.mark.parametrize("k,n", [(32, 16), (96, 48), (256, 80), (1024, 272)])
def test_packed_product_matches_fp64(m, k, n):
    gen = torch.Generator().manual_seed(m * 7919 + k * 31 + n)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    y = cpu_amx.amx_linear(x, cpu_amx.pack(w))
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    _close_to_fp64(y, x, w)


@needs_amx
def test_leading_dimensions_and_threads_give_the_same_product():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 5, 128, generator=gen).to(torch.bfloat16)
    w = torch.randn(4096 + 64, 128, generator=gen).to(torch.bfloat16)  # enough blocks to split
    p = cpu_amx.pack(w)
    with torch_threads(1):
        one = cpu_amx.amx_linear(x, p)
    with torch_threads(3):
        three = cpu_amx.amx_linear(x, p)
    assert one.shape == (3, 5, 4096 + 64)
    assert torch.equal(one, three)
    _close_to_fp64(one.reshape(15, -1), x.reshape(15, 128), w)


def test_pack_unpack_and_rows_are_exact():
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(48, 64, generator=gen).to(torch.bfloat16)
    p = cpu_amx.pack(w)
    assert cpu_amx.is_packed(p) and not cpu_amx.is_packed(w)
    assert p.shape == (3, 2, 16, 16, 2) and p.numel() == w.numel()
    assert torch.equal(cpu_amx.unpack(p), w)
    ids = torch.tensor([[0, 47, 16], [15, 31, 5]])
    assert torch.equal(cpu_amx.rows(p, ids), w[ids])
    assert torch.equal(embed_rows(p, ids), w[ids]) and torch.equal(embed_rows(w, ids), w[ids])
    assert not cpu_amx.packable(w.float()) and not cpu_amx.packable(w[:, :48]) and not cpu_amx.packable(w[:40])


def test_a_packed_weight_outside_the_kernel_reach_is_the_plain_product(monkeypatch):
    """Where no kernel is loaded, a packed weight gives F.linear on the weight it holds, exactly."""
    monkeypatch.setattr(cpu_amx, "_library", lambda: None)
    monkeypatch.setattr(cpu_pairs, "_library", lambda: None)
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(32, 64, generator=gen).to(torch.bfloat16)
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    assert torch.equal(linear(x, cpu_amx.pack(w)), torch.nn.functional.linear(x, w))


@needs_packing
def test_pack_for_cpu_packs_projections_once_and_leaves_the_rest():
    gen = torch.Generator().manual_seed(2)
    bf = dict(dtype=torch.bfloat16)
    embed = torch.randn(64, 32, generator=gen).to(**bf)
    weights = {
        "embed": embed, "lm_head": embed,  # tied: one tensor under both names
        "layers.0.attn.q_proj": torch.randn(32, 32, generator=gen).to(**bf),
        "layers.0.input_norm": torch.randn(32, generator=gen).to(**bf),
        "layers.0.mlp.experts.gate_proj": torch.randn(4, 16, 32, generator=gen).to(**bf),  # 3-D stack
        "layers.0.attn.o_proj": torch.randn(32, 24, generator=gen).to(**bf),  # K % 32 != 0
    }
    cfg = dataclasses.replace(default_config(), dtype="bfloat16")
    out = pack_for_cpu(weights, cfg)
    assert out is not weights and weights["layers.0.attn.q_proj"].dim() == 2  # the input is left whole
    assert cpu_amx.is_packed(out["layers.0.attn.q_proj"]) and cpu_amx.is_packed(out["lm_head"])
    assert out["embed"] is out["lm_head"]  # packed once, shared
    assert torch.equal(cpu_amx.unpack(out["lm_head"]), embed)
    for name in ("layers.0.input_norm", "layers.0.mlp.experts.gate_proj", "layers.0.attn.o_proj"):
        assert out[name] is weights[name], name
    fp32 = {name: t.float() for name, t in weights.items()}
    assert pack_for_cpu(fp32, cfg) is fp32  # nothing to pack in an fp32 model


@needs_packing
def test_bf16_engine_with_packed_weights_decodes_as_unpacked(monkeypatch):
    """Batched decode steps and a ragged verify forward of a bf16 engine whose projections are
    packed give the logits of the same engine with packing turned off, within bf16 noise."""
    cfg = dataclasses.replace(default_config(), dtype="bfloat16", hidden_size=64, intermediate_size=128)
    prompts = random_prompts(5, 3, cfg.vocab_size, 9, 30)

    def run(packed: bool) -> list[torch.Tensor]:
        if not packed:
            monkeypatch.setattr(packing, "packing_ready", lambda: False)
        torch.manual_seed(0)
        engine = HybridEngine(cfg)
        assert any(cpu_amx.is_packed(t) for t in engine.model.w.values()) == packed
        for slot, prompt in enumerate(prompts):
            engine.alloc(slot)
            engine.prefill(slot, prompt)
        seen = [engine.decode_batch([0, 1, 2], [5 + step, 6 + 2 * step, 7 + 3 * step]).float() for step in range(4)]
        seen += [t.float() for t in engine.verify_batched([0, 1, 2], [[1, 2, 3], [4], [5, 6]])]
        monkeypatch.undo()
        return seen

    packed, plain = run(True), run(False)
    for a, b in zip(packed, plain, strict=True):
        scale = b.abs().max().item()
        assert (a - b).abs().max().item() <= 0.03 * scale + 1e-3
