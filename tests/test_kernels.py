"""Kernel tests: Triton (interpreter, fp32, tiny shapes) vs plain-torch references,
and the references vs independent oracles (Python loops, dense attention,
token-at-a-time recurrence)."""

import os
import subprocess
import sys

# Must precede the first `import triton` anywhere: @triton.jit picks the
# interpreter at decoration time.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fxsched.kernels import bench  # noqa: E402
from fxsched.kernels._triton import HAVE_TRITON, kernel_is_interpreted, use_triton  # noqa: E402
from fxsched.kernels.gated_delta import gated_delta, gated_delta_reference, gated_delta_triton  # noqa: E402
from fxsched.kernels.gdn_fold import gdn_fold, gdn_fold_reference, gdn_fold_triton  # noqa: E402
from fxsched.kernels.greedy_accept import (  # noqa: E402
    greedy_accept,
    greedy_accept_reference,
    greedy_accept_triton,
    row_offsets_from_counts,
)
from fxsched.kernels.paged_attention import (  # noqa: E402
    paged_attention,
    paged_attention_reference,
    paged_attention_triton,
)
from fxsched.kernels.paged_kv_append import (  # noqa: E402
    paged_kv_append,
    paged_kv_append_reference,
    paged_kv_append_triton,
)
from fxsched.kernels.lora_sgmv import (  # noqa: E402
    lora_expand_,
    lora_expand_reference,
    lora_expand_triton,
    lora_shrink,
    lora_shrink_reference,
    lora_shrink_triton,
)
from fxsched.kernels.row_argmax import row_argmax, row_argmax_reference, row_argmax_triton  # noqa: E402


def _interpreter_skip_reason() -> str:
    try:
        import triton  # noqa: F401
    except ImportError as exc:  # under TRITON_INTERPRET=1 triton itself imports numpy
        return f"triton cannot be imported: {exc}"
    try:
        import numpy  # noqa: F401
    except ImportError:
        return "the Triton interpreter needs numpy, which is not installed"
    if not HAVE_TRITON:
        return "fxsched.kernels defined no Triton kernels"
    from fxsched.kernels import gated_delta, gdn_fold, greedy_accept, paged_attention, paged_kv_append, row_argmax

    kernels = [
        greedy_accept._greedy_accept_kernel,
        row_argmax._row_argmax_kernel,
        gdn_fold._gather_rows_to_slots_kernel,
        paged_kv_append._paged_kv_append_kernel,
        paged_attention._paged_attention_kernel,
        gated_delta._gated_delta_kernel,
    ]
    if not all(kernel_is_interpreted(k) for k in kernels):
        return "fxsched.kernels was imported before TRITON_INTERPRET=1 was set; kernels are compiled, not interpreted"
    return ""


_SKIP_REASON = _interpreter_skip_reason()
interpreted = pytest.mark.skipif(bool(_SKIP_REASON), reason=_SKIP_REASON or "n/a")

# The interpreter runs every program in Python: few examples, tiny shapes.
interp_settings = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
cheap_settings = settings(max_examples=80, deadline=None)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- greedy accept


def _greedy_case(rows_per_seq: list[int], seed: int, match_prob: float):
    gen = _gen(seed)
    offsets = row_offsets_from_counts(torch.tensor(rows_per_seq))
    target = torch.randint(0, 5, (sum(rows_per_seq),), generator=gen)
    drafts = []
    for b, rows in enumerate(rows_per_seq):
        start = int(offsets[b])
        for i in range(rows - 1):
            same = torch.rand((), generator=gen).item() < match_prob
            drafts.append(int(target[start + i]) if same else int(target[start + i] + 1 + torch.randint(0, 3, (), generator=gen)))
    return target, torch.tensor(drafts, dtype=torch.int64), offsets


def _greedy_loop(target, drafts, offsets):
    accepted, bonus = [], []
    for b in range(offsets.numel() - 1):
        start, end = int(offsets[b]), int(offsets[b + 1])
        n = 0
        while n < end - start - 1 and int(drafts[start - b + n]) == int(target[start + n]):
            n += 1
        accepted.append(n)
        bonus.append(int(target[start + n]))
    return torch.tensor(accepted, dtype=torch.int64), torch.tensor(bonus, dtype=torch.int64)


