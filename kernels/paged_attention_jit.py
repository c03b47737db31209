"""The Triton device code of paged attention (specs/gpu-kernels.md §17.1, §17.2, §17.5): the
one-pass kernel, the split-KV partition kernel and its reduce launch, and the tile helpers they
share. ``paged_attention`` (the host side: checks, launch rule, reference, dispatch) launches them;
each is None when Triton is not installed.
"""

from __future__ import annotations

from ._triton import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _query_tile(
        q_ptr,
        seq,
        kv_head,
        m_chunk,
        rows_per_seq,
        group_size,
        head_dim,
        q_stride_b,
        q_stride_row,
        q_stride_head,
        BLOCK_M: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # The [BLOCK_M, BLOCK_D] query tile of (seq, kv head, m chunk): tile row r is
        # query row j = r // group of query head kv_head * group + r % group.
        tile_row = m_chunk * BLOCK_M + tl.arange(0, BLOCK_M)
        query_row = tile_row // group_size
        q_head = kv_head * group_size + tile_row % group_size
        row_ok = tile_row < rows_per_seq * group_size
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < head_dim
        q_offsets = seq * q_stride_b + query_row.to(tl.int64)[:, None] * q_stride_row
        q_offsets += q_head.to(tl.int64)[:, None] * q_stride_head + dims[None, :]
        q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        return q, query_row, q_head, row_ok, dims, dim_ok

    @triton.jit
    def _attend_tiles(
        q,
        m_i,
        l_i,
        acc,
        seq,
        kv_head,
        first,
        last,
        visible_len,
        dims,
        dim_ok,
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr,
        scale,
        block_size,
        cache_stride_block,
        cache_stride_slot,
        cache_stride_head,
        table_stride_b,
        BLOCK_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        # Online softmax over the cache positions [first, last) in BLOCK_N-token tiles.
        # Invariant: m_i = running max score, l_i = sum exp(score - m_i),
        # acc = sum exp(score - m_i) * value, over the tokens seen so far.
        for tile_start in range(first, last, BLOCK_N):
            pos = tile_start + tl.arange(0, BLOCK_N).to(tl.int64)
            pos_ok = pos < last
            physical = tl.load(
                block_tables_ptr + seq * table_stride_b + pos // block_size, mask=pos_ok, other=0
            ).to(tl.int64)
            kv_offsets = physical * cache_stride_block + (pos % block_size) * cache_stride_slot
            kv_offsets += kv_head * cache_stride_head
            kv_mask = pos_ok[:, None] & dim_ok[None, :]
            keys = tl.load(k_cache_ptr + kv_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
            values = tl.load(v_cache_ptr + kv_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)

            scores = tl.dot(q, tl.trans(keys.to(q.dtype)), input_precision=DOT_PRECISION) * scale
            visible = (pos[None, :] < visible_len[:, None]) & pos_ok[None, :]
            scores = tl.where(visible, scores, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            probs = tl.exp(scores - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(probs, axis=1)
            acc = acc * alpha[:, None] + tl.dot(probs.to(values.dtype), values, input_precision=DOT_PRECISION)
            m_i = m_new
        return m_i, l_i, acc

    @triton.jit
    def _new_rows(query_lens_ptr, seq, rows_per_seq, context_len, RAGGED: tl.constexpr):
        # The sequence's new rows (int64): its query_lens entry when ragged, else every row.
        if RAGGED:
            new_rows = tl.load(query_lens_ptr + seq).to(tl.int64)
        else:
            new_rows = context_len * 0 + rows_per_seq
        return new_rows

    @triton.jit
    def _causal_end(context_len, new_rows, m_chunk, rows_per_seq, group_size, BLOCK_M: tl.constexpr):
        # One past the last position any row of the chunk sees: its last row's bound
        # (rows past the chunk's see more; a tile stops there instead of sweeping the
        # whole context, which halves a prefill's work).
        last_row = tl.minimum((m_chunk * BLOCK_M + BLOCK_M - 1) // group_size, rows_per_seq - 1)
        return tl.minimum(context_len, context_len - new_rows + last_row + 1)

    @triton.jit
    def _paged_attention_kernel(
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr,
        context_lens_ptr,
        query_lens_ptr,
        out_ptr,
        scale,
        rows_per_seq,
        group_size,
        head_dim,
        block_size,
        q_stride_b,
        q_stride_row,
        q_stride_head,
        cache_stride_block,
        cache_stride_slot,
        cache_stride_head,
        table_stride_b,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        RAGGED: tl.constexpr,
    ):
        # Program (b, kv head, m chunk) handles BLOCK_M of the K rows x group
        # query heads sharing this kv head as one [BLOCK_M, BLOCK_D] tile and
        # sweeps the context its rows see (gpu-kernels.md §17.1, §17.5).
        seq = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1)
        m_chunk = tl.program_id(2)
        context_len = tl.load(context_lens_ptr + seq).to(tl.int64)
        new_rows = _new_rows(query_lens_ptr, seq, rows_per_seq, context_len, RAGGED)
        q, query_row, q_head, row_ok, dims, dim_ok = _query_tile(
            q_ptr, seq, kv_head, m_chunk, rows_per_seq, group_size, head_dim,
            q_stride_b, q_stride_row, q_stride_head, BLOCK_M, BLOCK_D,
        )
        visible_len = context_len - new_rows + query_row + 1  # [BLOCK_M]
        end = _causal_end(context_len, new_rows, m_chunk, rows_per_seq, group_size, BLOCK_M)
        m_i = tl.full((BLOCK_M,), -float("inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        m_i, l_i, acc = _attend_tiles(
            q, m_i, l_i, acc, seq, kv_head, 0, end, visible_len, dims, dim_ok,
            k_cache_ptr, v_cache_ptr, block_tables_ptr, scale, block_size,
            cache_stride_block, cache_stride_slot, cache_stride_head, table_stride_b, BLOCK_N, DOT_PRECISION,
        )
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        out_offsets = seq * q_stride_b + query_row.to(tl.int64)[:, None] * q_stride_row
        out_offsets += q_head.to(tl.int64)[:, None] * q_stride_head + dims[None, :]
        tl.store(
            out_ptr + out_offsets,
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )

    @triton.jit
    def _paged_attention_split_kernel(
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr,
        context_lens_ptr,
        query_lens_ptr,
        part_max_ptr,
        part_sum_ptr,
        part_acc_ptr,
        scale,
        rows_per_seq,
        group_size,
        head_dim,
        block_size,
        num_splits,
        q_stride_b,
        q_stride_row,
        q_stride_head,
        cache_stride_block,
        cache_stride_slot,
        cache_stride_head,
        table_stride_b,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        RAGGED: tl.constexpr,
    ):
        # Program (b * S + split, kv head, m chunk): the same tile as
        # _paged_attention_kernel over partition `split` of the context only
        # (gpu-kernels.md §17.2); writes its unnormalised (max, sum, acc) per
        # query row to part_*[(b * K + j) * Hq + h, split]. An empty partition
        # writes (-inf, 0, 0).
        pid = tl.program_id(0).to(tl.int64)
        seq = pid // num_splits
        split = pid % num_splits
        kv_head = tl.program_id(1)
        m_chunk = tl.program_id(2)
        context_len = tl.load(context_lens_ptr + seq).to(tl.int64)
        q, query_row, q_head, row_ok, dims, dim_ok = _query_tile(
            q_ptr, seq, kv_head, m_chunk, rows_per_seq, group_size, head_dim,
            q_stride_b, q_stride_row, q_stride_head, BLOCK_M, BLOCK_D,
        )
        new_rows = _new_rows(query_lens_ptr, seq, rows_per_seq, context_len, RAGGED)
        visible_len = context_len - new_rows + query_row + 1
        partition = tl.cdiv(tl.cdiv(context_len, BLOCK_N), num_splits) * BLOCK_N
        first = split * partition
        end = _causal_end(context_len, new_rows, m_chunk, rows_per_seq, group_size, BLOCK_M)
        last = tl.minimum(first + partition, end)
        m_i = tl.full((BLOCK_M,), -float("inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        m_i, l_i, acc = _attend_tiles(
            q, m_i, l_i, acc, seq, kv_head, first, last, visible_len, dims, dim_ok,
            k_cache_ptr, v_cache_ptr, block_tables_ptr, scale, block_size,
            cache_stride_block, cache_stride_slot, cache_stride_head, table_stride_b, BLOCK_N, DOT_PRECISION,
        )
        q_heads = tl.num_programs(1) * group_size
        slot = ((seq * rows_per_seq + query_row) * q_heads + q_head) * num_splits + split  # [BLOCK_M]
        tl.store(part_max_ptr + slot, m_i, mask=row_ok)
        tl.store(part_sum_ptr + slot, l_i, mask=row_ok)
        tl.store(
            part_acc_ptr + slot[:, None] * head_dim + dims[None, :], acc, mask=row_ok[:, None] & dim_ok[None, :]
        )

    @triton.jit
    def _paged_attention_reduce_kernel(
        part_max_ptr,
        part_sum_ptr,
        part_acc_ptr,
        out_ptr,
        num_splits,
        head_dim,
        SPLIT_BLOCK: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # Program r merges the S partials of output row r = (b * K + j) * Hq + h
        # with the same online rule: out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s.
        row = tl.program_id(0).to(tl.int64)
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < head_dim
        m_run = tl.full((), -float("inf"), tl.float32)
        l_run = tl.zeros((), tl.float32)
        acc = tl.zeros((BLOCK_D,), tl.float32)
        for first in range(0, num_splits, SPLIT_BLOCK):
            split = first + tl.arange(0, SPLIT_BLOCK)
            split_ok = split < num_splits
            slot = row * num_splits + split
            m_s = tl.load(part_max_ptr + slot, mask=split_ok, other=-float("inf"))
            l_s = tl.load(part_sum_ptr + slot, mask=split_ok, other=0.0)
            acc_s = tl.load(
                part_acc_ptr + slot[:, None] * head_dim + dims[None, :],
                mask=split_ok[:, None] & dim_ok[None, :],
                other=0.0,
            )
            m_new = tl.maximum(m_run, tl.max(m_s, axis=0))
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
            alpha = tl.exp(m_run - m_safe)
            weight = tl.exp(m_s - m_safe)  # 0 for an empty partition (m_s = -inf)
            l_run = l_run * alpha + tl.sum(weight * l_s, axis=0)
            acc = acc * alpha + tl.sum(weight[:, None] * acc_s, axis=0)
            m_run = m_new
        out = acc / tl.where(l_run == 0.0, 1.0, l_run)
        tl.store(out_ptr + row * head_dim + dims, out.to(out_ptr.dtype.element_ty), mask=dim_ok)
else:  # pragma: no cover
    _paged_attention_kernel = None
    _paged_attention_split_kernel = None
    _paged_attention_reduce_kernel = None
