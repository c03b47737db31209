"""The simulated device of the model checker: the scripted model of the recording device, fast
and silent, with a finite block pool, injected faults, and a check of every call's arguments.

It answers every call by the same rules as the recording device (``ScriptedDevice``), keeps a
strict block pool (growing past it is KV exhaustion on a decode and a fault elsewhere), refuses
calls on sequences that are not allocated, and can fail scheduled calls. It records no trace; it
keeps what the invariants need: the pool, the slots, each sequence's KV length, the drafts it saw
accepted and the longest KV written per request, the prefix-cache hits it reported, and whom the last failed call blamed.

The bookkeeping that judges every call (the pool, the prompt writes, plain decodes and decodes
answered ahead, the EP words, the ledgers, sampled rows) is the base class's,
``sim_base.SimBase``; its docstring lists the checks. This module adds the verifies, proposals and
hidden rows, the SSM snapshot ring, slots, spill files, the prefix cache and adapters.

Sampled rows: the device offers ``sample_rows``, so the interpreter asks it for a sampled row's
token instead of copying the row to the host; it answers what the host copy would give, by the same
``sampling.host_pick`` over the same row (30.0 at the scripted answer, 0.0 elsewhere), memoised per
(answer, pick), with the row's weights memoised apart from the seed: the walk's seeds and answers
repeat, and a pick is its costliest call. (The
recording device keeps the host copy: its reference traces list ``copy_logits_to_host``.)

What a real device varies (the recording device never does, so the goldens stay as they are):
``short_proposals`` (a seed) cuts now and then a proposal's drafts short, to none sometimes;
``late_drafts`` (a seed) answers now and then a proposal with ``LATE_DRAFT`` placeholders, as the
torch device does (specs/async.md §16.3), and fills them in at the verify that consumes them; now
and then (``LATE_FAILURE_CHANCE`` of the late ones) such a proposal fails after its answer went
out, and the verify that consumes its drafts answers that failure;
``keep_decodes`` (a seed) keeps a plain decode's tokens on the device when its plan allows it
(``keep_ahead``: the decode is answered ahead, specs/async.md §16.6), feeds them to the next decode
(``LATE_TOKEN`` inputs) and gives them back at ``read_ahead``; now and then
(``AHEAD_FAILURE_CHANCE`` of the decodes kept) such a decode fails after its answer went out, and
the read of its tokens answers that failure;
``capacities`` are the answers of ``mtp_slot_draft_capacity`` in turn (0 included); a
self-speculative draft decode is wrong at the script's ``draft_wrong_every`` positions. The device
keeps for the invariants the drafts it proposed (``proposed``, ``proposed_at``), the capacities it
answered (``capacity_log``) and the last batched verify's sequences (``batch_seqs``).

"""

from __future__ import annotations

from typing import Optional

from fxsched.core.events import LATE_DRAFT
from fxsched.runtime.devices.device import DeviceError
from fxsched.runtime.devices.ledger import ADAPTER, SLOT, SPILL
from fxsched.runtime.devices.scripted import script_verify
from fxsched.runtime.devices.sim_base import (AHEAD_FAILURE, AHEAD_FAILURE_CHANCE, ArgumentError, Picked,
                                              SimBase, _agreed)

LATE_FAILURE = "the late proposal"  # how the fault of a verify whose late proposal failed begins its reason
LATE_FAILURE_CHANCE = 0.05  # of the proposals answered late


__all__ = ["AHEAD_FAILURE", "AHEAD_FAILURE_CHANCE", "ArgumentError", "LATE_FAILURE", "LATE_FAILURE_CHANCE",
           "Picked", "SimDevice"]


