"""The recording device: the scripted fake model writing one trace line per call.

It answers every call from per-request token scripts (``ScriptedDevice``, specs/recording-device.md
§3.3), keeps just enough bookkeeping (slots, KV blocks, sequence lengths) for its answers and
free-block counts to be realistic, and never makes a decision: blocks grow without bound and a
released sequence can still be named. Spills go to real files, which a scenario may corrupt or
lose. The scheduler's interpreter writes its ``fx`` lines into the same list, so the three kinds
of recorded lines interleave in call order.
"""

from __future__ import annotations

from typing import Optional

import attrs

from fxsched.runtime.devices.device import DeviceError
from fxsched.runtime.devices.script_rules import Script, script_key
from fxsched.runtime.devices.scripted import ScriptedDevice
from fxsched.runtime.devices.scripted_book import ScriptedSequence
from fxsched.runtime.devices.spill_files import SpillError, SpillFiles



@attrs.frozen
class DeviceConfig:
    """The model configuration of a scenario (specs/scenarios.md §2.3)."""

    vocab: int = 64
    block_size: int = 16
    total_blocks: int = 1000
    held_blocks: int = 0
    reclaimable: int = 0
    has_proposer: bool = False
    dflash_gamma: Optional[int] = None
    has_self_speculative: bool = False
    supports_beam: bool = False
    has_ssm_layers: bool = False
    ring_slots: int = 0
    can_batch_verify: bool = True
    slot_draft_capacity: int = 8
    kv_exhaust_at: tuple[int, ...] = ()
    twophase_ok: bool = False
    device_token_feed: bool = True
    decode_fault_at: tuple[int, ...] = ()
    spill_corrupt_for: tuple[int, ...] = ()
    spill_missing_for: tuple[int, ...] = ()


class RecordingDevice(ScriptedDevice):
    """Implements the Device protocol from scripts; ``lines`` is the trace."""

    lines: list[str]

    def __init__(self, config: DeviceConfig, scripts: dict[int, Script],
                 cancel_flags: Optional[set[int]] = None):
        super().__init__(scripts, vocab=config.vocab, block_size=config.block_size,
                         total_blocks=config.total_blocks, held_blocks=config.held_blocks,
                         reclaimable=config.reclaimable, cancel_flags=cancel_flags or (),
                         kv_exhaust_at=config.kv_exhaust_at, decode_fault_at=config.decode_fault_at,
                         can_batch_verify=config.can_batch_verify, slot_draft_capacity=config.slot_draft_capacity,
                         lines=[])
        self.config = config
        self.spill = SpillFiles()

    def _seq(self, seq_id: int) -> ScriptedSequence:
        try:
            return self.sequences[seq_id]
        except KeyError:
            raise DeviceError(f"unknown sequence {seq_id}") from None

    def _grow_to(self, seq: ScriptedSequence, seq_len: int) -> None:
        need = self._need(seq_len)
        if need > seq.blocks:
            self.used_blocks += need - seq.blocks
            seq.blocks = need

    def free_count(self) -> int:
        return max(super().free_count(), 0)

    def save_sequence_state(self, seq: int) -> None:
        """Spill the sequence to a file; the scenario may corrupt or lose it afterwards."""
        s = self._seq(seq)
        self.lines.append(f"save_sequence_state({s.sid}, blocks={s.blocks})")
        path = self.spill.path_for(seq)
        self.spill.write(seq, {"session": s.session, "tokens": list(s.tokens), "seq_len": s.seq_len,
                               "blocks": s.blocks})
        request = script_key(s.session, s.tokens)
        if request in self.config.spill_corrupt_for:
            data = bytearray(path.read_bytes())
            data[-2] ^= 0xFF
            path.write_bytes(bytes(data))
        if request in self.config.spill_missing_for:
            path.unlink()

    def restore_sequence_state(self, seq: int, blocks: int) -> None:
        """Read the spill file back and check it; the session number is not restored."""
        s = self._seq(seq)
        head = f"restore_sequence_state({s.sid}, blocks={blocks})"
        try:
            saved = self.spill.read(seq)
        except SpillError as err:
            self.lines.append(f"{head} -> ERR {err}")
            raise DeviceError(str(err)) from None
        self.lines.append(head)
        s.tokens = list(saved["tokens"])
        s.seq_len = saved["seq_len"]
        s.blocks = blocks
        self.used_blocks += blocks

    def teardown(self) -> None:
        super().teardown()
        self.spill.close()
