"""The simulated device's sequences beyond their forwards: ``SimSequences``, the layer of
``simulated.SimDevice`` that allocates, frees, compacts and truncates sequences (the slot and
adapter-slot ledgers, specs/checker.md §11.8), spills and restores them (``spill_corrupt_for``
damages a file, ``spill_missing_for`` loses it), keeps the prefix cache and the SSM snapshot ring
(specs/watchdog.md §7.4, §7.5), and answers the adapter ids.

Prefix cache (``prefix_cache``): ``cache_sequence`` remembers the body of the sequence's prompt
(every token after the first, which is the request id); a later first prefill whose body shares
whole blocks with a remembered one reports those tokens as cached (``cached[request id]``): a
prefill or prefill chunk of one sequence in its answer's one count, a batched or mixed forward as
(sequence id, tokens) of each first chunk that found any (specs/scheduler.md §5.10), as the torch
device does. The
``reclaimable`` blocks are part of ``held_blocks``: a reclaim moves them to the free pool.
Adapters: ``adapters`` maps an adapter slot to its id (slot -1, the base model, is id 0).
"""

from __future__ import annotations

from fxsched.runtime.devices.device import DeviceError
from fxsched.runtime.devices.ledger import ADAPTER, SLOT, SPILL
from fxsched.runtime.devices.scripted_book import ScriptedSequence
from fxsched.runtime.devices.sim_base import SimBase