class SimDevice(SimBase):
    """Implements the Device protocol for the random walk and the hypothesis machine."""

    # --- verifies and what they leave to commit -------------------------------------------------------

    WIDTHS = {"decode_verify_graphed": 2, "decode_verify_graphed_k3": 3, "decode_verify_graphed_k4": 4,
              "decode_and_verify_fused": 4}
    """The verifies of a fixed width (anchor + drafts)."""

    def _check_drafts(self, call: str, seq: int, tokens) -> None:
        """A verify after a proposal feeds the anchor then a prefix of the drafts that proposal
        returned (specs/speculation.md §6.5: keep ≤ the drafts held; the surplus is dropped)."""
        drafts = self.proposed.pop(seq, None)
        at = self.proposed_at.pop(seq, None)
        self.verify_tick = self.tick
        if self.strict_drafts:
            if self.verified_tick.get(seq) == self.tick:
                raise self._bad(call, f"sequence {seq} verified twice in tick {self.tick}")
            if at == self.tick and not self.dflash:  # an MTP bootstrap is verified from the next step on
                raise self._bad(call, f"sequence {seq} verifies the drafts proposed in this step (tick {self.tick})")
        self.verified_tick[seq] = self.tick
        self.last_forward[seq] = call
        self.hidden_saved = False
        if drafts is None:
            if self.strict_drafts and len(tokens) > 1:
                raise self._bad(call, f"inputs {list(tokens)} for sequence {seq}, which has no proposal since its "
                                      f"allocation or last verify")
        elif list(tokens[1:]) != drafts[:len(tokens) - 1]:
            raise self._bad(call, f"inputs {list(tokens)} for sequence {seq}, whose proposal was {drafts}")

    def serial_verify(self, name: str, seq: int, tokens) -> list[int]:
        s = self._seq(seq)
        width = self.WIDTHS.get(name)
        if width is not None and len(tokens) != width:
            raise self._bad(name, f"{len(tokens)} tokens for a width-{width} verify")
        if name == "decode_verify_dflash" and len(tokens) < 5:  # keep >= 4 (specs/speculation.md §6.5)
            raise self._bad(name, f"a block verify of {len(tokens) - 1} drafts (four or more take it)")
        self._adapted(name, (seq,))
        self._runs(name, verifies=((seq, tokens),))  # the EP words announced the inputs as the query holds them
        tokens = self._resolve(name, seq, tokens)
        if name != "decode_verify":
            self._check_drafts(name, seq, tokens)
        self.blamed = frozenset((self._rid(s),))
        self.verified[seq] = (len(tokens), s.seq_len)
        rows = super().serial_verify(name, seq, tokens)
        self.verify_io[seq] = (tuple(tokens), tuple(rows))
        self.verify_order = ((seq, name != "decode_verify"),)
        self.blamed = None
        return rows

    def _accepted(self, seq: int) -> Optional[int]:
        """The drafts the last verify of ``seq`` accepted, from its own inputs and rows (None: no
        verify since the last plain decode)."""
        io = self.verify_io.get(seq)
        return None if io is None else _agreed(*io)

    def decode_verify_batched(self, tokens, ks, seqs, stream: int, woa: bool) -> list[int]:
        if len(set(seqs)) != len(seqs) or len(ks) != len(seqs) or sum(ks) != len(tokens):
            raise self._bad("decode_verify_batched", f"ks={list(ks)} seqs={list(seqs)} for {len(tokens)} tokens")
        self._adapted("decode_verify_batched", seqs)
        self._blame(seqs)
        verifies, offset = [], 0
        for k, seq_id in zip(ks, seqs, strict=True):
            verifies.append((seq_id, tokens[offset:offset + k]))
            offset += k
        self._runs("decode_verify_batched", verifies=tuple(verifies))
        tokens = tuple(t for seq_id, run in verifies for t in self._resolve("decode_verify_batched", seq_id, run))
        offset = 0
        for k, seq_id in zip(ks, seqs, strict=True):
            self.verified[seq_id] = (k, self._seq(seq_id).seq_len)
            self._check_drafts("decode_verify_batched", seq_id, tokens[offset:offset + k])
            offset += k
        rows = super().decode_verify_batched(tokens, ks, seqs, stream, woa)
        offset = 0
        for k, seq_id in zip(ks, seqs, strict=True):
            self.verify_io[seq_id] = (tuple(tokens[offset:offset + k]), tuple(rows[offset:offset + k]))
            offset += k
        self.batch_seqs = tuple(seqs)
        self.verify_order = tuple((seq_id, True) for seq_id in seqs)
        self.blamed = None
        return rows

    def _verified(self, call: str, seq: int) -> tuple[int, int]:
        self._seq(seq)
        got = self.verified.get(seq)
        if got is None:
            raise self._bad(call, f"sequence {seq} has no verify to commit")
        return got

    def commit_accepted_prefix(self, seq: int, na: int, k: int) -> None:
        rows, _ = self._verified("commit_accepted_prefix", seq)
        if not 0 <= na <= min(k, rows):
            raise self._bad("commit_accepted_prefix", f"na={na}, k={k} for sequence {seq}, whose verify had {rows} rows")
        accepted = self._accepted(seq)
        if accepted is not None and na != accepted + 1:
            raise self._bad("commit_accepted_prefix", f"na={na} for sequence {seq}, whose verify accepted {accepted} "
                                                      f"drafts (commit accepted + 1)")
        super().commit_accepted_prefix(seq, na, k)

    def commit_ctx(self, seq: int, n: int, base: int, row: int) -> None:
        rows, before = self._verified("commit_ctx", seq)
        if not 1 <= n <= rows or base != before:
            raise self._bad("commit_ctx", f"n={n}, base={base} for sequence {seq}, whose verify had {rows} rows "
                                          f"from {before}")
        super().commit_ctx(seq, n, base, row)

    def trim_proposer_state(self, seq: int, na: int, stream: int) -> None:
        rows, _ = self._verified("trim_proposer_state", seq)
        if not 0 <= na <= rows:
            raise self._bad("trim_proposer_state", f"na={na} for sequence {seq}, whose verify had {rows} rows")
        super().trim_proposer_state(seq, na, stream)

    def gdn_fold_accepted(self, slots, accepted, k: int) -> bool:
        live = {s.slot for s in self.live.values()}
        if (len(slots) != len(accepted) or len(set(slots)) != len(slots) or not set(slots) <= live
                or any(not 1 <= a <= k for a in accepted)):
            raise self._bad("gdn_fold_accepted", f"slots={list(slots)} accepted={list(accepted)} k={k}, "
                                                 f"live slots {sorted(live)}")
        return super().gdn_fold_accepted(slots, accepted, k)

    # --- hidden rows and proposals --------------------------------------------------------------------

    def _check_row(self, call: str, row: int) -> None:
        if not 0 <= row < len(self.rows):
            raise self._bad(call, f"row {row}, the last forward made {len(self.rows)}")

    def save_hidden_for_mtp(self, row: int, stream: int) -> None:
        self._check_row("save_hidden_for_mtp", row)
        self.hidden_saved = True
        self.stash_index = None
        super().save_hidden_for_mtp(row, stream)

    def stash_verify_hidden_rows(self, rows, stream: int) -> None:
        for row in rows:
            self._check_row("stash_verify_hidden_rows", row)
        self.stash = len(rows)
        super().stash_verify_hidden_rows(rows, stream)

    def stash_verify_catchup_rows(self, pairs) -> None:
        for _, row in pairs:
            self._check_row("stash_verify_catchup_rows", row)
        super().stash_verify_catchup_rows(pairs)

    def save_hidden_for_mtp_from_stash(self, index: int, stream: int) -> None:
        if not 0 <= index < self.stash:
            raise self._bad("save_hidden_for_mtp_from_stash", f"index {index}, the stash holds {self.stash}")
        self.hidden_saved = True
        self.stash_index = index
        super().save_hidden_for_mtp_from_stash(index, stream)

    def run_mtp_propose_multi(self, token: int, pos: int, n: int, seq: int, stream: int, mask: bool) -> list[int]:
        s = self._seq(seq)
        if pos != s.seq_len or n < 1:
            raise self._bad("run_mtp_propose_multi", f"pos={pos}, n={n} for sequence {seq}, which holds {s.seq_len}")
        if self.strict_drafts and not self.dflash and not self.hidden_saved:
            # (a DFlash bootstrap proposes straight from the last token: specs/speculation.md §6.4)
            raise self._bad("run_mtp_propose_multi", f"sequence {seq}: no hidden state saved since the last forward")
        index, self.stash_index = self.stash_index, None
        if index is not None and self.hidden_saved and (index >= len(self.batch_seqs) or self.batch_seqs[index] != seq):
            # the stash holds the batched verify's rows in batch order (specs/speculation.md §6.12)
            owner = self.batch_seqs[index] if index < len(self.batch_seqs) else None
            raise self._bad("run_mtp_propose_multi", f"sequence {seq} proposes from stash entry {index}, which is "
                                                     f"sequence {owner}'s")
        self.hidden_saved = False
        after = self.last_forward.get(seq)
        self.checkpoint_due[seq] = {"decode": "start_checkpoint_async",
                                    "decode_verify_graphed": "decode_marconi_checkpoint"}.get(after or "", "")
        drafts = self._short(seq, super().run_mtp_propose_multi(token, pos, n, seq, stream, mask))
        self.proposed[seq] = list(drafts)
        self.proposed_at[seq] = self.tick
        return self._answer(seq, drafts)

    def _answer(self, seq: int, drafts: list[int]) -> list[int]:
        """A proposal's answer: its drafts, or with late drafts on, now and then a LATE_DRAFT for
        each (the values stay here until the verify that consumes them)."""
        self.late_failed.pop(seq, None)
        drawn = self.drawn_late.pop(seq, None)
        late, fails = drawn if drawn is not None else self._draw_late(len(drafts))
        if not late:
            self.late.discard(seq)
            return drafts
        self.late.add(seq)
        if fails:  # its forward fails after the answer went out
            self.late_failed[seq] = f"{LATE_FAILURE} of sequence {seq} failed: out of drafter cache (simulated)"
        return [LATE_DRAFT] * len(drafts)

    def _draw_late(self, n: int) -> tuple[bool, bool]:
        """Whether a proposal of ``n`` drafts is answered late, and whether it then fails."""
        rng = self.late_rng
        if rng is None or not n or rng.random() >= 0.7:
            return False, False
        return True, rng.random() < LATE_FAILURE_CHANCE

    def late_proposal(self, seqs, n: int) -> Optional[int]:
        """With a lane (specs/async.md §16.5): draw now, in the order the proposal itself would,
        how many drafts each sequence keeps and whether it is answered late; the proposal takes
        these draws when it runs. The count when every sequence is late with the same count (the
        interpreter then answers ahead), None otherwise. Script proposals hold ``n`` drafts."""
        if self.late_rng is None:
            return None
        keeps = [self._draw_short(n) for _ in seqs]
        lates = [self._draw_late(k) for k in keeps]
        self.drawn_short.update(zip(seqs, keeps, strict=True))
        self.drawn_late.update(zip(seqs, lates, strict=True))
        if all(late for late, _ in lates) and len(set(keeps)) == 1:
            return keeps[0]
        return None

    def _resolve(self, call: str, seq: int, tokens) -> tuple[int, ...]:
        """A verify's inputs with its late drafts filled in: they must be the drafts right after the
        anchor, of a proposal this device answered late, at most as many as it proposed."""
        tokens = tuple(tokens)
        late = [i for i, t in enumerate(tokens) if t == LATE_DRAFT]
        if not late:
            return tokens
        held = self.proposed.get(seq)
        failure = self.late_failed.pop(seq, None) if seq in self.late else None
        if failure is not None:  # the failure of a late proposal is its verify's (specs/async.md §16.3)
            if self.blamed is None:
                self.blamed = frozenset((self._rid(self._seq(seq)),))
            raise DeviceError(f"{call}: {failure}")
        if seq not in self.late or held is None or late != list(range(1, len(late) + 1)) or len(late) > len(held):
            raise self._bad(call, f"late drafts at {late} of inputs {list(tokens)} for sequence {seq}, whose "
                                  f"proposal was {'late' if seq in self.late else 'answered'} with {held}")
        self.late.discard(seq)
        return tokens[:1] + tuple(held[:len(late)]) + tokens[len(late) + 1:]

    def _short(self, seq: int, drafts: list[int]) -> list[int]:
        """A proposal as the proposer may really return it: with short proposals on, now and then
        fewer drafts than asked, or none."""
        drawn = self.drawn_short.pop(seq, None)
        return drafts[:drawn if drawn is not None else self._draw_short(len(drafts))]

    def _draw_short(self, n: int) -> int:
        """How many of a proposal's ``n`` drafts it keeps."""
        rng = self.short_rng
        if rng is None or not n or rng.random() >= 0.3:
            return n
        return rng.randrange(n)

    def mtp_slot_draft_capacity(self, slot: int) -> int:
        if not self.capacities:
            answer = super().mtp_slot_draft_capacity(slot)
        else:
            answer = self.capacities[self.capacity_calls % len(self.capacities)]
            self.capacity_calls += 1
        self.capacity_log.append(answer)
        return answer

    def _checkpoint(self, call: str, seq: int) -> None:
        """The checkpoint after a proposal (specs/speculation.md §6.3 step 5, §6.6 step 5): the
        async one after a bootstrap decode, the Marconi one after a K = 2 verify, none after a
        K = 3 / 4 verify (a later plain decode makes its own Marconi checkpoint, scheduler.md
        §5.16, so only an async one is wrong there)."""
        self._seq(seq)
        due = self.checkpoint_due.pop(seq, None)
        if self.strict_drafts and due is not None and due != call and (due or call == "start_checkpoint_async"):
            raise self._bad(call, f"sequence {seq}: after its proposal the rule book calls {due or 'no checkpoint'}")

    def start_checkpoint_async(self, seq: int) -> None:
        self._checkpoint("start_checkpoint_async", seq)
        super().start_checkpoint_async(seq)

    def decode_marconi_checkpoint(self, seq: int) -> None:
        self._checkpoint("decode_marconi_checkpoint", seq)
        super().decode_marconi_checkpoint(seq)

    def run_mtp_propose_batched(self, tokens, positions, stash, n: int, seqs, stream: int) -> list[list[int]]:
        if len(set(seqs)) != len(seqs) or not len(tokens) == len(positions) == len(seqs) or n < 1:
            raise self._bad("run_mtp_propose_batched", f"{len(tokens)} tokens, {len(positions)} positions for "
                                                       f"sequences {list(seqs)}")
        for seq_id, pos in zip(seqs, positions, strict=True):
            if pos != self._seq(seq_id).seq_len:
                raise self._bad("run_mtp_propose_batched", f"pos={pos} for sequence {seq_id}, which holds "
                                                           f"{self._seq(seq_id).seq_len}")
        self._blame(seqs)
        drafts = [self._short(seq_id, d) for seq_id, d in
                  zip(seqs, super().run_mtp_propose_batched(tokens, positions, stash, n, seqs, stream), strict=True)]
        for seq_id, mine in zip(seqs, drafts, strict=True):
            self.proposed[seq_id] = list(mine)
            self.proposed_at[seq_id] = self.tick
        self.blamed = None
        return [self._answer(seq_id, mine) for seq_id, mine in zip(seqs, drafts, strict=True)]

    def run_mtp_catchup_batched(self, tokens, slots, pos) -> int:
        """Stash slots ``4·i`` of the batch's pending sequences, at most 4 accepted drafts each
        (specs/speculation.md §6.12 step 9)."""
        if (len(tokens) != len(slots) or len(pos) != len(slots) or len(set(slots)) != len(slots)
                or any(slot % 4 or len(t) > 4 for slot, t in zip(slots, tokens, strict=True))):
            raise self._bad("run_mtp_catchup_batched", f"slots={list(slots)}, {len(tokens)} token lists "
                                                       f"{[len(t) for t in tokens]}, {len(pos)} positions")
        for slot, mine, p in zip(slots, tokens, pos, strict=True):  # slot 4·i: the batch's i-th sequence
            i = slot // 4
            seq_id = self.batch_seqs[i] if i < len(self.batch_seqs) else None
            s = self.live.get(seq_id) if seq_id is not None else None
            if s is None or p != s.seq_len - len(mine):
                held = s.seq_len if s is not None else None
                raise self._bad("run_mtp_catchup_batched", f"pos={p} for stash slot {slot} (sequence {seq_id}, "
                                                           f"holding {held}) with {len(mine)} drafts")
        return super().run_mtp_catchup_batched(tokens, slots, pos)

    def rollback_ssm_states(self, seq: int, n: int) -> None:
        """Roll the SSM state back to ``n`` steps past the last verify's base, which is where the
        KV now ends (the truncate came first)."""
        s = self._seq(seq)
        _, before = self._verified("rollback_ssm_states", seq)
        if n != s.seq_len - before:
            raise self._bad("rollback_ssm_states", f"n={n} for sequence {seq}, which holds {s.seq_len - before} "
                                                   f"tokens past its verify's base {before}")
        super().rollback_ssm_states(seq, n)

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

    # --- slots, spill, prefix cache, adapters ---------------------------------------------------------

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
        self.prompted.discard(seq)
        self.epoch += 1
        super().free_sequence(seq)
        self._refuse("free_sequence", self.ledger.release(SLOT, slot))
        self.ledger.accounts[ADAPTER].pop(seq, None)  # (none when it failed before its acquire)
        self.freed_slots.add(slot)
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

    def sample_verify(self, picks, eos_ids) -> list[int]:
        """The last verify's rows under their picks (specs/speculation.md §6.16): a row whose pick
        masks EOS (its output position is below ``min_tokens``) and whose scripted answer is EOS
        answers what the pick draws instead, as a plain decode's host pick does; every other row
        keeps its answer (the scripted logits put all the mass on it, so a rejection-sampled
        verify keeps exactly the greedy verify's drafts). The accepted-draft count follows."""
        rows = list(self.rows)
        if len(picks) != len(rows):
            raise self._bad("sample_verify", f"{len(picks)} picks for the {len(rows)} rows of the last verify")
        offset = 0
        for seq_id, counted in self.verify_order:
            inputs, old = self.verify_io[seq_id]
            new = list(old)
            drawn: dict[int, int] = {}
            for i in range(len(new)):
                pick = picks[offset + i]
                if pick.mask_eos and new[i] in eos_ids:
                    drawn[i] = self._pick(new[i], pick, eos_ids)
                    # the rows after a drawn one follow from it: a draft equal to the drawn token
                    # goes on with the script (script_verify's rule), any other is rejected
                    new = script_verify(self._script(self._seq(seq_id)), self.verified[seq_id][1], inputs, drawn)
            if new != list(old):
                if counted and self.count_accepted:
                    rid = self.live[seq_id].request_id
                    self.accepted[rid] = self.accepted.get(rid, 0) - _agreed(inputs, old) + _agreed(inputs, new)
                self.verify_io[seq_id] = (inputs, tuple(new))
                rows[offset:offset + len(new)] = new
            offset += len(new)
        self.rows = rows
        return rows

    def adapter_id_for(self, slot: int) -> int:
        return self.adapters.get(slot, -1)

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
