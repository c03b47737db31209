"""The torch device's lifecycle: start-up, sequences (alloc, free, cache, compact, spill, restore,
truncate), adapters and EP words (a single rank), streams and teardown."""

from __future__ import annotations

import logging
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any, Mapping, Optional

import structlog
import torch

from fxsched.runtime.devices.device import DeviceError

from fxsched.runtime.devices.torch_book import DeviceBook, DeviceSeq, DeviceStateError

log = structlog.get_logger("fxsched.torch_device")


def fx_logger() -> Any:
    """A logger bound now for the device's fx lines (one per effect, hundreds per tick at a large
    batch), or None when debug events are filtered out, so a line costs one attribute test."""
    bound = log.bind()
    enabled = getattr(bound, "is_enabled_for", None)
    return bound if enabled is None or enabled(logging.DEBUG) else None


class Lifecycle(DeviceBook):
    """Sequences, streams and the device's end."""

    _fx_log: Any = None  # fx_logger(), set by TorchDevice
    _adapters: dict[str, Path]  # the LoRA registry: name -> PEFT adapter directory
    _lora_names: dict[int, str]  # LoRA pool slot -> the name of the adapter it holds
    _lora_used: dict[int, int]  # LoRA pool slot -> when it was last loaded, rotated to or acquired
    _lora_clock: int
    _spill_adapters: dict[int, int]  # spilled sequence -> the LoRA slot it ran with
    _admitting: Optional[int]  # the sequence allocated last, until it acquires its adapter slot

    def _lora_init(self, adapters: Optional[Mapping[str, str | Path]]) -> None:
        self._adapters = {str(name): Path(path) for name, path in (adapters or {}).items()}
        self._lora_names, self._lora_used, self._lora_clock = {}, {}, 0
        self._spill_adapters = {}
        self._admitting = None

    def bind_gpu_to_thread(self) -> None:
        if self.engine.device.type == "cuda":
            torch.cuda.set_device(self.engine.device)

    def create_stream(self) -> int:
        return self.streams.create_stream()

    def create_event(self) -> int:
        return self.streams.create_event()

    def num_free_blocks(self) -> int:
        return self.engine.num_free_blocks()

    def ssm_snapshot_occupancy(self) -> None:
        """Nothing to report (no snapshot ring); every first read of a pair marks a tick."""
        self._occupancy_reads += 1
        if self._occupancy_reads % 2 == 1:
            self.tick += 1
            self.on_tick(self.tick)

    def alloc_sequence(self, seq: int, session: int) -> int:
        if seq in self._seqs:
            raise DeviceStateError(f"sequence {seq} is already allocated (slot {self._seqs[seq].slot})")
        free = self.engine.free_slots()
        if not free:
            raise DeviceError(f"no free slot for sequence {seq}: all {self.cfg.max_slots} slots hold sequences")
        slot = free[0]
        with self._errors("alloc_sequence"):
            self.engine.alloc(slot)
        if self.grammars is not None:
            self.grammars.bind(seq, session)
        self._seqs[seq] = DeviceSeq(seq, session, slot)
        self._by_slot[slot] = seq
        self._admitting = seq  # until acquire_adapter_slot binds it (specs/scheduler.md §5.10 step 2)
        return slot

    def alloc_sequence_for(self, seq: int, session: int, budget: int) -> int:
        if budget > self.cfg.max_seq_len:
            log.debug("alloc_budget_over_context", seq=seq, budget=budget, max_seq_len=self.cfg.max_seq_len)
        return self.alloc_sequence(seq, session)

    def free_sequence(self, seq: int) -> None:
        s = self._seq(seq)
        with self._errors("free_sequence"):
            self.engine.free(s.slot)
        self._cached_by_session[s.session] = s.cached_tokens
        self._late.pop(seq, None)
        self._forget_ahead(seq)
        del self._by_slot[s.slot]
        del self._seqs[seq]
        if self._admitting == seq:
            self._admitting = None

    def cache_sequence(self, seq: int) -> None:
        s = self._seq(seq)
        self._settle(s, "cache_sequence")
        with self._errors("cache_sequence"):
            self.stats.cached_blocks += self.engine.cache_sequence(s.slot)

    def compact_sequence(self, seq: int, new_slot: int) -> None:
        s = self._seq(seq)
        if new_slot == s.slot:
            return
        if new_slot in self._by_slot:
            raise DeviceStateError(f"compact_sequence: slot {new_slot} still holds sequence {self._by_slot[new_slot]}")
        with self._errors("compact_sequence"):
            self.engine.compact(s.slot, new_slot)
        del self._by_slot[s.slot]
        s.slot = new_slot
        self._by_slot[new_slot] = seq

    def detach_slot_for_reuse(self, seq: int) -> None:
        """The engine keeps the sequence in its slot until it is moved or freed: nothing to do."""
        log.debug("detach_slot_for_reuse", seq=seq, slot=self._seq(seq).slot)

    def save_sequence_state(self, seq: int) -> None:
        """Spill the committed state of the sequence to a file of the device's spill directory."""
        s = self._seq(seq)
        self._settle(s, "save_sequence_state")
        if self._spill_dir is None:
            self._spill_dir = Path(tempfile.mkdtemp(prefix="fxsched-spill-"))
            # removed by close(), or when the device is collected or the process exits unclosed
            self._spill_cleanup = weakref.finalize(self, shutil.rmtree, self._spill_dir, True)
        path = self._spill_dir / f"seq-{seq}.spill"
        with self._errors(f"save_sequence_state(seq {seq}, {path})"):
            self.engine.save_sequence_state(s.slot, path)
        self._spills[seq] = path
        if s.adapter_slot >= 0:  # its adapter stays loaded until it comes back (specs/lora.md §18.5)
            self._spill_adapters[seq] = s.adapter_slot
        self.stats.spills += 1

    def restore_sequence_state(self, seq: int, blocks: int) -> None:
        """Load a spilled sequence into its freshly allocated (empty) slot, on fresh KV blocks."""
        s = self._seq(seq)
        path = self._spills.get(seq)
        if path is None:
            raise DeviceError(f"restore_sequence_state: sequence {seq} has no spilled state")
        self._make_room(blocks, "restore_sequence_state")
        with self._errors(f"restore_sequence_state(seq {seq}, {path})"):
            self.engine.restore_sequence_state(s.slot, path)
        del self._spills[seq]
        self._spill_adapters.pop(seq, None)
        path.unlink(missing_ok=True)
        held = len(self.engine.block_table(s.slot))
        if held != blocks:
            log.debug("restore_blocks", seq=seq, scheduler_blocks=blocks, engine_blocks=held)
        self.stats.restores += 1

    def reclaim_prefix_blocks(self, n: int) -> int:
        return self.engine.reclaim(n)

    def truncate_sequence(self, seq: int, seq_len: int) -> None:
        """The scheduler's rewind: drop pending rows beyond ``seq_len`` (they are never committed)."""
        s = self._seq(seq)
        committed = self.engine.seq_len(s.slot)
        rows = len(s.pending.tokens) if s.pending else 0
        if committed <= seq_len <= committed + rows:
            if s.pending is not None:
                s.pending.keep = seq_len - committed
            return
        if seq_len < committed:
            raise DeviceStateError(f"truncate_sequence: sequence {seq} would rewind committed tokens "
                                   f"({committed} -> {seq_len}); HybridEngine cannot rewind a committed state")
        raise DeviceStateError(f"truncate_sequence: sequence {seq} has {committed} committed + {rows} pending "
                               f"rows, cannot grow to {seq_len}")

    # ---- LoRA adapters (specs/lora.md §18.5) ----------------------------------------------------
    def adapter_id_for(self, slot: int) -> int:
        """0 for the base model (slot -1); the id of the adapter a LoRA slot holds; -1 for an
        empty or unknown slot."""
        if slot == -1:
            return 0
        pool = self.engine.lora
        if pool is None or not 0 <= slot < pool.max_loras:
            return -1
        return pool.adapter_id(slot) or -1

    def acquire_adapter_slot(self, slot: int) -> int:
        """Bind the sequence allocated last (the one being admitted, or swapped or resumed back in)
        to LoRA slot `slot` (-1: the base model): its rows run with that adapter from now on."""
        seq, self._admitting = self._admitting, None
        if seq is None or seq not in self._seqs:
            if slot == -1:
                return slot
            raise DeviceStateError(f"acquire_adapter_slot({slot}): no sequence was allocated since the last acquire")
        s = self._seqs[seq]
        with self._errors(f"acquire_adapter_slot({slot}) for sequence {seq}"):
            self.engine.bind_adapter(s.slot, slot)
        s.adapter_slot = slot
        if slot >= 0:
            self._touch_lora(slot)
        return slot

    def set_active_lora(self, name: str) -> None:
        """Rotation: make the registered adapter `name` loaded (a no-op but for its recency when it
        is), in the lowest empty LoRA slot, else in the least recently used slot no sequence (live
        or spilled) runs with."""
        pool = self.engine.lora
        if pool is None:
            raise DeviceError(f"LoRA adapter {name!r}: the torch model has no LoRA adapters")
        loaded = self.adapter_slot_of(name)
        if loaded >= 0:
            self._touch_lora(loaded)
            return
        path = self._adapters.get(name)
        if path is None:
            known = ", ".join(sorted(self._adapters)) or "none"
            raise DeviceError(f"LoRA adapter {name!r} is not registered (registered: {known})")
        slot = self._lora_victim([pool.adapter_id(s) for s in range(pool.max_loras)])
        with self._errors(f"set_active_lora({name!r})"):
            self.engine.load_adapter(slot, path)
        old = self._lora_names.pop(slot, None)
        if old is not None:
            log.info("lora_evicted", name=old, slot=slot)
        self._lora_names[slot] = name
        self._touch_lora(slot)
        log.info("lora_loaded", name=name, slot=slot, path=str(path))

    def adapter_slot_of(self, name: str) -> int:
        """The LoRA slot holding the registered adapter `name`, or -1 if it is not loaded."""
        return next((slot for slot, held in self._lora_names.items() if held == name), -1)

    def _touch_lora(self, slot: int) -> None:
        self._lora_clock += 1
        self._lora_used[slot] = self._lora_clock

    def _lora_victim(self, ids: list[int]) -> int:
        """The slot a new adapter goes to (`ids`: the id each slot holds, 0 when empty): the lowest
        empty one, else the least recently used one that no live or spilled sequence runs with
        (DeviceError when every slot is in use)."""
        count = len(ids)
        empty = [s for s in range(count) if not ids[s]]
        if empty:
            return empty[0]
        busy = {s.adapter_slot for s in self._seqs.values()} | set(self._spill_adapters.values())
        idle = [s for s in range(count) if s not in busy]
        if not idle:
            raise DeviceError(f"no LoRA slot to load into: all {count} slots hold adapters sequences run with")
        return min(idle, key=lambda s: self._lora_used.get(s, 0))

    # the EP words (several a tick): a debug line each, built only where debug events are on

    def ep_broadcast_cmd_for_seq(self, seq_slot: int, cmd: int) -> None:
        if self._fx_log is not None:
            self._fx_log.debug("ep_broadcast_cmd_for_seq", slot=seq_slot, cmd=hex(cmd))

    def ep_broadcast_cmd(self, cmd: int) -> None:
        if self._fx_log is not None:
            self._fx_log.debug("ep_broadcast_cmd", cmd=hex(cmd))

    def ep_broadcast_tokens(self, tokens) -> None:
        if self._fx_log is not None:
            self._fx_log.debug("ep_broadcast_tokens", n=len(tokens))

    def ep_sync_vision_embeds(self, n: int) -> None:
        if self._fx_log is not None:
            self._fx_log.debug("ep_sync_vision_embeds", n=n)

    def poll_innerq(self) -> None:
        pass

    def record_event(self, event: int, stream: int) -> None:
        with self._errors("record_event"):
            self.streams.record_event(event, stream)

    def stream_wait_event(self, stream: int, event: int) -> None:
        with self._errors("stream_wait_event"):
            self.streams.stream_wait_event(stream, event)

    def synchronize(self, stream: int) -> None:
        with self._errors("synchronize"):
            self.streams.synchronize(stream)

    def sync_secondary(self) -> None:
        self.streams.sync_secondary()

    def teardown(self) -> None:
        self.streams.synchronize_all()
        self.close()

    def release_all(self) -> None:
        """Free every sequence still on the device (after a failed run), so the engine's slots
        and blocks are usable again."""
        for seq in list(self._seqs):
            self.free_sequence(seq)

    def close(self) -> None:
        """Remove the spill directory (if the device made it)."""
        if self._spill_cleanup is not None and not self._closed:
            self._spill_cleanup()
        self._closed = True

    def note_fx(self, line: str) -> None:
        if self._fx_log is not None:
            self._fx_log.debug("fx", line=line)