class SimSequences(SimBase):
    """Allocation, slots, spills, the prefix cache, the SSM snapshot ring and adapters of ``SimDevice``."""

    # --- allocation, slots, adapters --------------------------------------------------------------------

    def _alloc(self, seq: int, session: int) -> int:
        if seq in self.live:
            raise self._bad("alloc_sequence", f"sequence {seq} is already allocated")
        self.epoch += 1
        slot = super()._alloc(seq, session)
        self._refuse("alloc_sequence", self.ledger.acquire(SLOT, slot, seq))
        self.freed_slots.discard(slot)
        self.awaiting_adapter = seq
        return slot

    def acquire_adapter_slot(self, slot: int) -> int:
        """The adapter slot of the sequence allocated last (specs/scheduler.md §5.10 step 2), once."""
        seq = self.awaiting_adapter
        if seq is None:
            raise self._bad("acquire_adapter_slot", f"adapter slot {slot}, but no sequence was allocated since the "
                                                    f"last acquire")
        self.awaiting_adapter = None
        want = self.adapter_of.get(self._rid(self.live[seq]))
        if want is not None and want != slot:
            raise self._bad("acquire_adapter_slot", f"adapter slot {slot} for sequence {seq}, whose request asked "
                                                    f"for {want}")
        self._refuse("acquire_adapter_slot", self.ledger.acquire(ADAPTER, seq, slot))
        return super().acquire_adapter_slot(slot)

    def compact_sequence(self, seq: int, new_slot: int) -> None:
        s = self._seq(seq)
        if new_slot != s.slot and any(o.slot == new_slot for o in self.live.values() if o is not s):
            raise DeviceError(f"compaction target slot {new_slot} is held by another sequence")
        if new_slot != s.slot:
            self._refuse("compact_sequence", self.ledger.release(SLOT, s.slot))
            self._refuse("compact_sequence", self.ledger.acquire(SLOT, new_slot, seq))
        self.epoch += 1
        super().compact_sequence(seq, new_slot)

    def free_sequence(self, seq: int) -> None:
        slot = self._seq(seq).slot
        self._ctx_committed("free_sequence", seq)
        self.prompted.discard(seq)
        self.epoch += 1
        super().free_sequence(seq)
        self._refuse("free_sequence", self.ledger.release(SLOT, slot))
        self.ledger.accounts[ADAPTER].pop(seq, None)  # (none when it failed before its acquire)
        self.freed_slots.add(slot)
        self.last_freed = slot
        if self.awaiting_adapter == seq:
            self.awaiting_adapter = None
        self.verified.pop(seq, None)
        for held in (self.verify_io, self.proposed, self.proposed_at, self.last_forward, self.checkpoint_due,
                     self.verified_tick):
            held.pop(seq, None)
        self.late.discard(seq)
        for drawn in (self.late_failed, self.drawn_short, self.drawn_late, self.kept, self.kept_failed,
                      self.fed_kept):
            drawn.pop(seq, None)

    def truncate_sequence(self, seq: int, seq_len: int) -> None:
        s = self._seq(seq)
        if not 0 <= seq_len <= s.seq_len:
            raise self._bad("truncate_sequence", f"to {seq_len} tokens, sequence {seq} holds {s.seq_len}")
        super().truncate_sequence(seq, seq_len)

    def adapter_id_for(self, slot: int) -> int:
        return self.adapters.get(slot, -1)

    # --- spill files ---------------------------------------------------------------------------------

    def save_sequence_state(self, seq: int) -> None:
        s = self._seq(seq)
        self._script(s)
        self._refuse("save_sequence_state", self.ledger.acquire(SPILL, seq, s.request_id))
        self.spill_owner[seq] = s.request_id
        if s.request_id in self.spill_missing_for:
            return
        self.spilled[seq] = {"tokens": list(s.tokens), "seq_len": s.seq_len, "blocks": s.blocks,
                             "corrupt": s.request_id in self.spill_corrupt_for, "prompted": seq in self.prompted}

    def restore_sequence_state(self, seq: int, blocks: int) -> None:
        s = self._seq(seq)
        if s.seq_len or s.blocks:
            raise self._bad("restore_sequence_state", f"into sequence {seq}, which holds {s.seq_len} tokens")
        saved = self.spilled.pop(seq, None)
        self._refuse("restore_sequence_state", self.ledger.release(SPILL, seq))
        if saved is None:
            self.blamed = frozenset((self.spill_owner.get(seq, 0),))
            raise DeviceError(f"spill file for sequence {seq} is missing")
        self.blamed = frozenset((saved["tokens"][0] if saved["tokens"] else 0,))
        if saved["corrupt"]:
            raise DeviceError(f"spill file for sequence {seq} is corrupted (checksum mismatch)")
        if blocks > self.free_count():
            raise DeviceError("out of KV blocks")
        if blocks != saved["blocks"]:
            raise self._bad("restore_sequence_state", f"blocks={blocks}, the sequence held {saved['blocks']}")
        self.blamed = None
        if saved["prompted"]:
            self.prompted.add(seq)
        s.tokens = saved["tokens"]
        s.seq_len = saved["seq_len"]
        s.blocks = blocks
        self.used_blocks += blocks
        self.epoch += 1

    # --- the prefix cache ------------------------------------------------------------------------------

    def cache_sequence(self, seq: int) -> None:
        s = self._seq(seq)
        if self.prefix_cache and len(s.tokens) > 1:
            self.cached_bodies.append(tuple(s.tokens[1:]))
            del self.cached_bodies[:-4]
        super().cache_sequence(seq)

    def reclaim_prefix_blocks(self, n: int) -> int:
        if n < 1:
            raise self._bad("reclaim_prefix_blocks", f"n={n}")
        got = min(n, self.reclaimable)
        self.reclaimable -= got
        self.held_blocks -= got
        self.epoch += 1
        return got

    def _first_prefill(self, s: ScriptedSequence, prompt) -> int:
        """The prefix-cache hit a first prefill reports (0 when the cache is off or misses)."""
        rid = self._rid(s)
        if rid in self.prefilled:
            return 0
        self.prefilled.add(rid)
        if not self.prefix_cache:
            return 0
        body = tuple(prompt[1:])
        best = 0
        for cached in self.cached_bodies:
            n = 0
            for a, b in zip(body, cached, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        hit = (best // self.block_size) * self.block_size
        if hit:
            self.cached[rid] = hit
        return hit

    # --- the SSM snapshot ring (specs/watchdog.md §7.4, §7.5) ------------------------------------------

    def save_decode_ssm_snapshot(self, seq: int, ring: int) -> None:
        """A save goes to the ring's cursor, then the cursor moves on (mod ``ring_slots``); the
        entry's position is the output length, the new token included (the KV holds it but that
        token)."""
        s = self._seq(seq)
        if self.ring_slots:
            entries, cursor = self.rings.get(self._rid(s), ({}, 0))
            if ring != cursor:
                raise self._bad("save_decode_ssm_snapshot", f"ring slot {ring} for sequence {seq}, the cursor is "
                                                            f"at {cursor} of {self.ring_slots}")
            entries = dict(entries)
            entries[ring] = s.seq_len - self._script(s).prompt_len + 1
            self.rings[self._rid(s)] = (entries, (cursor + 1) % self.ring_slots)
        super().save_decode_ssm_snapshot(seq, ring)

    def restore_decode_ssm_snapshot(self, seq: int, ring: int) -> None:
        """A restore names a slot holding an entry; the ring then keeps the entries up to its
        position and the cursor follows the kept entry of the largest position."""
        s = self._seq(seq)
        if self.ring_slots:
            entries, _ = self.rings.get(self._rid(s), ({}, 0))
            if ring not in entries:
                raise self._bad("restore_decode_ssm_snapshot", f"ring slot {ring} of sequence {seq} holds nothing "
                                                               f"(the ring holds {entries})")
            at = entries[ring]
            kept = {slot: pos for slot, pos in entries.items() if pos <= at}
            top = max(kept, key=lambda slot: kept[slot])
            self.rings[self._rid(s)] = (kept, (top + 1) % self.ring_slots)
        super().restore_decode_ssm_snapshot(seq, ring)

    def _ring_reset(self, s: ScriptedSequence) -> None:
        """A prompt written from its start (a first prefill or a requeue resume): an empty ring."""
        self.rings[self._rid(s)] = ({}, 0)
