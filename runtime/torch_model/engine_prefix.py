"""HybridEngine's prefix cache: a prompt prefilled from cached blocks (`prefill`: `attach_prefix`,
then the rest committed, then `capture_prompt`), and a sequence's full blocks, with their GDN
snapshots, hidden rows and drafter features, cached for later prompts (`cache_sequence`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .engine_commit import CommitPath
from .errors import OutOfBlocksError, SlotError
from .paged_kv import blocks_for
from .prefix_cache import CachedBlock
from .slots import Captured


class PrefixCaching(CommitPath):
    """The prefix cache of ``HybridEngine`` (which provides the rest)."""

    # ---- prefix cache -------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, slot: int, tokens: Sequence[int]) -> torch.Tensor:
        """Prefill an empty slot with a prompt, reusing prefix-cache blocks; returns last-row logits [V].

        At most (len(tokens) - 1) // block_size full blocks are reused, so at least one token is
        recomputed; `cached_prompt_tokens(slot)` reports how many were reused. Afterwards
        captured_hidden(slot) covers the whole prompt (cached rows included).
        """
        cached = self.attach_prefix(slot, tokens)
        logits = self.prefill_chunk(slot, tokens[cached:], cached)
        self.capture_prompt(slot, len(tokens))
        return logits

    def attach_prefix(self, slot: int, tokens: Sequence[int]) -> int:
        """Start an empty slot's prompt `tokens` from the prefix cache: the deepest run of cached
        full blocks that ends at a GDN snapshot (at most (len(tokens) - 1) // block_size, so one
        token at least is left to compute) becomes the slot's first blocks, with their GDN state,
        hidden rows and drafter features; returns the tokens attached (0 on a miss). The caller
        then commits tokens[returned:] (one slot alone, or beside other slots' rows in a batched
        forward) and calls `capture_prompt`."""
        state = self._slot(slot)
        if state.seq_len or state.block_table:
            raise SlotError(f"slot {slot}: prefill needs an empty slot (seq_len={state.seq_len}); use prefill_chunk")
        self._check_rows(slot, 0, tokens)
        bs = self.cfg.block_size
        hits = self.prefix.lookup(state.adapter_id, tokens, (len(tokens) - 1) // bs)
        if self.dflash_features is not None:  # a cached block is usable only with its context features
            hits = hits[:next((i for i, e in enumerate(hits) if e.block_id not in self._block_features), len(hits))]
        # resume from the deepest hit with a GDN snapshot (cache_sequence keeps them every few blocks)
        hits = hits[:next((i + 1 for i in range(len(hits) - 1, -1, -1) if hits[i].gdn_state is not None), 0)]
        need = blocks_for(len(tokens), bs) - len(hits)
        if need > self.pool.num_free():
            raise OutOfBlocksError(f"prefill of {len(tokens)} tokens needs {need} new KV blocks, "
                                   f"only {self.pool.num_free()} free")
        cached = len(hits) * bs
        for i, entry in enumerate(hits):
            self.pool.incref(entry.block_id)
            state.block_table.append(entry.block_id)
            if entry.gdn_state is not None:
                state.boundary_states[i + 1] = entry.gdn_state
            if self.keeps_hidden:
                self.hidden_history[slot, i * bs:(i + 1) * bs] = entry.hidden
            if self.dflash_features is not None:
                self.dflash_features[slot, i * bs:(i + 1) * bs] = self._block_features[entry.block_id]
        if hits:
            resume = hits[-1].gdn_state
            assert resume is not None  # the hits end at a snapshotted block
            self.gdn.load(slot, resume)
            state.tokens = [int(t) for t in tokens[:cached]]
            state.seq_len = cached
        state.cached_prompt_tokens = cached
        return cached

    def capture_prompt(self, slot: int, n: int) -> int:
        """After a prompt's first `n` tokens are committed (some from the prefix cache): the slot's
        captured rows become all `n` (cached rows included) where hidden rows or drafter features
        are kept. Returns the index of the last row in the slot's captured rows."""
        if self.keeps_hidden:  # the whole prompt's rows, cached ones included (MTP reads the last)
            self._captured[slot] = Captured(self.hidden_history[slot, :n].clone())
        if self.dflash_features is not None:
            self._captured_features[slot] = Captured(self.dflash_features[slot, :n].clone())
        captured = self._captured[slot]
        return captured.rows().shape[0] - 1 if captured is not None else n - 1

    def cache_sequence(self, slot: int) -> int:
        """Insert the slot's full committed blocks (with boundary GDN states) into the prefix cache.

        Blocks up to the last one whose boundary has a snapshot (ModelConfig.gdn_snapshot_blocks: a
        hit resumes from the deepest snapshotted block), the others with no state of their own.
        Returns how many blocks were newly cached.
        """
        state = self._slot(slot)
        if not self.prefix.enabled:  # nothing is cached: no keys to hash, no rows to copy
            return 0
        bs = self.cfg.block_size
        full = state.seq_len // bs
        last = max((k for k in state.boundary_states if k <= full), default=0)
        keys = self.prefix.keys_for(state.adapter_id, state.tokens, last)
        entries = []
        for i, key in enumerate(keys):
            snapshot = state.boundary_states.get(i + 1)
            entries.append(CachedBlock(key, state.block_table[i], state.adapter_id,
                                       tuple(state.tokens[i * bs:(i + 1) * bs]), snapshot,
                                       self.hidden_rows(slot, i * bs, (i + 1) * bs).clone()))
            if self.dflash_features is not None:  # side table: prefill reuses a block with its features
                self._block_features[state.block_table[i]] = self.dflash_features[slot, i * bs:(i + 1) * bs].clone()
        return self.prefix.insert(entries)
