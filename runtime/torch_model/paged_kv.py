"""Paged KV cache: a refcounted pool of fixed-size blocks plus per-layer K/V block storage.

Invariants: a block is in the free list iff its refcount is 0; every position p of a sequence
lives at (block_table[p // block_size], p % block_size); blocks are never written while shared
(refcount > 1) because writers only touch positions >= their sequence's committed length and
only full, committed blocks are ever shared.
"""

from __future__ import annotations

import re
from typing import Sequence

import torch

from .errors import OutOfBlocksError


class BlockPool:
    """Refcounted block pool that keeps each sequence's blocks consecutive where it can.

    Placement (deterministic): a sequence that grows (`after` = its last block) takes the blocks
    right after it while they are free; any other request takes the largest free run -- from its
    start when the run opens the pool or follows free space, else from its middle, so the sequence
    before the run keeps half of it to grow into. A fresh pool therefore hands out 0, 1, 2, ...
    Consecutive blocks let attention read a sequence's keys as a view of the cache
    (attn_plan.py); when the pool is too full for that, any free block serves (attention then
    gathers that sequence's blocks), so placement never refuses a request that fits.
    """

    _RUN = re.compile(b"\x01+")

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._refcount = [0] * num_blocks
        self._is_free = bytearray(b"\x01") * num_blocks
        self._num_free = num_blocks

    def num_free(self) -> int:
        """Number of blocks with refcount 0."""
        return self._num_free

    def refcount(self, block: int) -> int:
        """Current number of holders of `block`."""
        return self._refcount[block]

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """Take n free blocks (refcount 1 each), placed as the class docstring says (`after`: the
        last block of the sequence they extend); raise OutOfBlocksError, changing nothing, if fewer."""
        if n > self._num_free:
            raise OutOfBlocksError(f"need {n} KV blocks, only {self._num_free} free "
                                   f"(of {self.num_blocks}); reclaim cached blocks or free a slot")
        blocks: list[int] = []
        is_free = self._is_free
        if after is not None:
            nxt = after + 1
            while len(blocks) < n and nxt < self.num_blocks and is_free[nxt]:
                blocks.append(nxt)
                nxt += 1
        while len(blocks) < n:
            start, end = max(((m.start(), m.end()) for m in self._RUN.finditer(is_free)),
                             key=lambda r: (r[1] - r[0], -r[0]))
            want = n - len(blocks)
            if start > 0 and end - start > want:  # a maximal run after start 0 follows a used block
                start += (end - start - want) // 2
            blocks.extend(range(start, min(end, start + want)))
            for b in blocks:
                is_free[b] = 0
        for b in blocks:
            is_free[b] = 0
            self._refcount[b] = 1
        self._num_free -= n
        return blocks

    def incref(self, block: int) -> None:
        """Add a holder to an allocated block."""
        if self._refcount[block] <= 0:
            raise ValueError(f"incref of free block {block}")
        self._refcount[block] += 1

    def decref(self, block: int) -> None:
        """Drop a holder; the block returns to the free pool when its last holder drops it."""
        if self._refcount[block] <= 0:
            raise ValueError(f"decref of free block {block}")
        self._refcount[block] -= 1
        if self._refcount[block] == 0:
            self._is_free[block] = 1
            self._num_free += 1


class PagedKVCache:
    """K and V storage of every attention layer: [num_blocks, block_size, num_kv_heads, head_dim]."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, device: torch.device | str, dtype: torch.dtype = torch.float32) -> None:
        self.block_size = block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]

    def write(self, layer: int, flat_index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store rows k/v [N, Hkv, Dh] at flat cache indices (block * block_size + offset) [N]."""
        self.k[layer].view(-1, *self.k[layer].shape[2:]).index_copy_(0, flat_index, k)
        self.v[layer].view(-1, *self.v[layer].shape[2:]).index_copy_(0, flat_index, v)

    def copy_blocks(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy the contents of blocks src[i] into dst[i] in every layer."""
        if not src:
            return
        device = self.k[0].device
        s = torch.tensor(list(src), device=device, dtype=torch.long)
        d = torch.tensor(list(dst), device=device, dtype=torch.long)
        for cache in (*self.k, *self.v):
            cache.index_copy_(0, d, cache.index_select(0, s))


def flat_indices(block_table: Sequence[int], start: int, count: int, block_size: int) -> list[int]:
    """Flat cache indices of positions start..start+count-1 of a sequence with `block_table`."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, start + count)]


def blocks_for(num_positions: int, block_size: int) -> int:
    """Blocks needed to hold positions 0..num_positions-1."""
    return -(-num_positions // block_size)
