"""Prefix cache of full KV blocks keyed by a chain hash of (parent hash, adapter id, block tokens).

Sharing is by reference counting, not copying: a cached block is held once by the cache and once
per sequence that reuses it; it is immutable because only full, committed blocks are cached and
sequences only write positions >= their committed length. An entry stores the GDN state at the
block's end boundary where the sequence kept one (every ModelConfig.gdn_snapshot_blocks blocks) and
the target hidden rows of the block, so a hit that ends at a snapshotted block restores a sequence
exactly (recurrent state and drafter context included).

Invariants: an entry is reachable only through its full chain from the first block; eviction
(`reclaim`) only frees entries no sequence holds, deepest-in-chain/least-recently-used first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch

from .gdn import GdnSnapshot
from .paged_kv import BlockPool


def chain_hash(parent: bytes | None, adapter_id: int, tokens: Sequence[int]) -> bytes:
    """sha256 over the parent key, the adapter id and the block's token ids (process independent)."""
    digest = hashlib.sha256()
    digest.update(parent or b"\x00" * 32)
    digest.update(int(adapter_id).to_bytes(8, "little", signed=True))
    for token in tokens:
        digest.update(int(token).to_bytes(4, "little", signed=True))
    return digest.digest()


@dataclass
class CachedBlock:
    """One cached full block: its KV block id, tokens, and the state at its end boundary."""

    key: bytes
    block_id: int
    adapter_id: int
    tokens: tuple[int, ...]
    gdn_state: GdnSnapshot | None  # None: no snapshot at this block (kept every gdn_snapshot_blocks blocks)
    hidden: torch.Tensor  # [block_size, D] target hidden rows (pre-norm) of the block's positions


class PrefixCache:
    """Chain-hashed map of cached blocks over a shared BlockPool (which counts the cache as a holder)."""

    def __init__(self, pool: BlockPool, block_size: int, enabled: bool = True) -> None:
        self.pool = pool
        self.block_size = block_size
        self.enabled = enabled  # False (``fxsched serve --no-enable-prefix-caching``): never a hit, nothing kept
        self._entries: OrderedDict[bytes, CachedBlock] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def keys_for(self, adapter_id: int, tokens: Sequence[int], num_blocks: int) -> list[bytes]:
        """Chain keys of the first num_blocks full blocks of `tokens`."""
        keys, parent, bs = [], None, self.block_size
        for i in range(num_blocks):
            parent = chain_hash(parent, adapter_id, tokens[i * bs:(i + 1) * bs])
            keys.append(parent)
        return keys

    def lookup(self, adapter_id: int, tokens: Sequence[int], max_blocks: int) -> list[CachedBlock]:
        """Longest cached chain (at most max_blocks) of full-block prefixes of `tokens`; marks it used."""
        hits: list[CachedBlock] = []
        if not self.enabled:
            return hits
        bs = self.block_size
        for i, key in enumerate(self.keys_for(adapter_id, tokens, min(max_blocks, len(tokens) // bs))):
            entry = self._entries.get(key)
            if entry is None or entry.tokens != tuple(tokens[i * bs:(i + 1) * bs]) or entry.adapter_id != adapter_id:
                break
            hits.append(entry)
        self._touch(hits)
        return hits

    def insert(self, entries: Sequence[CachedBlock]) -> int:
        """Insert a chain of new entries (parents first), taking a reference on each block.

        Entries whose key is already cached are skipped. Returns how many were inserted.
        """
        touched: list[CachedBlock] = []
        count = 0
        if not self.enabled:
            return count
        for entry in entries:
            existing = self._entries.get(entry.key)
            if existing is None:
                self.pool.incref(entry.block_id)
                self._entries[entry.key] = existing = entry
                count += 1
            touched.append(existing)
        self._touch(touched)
        return count

    def num_evictable(self) -> int:
        """Cached blocks held by no sequence (what `reclaim` could free)."""
        return sum(1 for e in self._entries.values() if self.pool.refcount(e.block_id) == 1)

    def reclaim(self, n: int) -> int:
        """Evict up to n unused entries (least recently used first), freeing their blocks; returns count."""
        victims = [k for k, e in self._entries.items() if self.pool.refcount(e.block_id) == 1][:max(n, 0)]
        for key in victims:
            self.pool.decref(self._entries.pop(key).block_id)
        return len(victims)

    def _touch(self, chain: Sequence[CachedBlock]) -> None:
        # Deepest block first, so parents end up more recently used than their children and are
        # evicted after them (an evicted parent would orphan its descendants).
        for entry in reversed(chain):
            self._entries.move_to_end(entry.key)