ragged_rows = st.lists(st.integers(1, 6), min_size=1, max_size=6)


@cheap_settings
@given(rows=ragged_rows, seed=st.integers(0, 2**31), match_prob=st.sampled_from([0.0, 0.5, 0.9, 1.0]))
def test_greedy_accept_kernel_reference_matches_python_loop(rows, seed, match_prob):
    target, drafts, offsets = _greedy_case(rows, seed, match_prob)
    accepted, bonus = greedy_accept_reference(target, drafts, offsets)
    want_accepted, want_bonus = _greedy_loop(target, drafts, offsets)
    assert torch.equal(accepted, want_accepted)
    assert torch.equal(bonus, want_bonus)


@interpreted
@interp_settings
@given(rows=ragged_rows, seed=st.integers(0, 2**31), match_prob=st.sampled_from([0.0, 0.5, 0.9, 1.0]))
def test_greedy_accept_kernel_triton_matches_reference(rows, seed, match_prob):
    target, drafts, offsets = _greedy_case(rows, seed, match_prob)
    got = greedy_accept_triton(target, drafts, offsets)
    want = greedy_accept_reference(target, drafts, offsets)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@interpreted
@pytest.mark.parametrize(
    "rows, match_prob, expect_accepted",
    [
        ([1, 1, 1], 1.0, [0, 0, 0]),  # K=1: no drafts, bonus is row 0
        ([4, 3, 5], 1.0, [3, 2, 4]),  # all drafts accepted
        ([4, 3, 5], 0.0, [0, 0, 0]),  # none accepted
        ([40, 2], 1.0, [39, 1]),  # drafts span more than one DRAFT_BLOCK
    ],
)
def test_greedy_accept_kernel_edge_cases(rows, match_prob, expect_accepted):
    target, drafts, offsets = _greedy_case(rows, 7, match_prob)
    accepted, bonus = greedy_accept_triton(target, drafts, offsets)
    assert accepted.tolist() == expect_accepted
    starts = offsets[:-1].long()
    assert torch.equal(bonus, target[starts + accepted])
    want = greedy_accept_reference(target, drafts, offsets)
    assert torch.equal(accepted, want[0]) and torch.equal(bonus, want[1])


def test_greedy_accept_kernel_late_mismatch_after_block():
    # mismatch at draft 35 (second block of 32) must be found; int32 ids work too.
    rows = [40]
    target, drafts, offsets = _greedy_case(rows, 3, 1.0)
    drafts[35] += 1
    for fn in [greedy_accept_reference] + ([greedy_accept_triton] if not _SKIP_REASON else []):
        accepted, bonus = fn(target.int(), drafts.int(), offsets)
        assert accepted.tolist() == [35] and bonus.tolist() == [int(target[35])]


# --------------------------------------------------------------------------- row argmax


@interpreted
@interp_settings
@given(
    num_rows=st.integers(1, 4),
    vocab=st.integers(1, 70),
    block=st.sampled_from([8, 16, 128]),
    seed=st.integers(0, 2**31),
    specials=st.sampled_from(["none", "nan", "-inf", "+inf"]),
)
def test_row_argmax_kernel_triton_matches_torch(num_rows, vocab, block, seed, specials):
    gen = _gen(seed)
    # few distinct values -> many ties across block boundaries
    logits = torch.randint(-3, 3, (num_rows, vocab), generator=gen).float()
    if specials != "none":
        value = {"nan": float("nan"), "-inf": float("-inf"), "+inf": float("inf")}[specials]
        where = torch.rand(num_rows, vocab, generator=gen) < 0.2
        logits[where] = value
    got = row_argmax_triton(logits, vocab_block=block)
    assert torch.equal(got, torch.argmax(logits, dim=-1))
    assert torch.equal(got, row_argmax_reference(logits))


@interpreted
def test_row_argmax_kernel_edge_rows():
    logits = torch.tensor(
        [
            [1.0, 5.0, 5.0, 2.0, 5.0],  # tie -> lowest index
            [float("-inf")] * 5,  # all -inf -> 0
            [0.0, float("nan"), 9.0, float("nan"), 1.0],  # first NaN wins
            [-1.0, -2.0, -3.0, -0.5, -0.5],
        ]
    )
    got = row_argmax_triton(logits, vocab_block=2)
    assert got.tolist() == [1, 0, 1, 3]
    assert torch.equal(got, torch.argmax(logits, -1))
    strided = torch.randn(6, 33)[:, 1::2]  # non-unit column stride
    assert torch.equal(row_argmax_triton(strided, vocab_block=4), torch.argmax(strided, -1))


