"""HybridEngine's slot table: slots allocated and freed, a slot's committed state read, the block
pool's counts, and slots bound to LoRA adapters (specs/lora.md §18.1).

SlotTable also declares the engine's state (set by ``HybridEngine.__init__`` in engine.py, whose
module docstring states the invariants) for the mixins the engine is built from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from .config import ModelConfig
from .drafters import DFlashDrafter, MtpHead
from .errors import SlotError
from .gdn import GdnSnapshot, GdnStateCache
from .graphs import ForwardGraphs
from .hf_drafters import PublishedDFlash, PublishedMtp
from .lora import LoraPool
from .lora import load_adapter as read_adapter
from .model import HybridModel
from .paged_kv import BlockPool, PagedKVCache, blocks_for
from .prefix_cache import PrefixCache
from .slots import Captured, PendingRows, SlotState
from .transfers import send_ints


class SlotTable:
    """Slots, blocks and LoRA adapters of ``HybridEngine`` (which provides the rest)."""

    # the engine's state, set by HybridEngine.__init__
    cfg: ModelConfig
    device: torch.device
    model: HybridModel
    pool: BlockPool
    kv: PagedKVCache
    gdn: GdnStateCache
    forward_rows: int | None
    prefix: PrefixCache
    mtp: MtpHead | PublishedMtp | None
    dflash: DFlashDrafter | PublishedDFlash | None
    dflash_features: torch.Tensor | None
    _block_features: dict[int, torch.Tensor]
    keeps_hidden: bool
    hidden_history: torch.Tensor
    mtp_hidden: torch.Tensor
    _mtp_hidden_set: list[bool]
    _slots: list[SlotState | None]
    _pending: list[PendingRows | None]
    _captured: list[Captured | None]
    _captured_features: list[Captured | None]
    lora: LoraPool | None
    graphs: ForwardGraphs | None

    # ---- slots --------------------------------------------------------------------------------
    def _slot(self, slot: int) -> SlotState:
        if not 0 <= slot < self.cfg.max_slots:
            raise SlotError(f"slot {slot} out of range [0, {self.cfg.max_slots})")
        state = self._slots[slot]
        if state is None:
            raise SlotError(f"slot {slot} is not allocated")
        return state

    def is_allocated(self, slot: int) -> bool:
        """Whether `slot` currently holds a sequence (possibly empty)."""
        return 0 <= slot < self.cfg.max_slots and self._slots[slot] is not None

    def free_slots(self) -> list[int]:
        """Unallocated slots in increasing order."""
        return [s for s in range(self.cfg.max_slots) if self._slots[s] is None]

    def alloc(self, slot: int, adapter_id: int = 0, lora_slot: int = -1) -> None:
        """Make `slot` hold an empty sequence (seq_len 0, zero GDN state) for adapter `adapter_id`, or
        with lora_slot >= 0 for the LoRA adapter in that pool slot (its id: `bind_adapter`)."""
        if not 0 <= slot < self.cfg.max_slots:
            raise SlotError(f"slot {slot} out of range [0, {self.cfg.max_slots})")
        if self._slots[slot] is not None:
            raise SlotError(f"slot {slot} is already allocated")
        if lora_slot >= 0:
            adapter_id = self._lora_id(lora_slot)
        self._slots[slot] = SlotState(adapter_id=adapter_id, lora_slot=lora_slot)
        self._clear_slot_tensors(slot)

    # ---- LoRA adapters (specs/lora.md §18.1) ------------------------------------------------------
    def _lora_pool(self) -> LoraPool:
        if self.lora is None:
            raise SlotError("this engine has no LoRA pool (max_loras = 0)")
        return self.lora

    def _lora_id(self, lora_slot: int) -> int:
        pool = self._lora_pool()
        if not 0 <= lora_slot < pool.max_loras:
            raise SlotError(f"adapter slot {lora_slot} out of range [0, {pool.max_loras})")
        adapter_id = pool.adapter_id(lora_slot)
        if not adapter_id:
            raise SlotError(f"adapter slot {lora_slot} holds no adapter")
        return adapter_id

    def load_adapter(self, lora_slot: int, adapter_dir: str | Path) -> int:
        """Load the PEFT adapter in `adapter_dir` into pool slot `lora_slot` (AdapterError for a bad
        adapter, the slot unchanged); returns its id. SlotError while a sequence runs with the
        adapter the slot holds."""
        pool = self._lora_pool()
        if not 0 <= lora_slot < pool.max_loras:
            raise SlotError(f"adapter slot {lora_slot} out of range [0, {pool.max_loras})")
        self._check_unused(lora_slot)
        return pool.load(lora_slot, adapter_dir)

    def check_adapter(self, adapter_dir: str | Path) -> None:
        """Read and check the PEFT adapter in `adapter_dir` against this model and pool (AdapterError
        naming the file, §18.4) without loading it: the pool is unchanged."""
        pool = self._lora_pool()
        read_adapter(adapter_dir, self.cfg, pool.max_rank)

    def unload_adapter(self, lora_slot: int) -> None:
        """Empty pool slot `lora_slot` (SlotError while a sequence runs with its adapter)."""
        self._lora_id(lora_slot)
        self._check_unused(lora_slot)
        self._lora_pool().clear(lora_slot)

    def _check_unused(self, lora_slot: int) -> None:
        users = [s for s, state in enumerate(self._slots) if state is not None and state.lora_slot == lora_slot]
        if users:
            raise SlotError(f"adapter slot {lora_slot}: slots {users} run with its adapter")

    def bind_adapter(self, slot: int, lora_slot: int) -> int:
        """Make the sequence in `slot` run with the adapter in pool slot `lora_slot` (-1: the base
        model); returns the adapter id. A sequence that already holds tokens keeps its adapter id
        (its KV was computed with it): SlotError if the slot's adapter is another (a restored
        sequence whose adapter was replaced while it was spilled)."""
        state = self._slot(slot)
        adapter_id = self._lora_id(lora_slot) if lora_slot >= 0 else 0
        if (state.seq_len or state.block_table) and adapter_id != state.adapter_id:
            raise SlotError(f"slot {slot} holds {state.seq_len} tokens of adapter id {state.adapter_id}, "
                            f"cannot run them with adapter id {adapter_id} (adapter slot {lora_slot})")
        state.adapter_id, state.lora_slot = adapter_id, lora_slot
        return adapter_id

    def free(self, slot: int) -> None:
        """Release `slot`: drop its block references (cached blocks stay in the prefix cache)."""
        state = self._slot(slot)
        for block in state.block_table:
            self.pool.decref(block)
        self._slots[slot] = None
        self._clear_slot_tensors(slot)

    def _clear_slot_tensors(self, slot: int) -> None:
        self.gdn.reset(slot)
        if self.dflash is not None:
            self.dflash.reset(slot)
        if isinstance(self.mtp, PublishedMtp):
            self.mtp.reset(slot)
        self._mtp_hidden_set[slot] = False
        self._pending[slot] = None
        self._captured[slot] = None
        self._captured_features[slot] = None

    def seq_len(self, slot: int) -> int:
        """Committed length of the sequence in `slot`."""
        return self._slot(slot).seq_len

    def tokens(self, slot: int) -> list[int]:
        """Copy of the committed tokens of `slot` (len == seq_len)."""
        return list(self._slot(slot).tokens)

    def block_table(self, slot: int) -> list[int]:
        """Copy of the block table of `slot`."""
        return list(self._slot(slot).block_table)

    def cached_prompt_tokens(self, slot: int) -> int:
        """How many prompt tokens of the last `prefill` of `slot` were served from the prefix cache."""
        return self._slot(slot).cached_prompt_tokens

    def slot_state(self, slot: int) -> SlotState:
        """The live bookkeeping record of allocated `slot` (package-internal; do not mutate)."""
        return self._slot(slot)

    def gdn_state(self, slot: int) -> GdnSnapshot:
        """Copies of the committed GDN state of `slot`: per GDN layer (recurrent, conv)."""
        self._slot(slot)
        return self.gdn.snapshot(slot)

    def captured_hidden(self, slot: int) -> torch.Tensor:
        """Final hidden rows [rows, D] (pre-norm) of the last forward of `slot` (prefill: whole prompt)."""
        self._slot(slot)
        captured = self._captured[slot]
        if captured is None:
            raise SlotError(f"slot {slot} has no forward yet")
        return captured.rows()

    def captured_rows(self, slots: Sequence[int], rows: Sequence[int]) -> torch.Tensor:
        """Hidden row rows[i] of the last forward of slots[i], copied, [N, D]: one gather when every
        slot's rows come from the same batched forward."""
        for slot in slots:
            self._slot(slot)
        caps = [self._captured[slot] for slot in slots]
        first = caps[0] if caps else None
        if first is not None and first.b is not None:
            same = [c.b for c, r in zip(caps, rows, strict=True)
                    if c is not None and c.batched is first.batched and c.b is not None and 0 <= r < c.n]
            if len(same) == len(caps):
                b_t, row_t = send_ints([same, list(rows)], self.device)
                return first.batched[b_t, row_t]
        return torch.stack([self.captured_hidden(slot)[row] for slot, row in zip(slots, rows, strict=True)])

    def hidden_rows(self, slot: int, start: int, end: int) -> torch.Tensor:
        """The committed hidden rows [end - start, D] of `slot` (zeros where the engine keeps no
        history: nothing reads them then, and spill files and cache entries keep their shape)."""
        if self.keeps_hidden:
            return self.hidden_history[slot, start:end]
        return torch.zeros(end - start, self.cfg.hidden_size, device=self.device, dtype=self.hidden_history.dtype)

    # ---- blocks -------------------------------------------------------------------------------
    def num_free_blocks(self) -> int:
        """Blocks in the free pool (cached-but-unused blocks are not free until reclaimed)."""
        return self.pool.num_free()

    def num_cached_blocks(self) -> int:
        """Blocks held by the prefix cache."""
        return len(self.prefix)

    def num_evictable_blocks(self) -> int:
        """Cached blocks no sequence uses: the most `reclaim` can free."""
        return self.prefix.num_evictable()

    def blocks_needed(self, slot: int, num_rows: int) -> int:
        """New blocks a forward of num_rows rows on `slot` would allocate."""
        state = self._slot(slot)
        return max(0, blocks_for(state.seq_len + num_rows, self.cfg.block_size) - len(state.block_table))

    def reclaim(self, n: int) -> int:
        """Evict up to n unused prefix-cache blocks into the free pool; returns how many were freed."""
        return self.prefix.reclaim(n)
