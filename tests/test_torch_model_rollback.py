"""Partial accepts: the committed state equals the state of running only the accepted tokens."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")
pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fxsched.runtime.torch_model.config import default_config  # noqa: E402
from fxsched.runtime.torch_model.engine import HybridEngine  # noqa: E402
from fxsched.runtime.torch_model.errors import SlotError  # noqa: E402
from fxsched.runtime.bench.prompts import random_prompts  # noqa: E402

ATOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def engine() -> HybridEngine:
    return HybridEngine(default_config())


def _assert_same_state(engine: HybridEngine, a: int, b: int) -> None:
    assert engine.seq_len(a) == engine.seq_len(b)
    assert engine.tokens(a) == engine.tokens(b)
    for (ra, ca), (rb, cb) in zip(engine.gdn_state(a), engine.gdn_state(b), strict=True):
        torch.testing.assert_close(ra, rb, atol=ATOL, rtol=0)
        torch.testing.assert_close(ca, cb, atol=ATOL, rtol=0)


@pytest.mark.parametrize("prompt_len", [5, 14])  # 14: the verify rows cross a block boundary
@pytest.mark.parametrize("k", [2, 4, 6])
def test_rollback_partial_accept_equals_running_accepted_tokens(engine, prompt_len, k):
    prompt = random_prompts(7, 1, engine.cfg.vocab_size, prompt_len, prompt_len)[0]
    rows = random_prompts(8 + k, 1, engine.cfg.vocab_size, k, k)[0]
    for n_keep in range(k + 1):
        engine.alloc(0)
        engine.alloc(1)
        engine.prefill(0, prompt)
        engine.verify(0, rows)
        engine.commit_accepted_prefix(0, n_keep)
        engine.prefill(1, prompt)
        if n_keep:
            engine.prefill_chunk(1, rows[:n_keep], len(prompt))
        _assert_same_state(engine, 0, 1)
        bs = engine.cfg.block_size
        assert len(engine.block_table(0)) == -(-(prompt_len + n_keep) // bs)
        # the continuation after the rollback matches too (KV beyond seq_len was overwritten)
        nxt = [3, 1, 4]
        torch.testing.assert_close(engine.verify(0, nxt), engine.verify(1, nxt), atol=1e-4, rtol=0)
        engine.free(0)
        engine.free(1)
        assert engine.num_free_blocks() == engine.cfg.num_blocks


def test_rollback_batched_fold_equals_single_commits(engine):
    prompts = random_prompts(11, 3, engine.cfg.vocab_size, 3, 30)
    rows = [[1, 2], [5, 6, 7, 8, 9, 10], [4, 4, 4, 4]]
    accepted = [2, 3, 1]
    for slot, prompt in enumerate(prompts):
        engine.alloc(slot)
        engine.alloc(slot + 3)
        engine.prefill(slot, prompt)
        engine.prefill(slot + 3, prompt)
    logits = engine.verify_batched([0, 1, 2], rows)
    engine.gdn_fold_accepted([0, 1, 2], accepted)
    for slot in range(3):
        single = engine.verify(slot + 3, rows[slot])
        torch.testing.assert_close(logits[slot], single, atol=1e-4, rtol=0)
        engine.commit_accepted_prefix(slot + 3, accepted[slot])
        _assert_same_state(engine, slot, slot + 3)


def test_rollback_decode_and_verify_agree(engine):
    prompt = random_prompts(5, 1, engine.cfg.vocab_size, 20, 20)[0]
    engine.alloc(0)
    engine.alloc(1)
    engine.prefill(0, prompt)
    engine.prefill(1, prompt)
    tokens = [7, 8, 9, 10]
    verify_logits = engine.verify(0, tokens)
    engine.commit_accepted_prefix(0, len(tokens))
    decode_logits = torch.stack([engine.decode_batch([1], [t])[0] for t in tokens])
    torch.testing.assert_close(verify_logits, decode_logits, atol=1e-4, rtol=0)
    _assert_same_state(engine, 0, 1)
    torch.testing.assert_close(engine.captured_hidden(0)[-1], engine.captured_hidden(1)[-1], atol=1e-5, rtol=0)


def test_rollback_dflash_context_commit_and_trim(engine):
    prompt = random_prompts(3, 1, engine.cfg.vocab_size, 12, 12)[0]
    engine.alloc(0)
    engine.alloc(1)
    engine.prefill(0, prompt)
    engine.commit_ctx(0, len(prompt))
    engine.verify(0, [1, 2, 3, 4])
    engine.commit_ctx(0, 4)  # optimistic: all rows ...
    engine.trim_proposer_state(0, 2)  # ... then drop the two rejected ones
    engine.commit_accepted_prefix(0, 2)
    assert engine.ctx_len(0) == engine.seq_len(0) == len(prompt) + 2
    engine.prefill(1, prompt + [1, 2])
    engine.commit_ctx(1, len(prompt) + 2)
    assert engine.dflash_propose([0, 1], [5, 5]) == [engine.dflash_propose([1], [5])[0]] * 2


def test_rollback_errors(engine):
    engine.alloc(0)
    with pytest.raises(SlotError, match="nothing to commit"):
        engine.commit_accepted_prefix(0, 1)
    engine.prefill(0, [1, 2, 3])
    engine.verify(0, [4, 5])
    with pytest.raises(ValueError, match="cannot accept 3 of 2"):
        engine.commit_accepted_prefix(0, 3)
    with pytest.raises(SlotError, match="not allocated"):
        engine.verify(1, [1])
    with pytest.raises(SlotError, match="exceed max_seq_len"):
        engine.verify(0, [1] * engine.cfg.max_seq_len)
    with pytest.raises(ValueError, match="outside"):
        engine.verify(0, [engine.cfg.vocab_size])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt_len=st.integers(1, 40),
       steps=st.lists(st.tuples(st.lists(st.integers(0, 63), min_size=1, max_size=6), st.integers(0, 6)),
                      min_size=1, max_size=6))
def test_rollback_random_verify_commit_sequences(engine, prompt_len, steps):
    """Any sequence of verify + partial commit equals decoding just the committed tokens."""
    prompt = [(7 * i + 3) % 64 for i in range(prompt_len)]
    engine.alloc(0)
    engine.alloc(1)
    try:
        engine.prefill(0, prompt)
        engine.prefill(1, prompt)
        for rows, n_keep in steps:
            engine.verify(0, rows)
            engine.commit_accepted_prefix(0, min(n_keep, len(rows)))
        committed = engine.tokens(0)[prompt_len:]
        for token in committed:
            engine.decode_batch([1], [token])
        _assert_same_state(engine, 0, 1)
        assert len(engine.block_table(0)) == -(-engine.seq_len(0) // engine.cfg.block_size)
    finally:
        engine.free(0)
        engine.free(1)
    assert engine.num_free_blocks() == engine.cfg.num_blocks
