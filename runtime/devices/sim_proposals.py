"""The simulated device's proposals: ``SimProposals``, the layer of ``simulated.SimDevice`` that
checks the hidden-row saves and stashes a proposal reads, the proposals (MTP / DFlash, batched,
catch-up) and the checkpoint each one calls for (specs/speculation.md §6.3, §6.6, §6.12), and
answers them as a real proposer may: ``short_proposals`` (a seed) cuts now and then a proposal's
drafts short, to none sometimes; ``late_drafts`` (a seed) answers now and then a proposal with
``LATE_DRAFT`` placeholders (specs/async.md §16.3), filled in at the verify that consumes them
(``_resolve``); now and then (``LATE_FAILURE_CHANCE`` of the late ones) such a proposal fails after
its answer went out, and that verify answers the failure; ``capacities`` are the answers of
``mtp_slot_draft_capacity`` in turn."""

from __future__ import annotations

from typing import Optional

from fxsched.core.events import LATE_DRAFT
from fxsched.runtime.devices.device import DeviceError
from fxsched.runtime.devices.sim_decodes import SimDecodes

LATE_FAILURE = "the late proposal"  # how the fault of a verify whose late proposal failed begins its reason
LATE_FAILURE_CHANCE = 0.05  # of the proposals answered late


class SimProposals(SimDecodes):
    """The hidden rows, proposals and checkpoints of ``SimDevice``."""

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
