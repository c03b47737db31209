"""Prefix cache: repeated prompts are served from cached blocks and give identical output."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from fxsched.runtime.torch_model.config import default_config  # noqa: E402
from fxsched.runtime.torch_model.engine import HybridEngine  # noqa: E402
from fxsched.runtime.torch_model.errors import OutOfBlocksError  # noqa: E402
from fxsched.runtime.torch_model.prefix_cache import chain_hash  # noqa: E402
from support.speculative import DFlashProposer, MtpProposer, speculative_generate  # noqa: E402
from fxsched.runtime.bench.prompts import random_prompts  # noqa: E402

MAX_TOKENS = 20


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def reference_engine() -> HybridEngine:
    return HybridEngine(default_config())


def _blocks_accounted(engine: HybridEngine) -> bool:
    """Every block is free, or held by the cache and/or slots, consistently with its refcount."""
    holders = [0] * engine.cfg.num_blocks
    for slot in range(engine.cfg.max_slots):
        if engine.is_allocated(slot):
            for b in engine.block_table(slot):
                holders[b] += 1
    for entry in engine.prefix._entries.values():
        holders[entry.block_id] += 1
    return all(engine.pool.refcount(b) == h for b, h in enumerate(holders)) and \
        engine.num_free_blocks() == holders.count(0)


def _cache_prompt(engine: HybridEngine, prompt: list[int], adapter_id: int = 0) -> list[int]:
    out = engine.greedy_generate(prompt, MAX_TOKENS, slot=0, adapter_id=adapter_id, free_slot=False)
    engine.cache_sequence(0)
    engine.free(0)
    return out


def test_prefix_cache_repeated_prompt_reports_cached_tokens_and_same_output(reference_engine):
    engine = HybridEngine(default_config())
    prompt = random_prompts(21, 1, engine.cfg.vocab_size, 40, 40)[0]
    expected = reference_engine.greedy_generate(prompt, MAX_TOKENS)
    assert _cache_prompt(engine, prompt) == expected
    assert engine.num_cached_blocks() == (40 + MAX_TOKENS - 1) // 16  # full committed blocks
    out = engine.greedy_generate(prompt, MAX_TOKENS, slot=3, free_slot=False)
    assert engine.cached_prompt_tokens(3) == 32
    assert out == expected
    assert _blocks_accounted(engine)
    engine.free(3)


def test_prefix_cache_shared_prefix_different_tail(reference_engine):
    engine = HybridEngine(default_config())
    base = random_prompts(22, 1, engine.cfg.vocab_size, 40, 40)[0]
    _cache_prompt(engine, base)
    for tail_at, cached in [(20, 16), (35, 32), (10, 0)]:
        prompt = base[:tail_at] + [5, 6, 7, 8, 9]
        out = engine.greedy_generate(prompt, MAX_TOKENS, slot=1, free_slot=False)
        assert engine.cached_prompt_tokens(1) == cached
        assert out == reference_engine.greedy_generate(prompt, MAX_TOKENS)
        engine.free(1)


def test_prefix_cache_keeps_one_token_to_compute_and_respects_adapter(reference_engine):
    engine = HybridEngine(default_config())
    prompt = random_prompts(23, 1, engine.cfg.vocab_size, 32, 32)[0]
    _cache_prompt(engine, prompt, adapter_id=7)
    engine.alloc(0, adapter_id=7)
    engine.prefill(0, prompt)
    assert engine.cached_prompt_tokens(0) == 16  # a 32-token prompt recomputes its last block
    engine.free(0)
    engine.alloc(0, adapter_id=8)
    engine.prefill(0, prompt)
    assert engine.cached_prompt_tokens(0) == 0
    engine.free(0)
    assert chain_hash(None, 7, prompt[:16]) != chain_hash(None, 8, prompt[:16])


@pytest.mark.parametrize("proposer", [DFlashProposer(), MtpProposer(3)], ids=repr)
def test_prefix_cache_hit_then_speculative_decoding_is_lossless(reference_engine, proposer):
    engine = HybridEngine(default_config())
    prompts = random_prompts(24, 3, engine.cfg.vocab_size, 33, 45)
    for p in prompts:
        _cache_prompt(engine, p)
    outputs, _ = speculative_generate(engine, prompts, MAX_TOKENS, proposer)
    assert outputs == [reference_engine.greedy_generate(p, MAX_TOKENS) for p in prompts]


def test_prefix_cache_reclaim_frees_only_unused_blocks():
    engine = HybridEngine(default_config())
    prompts = random_prompts(25, 2, engine.cfg.vocab_size, 48, 48)
    for p in prompts:
        _cache_prompt(engine, p)
    cached = engine.num_cached_blocks()
    assert cached == 2 * 4 and engine.num_evictable_blocks() == cached
    engine.alloc(0)
    engine.prefill(0, prompts[0])  # holds 2 cached blocks (48 tokens -> (48-1)//16 = 2)
    assert engine.cached_prompt_tokens(0) == 32
    assert engine.num_evictable_blocks() == cached - 2
    free = engine.num_free_blocks()
    assert engine.reclaim(3) == 3
    assert engine.num_free_blocks() == free + 3
    assert engine.reclaim(100) == cached - 2 - 3
    assert engine.num_cached_blocks() == 2 and _blocks_accounted(engine)
    engine.free(0)
    assert engine.reclaim(100) == 2
    assert engine.num_free_blocks() == engine.cfg.num_blocks


def test_prefix_cache_reclaim_evicts_chain_tails_first():
    engine = HybridEngine(default_config())
    prompt = random_prompts(26, 1, engine.cfg.vocab_size, 64, 64)[0]
    _cache_prompt(engine, prompt)
    engine.reclaim(2)  # drop the two deepest blocks, keep the chain head usable
    engine.alloc(0)
    engine.prefill(0, prompt)
    assert engine.cached_prompt_tokens(0) == 16 * (engine.num_cached_blocks())


def test_prefix_cache_out_of_blocks_leaves_slot_empty():
    cfg = dataclasses.replace(default_config(), num_blocks=32)
    engine = HybridEngine(cfg)
    prompt = random_prompts(27, 1, cfg.vocab_size, 40, 40)[0]
    _cache_prompt(engine, prompt)
    engine.alloc(1)
    engine.prefill(1, [1] * (16 * (cfg.num_blocks - engine.num_cached_blocks()) - 8))
    engine.alloc(0)
    with pytest.raises(OutOfBlocksError):
        engine.prefill(0, prompt)
    assert engine.seq_len(0) == 0 and engine.block_table(0) == [] and _blocks_accounted(engine)


def test_prefix_cache_hit_restores_gdn_and_drafter_state_exactly(reference_engine):
    engine = HybridEngine(default_config())
    prompt = random_prompts(28, 1, engine.cfg.vocab_size, 50, 50)[0]
    _cache_prompt(engine, prompt)
    for e in (engine, reference_engine):
        e.alloc(2)
        last = int(e.prefill(2, prompt).argmax())
        e.commit_ctx(2, len(prompt))
        e.save_hidden_for_mtp(2, -1)
    assert engine.cached_prompt_tokens(2) == 48 and reference_engine.cached_prompt_tokens(2) == 0
    for (ra, ca), (rb, cb) in zip(engine.gdn_state(2), reference_engine.gdn_state(2), strict=True):
        torch.testing.assert_close(ra, rb, atol=1e-5, rtol=0)
        torch.testing.assert_close(ca, cb, atol=1e-5, rtol=0)
    assert engine.dflash_propose([2], [last]) == reference_engine.dflash_propose([2], [last])
    assert engine.mtp_propose([2], [last], 4) == reference_engine.mtp_propose([2], [last], 4)
    reference_engine.free(2)


def test_prefix_cache_rejected_prompt_leaves_slot_empty():
    engine = HybridEngine(default_config())
    prompt = random_prompts(29, 1, engine.cfg.vocab_size, 40, 40)[0]
    _cache_prompt(engine, prompt)
    engine.alloc(0)
    free = engine.num_free_blocks()
    with pytest.raises(ValueError, match="outside"):
        engine.prefill(0, prompt + [engine.cfg.vocab_size])
    assert engine.seq_len(0) == 0 and engine.block_table(0) == [] and engine.num_free_blocks() == free
    engine.prefill(0, prompt)
    assert engine.cached_prompt_tokens(0) == 32


@pytest.mark.parametrize("every", [2, 3])
def test_gdn_snapshots_every_few_blocks_resume_from_the_deepest_one(reference_engine, every):
    """With GDN snapshots every `every` blocks, a repeated prompt resumes from the deepest cached block
    that has one (the blocks between are cached for their KV but hold no state) and still gives the
    uncached output; the sequence held a snapshot only at those boundaries."""
    engine = HybridEngine(dataclasses.replace(default_config(), gdn_snapshot_every=every))
    assert engine.cfg.gdn_snapshot_blocks == every
    prompt = random_prompts(23, 1, engine.cfg.vocab_size, 90, 90)[0]
    expected = reference_engine.greedy_generate(prompt, MAX_TOKENS)
    out = engine.greedy_generate(prompt, MAX_TOKENS, slot=0, free_slot=False)
    assert out == expected
    full = engine.seq_len(0) // 16
    assert sorted(engine.slot_state(0).boundary_states) == [k for k in range(1, full + 1) if k % every == 0]
    engine.cache_sequence(0)
    engine.free(0)
    assert engine.num_cached_blocks() == full // every * every
    again = engine.greedy_generate(prompt, MAX_TOKENS, slot=3, free_slot=False)
    usable = (90 - 1) // 16  # at least one prompt token is recomputed
    assert engine.cached_prompt_tokens(3) == usable // every * every * 16
    assert again == expected
    assert _blocks_accounted(engine)
    engine.free(3)
