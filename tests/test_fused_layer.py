"""A bf16 CPU model's layers with their projections fused (runtime/torch_model/fused.py,
specs/cpu-kernels.md §15.10) against the same model run step by step: the fused q/k/v(/gate) and
gate/up products, the one-call q/k norms and rotation, the K/V write and the residual add fused
with the next norm must give the step-by-step forward's logits bit for bit, through prefill, batched
decode and a ragged verify. Skipped (with the reason) where no kernel reads packed weights: the
fusion is made only over packed projections."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fxsched.kernels import cpu_amx, cpu_layers, cpu_pairs, cpu_pointwise
from fxsched.runtime.bench.prompts import random_prompts
from fxsched.runtime.torch_model import fused, model, packing
from fxsched.runtime.torch_model.config import default_config
from fxsched.runtime.torch_model.engine import HybridEngine
from support.torch_testing import torch_threads

needs_packing = pytest.mark.skipif(not (packing.packing_ready() and cpu_pointwise.ready()),
                                   reason="no kernel reads packed weights here (needs AMX-BF16 or AVX512-BF16 and "
                                   "a C compiler; FXSCHED_KERNELS=torch disables them)")


def _step_by_step_add_norm(h, delta, weight, eps):
    h = h + delta
    return h, model.rms_norm(h, weight, eps)


@needs_packing
@pytest.mark.parametrize("options", [
    dict(qk_norm=True, head_dim=32),  # Qwen3's attention
    dict(qk_norm=True, attn_output_gate=True, head_dim=32, partial_rotary_factor=0.25),  # Qwen3.5's
    dict(head_dim=16),  # the embedded model's, rotation over 16 dims
])
def test_fused_layers_give_the_step_by_step_logits(monkeypatch, options):
    cfg = dataclasses.replace(default_config(), dtype="bfloat16", hidden_size=64, intermediate_size=128, **options)
    prompts = random_prompts(5, 3, cfg.vocab_size, 9, 40)
    taken: list[str] = []
    inputs = fused.attention_inputs
    monkeypatch.setattr(fused, "attention_inputs", lambda *a: taken.append("attn") or inputs(*a))

    def run(fuse: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        engine = HybridEngine(cfg)
        if not fuse:
            engine.model.fused = {}
            monkeypatch.setattr(model, "add_norm", _step_by_step_add_norm)
        else:
            assert set(engine.model.fused) == ({f"layers.{i}.attn" for i in cfg.attn_layers}
                                               | {f"layers.{i}.mlp" for i in range(cfg.num_layers)})
        seen = []
        for slot, prompt in enumerate(prompts):
            engine.alloc(slot)
            seen.append(engine.prefill(slot, prompt))
        seen += [engine.decode_batch([0, 1, 2], [5 + step, 6 + 2 * step, 7 + 3 * step]) for step in range(4)]
        seen += list(engine.verify_batched([0, 1, 2], [[1, 2, 3], [4], [5, 6]]))
        monkeypatch.setattr(model, "add_norm", fused.add_norm)
        return seen

    plain = run(False)
    assert taken == []
    fast = run(True)
    assert len(taken) >= len(cfg.attn_layers) * (len(prompts) + 5)  # every forward's attention took it
    for a, b in zip(fast, plain, strict=True):
        assert torch.equal(a, b)


@needs_packing
def test_fusion_holds_each_weight_once_under_its_own_name():
    cfg = dataclasses.replace(default_config(), dtype="bfloat16", hidden_size=64, intermediate_size=128,
                              attn_output_gate=True, qk_norm=True, head_dim=32)
    torch.manual_seed(0)
    plain = {n: t.clone() for n, t in HybridEngine(cfg).model.w.items()}  # views before: clone the values
    torch.manual_seed(0)
    w = HybridEngine(cfg).model
    prefix = f"layers.{cfg.attn_layers[0]}.attn"
    whole = w.fused[prefix]
    parts = [w.w[f"{prefix}.{p}"] for p in ("q_proj", "k_proj", "v_proj", "gate_proj")]
    base = whole.untyped_storage().data_ptr()
    offsets = [p.untyped_storage().data_ptr() - base + p.storage_offset() * p.element_size() for p in parts]
    sizes = [p.numel() * p.element_size() for p in parts]
    assert all(p.untyped_storage().data_ptr() == base for p in parts)  # views: memory holds them once
    assert offsets == [sum(sizes[:i]) for i in range(4)] and sum(sizes) == whole.numel() * whole.element_size()
    for name in (f"{prefix}.q_proj", f"{prefix}.gate_proj", "layers.0.mlp.up_proj"):
        assert cpu_amx.is_packed(w.w[name]) and torch.equal(cpu_amx.unpack(w.w[name]), cpu_amx.unpack(plain[name]))
    assert sum(t.numel() for t in w.w.values()) == sum(t.numel() for t in plain.values())


@needs_packing
def test_only_stacked_packings_are_fused():
    cfg = dataclasses.replace(default_config(), dtype="bfloat16", hidden_size=64, intermediate_size=128)
    gen = torch.Generator().manual_seed(3)
    names = [f"layers.0.mlp.{p}" for p in ("gate_proj", "up_proj")]
    plain = {n: torch.randn(128, 64, generator=gen).to(torch.bfloat16) for n in names}
    apart = {n: cpu_amx.pack(t) for n, t in plain.items()}  # packed one by one: two buffers
    assert fused.fuse_projections(apart, cfg) == {}
    stacked = dict(plain)
    whole = fused.pack_fused(stacked, names)
    assert whole is not None and fused.fuse_projections(stacked, cfg) == {"layers.0.mlp": whole}
    assert torch.equal(cpu_amx.unpack(whole), torch.cat([plain[n] for n in names]))
    for n in names:
        assert stacked[n]._base is whole and torch.equal(cpu_amx.unpack(stacked[n]), plain[n])


needs_stack = pytest.mark.skipif(not (packing.packing_ready() and cpu_layers.ready()),
                                 reason="the layer sequencer cannot run here (needs a kernel over packed weights, "
                                 "the row attention and pointwise kernels, and a C compiler)")


@needs_stack
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("product", ["host", "pairs"])
def test_decode_layers_in_one_call_give_the_layer_by_layer_logits(monkeypatch, qk_norm, threads, product):
    """A dense all-attention model (Qwen3's shape): decode and verify forwards through
    kernels/cpu_layers.c against the same forwards layer by layer in Python, bit for bit; with the
    host's packed product and with AVX512-BF16's (on an AMX host too, AMX set aside)."""
    if product == "pairs":
        if not cpu_pairs.loads():
            pytest.skip("the AVX512-BF16 packed kernel cannot run here (needs AVX512-BF16 and a C compiler)")
        monkeypatch.setattr(cpu_amx, "ready", lambda: False)
    cfg = dataclasses.replace(default_config(), dtype="bfloat16", hidden_size=64, intermediate_size=128,
                              layer_pattern=("attn",) * 4, head_dim=32, qk_norm=qk_norm, mtp=False)
    prompts = random_prompts(6, 4, cfg.vocab_size, 9, 40)
    calls: list[int] = []
    whole = cpu_layers.decode_layers
    monkeypatch.setattr(cpu_layers, "decode_layers", lambda *a: calls.append(1) or whole(*a))

    def run(stack: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        engine = HybridEngine(cfg)
        assert engine.model.stack.ok
        engine.model.stack.ok = stack
        seen = []
        for slot, prompt in enumerate(prompts):
            engine.alloc(slot)
            seen.append(engine.prefill(slot, prompt))
        seen += [engine.decode_batch([0, 1, 2, 3], [5 + s, 6 + 2 * s, 7 + 3 * s, 8]) for s in range(5)]
        seen += list(engine.verify_batched([0, 1, 2], [[1, 2, 3], [4, 5, 6], [7, 8, 9]]))
        return seen

    with torch_threads(threads):
        plain = run(False)
        assert calls == []
        fast = run(True)
    assert len(calls) >= 6  # the decodes and the uniform verify took the one call
    for a, b in zip(fast, plain, strict=True):
        assert torch.equal(a, b)