# --------------------------------------------------------------------------- GDN fold


def _fold_case(batch, kmax, slots, seed, heads=2, key_dim=3, value_dim=2, channels=3, width=2):
    gen = _gen(seed)
    states_rows = torch.randn(batch, kmax, heads, key_dim, value_dim, generator=gen)
    conv_rows = torch.randn(batch, kmax, channels, width, generator=gen)
    accepted = torch.randint(0, kmax, (batch,), generator=gen)
    slot_ids = torch.randperm(slots, generator=gen)[:batch]
    padding = torch.rand(batch, generator=gen) < 0.25
    slot_ids = torch.where(padding, torch.full_like(slot_ids, -1), slot_ids)
    state = torch.randn(slots, heads, key_dim, value_dim, generator=gen)
    conv = torch.randn(slots, channels, width, generator=gen)
    return states_rows, conv_rows, accepted, slot_ids, state, conv


fold_shapes = st.integers(1, 4).flatmap(
    lambda b: st.tuples(st.just(b), st.integers(1, 4), st.integers(b, b + 3), st.integers(0, 2**31))
)


@cheap_settings
@given(shape=fold_shapes)
def test_gdn_fold_kernel_reference_matches_loop(shape):
    states_rows, conv_rows, accepted, slot_ids, state, conv = _fold_case(*shape)
    want_state, want_conv = state.clone(), conv.clone()
    for b in range(states_rows.shape[0]):
        if int(slot_ids[b]) >= 0:
            want_state[int(slot_ids[b])] = states_rows[b, int(accepted[b])]
            want_conv[int(slot_ids[b])] = conv_rows[b, int(accepted[b])]
    gdn_fold_reference(states_rows, conv_rows, accepted, slot_ids, state, conv)
    assert torch.equal(state, want_state) and torch.equal(conv, want_conv)


@interpreted
@interp_settings
@given(shape=fold_shapes)
def test_gdn_fold_kernel_triton_matches_reference(shape):
    states_rows, conv_rows, accepted, slot_ids, state, conv = _fold_case(*shape)
    want_state, want_conv = state.clone(), conv.clone()
    gdn_fold_reference(states_rows, conv_rows, accepted, slot_ids, want_state, want_conv)
    gdn_fold_triton(states_rows, conv_rows, accepted, slot_ids, state, conv)
    assert torch.equal(state, want_state) and torch.equal(conv, want_conv)


@interpreted
def test_gdn_fold_kernel_edges_strided_slots_and_large_rows():
    # first and last row accepted, slot-strided destination views, and a per-row
    # block larger than one COPY_BLOCK chunk (H*Dk*Dv = 2*32*20 = 1280).
    states_rows, conv_rows, _, _, _, _ = _fold_case(2, 3, 4, 11, heads=2, key_dim=32, value_dim=20)
    accepted = torch.tensor([0, 2])
    slot_ids = torch.tensor([3, 0])
    state_store = torch.zeros(8, 2, 32, 20)
    conv_store = torch.zeros(8, 3, 2)
    state, conv = state_store[::2], conv_store[::2]  # slot stride 2 * block
    want_state, want_conv = state.clone(), conv.clone()
    gdn_fold_reference(states_rows, conv_rows, accepted, slot_ids, want_state, want_conv)
    gdn_fold_triton(states_rows, conv_rows, accepted, slot_ids, state, conv)
    assert torch.equal(state, want_state) and torch.equal(conv, want_conv)
    assert torch.equal(state[3], states_rows[0, 0]) and torch.equal(state[0], states_rows[1, 2])
    assert torch.count_nonzero(state_store[1::2]) == 0  # untouched interleaved slots


# --------------------------------------------------------------------------- paged KV cache helpers


