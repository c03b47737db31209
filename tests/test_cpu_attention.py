"""The CPU row-attention kernel (kernels/cpu_attention.c) against attention written out in fp64, and
a bf16 engine whose decode and verify rows go through it against the same engine on PyTorch's SDPA.

The kernel's products of bf16 are exact in fp32 and it rounds the output once to bf16, so it may
differ from the fp64 result by one bf16 rounding plus fp32 noise. Skipped (with the reason) on
hosts where the kernel cannot run: no AVX2 or AVX512-BF16, no C compiler.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from fxsched.kernels import cpu_attention
from fxsched.runtime.bench.prompts import random_prompts
from fxsched.runtime.torch_model.config import default_config
from fxsched.runtime.torch_model.engine import HybridEngine
from support.torch_testing import torch_threads

needs_kernel = pytest.mark.skipif(not cpu_attention.ready(), reason="the CPU attention kernel cannot run here "
                                  "(needs AVX2 and FMA, or AVX512-BF16, and a C compiler; FXSCHED_KERNELS=torch disables it)")


def _written_out(q, k_cache, v_cache, qrow, ctx, table):
    """Attention of query row qrow over positions 0..ctx-1, the cache read position by position
    through the block table, in fp64 (q [N, Hq, D]; caches [blocks, bs, Hkv, D])."""
    bs, hkv, d = k_cache.shape[1:]
    hq = q.shape[1]
    out = torch.empty(hq, d, dtype=torch.float64)
    for h in range(hq):
        g = h // (hq // hkv)
        keys = torch.stack([k_cache[table[s // bs], s % bs, g] for s in range(ctx)]).double()
        values = torch.stack([v_cache[table[s // bs], s % bs, g] for s in range(ctx)]).double()
        scores = keys @ q[qrow, h].double() / math.sqrt(d)
        weights = torch.exp(scores - scores.max())
        out[h] = (weights / weights.sum()) @ values
    return out


@needs_kernel
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 32), (16, 8, 128), (8, 2, 256), (3, 3, 64)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bs", [4, 16])  # 16: whole AMX tiles a block, where the AMX build takes the scores
def test_kernel_matches_attention_written_out(hq, hkv, d, threads, bs):
    gen = torch.Generator().manual_seed(hq * 1000 + d + bs)
    blocks = 24
    k_cache = torch.randn(blocks, bs, hkv, d, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(blocks, bs, hkv, d, generator=gen).to(torch.bfloat16)
    q = (torch.randn(6, hq, d, generator=gen) * 2).to(torch.bfloat16)
    # three sequences with scattered blocks; contexts of 1, a block boundary, and a partial block
    perm = torch.randperm(blocks, generator=gen).tolist()
    seq_tables = [perm[0:3], perm[3:10], perm[10:17]]
    rows = [(0, 1, 0), (2, 2 * bs, 1), (3, 6 * bs + 3, 2), (5, 6 * bs + 2, 2)]  # (query row, ctx, sequence)
    nb = max(len(t) for t in seq_tables)
    tables = torch.tensor([seq_tables[s] + [0] * (nb - len(seq_tables[s])) for _, _, s in rows], dtype=torch.int32)
    q_rows = torch.tensor([r for r, _, _ in rows], dtype=torch.int32)
    ctx = torch.tensor([c for _, c, _ in rows], dtype=torch.int32)
    with torch_threads(threads):
        out = cpu_attention.paged_attention_bf16(q, k_cache, v_cache, q_rows, ctx, tables)
    for r, c, s in rows:
        ref = _written_out(q, k_cache, v_cache, r, c, seq_tables[s])
        tol = ref.abs() * 2.0 ** -8 + 1e-4
        assert ((out[r].double() - ref).abs() <= tol).all(), (r, (out[r].double() - ref).abs().max().item())
    untouched = [i for i in range(q.shape[0]) if i not in {r for r, _, _ in rows}]
    assert (out[untouched] == 0).all()


def test_fits_refuses_what_the_kernel_does_not_take():
    q = torch.zeros(1, 4, 16, dtype=torch.bfloat16)
    assert not cpu_attention.fits(q, torch.zeros(2, 4, 2, 16, dtype=torch.bfloat16))  # head dim 16
    q32 = torch.zeros(1, 4, 32)
    assert not cpu_attention.fits(q32, torch.zeros(2, 4, 2, 32))  # fp32


@needs_kernel
@pytest.mark.parametrize("fragmented", [False, True])
def test_bf16_engine_decodes_and_verifies_as_on_sdpa(monkeypatch, fragmented):
    """A bf16 engine (head dim 32, so the kernel takes it) gives, for batched decode steps and a
    ragged verify forward, the logits of the same engine with the kernel turned off (SDPA per
    sequence), within bf16 noise, with its blocks consecutive or scattered."""
    cfg = dataclasses.replace(default_config(), head_dim=32, dtype="bfloat16")
    prompts = random_prompts(7, 3, cfg.vocab_size, 9, 30)

    calls = []
    kernel_fn = cpu_attention.paged_attention_bf16

    def spy(*args):
        calls.append(args[3].shape[0])  # rows served
        return kernel_fn(*args)

    def run(kernel: bool) -> list[torch.Tensor]:
        if kernel:
            monkeypatch.setattr(cpu_attention, "paged_attention_bf16", spy)
        else:
            monkeypatch.setattr(cpu_attention, "fits", lambda *a: False)
        torch.manual_seed(0)
        engine = HybridEngine(cfg)
        if fragmented:
            held = engine.pool.allocate(cfg.num_blocks)
            for block in held[::2]:
                engine.pool.decref(block)
        for slot, prompt in enumerate(prompts):
            engine.alloc(slot)
            engine.prefill(slot, prompt)
        seen = []
        for step in range(6):  # fixed inputs, so both runs see the same sequences
            seen.append(engine.decode_batch([0, 1, 2], [5 + step, 6 + 2 * step, 7 + 3 * step]).float())
        seen += [t.float() for t in engine.verify_batched([0, 1, 2], [[1, 2, 3], [4], [5, 6]])]
        monkeypatch.undo()
        return seen

    with_kernel, on_sdpa = run(True), run(False)
    assert calls and 3 in calls and 6 in calls  # decode steps (3 rows) and the verify (3 + 1 + 2 rows)
    for a, b in zip(with_kernel, on_sdpa, strict=True):
        scale = b.abs().max().item()
        assert (a - b).abs().max().item() <= 0.02 * scale + 1e-3
