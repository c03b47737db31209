"""Paged attention over the block cache equals dense causal attention; block pool accounting."""

from __future__ import annotations

import dataclasses
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from fxsched.runtime.torch_model.attention import paged_attention  # noqa: E402
from fxsched.runtime.torch_model.config import default_config  # noqa: E402
from fxsched.runtime.torch_model.engine import HybridEngine  # noqa: E402
from fxsched.runtime.torch_model.errors import OutOfBlocksError  # noqa: E402
from fxsched.runtime.torch_model.paged_kv import BlockPool, PagedKVCache, flat_indices  # noqa: E402
from fxsched.runtime.bench.prompts import random_prompts  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def dense_causal_attention(q, k, v, q_start):
    """Reference: q [T, Hq, D] at positions q_start.., k/v [S, Hkv, D] at 0..S-1, plain loops-free math."""
    t, hq, d = q.shape
    s, hkv, _ = k.shape
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(d)
    causal = torch.arange(s)[None, :] <= (q_start + torch.arange(t))[:, None]
    scores = scores.masked_fill(~causal, float("-inf"))
    return torch.einsum("hts,shd->thd", torch.softmax(scores, -1), v)


@pytest.mark.parametrize("seq_len,num_queries", [(1, 1), (15, 15), (16, 3), (17, 17), (40, 6), (64, 1)])
@pytest.mark.parametrize("seed", [0, 1])
def test_paged_attention_equals_dense(seq_len, num_queries, seed):
    gen = torch.Generator().manual_seed(seed)
    bs, hq, hkv, d, num_blocks = 16, 4, 2, 8, 12
    cache = PagedKVCache(1, num_blocks, bs, hkv, d, "cpu")
    # two sequences whose blocks are scattered and interleaved in the pool
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    nb = -(-seq_len // bs)
    tables = [perm[:nb], perm[nb:2 * nb]]
    ks = [torch.randn(seq_len, hkv, d, generator=gen) for _ in tables]
    vs = [torch.randn(seq_len, hkv, d, generator=gen) for _ in tables]
    for table, k, v in zip(tables, ks, vs, strict=True):
        cache.write(0, torch.tensor(flat_indices(table, 0, seq_len, bs)), k, v)
    q = torch.randn(2, num_queries, hq, d, generator=gen)
    start = seq_len - num_queries
    positions = (start + torch.arange(num_queries)).expand(2, -1)
    out = paged_attention(q, cache.k[0], cache.v[0], torch.tensor(tables), positions)
    for b in range(2):
        expected = dense_causal_attention(q[b], ks[b], vs[b], start)
        torch.testing.assert_close(out[b], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["placed", "fragmented"])
def test_paged_engine_two_sequences_match_one_alone(layout):
    """Two sequences decoded in lockstep give the logits of each run on its own, whether the pool
    places each one's blocks consecutively (attention reads a view of the cache) or every other
    block is held elsewhere (attention gathers the sequence's blocks)."""
    cfg = default_config()
    prompts = random_prompts(3, 2, cfg.vocab_size, 10, 20)
    batched = HybridEngine(cfg)
    if layout == "fragmented":
        held = batched.pool.allocate(cfg.num_blocks)
        for block in held[::2]:
            batched.pool.decref(block)
    alone = HybridEngine(cfg)
    for slot, prompt in enumerate(prompts):
        batched.alloc(slot)
        batched.prefill(slot, prompt)
    alone.alloc(0)
    alone.prefill(0, prompts[0])
    tok = [1, 2]
    for _ in range(40):
        logits = batched.decode_batch([0, 1], tok)
        ref = alone.decode_batch([0], tok[:1])
        torch.testing.assert_close(logits[0], ref[0], atol=1e-4, rtol=0)
        tok = logits.argmax(-1).tolist()
    for slot in (0, 1):
        table = batched.block_table(slot)
        consecutive = table == list(range(table[0], table[0] + len(table)))
        assert consecutive == (layout == "placed") and len(table) > 2


def test_block_pool_keeps_growing_sequences_consecutive():
    """New sequences go to the middle of the largest free run, so lockstep growth stays consecutive."""
    pool = BlockPool(64)
    a, b = pool.allocate(4), pool.allocate(4)
    assert a == [0, 1, 2, 3] and b == [32, 33, 34, 35]
    for _ in range(10):
        a += pool.allocate(1, after=a[-1])
        b += pool.allocate(1, after=b[-1])
    assert a == list(range(0, 14)) and b == list(range(32, 46))
    c = pool.allocate(2)
    assert c == [22, 23]  # the middle of the larger gap, [14, 32)
    rest = pool.allocate(pool.num_free())
    assert sorted(a + b + c + rest) == list(range(64)) and pool.num_free() == 0


def test_paged_prefill_equals_token_by_token_decode():
    cfg = default_config()
    engine = HybridEngine(cfg)
    prompt = random_prompts(4, 1, cfg.vocab_size, 37, 37)[0]
    engine.alloc(0)
    engine.alloc(1)
    last = engine.prefill(0, prompt)
    engine.prefill(1, prompt[:1])
    for t in prompt[1:]:
        step = engine.decode_batch([1], [t])[0]
    torch.testing.assert_close(last, step, atol=1e-4, rtol=0)
    assert engine.num_free_blocks() == cfg.num_blocks - 2 * 3


def test_block_pool_refcounts_and_exhaustion():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free() == 1
    pool.incref(a[0])
    pool.decref(a[0])
    assert pool.refcount(a[0]) == 1
    with pytest.raises(OutOfBlocksError, match="need 2 KV blocks, only 1 free"):
        pool.allocate(2)
    assert pool.num_free() == 1
    for b in a:
        pool.decref(b)
    assert pool.num_free() == 4
    with pytest.raises(ValueError):
        pool.decref(0)


def test_engine_out_of_blocks_changes_nothing():
    cfg = dataclasses.replace(default_config(), num_blocks=40)
    engine = HybridEngine(cfg)
    engine.alloc(0)
    engine.alloc(1)
    engine.prefill(0, [1] * 500)  # 32 blocks
    free = engine.num_free_blocks()
    with pytest.raises(OutOfBlocksError):
        engine.prefill(1, [2] * 200)
    assert engine.num_free_blocks() == free and engine.seq_len(1) == 0 and engine.block_table(1) == []
