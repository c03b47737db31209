"""Split-KV (flash-decoding) paged attention (specs/gpu-kernels.md §17.2): the partition kernel and
its reduce under the Triton interpreter (fp32, tiny shapes) against the fp64 reference, and the
host rule that picks the number of partitions."""

import os

# Must precede the first `import triton` anywhere: @triton.jit picks the
# interpreter at decoration time (conftest.py sets it too on a machine without CUDA).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from fxsched.kernels import paged_attention as pa  # noqa: E402
from fxsched.kernels._triton import HAVE_TRITON, kernel_is_interpreted  # noqa: E402


def _interpreter_skip_reason() -> str:
    try:
        import numpy  # noqa: F401
        import triton  # noqa: F401
    except ImportError as exc:
        return f"the Triton interpreter cannot run here: {exc}"
    if not HAVE_TRITON:
        return "fxsched.kernels defined no Triton kernels"
    kernels = (pa._paged_attention_kernel, pa._paged_attention_split_kernel, pa._paged_attention_reduce_kernel)
    if not all(kernel_is_interpreted(k) for k in kernels):
        return "fxsched.kernels was imported before TRITON_INTERPRET=1 was set; kernels are compiled, not interpreted"
    return ""


_SKIP_REASON = _interpreter_skip_reason()
interpreted = pytest.mark.skipif(bool(_SKIP_REASON), reason=_SKIP_REASON or "n/a")


def _case(lens, rows, kv_heads, group, dim, block_size, seed):
    """Random caches and a shuffled block table holding contexts of ``lens`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = max(1, max(-(-n // block_size) for n in lens))
    num_blocks = len(lens) * per_seq + 2
    tables = torch.randperm(num_blocks, generator=gen)[: len(lens) * per_seq].view(len(lens), per_seq).int()
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    query = torch.randn(len(lens), rows, kv_heads * group, dim, generator=gen)
    return query, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


def _reference64(query, k_cache, v_cache, tables, lens, scale):
    return pa.paged_attention_reference(query.double(), k_cache.double(), v_cache.double(), tables, lens, scale).float()


class _GridRecorder:
    """Stands in for a @triton.jit kernel object: records each launch grid, then launches (or not)."""

    def __init__(self, kernel, run=True):
        self.kernel, self.run, self.grids = kernel, run, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid] if self.run else (lambda *args, **kwargs: None)


@interpreted
@pytest.mark.parametrize(
    "lens, rows, group, splits",
    [
        # kv tile 16: 40 tokens = 3 tiles -> partitions of 16, 16, 8 (partial) and one empty; 5 tokens
        # fit in the first partition; 33 tokens leave the last partition a single token
        ([40, 5, 33], 1, 2, 4),
        # verify rows: 70 tokens = 5 tiles -> 32, 32, 6; 2 tokens < K = 3: row 0 sees nothing (zeros)
        ([70, 2, 19], 3, 3, 3),
        # K * group = 36 rows: two BLOCK_M chunks per kv head; more partitions than tiles
        ([50, 23], 9, 4, 6),
    ],
)
def test_split_kv_matches_the_reference(lens, rows, group, splits):
    dim, scale = 5, 5**-0.5  # D = 5: a padded head dim
    query, k_cache, v_cache, tables, lens_t = _case(lens, rows, 2, group, dim, 4, sum(lens) + rows)
    got = pa.paged_attention_triton(query, k_cache, v_cache, tables, lens_t, scale, kv_tile=16, num_splits=splits)
    want = _reference64(query, k_cache, v_cache, tables, lens_t, scale)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    one_pass = pa.paged_attention_triton(query, k_cache, v_cache, tables, lens_t, scale, kv_tile=16, num_splits=1)
    torch.testing.assert_close(got, one_pass, atol=1e-5, rtol=1e-5)
    for b, n in enumerate(lens):
        if n < rows:
            assert torch.count_nonzero(got[b, : rows - n]) == 0


@interpreted
def test_a_long_batch_one_decode_splits_by_itself_and_fills_the_sms(monkeypatch):
    # Qwen3-Next's grouping (16 q / 2 kv heads), batch 1, K = 1, 4096 tokens: the one-pass grid would
    # be 2 programs; paged_attention must launch at least 132 (an H100's SMs) through the split path.
    # (Grids only: 132 interpreted programs take seconds; the next test runs the same path.)
    query, k_cache, v_cache, tables, lens = _case([4096], 1, 2, 8, 8, 16, 7)
    split = _GridRecorder(pa._paged_attention_split_kernel, run=False)
    reduce = _GridRecorder(pa._paged_attention_reduce_kernel, run=False)
    monkeypatch.setattr(pa, "_paged_attention_split_kernel", split)
    monkeypatch.setattr(pa, "_paged_attention_reduce_kernel", reduce)
    pa.paged_attention(query, k_cache, v_cache, tables, lens, 8**-0.5)
    assert len(split.grids) == 1 and reduce.grids == [(16,)]  # one reduce program per (row, q head)
    grid = split.grids[0]
    assert grid[0] * grid[1] * grid[2] >= pa.DEFAULT_SM_COUNT, grid


@interpreted
def test_paged_attention_takes_the_split_path_by_itself_and_matches_the_reference(monkeypatch):
    # A GPU of 8 SMs (few programs to interpret): batch 1, 2 kv heads, verify rows K = 2, a table of
    # 608 tokens (> SPLIT_MIN_CONTEXT) with 600 in the context.
    monkeypatch.setattr(pa, "DEFAULT_SM_COUNT", 8)
    query, k_cache, v_cache, tables, lens = _case([600], 2, 2, 3, 4, 16, 11)
    split = _GridRecorder(pa._paged_attention_split_kernel)
    monkeypatch.setattr(pa, "_paged_attention_split_kernel", split)
    got = pa.paged_attention(query, k_cache, v_cache, tables, lens, 0.5)
    assert len(split.grids) == 1 and split.grids[0][0] == 4  # cdiv(8 SMs, 2 programs) partitions
    torch.testing.assert_close(got, _reference64(query, k_cache, v_cache, tables, lens, 0.5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sm_count", [132, 114, 78])
@pytest.mark.parametrize("context", [4096, 32768])
@pytest.mark.parametrize("rows, group, dtype", [(1, 8, torch.bfloat16), (1, 4, torch.float32), (8, 8, torch.bfloat16)])
def test_split_count_launches_at_least_one_program_per_sm(sm_count, context, rows, group, dtype):
    config = pa.launch_config(rows, group, 256, dtype)
    m_chunks = -(-(rows * group) // config["BLOCK_M"])
    programs = 2 * m_chunks  # batch 1, 2 kv heads
    splits = pa.split_count(programs, context, config["BLOCK_N"], sm_count)
    assert splits > 1 and programs * splits >= sm_count
    assert splits <= pa.MAX_SPLITS and splits * config["BLOCK_N"] <= context  # no partition without a tile


def test_split_count_keeps_one_pass_for_full_grids_and_short_tables():
    assert pa.split_count(programs=66, context_bound=1 << 20, block_n=32, sm_count=132) == 2
    assert pa.split_count(programs=67, context_bound=1 << 20, block_n=32, sm_count=132) == 1
    assert pa.split_count(programs=2, context_bound=pa.SPLIT_MIN_CONTEXT - 1, block_n=32, sm_count=132) == 1
    assert pa.split_count(programs=2, context_bound=pa.SPLIT_MIN_CONTEXT, block_n=32, sm_count=132) == 16
    assert pa.split_count(programs=1, context_bound=1 << 20, block_n=16, sm_count=1024) == pa.MAX_SPLITS
