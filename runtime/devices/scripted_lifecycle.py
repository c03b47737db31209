"""The scripted device's lifecycle calls (specs/recording-device.md §3.8.1, §3.8.2, §3.8.8):
start-up and the occupancy tick, sequences and their slots, adapters, the EP command words,
streams and teardown, each recorded as one trace line."""

from __future__ import annotations

from fxsched.runtime.devices.scripted_book import ScriptedBook, ScriptedSequence


class ScriptedLifecycle(ScriptedBook):
    """Start-up, sequences, adapters, EP words, streams and teardown of ``ScriptedDevice``."""

    # --- start-up and snapshot ----------------------------------------------------------------------

    def bind_gpu_to_thread(self) -> None:
        if self.lines is not None:
            self.lines.append("bind_gpu_to_thread()")

    def create_stream(self) -> int:
        if self.lines is not None:
            self.lines.append("create_stream() -> 1")
        return 1

    def create_event(self) -> int:
        if self.lines is not None:
            self.lines.append("create_event() -> 2")
        return 2

    def num_free_blocks(self) -> int:
        count = self.free_count()
        if self.lines is not None:
            self.lines.append(f"num_free_blocks() -> {count}")
        return count

    def ssm_snapshot_occupancy(self) -> None:
        self.occupancy_reads += 1
        if self.occupancy_reads % 2 == 1:
            self.tick += 1
            if self.lines is not None:
                self.lines.append(f"-- tick {self.tick}")
            self.on_tick(self.tick)

    # --- sequences ----------------------------------------------------------------------------------

    def _alloc(self, seq: int, session: int) -> int:
        slot = self._allocate_slot()
        s = ScriptedSequence(seq, session, slot)
        self.sequences[seq] = s
        self.live[seq] = s
        return slot

    def alloc_sequence(self, seq: int, session: int) -> int:
        slot = self._alloc(seq, session)
        if self.lines is not None:
            self.lines.append(f"alloc_sequence() -> slot {slot}")
        return slot

    def alloc_sequence_for(self, seq: int, session: int, budget: int) -> int:
        slot = self._alloc(seq, session)
        if self.lines is not None:
            self.lines.append(f"alloc_sequence_for(budget={budget}) -> slot {slot}")
        return slot

    def free_sequence(self, seq: int) -> None:
        s = self._seq(seq)
        if self.lines is not None:
            self.lines.append(f"free_sequence({s.sid}, blocks={s.blocks})")
        self.used_blocks -= s.blocks
        s.blocks = 0
        self.live.pop(seq, None)
        self._release_slot(s.slot)

    def cache_sequence(self, seq: int) -> None:
        s = self._seq(seq)
        if self.lines is not None:
            self.lines.append(f"cache_sequence({s.sid})")

    def compact_sequence(self, seq: int, new_slot: int) -> None:
        s = self._seq(seq)
        if self.lines is not None:
            self.lines.append(f"compact_sequence({s.sid}, new_slot={new_slot})")
        if new_slot != s.slot:
            if new_slot in self.free_slots:
                self.free_slots.remove(new_slot)
            self._release_slot(s.slot)
            s.slot = new_slot

    def detach_slot_for_reuse(self, seq: int) -> None:
        s = self._seq(seq)
        if self.lines is not None:
            self.lines.append(f"detach_slot_for_reuse({s.sid})")

    def reclaim_prefix_blocks(self, n: int) -> int:
        got = min(n, self.reclaimable)
        self.reclaimable -= got
        self.used_blocks = max(self.used_blocks - got, 0)
        if self.lines is not None:
            self.lines.append(f"reclaim_prefix_blocks({n}) -> {got}")
        return got

    def truncate_sequence(self, seq: int, seq_len: int) -> None:
        s = self._seq(seq)
        s.seq_len = seq_len
        del s.tokens[seq_len:]

    # --- adapters, EP, streams ----------------------------------------------------------------------

    def adapter_id_for(self, slot: int) -> int:
        if self.lines is not None:
            self.lines.append(f"adapter_id_for({slot})")
        return 0 if slot == -1 else -1  # only the active adapter (slot -1) is loaded

    def acquire_adapter_slot(self, slot: int) -> int:
        if self.lines is not None:
            self.lines.append(f"acquire_adapter_slot({slot})")
        return slot

    def set_active_lora(self, name: str) -> None:
        if self.lines is not None:
            self.lines.append(f"set_active_lora({name})")

    def ep_broadcast_cmd_for_seq(self, seq_slot: int, cmd: int) -> None:
        if self.lines is not None:
            self.lines.append(f"ep_broadcast_cmd_for_seq(seq={seq_slot}, cmd={cmd:#x})")

    def ep_broadcast_cmd(self, cmd: int) -> None:
        if self.lines is not None:
            self.lines.append(f"ep_broadcast_cmd({cmd:#x})")

    def ep_broadcast_tokens(self, tokens) -> None:
        if self.lines is not None:
            self.lines.append(f"ep_broadcast_tokens(n={len(tokens)})")

    def ep_sync_vision_embeds(self, n: int) -> None:
        if self.lines is not None:
            self.lines.append(f"ep_sync_vision_embeds(n={n})")

    def poll_innerq(self) -> None:
        if self.lines is not None:
            self.lines.append("poll_innerq()")

    def record_event(self, event: int, stream: int) -> None:
        if self.lines is not None:
            self.lines.append(f"record_event(event={event}, stream={stream})")

    def stream_wait_event(self, stream: int, event: int) -> None:
        if self.lines is not None:
            self.lines.append(f"stream_wait_event(stream={stream}, event={event})")

    def synchronize(self, stream: int) -> None:
        if self.lines is not None:
            self.lines.append(f"synchronize(stream={stream})")

    def sync_secondary(self) -> None:
        if self.lines is not None:
            self.lines.append("sync_secondary()")

    def teardown(self) -> None:
        if self.lines is not None:
            self.lines.append("teardown()")
        self.torn_down = True
