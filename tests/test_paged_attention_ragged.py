"""Ragged rows through the paged attention kernels (specs/gpu-kernels.md §17.5): a prefill or mixed
batch whose sequences have different numbers of new rows, right-padded, run as one launch. Under the
Triton interpreter (fp32, tiny shapes), one pass and split-KV, each sequence's valid rows must equal
causal softmax attention over its own keys laid out contiguously (an fp64 computation that knows
nothing of blocks or padding), and the torch reference must agree with it too."""

import os

# Must precede the first `import triton` anywhere (conftest.py sets it too on a machine without CUDA).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from fxsched.kernels import paged_attention as pa  # noqa: E402
from fxsched.kernels._triton import HAVE_TRITON, kernel_is_interpreted  # noqa: E402

_SKIP = "" if HAVE_TRITON and kernel_is_interpreted(pa._paged_attention_kernel) else (
    "the paged attention kernels are not interpreted in this process")
interpreted = pytest.mark.skipif(bool(_SKIP), reason=_SKIP or "n/a")


def _case(contexts, new_rows, kv_heads, group, dim, block_size, seed):
    """Caches holding contexts of ``contexts`` tokens in shuffled blocks, and queries for each
    sequence's last ``new_rows`` positions, right-padded to the longest (padding rows random)."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = max(-(-n // block_size) for n in contexts)
    num_blocks = len(contexts) * per_seq + 1
    tables = torch.randperm(num_blocks, generator=gen)[:len(contexts) * per_seq].view(len(contexts), per_seq)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    query = torch.randn(len(contexts), max(new_rows), kv_heads * group, dim, generator=gen)
    return query, k_cache, v_cache, tables, torch.tensor(contexts), torch.tensor(new_rows)


def _dense(query, k_cache, v_cache, tables, contexts, new_rows, scale):
    """Per sequence: its keys gathered position by position, causal attention of its new rows (fp64)."""
    block_size, group = k_cache.shape[1], query.shape[2] // k_cache.shape[2]
    outs = []
    for b, (n, q_len) in enumerate(zip(contexts.tolist(), new_rows.tolist(), strict=True)):
        blocks = [int(tables[b, p // block_size]) for p in range(n)]
        keys = torch.stack([k_cache[blk, p % block_size] for p, blk in enumerate(blocks)]).double()
        values = torch.stack([v_cache[blk, p % block_size] for p, blk in enumerate(blocks)]).double()
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)  # [n, Hq, D]
        q = query[b, :q_len].double()  # [q_len, Hq, D]
        scores = torch.einsum("jhd,phd->hjp", q, keys) * scale
        seen = torch.arange(n)[None, :] <= (n - q_len + torch.arange(q_len))[:, None]
        probs = torch.softmax(scores.masked_fill(~seen[None], float("-inf")), dim=-1)
        outs.append(torch.einsum("hjp,phd->jhd", probs, values))
    return outs


@interpreted
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("group", [1, 2])
def test_ragged_rows_equal_causal_attention_over_each_sequences_keys(splits, group):
    # a fresh prompt (all rows new), a chunk after a cached prefix, a decode row beside them
    contexts, new_rows = [23, 40, 9], [23, 7, 1]
    query, k_cache, v_cache, tables, ctx, q_lens = _case(contexts, new_rows, 2, group, 16, 4, seed=splits + group)
    scale = 16 ** -0.5
    got = pa.paged_attention_triton(query, k_cache, v_cache, tables, ctx, scale, num_splits=splits, query_lens=q_lens)
    ref = pa.paged_attention_reference(query, k_cache, v_cache, tables, ctx, scale, q_lens)
    for b, want in enumerate(_dense(query, k_cache, v_cache, tables, ctx, q_lens, scale)):
        n = new_rows[b]
        torch.testing.assert_close(got[b, :n].double(), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ref[b, :n].double(), want, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(got).all()  # padding rows: finite, ignored


def test_ragged_reference_with_full_rows_is_the_uniform_reference():
    query, k_cache, v_cache, tables, ctx, _ = _case([12, 20], [5, 5], 2, 2, 8, 4, seed=9)
    uniform = pa.paged_attention_reference(query, k_cache, v_cache, tables, ctx, 0.3)
    ragged = pa.paged_attention_reference(query, k_cache, v_cache, tables, ctx, 0.3, torch.tensor([5, 5]))
    torch.testing.assert_close(ragged, uniform)


@interpreted
def test_a_ragged_forward_through_the_kernel_equals_the_torch_forward(monkeypatch):
    """The model's wiring (attention.attention_layer, HybridEngine._row_batch): a mixed forward of a
    chunk after a committed prefix and two fresh prompts of other lengths, on the interpreted
    kernels (FXSCHED_KERNELS=triton: what a CUDA engine takes), equals the torch forward with its
    host plan."""
    from fxsched.runtime.torch_model import HybridEngine
    from fxsched.runtime.torch_model import attention
    from fxsched.runtime.torch_model.default_model import default_model_dir

    ragged_calls = []
    kernel = attention.paged_attention_kernel

    def counted(*args, **kwargs):
        ragged_calls.append(kwargs.get("query_lens") is not None)
        return kernel(*args, **kwargs)
    monkeypatch.setattr(attention, "paged_attention_kernel", counted)
    logits = {}
    for mode in ("triton", "torch"):
        monkeypatch.setenv("FXSCHED_KERNELS", mode)
        engine = HybridEngine.from_pretrained(default_model_dir(), max_slots=4, max_seq_len=64, block_size=4)
        for slot in range(3):
            engine.alloc(slot)
        engine.prefill(0, [5, 6, 7, 8, 9, 10])
        logits[mode] = engine.commit_forward([0, 1, 2], [[11, 12, 13], [3, 4, 5, 6, 7, 8, 9], [20, 21]])
    assert any(ragged_calls)  # the triton run took the ragged kernel
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=1e-4, rtol=1e-4)