def _paged_geometry(lens_needed, block_size, gen, spare=2):
    """Random block tables giving each sequence enough distinct physical blocks."""
    blocks_per_seq = max(1, max(-(-n // block_size) for n in lens_needed))
    num_blocks = len(lens_needed) * blocks_per_seq + spare
    perm = torch.randperm(num_blocks, generator=gen)[: len(lens_needed) * blocks_per_seq]
    return num_blocks, perm.view(len(lens_needed), blocks_per_seq).int()


def _append_loop(k_new, v_new, k_cache, v_cache, block_tables, start_positions):
    block_size = k_cache.shape[1]
    for b in range(k_new.shape[0]):
        for j in range(k_new.shape[1]):
            pos = int(start_positions[b]) + j
            if pos < 0 or pos // block_size >= block_tables.shape[1]:
                continue
            blk = int(block_tables[b, pos // block_size])
            if blk < 0:
                continue
            k_cache[blk, pos % block_size] = k_new[b, j]
            v_cache[blk, pos % block_size] = v_new[b, j]


append_shapes = st.tuples(
    st.integers(1, 3),  # B
    st.integers(1, 5),  # K
    st.integers(1, 2),  # H
    st.integers(1, 5),  # D
    st.sampled_from([1, 2, 4]),  # block size
    st.integers(0, 2**31),
)


def _append_case(batch, rows, heads, dim, block_size, seed):
    gen = _gen(seed)
    starts = torch.randint(0, 9, (batch,), generator=gen).int()
    num_blocks, tables = _paged_geometry([int(s) + rows for s in starts], block_size, gen)
    # sometimes an unallocated (-1) table entry or a negative start: those rows drop
    if torch.rand((), generator=gen) < 0.3:
        tables[0, -1] = -1
    if torch.rand((), generator=gen) < 0.2:
        starts[-1] = -rows
    if torch.rand((), generator=gen) < 0.3 and tables.shape[1] > 1:
        tables = tables[:, :-1]  # strided view; rows past the table's end drop
    k_new = torch.randn(batch, rows, heads, dim, generator=gen)
    v_new = torch.randn(batch, rows, heads, dim, generator=gen)
    k_cache = torch.randn(num_blocks, block_size, heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, heads, dim, generator=gen)
    return k_new, v_new, k_cache, v_cache, tables, starts


@cheap_settings
@given(shape=append_shapes)
def test_paged_kv_append_kernel_reference_matches_loop(shape):
    k_new, v_new, k_cache, v_cache, tables, starts = _append_case(*shape)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    _append_loop(k_new, v_new, want_k, want_v, tables, starts)
    paged_kv_append_reference(k_new, v_new, k_cache, v_cache, tables, starts)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@interpreted
@interp_settings
@given(shape=append_shapes)
def test_paged_kv_append_kernel_triton_matches_reference(shape):
    k_new, v_new, k_cache, v_cache, tables, starts = _append_case(*shape)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    paged_kv_append_reference(k_new, v_new, want_k, want_v, tables, starts)
    paged_kv_append_triton(k_new, v_new, k_cache, v_cache, tables, starts)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@interpreted
@pytest.mark.parametrize("rows, start", [(1, 5), (4, 6), (3, 0)])
def test_paged_kv_append_kernel_block_boundary_inside_rows(rows, start):
    # block_size 4: start 6 with 4 rows writes positions 6,7 | 8,9 across blocks 1 and 2.
    gen = _gen(rows * 10 + start)
    block_size = 4
    tables = torch.tensor([[5, 2, 7], [1, 0, 3]], dtype=torch.int32)
    starts = torch.tensor([start, 0], dtype=torch.int32)
    k_new = torch.randn(2, rows, 2, 3, generator=gen)
    v_new = torch.randn(2, rows, 2, 3, generator=gen)
    k_cache = torch.zeros(8, block_size, 2, 3)
    v_cache = torch.zeros(8, block_size, 2, 3)
    paged_kv_append_triton(k_new, v_new, k_cache, v_cache, tables, starts)
    for j in range(rows):
        pos = start + j
        assert torch.equal(k_cache[int(tables[0, pos // block_size]), pos % block_size], k_new[0, j])
        assert torch.equal(v_cache[int(tables[1, j // block_size]), j % block_size], v_new[1, j])
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    paged_kv_append_reference(k_new, v_new, want_k, want_v, tables, starts)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@interpreted
def test_paged_kv_append_kernel_drops_rows_past_table_and_unallocated():
    # block_size 2, table of 2 blocks: positions 0..3 exist; -1 marks an unallocated block.
    tables_full = torch.tensor([[3, 1, 0], [2, -1, 4]], dtype=torch.int32)
    tables = tables_full[:, :2]
    starts = torch.tensor([2, 1], dtype=torch.int32)
    k_new = torch.arange(1, 2 * 3 * 2 + 1, dtype=torch.float32).view(2, 3, 1, 2)
    v_new = -k_new
    k_cache = torch.zeros(5, 2, 1, 2)
    v_cache = torch.zeros(5, 2, 1, 2)
    paged_kv_append_triton(k_new, v_new, k_cache, v_cache, tables, starts)
    want_k = torch.zeros_like(k_cache)
    want_k[1, 0], want_k[1, 1] = k_new[0, 0], k_new[0, 1]  # seq 0: positions 2, 3; position 4 dropped
    want_k[2, 1] = k_new[1, 0]  # seq 1: position 1; positions 2, 3 hit the -1 block
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, -want_k)
    ref_k, ref_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    paged_kv_append_reference(k_new, v_new, ref_k, ref_v, tables, starts)
    assert torch.equal(ref_k, want_k) and torch.equal(ref_v, -want_k)


# --------------------------------------------------------------------------- paged attention


def _attention_case(batch, rows, kv_heads, group, dim, block_size, seed, short_context=False):
    """Dense per-sequence K/V scattered into a paged cache; returns both views."""
    gen = _gen(seed)
    low = 0 if short_context else rows
    lens = torch.randint(low, rows + 12, (batch,), generator=gen).int()
    num_blocks, tables = _paged_geometry([int(n) for n in lens], block_size, gen)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    query = torch.randn(batch, rows, kv_heads * group, dim, generator=gen)
    dense = []
    for b in range(batch):
        pos = torch.arange(int(lens[b]))
        blocks = tables[b].long()[pos // block_size]
        dense.append((k_cache[blocks, pos % block_size], v_cache[blocks, pos % block_size]))
    return query, k_cache, v_cache, tables, lens, dense


def _dense_causal_attention(query, dense, lens, scale):
    batch, rows, q_heads, dim = query.shape
    out = torch.zeros_like(query)
    for b in range(batch):
        keys, values = dense[b]
        group = q_heads // keys.shape[1]
        for j in range(rows):
            visible = int(lens[b]) - rows + j + 1
            if visible <= 0:
                continue
            for h in range(q_heads):
                k = keys[:visible, h // group].double()
                v = values[:visible, h // group].double()
                probs = torch.softmax((k @ query[b, j, h].double()) * scale, dim=0)
                out[b, j, h] = (probs @ v).float()
    return out


attention_shapes = st.tuples(
    st.integers(1, 3),  # B
    st.integers(1, 4),  # K rows
    st.integers(1, 2),  # Hkv
    st.integers(1, 3),  # group (Hq / Hkv)
    st.sampled_from([2, 3, 4, 8]),  # D
    st.sampled_from([1, 2, 4, 16]),  # block size
    st.integers(0, 2**31),
)


@cheap_settings
@given(shape=attention_shapes, short=st.booleans())
def test_paged_attention_kernel_reference_matches_dense(shape, short):
    query, k_cache, v_cache, tables, lens, dense = _attention_case(*shape, short_context=short)
    scale = 0.7
    got = paged_attention_reference(query, k_cache, v_cache, tables, lens, scale)
    want = _dense_causal_attention(query, dense, lens, scale)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@interpreted
@interp_settings
@given(shape=attention_shapes)
def test_paged_attention_kernel_triton_matches_reference(shape):
    query, k_cache, v_cache, tables, lens, _ = _attention_case(*shape)
    got = paged_attention_triton(query, k_cache, v_cache, tables, lens, 0.5, kv_tile=16)
    want = paged_attention_reference(query, k_cache, v_cache, tables, lens, 0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@interpreted
@pytest.mark.parametrize(
    "rows, lens, group",
    [
        (1, [1, 9], 2),  # decode, K=1, incl. a one-token context
        (3, [7, 10], 2),  # verify rows straddle block boundaries (block 4: positions 4..6 / 7..9)
        (3, [2, 40], 2),  # short context: row 0 sees nothing -> zeros; long context spans 3 kv tiles
        (9, [12, 20], 4),  # K * group = 36 query rows: two BLOCK_M chunks per kv head
    ],
)
def test_paged_attention_kernel_edges(rows, lens, group):
    gen = _gen(sum(lens))
    block_size, kv_heads, dim = 4, 2, 5  # D=5: padded head dim
    lens_t = torch.tensor(lens, dtype=torch.int32)
    num_blocks, tables = _paged_geometry(lens, block_size, gen)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    query = torch.randn(2, rows, kv_heads * group, dim, generator=gen)
    got = paged_attention_triton(query, k_cache, v_cache, tables, lens_t, dim**-0.5, kv_tile=16)
    want = paged_attention_reference(query, k_cache, v_cache, tables, lens_t, dim**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if lens[0] < rows:
        assert torch.count_nonzero(got[0, : rows - lens[0]]) == 0


# --------------------------------------------------------------------------- gated delta rule


def _delta_case(batch, steps, heads, key_dim, value_dim, seed, with_state=True):
    gen = _gen(seed)
    q = torch.randn(batch, steps, heads, key_dim, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(batch, steps, heads, key_dim, generator=gen), dim=-1)
    v = torch.randn(batch, steps, heads, value_dim, generator=gen)
    g = -torch.rand(batch, steps, heads, generator=gen)
    beta = torch.rand(batch, steps, heads, generator=gen)
    state = torch.randn(batch, heads, key_dim, value_dim, generator=gen) if with_state else None
    return q, k, v, g, beta, state


delta_shapes = st.tuples(
    st.integers(1, 2),  # B
    st.integers(1, 4),  # T
    st.integers(1, 2),  # H
    st.integers(1, 5),  # Dk
    st.integers(1, 5),  # Dv
    st.integers(0, 2**31),
)


@cheap_settings
@given(shape=delta_shapes, with_state=st.booleans())
def test_gated_delta_kernel_reference_states_match_token_at_a_time(shape, with_state):
    q, k, v, g, beta, state0 = _delta_case(*shape, with_state=with_state)
    scale = 0.8
    outputs, states = gated_delta_reference(q, k, v, g, beta, state0, scale)
    batch, steps, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    # (1) chaining single-token calls reproduces every per-token state and output
    state = state0
    for t in range(steps):
        sl = slice(t, t + 1)
        o_t, s_t = gated_delta_reference(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], state, scale)
        torch.testing.assert_close(o_t[:, 0], outputs[:, t])
        torch.testing.assert_close(s_t[:, 0], states[:, t])
        state = s_t[:, 0]
    # (2) the matrix form S_t = a (I - beta k k^T) S + beta k v^T, o = scale S^T q, in float64
    eye = torch.eye(key_dim, dtype=torch.float64)
    s = torch.zeros(batch, heads, key_dim, value_dim, dtype=torch.float64) if state0 is None else state0.double()
    for t in range(steps):
        kt, vt, qt = k[:, t].double(), v[:, t].double(), q[:, t].double()
        a = g[:, t].double().exp()[..., None, None]
        b = beta[:, t].double()[..., None, None]
        kkT = kt[..., :, None] * kt[..., None, :]
        s = a * (eye - b * kkT) @ s + b * kt[..., :, None] * vt[..., None, :]
        torch.testing.assert_close(states[:, t].double(), s, atol=1e-5, rtol=1e-5)
        o = scale * torch.einsum("bhkv,bhk->bhv", s, qt)
        torch.testing.assert_close(outputs[:, t].double(), o, atol=1e-5, rtol=1e-5)


@interpreted
@interp_settings
@given(shape=delta_shapes, with_state=st.booleans(), value_block=st.sampled_from([None, 2]))
def test_gated_delta_kernel_triton_matches_reference(shape, with_state, value_block):
    q, k, v, g, beta, state0 = _delta_case(*shape, with_state=with_state)
    got_o, got_s = gated_delta_triton(q, k, v, g, beta, state0, 0.6, value_block=value_block)
    want_o, want_s = gated_delta_reference(q, k, v, g, beta, state0, 0.6)
    torch.testing.assert_close(got_o, want_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_s, want_s, atol=1e-5, rtol=1e-5)


@interpreted
def test_gated_delta_kernel_single_token_and_fold_roundtrip():
    # T=1 (decode), then a K=3 verify whose accepted row's state is folded into a slot.
    q, k, v, g, beta, state0 = _delta_case(2, 1, 2, 4, 3, 5)
    got = gated_delta_triton(q, k, v, g, beta, state0)
    want = gated_delta_reference(q, k, v, g, beta, state0)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)

    q, k, v, g, beta, state0 = _delta_case(2, 3, 2, 4, 3, 6)
    _, states = gated_delta_triton(q, k, v, g, beta, state0)
    slots = torch.zeros(4, 2, 4, 3)
    conv = torch.zeros(4, 1, 1)
    accepted = torch.tensor([2, 0])
    gdn_fold_triton(states, torch.zeros(2, 3, 1, 1), accepted, torch.tensor([1, 3]), slots, conv)
    # slot 1 = state after all three rows; slot 3 = state after row 0 only
    full = gated_delta_reference(q[:1], k[:1], v[:1], g[:1], beta[:1], state0[:1])[1][0, 2]
    first = gated_delta_reference(q[1:, :1], k[1:, :1], v[1:, :1], g[1:, :1], beta[1:, :1], state0[1:])[1][0, 0]
    torch.testing.assert_close(slots[1], full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(slots[3], first, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- LoRA shrink and expand


def _lora_case(seed: int, slots: int, rank: int, width: int, out_dim: int, counts: list[int], n: int):
    """Pool tensors, input rows and a sorted-by-slot row set with ``counts[s]`` rows of slot s."""
    gen = _gen(seed)
    a = torch.randn(slots, rank, width, generator=gen)
    b = torch.randn(slots, out_dim, rank, generator=gen)
    x = torch.randn(n, width, generator=gen)
    order = torch.randperm(n, generator=gen)[: sum(counts)]
    rows = order.to(torch.int64)
    slot_of = torch.tensor([s for s, c in enumerate(counts) for _ in range(c)], dtype=torch.int32)
    return a, b, x, rows, slot_of


def _lora_oracle(x, rows, slots, a, b, y):
    """Row by row, in float64: y[rows[i]] + (x[rows[i]] @ a[s]^T) @ b[s]^T."""
    out = y.double().clone()
    for i in range(rows.shape[0]):
        r, s = int(rows[i]), int(slots[i])
        out[r] += (x[r].double() @ a[s].double().T) @ b[s].double().T
    return out


def test_lora_references_match_a_row_by_row_oracle():
    a, b, x, rows, slots = _lora_case(1, slots=5, rank=6, width=20, out_dim=30, counts=[3, 0, 4, 1, 2], n=14)
    y = torch.randn(14, 30, generator=_gen(2))
    got = lora_expand_reference(lora_shrink_reference(x, rows, slots, a), rows, slots, b, y.clone())
    assert torch.allclose(got.double(), _lora_oracle(x, rows, slots, a, b, y), atol=1e-4)
    untouched = sorted(set(range(14)) - set(rows.tolist()))
    assert torch.equal(got[untouched], y[untouched])  # rows without an adapter get nothing


@interpreted
@interp_settings
@given(
    counts=st.lists(st.integers(0, 20), min_size=1, max_size=5),
    rank=st.sampled_from([1, 4, 8, 16, 24]),
    width=st.integers(1, 80),
    out_dim=st.integers(1, 150),
    seed=st.integers(0, 2**16),
)
def test_lora_sgmv_triton_matches_torch(counts, rank, width, out_dim, seed):
    """Blocks of 16 rows that straddle slots, empty slots, ranks under the padded block, widths
    that are not multiples of the column blocks; y a strided view (the expand adds in place)."""
    n = sum(counts) + 3
    a, b, x, rows, slots = _lora_case(seed, len(counts), rank, width, out_dim, counts, n)
    h = lora_shrink_triton(x, rows, slots, a)
    assert torch.allclose(h, lora_shrink_reference(x, rows, slots, a), atol=1e-4, rtol=1e-4)
    wide = torch.randn(n, 2 * out_dim, generator=_gen(seed + 1))
    base = wide[:, :out_dim].clone()
    y_torch = base.clone()
    lora_expand_reference(h, rows, slots, b, y_torch)
    y_triton = wide.clone()
    lora_expand_triton(h, rows, slots, b, y_triton[:, :out_dim])  # a view: row stride 2 * out_dim
    assert torch.allclose(y_triton[:, :out_dim], y_torch, atol=1e-4, rtol=1e-4)
    assert torch.equal(y_triton[:, out_dim:], wide[:, out_dim:])  # nothing written beside the view
    # the dispatchers take the interpreted kernels for CPU tensors here
    y_dispatch = base.clone()
    lora_expand_(lora_shrink(x, rows, slots, a), rows, slots, b, y_dispatch)
    assert torch.allclose(y_dispatch, y_torch, atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------- dispatch and bench


@interpreted
def test_kernel_dispatch_uses_triton_under_interpreter_and_matches_reference(monkeypatch):
    logits = torch.randn(3, 17)
    assert use_triton(logits, kernel=bench.row_argmax_mod._row_argmax_kernel)
    assert torch.equal(row_argmax(logits), row_argmax_reference(logits))

    target, drafts, offsets = _greedy_case([3, 1, 4], 1, 0.7)
    got, want = greedy_accept(target, drafts, offsets), greedy_accept_reference(target, drafts, offsets)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

    fold = _fold_case(3, 2, 5, 2)
    fold_copy = [t.clone() for t in fold]
    gdn_fold(*fold)
    gdn_fold_reference(*fold_copy)
    assert torch.equal(fold[4], fold_copy[4]) and torch.equal(fold[5], fold_copy[5])

    append = _append_case(2, 3, 1, 2, 2, 3)
    append_copy = [t.clone() for t in append]
    paged_kv_append(*append)
    paged_kv_append_reference(*append_copy)
    assert torch.equal(append[2], append_copy[2]) and torch.equal(append[3], append_copy[3])

    query, k_cache, v_cache, tables, lens, _ = _attention_case(1, 2, 1, 2, 4, 2, 4)
    torch.testing.assert_close(
        paged_attention(query, k_cache, v_cache, tables, lens, 0.5),
        paged_attention_reference(query, k_cache, v_cache, tables, lens, 0.5),
        atol=1e-5,
        rtol=1e-5,
    )
    delta = _delta_case(1, 2, 1, 3, 2, 5)
    torch.testing.assert_close(gated_delta(*delta), gated_delta_reference(*delta), atol=1e-5, rtol=1e-5)

    monkeypatch.setenv("FXSCHED_KERNELS", "torch")
    assert not use_triton(logits, kernel=bench.row_argmax_mod._row_argmax_kernel)


def test_kernel_dispatch_falls_back_without_interpreter():
    # A compiled (non-interpreted) kernel never takes CPU tensors.
    assert not use_triton(torch.zeros(1), kernel=object())
    logits = torch.randn(2, 5)
    assert torch.equal(row_argmax_reference(logits), torch.argmax(logits, -1))


def test_kernel_bench_rows_on_cpu():
    rows = bench.run_kernel_bench("cpu", 1)
    assert [r["name"] for r in rows] == [
        "greedy_accept",
        "row_argmax",
        "gdn_fold",
        "paged_kv_append",
        "paged_attention",
        "gated_delta",
        "lora_sgmv",
    ]
    for row in rows:
        assert {"name", "shape", "ms_median_triton", "ms_median_torch", "gbytes_per_s_triton", "speedup"} <= set(row)
        assert row["ms_median_torch"] > 0
        assert row["ms_median_triton"] is None and row["speedup"] is None and row["gbytes_per_s_triton"] is None
        assert "triton not timed" in row["note"]


@interpreted
def test_kernel_bench_cases_agree_under_interpreter():
    # Each bench case's Triton launcher matches its reference (wiring check).
    for case in bench._cases(torch.device("cpu")):
        diff = bench._compare(case)
        assert diff < 1e-4, (case.name, diff)


# --------------------------------------------------------------------------- compiled mode without a GPU

# The ahead-of-time sm_90 compile of every kernel (no spills at any model shape) is in
# tests/test_kernels_aot.py.


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the Triton kernels are wanted and triton is imported")
def test_a_cpu_process_without_the_interpreter_does_not_import_triton():
    code = ("import sys; import fxsched.runtime.torch_model, fxsched.runtime.generate; "
            "from fxsched.kernels import _triton, row_argmax; "
            "print('triton' in sys.modules, _triton.HAVE_TRITON, row_argmax._row_argmax_kernel is None)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False", "True"]  # the references serve; ~70 MB not spent
