"""A committed forward cut into forwards of bounded size (batch_groups.py, specs/cpu-kernels.md §15.7).

Sequences are independent within a forward, so running them as several forwards, each committed,
must leave the same logits and the same sequence state as one forward: checked on a tiny Qwen3.5
checkpoint (GDN and attention layers) by continuing every sequence after the cut forward.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from support.hf_tiny import build

from fxsched.runtime.torch_model import HybridEngine
from fxsched.runtime.torch_model.batch_groups import MAX_ROWS, MIN_ROWS, forward_rows, row_groups
from fxsched.runtime.torch_model.config import ModelConfig


@pytest.mark.parametrize("lengths,cap", [
    ([1] * 7 + [128], 256), ([128] * 8, 256), ([300, 5, 5, 200, 90, 1], 256), ([3, 9, 4, 16, 2, 7, 8], 16),
    ([1], 1), (list(range(1, 40)), 64),
])
def test_groups_cover_every_sequence_once_within_the_row_cap(lengths, cap):
    groups = row_groups(lengths, cap)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        longest = max(lengths[i] for i in g)
        assert len(g) == 1 or len(g) * longest <= cap
        assert all(2 * lengths[i] >= longest for i in g)  # padding at most doubles a member's rows


def test_decode_rows_are_not_padded_to_a_prompt_chunk_and_equal_prompts_share_forwards():
    assert sorted(map(sorted, row_groups([1] * 7 + [128], 256))) == [[0, 1, 2, 3, 4, 5, 6], [7]]
    assert sorted(map(len, row_groups([128] * 8, 256))) == [2, 2, 2, 2]
    assert row_groups([16] * 4, 64) == [[0, 1, 2, 3]]
    assert row_groups([500], 64) == [[0]]  # one sequence is never cut
    with pytest.raises(ValueError, match="max_rows"):
        row_groups([1], 0)


def test_forward_rows_follow_the_widest_layer():
    # Qwen3-0.6B: the MLP is widest, 3 x 3072 fp32 values = 36 KiB a row: 32 MiB hold 910 rows -> 896
    dense = ModelConfig(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
                        layer_pattern=("attn",) * 28, num_attention_heads=16, num_kv_heads=8, head_dim=128)
    assert forward_rows(dense) == 896
    # a Qwen3.5 hybrid: 16 key and 16 value heads of 128, conv channels 6144: 3 x 6144 + 12 x 2048
    # = 43008 values = 168 KiB a row: 195 rows -> 192
    hybrid = ModelConfig(vocab_size=151936, hidden_size=1024, intermediate_size=3584, num_layers=24,
                         layer_pattern=("gdn", "gdn", "gdn", "attn") * 6, num_attention_heads=8, num_kv_heads=2,
                         head_dim=256, gdn_num_heads=16, gdn_key_dim=128, gdn_value_dim=128)
    assert forward_rows(hybrid) == 192
    tiny = ModelConfig()
    assert forward_rows(tiny) == MAX_ROWS
    wide = ModelConfig(hidden_size=64, intermediate_size=1 << 20)
    assert forward_rows(wide) == MIN_ROWS


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("groups") / "qwen3_5"
    build("Qwen3_5ForCausalLM", path)
    return path


def _engine(path: Path, rows: int | None) -> HybridEngine:
    engine = HybridEngine.from_pretrained(path, dtype="float32", max_seq_len=64, max_slots=6, block_size=4)
    engine.forward_rows = rows
    return engine


def test_a_cut_forward_leaves_the_logits_and_states_of_one_forward(ckpt):
    rng = random.Random(3)
    whole, cut = _engine(ckpt, None), _engine(ckpt, 8)
    vocab = whole.cfg.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (9, 2, 7, 5, 3)]
    for engine in (whole, cut):
        for slot in range(len(prompts)):
            engine.alloc(slot)
        engine.prefill(0, prompts[0][:4])  # one sequence already holds rows: it continues (a mixed forward)
    tails = [prompts[0][4:], *prompts[1:]]
    slots = list(range(len(prompts)))
    want = whole.commit_forward(slots, tails)
    got = cut.commit_forward(slots, tails)
    assert got.shape == want.shape == (len(prompts), vocab)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for engine in (whole, cut):
        assert [engine.seq_len(s) for s in slots] == [9, 2, 7, 5, 3]
    nxt = [rng.randrange(vocab) for _ in slots]
    torch.testing.assert_close(cut.decode_batch(slots, nxt), whole.decode_batch(slots, nxt), atol=1e-4, rtol=1e-4)


def test_a_sequence_longer_than_the_bound_runs_whole(ckpt):
    """One sequence is never cut: a prompt over forward_rows is one forward, alone or beside others."""
    rng = random.Random(5)
    whole, cut = _engine(ckpt, None), _engine(ckpt, 8)
    prompts = [[rng.randrange(whole.cfg.vocab_size) for _ in range(n)] for n in (12, 3)]
    for engine in (whole, cut):
        engine.alloc(0)
        engine.alloc(1)
    torch.testing.assert_close(cut.prefill(0, prompts[0]), whole.prefill(0, prompts[0]), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(cut.commit_forward([1, 0], [prompts[1], [4, 5]]),
                               whole.commit_forward([1, 0], [prompts[1], [4, 5]]), atol=1e-4, rtol=1e-4)


def test_decode_rows_beside_a_prompt_chunk_run_unpadded_under_the_row_bound(ckpt, monkeypatch):
    """A mixed step (decode rows beside a prompt chunk) well within forward_rows still runs as
    groups of like lengths, not one batch padded to the chunk, and its logits are the one
    forward's."""
    rng = random.Random(7)
    whole, grouped = _engine(ckpt, None), _engine(ckpt, 64)
    vocab = whole.cfg.vocab_size
    heads = [[rng.randrange(vocab) for _ in range(5)] for _ in range(3)]
    chunk = [rng.randrange(vocab) for _ in range(12)]
    for engine in (whole, grouped):
        for slot, head in enumerate(heads):
            engine.alloc(slot)
            engine.prefill(slot, head)
        engine.alloc(3)
    shapes: list[tuple[int, int]] = []
    real = grouped._forward

    def counted(slots, token_lists, **kw):
        shapes.append((len(slots), max(len(t) for t in token_lists)))
        return real(slots, token_lists, **kw)

    monkeypatch.setattr(grouped, "_forward", counted)
    rows = [[rng.randrange(vocab)] for _ in heads] + [chunk]
    want = whole.commit_forward([0, 1, 2, 3], rows)
    got = grouped.commit_forward([0, 1, 2, 3], rows)
    assert 4 * 12 <= 64 and sorted(shapes) == [(1, 12), (3, 1)]  # within the bound, yet two forwards
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def dense_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("groups") / "qwen3"
    build("Qwen3ForCausalLM", path)
    return path


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_mixed_step_of_a_dense_model_is_one_packed_forward_with_the_grouped_forwards_bits(dense_ckpt, dtype,
                                                                                           monkeypatch):
    """On a model without GDN layers a mixed step (decode rows beside prompt chunks, one fresh and
    one continuing) runs as one unpadded forward (specs/cpu-kernels.md §15.12), and its logits, and
    the states the sequences continue from, are those of the forwards of like lengths it replaces:
    bit for bit in bf16 (the packed CPU products, the row kernel, the fused projections: a row's sums
    never depend on the rows beside it); in fp32 within rounding (PyTorch's fp32 product picks its
    blocking by the row count)."""
    rng = random.Random(11)
    engines = [HybridEngine.from_pretrained(dense_ckpt, dtype=dtype, max_seq_len=96, max_slots=6, block_size=4)
               for _ in range(2)]
    packed, grouped = engines
    vocab = packed.cfg.vocab_size
    heads = [[rng.randrange(vocab) for _ in range(n)] for n in (5, 9, 3, 6)]
    for engine in engines:
        for slot, head in enumerate(heads):
            engine.alloc(slot)
            engine.prefill(slot, head)
        engine.alloc(4)
    monkeypatch.setattr(grouped, "_packs", lambda lengths: False)
    runs: list[tuple[int, int]] = []
    real = packed._run

    def counted(batch):
        runs.append(tuple(batch.tokens.shape))
        return real(batch)

    monkeypatch.setattr(packed, "_run", counted)
    rows = [[rng.randrange(vocab)] for _ in range(3)] + [[rng.randrange(vocab) for _ in range(14)],
                                                         [rng.randrange(vocab) for _ in range(17)]]
    slots = [0, 1, 2, 3, 4]
    got, want = packed.commit_forward(slots, rows), grouped.commit_forward(slots, rows)
    assert runs == [(1, 3 + 14 + 17)]  # one forward, no padding
    same = torch.equal if dtype == "bfloat16" else (lambda a, b: torch.allclose(a, b, atol=1e-5, rtol=1e-5))
    assert same(got, want)
    for engine in engines:
        assert [engine.seq_len(s) for s in slots] == [6, 10, 4, 20, 17]
    for _ in range(2):  # the sequences continue from the same keys and values
        nxt = [rng.randrange(vocab) for _ in slots]
        assert same(packed.decode_batch(slots, nxt), grouped.decode_batch(slots, nxt))


def test_a_model_with_gdn_layers_keeps_the_grouped_forwards(ckpt):
    """The GDN recurrence reads a [B, T] grid: a hybrid model never packs."""
    engine = _engine(ckpt, 64)
    assert not engine._packs([1, 1, 12]) and engine.cfg.gdn_layers
