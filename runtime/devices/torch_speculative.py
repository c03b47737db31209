"""The torch device's speculative bookkeeping: commits of verified rows (GDN fold, accepted prefix,
rollbacks), the DFlash context commits, the MTP hidden stash and the SSM snapshot ring."""

from __future__ import annotations

from typing import Sequence

import structlog

from fxsched.runtime.devices.device import DeviceError

from fxsched.runtime.devices.torch_book import DeviceBook, DeviceStateError

log = structlog.get_logger("fxsched.torch_device")


class Speculative(DeviceBook):
    """Commits and state saves around speculative steps."""

    def gdn_fold_accepted(self, slots, accepted, k: int) -> bool:
        """Commit accepted[i] rows (the anchor included) of each slot's verify, in one state write."""
        seqs = [self._seq_in_slot(slot) for slot in slots]
        for s, n in zip(seqs, accepted, strict=True):
            if s.pending is None:
                raise DeviceStateError(f"gdn_fold_accepted: sequence {s.seq_id} (slot {s.slot}) has no verify rows")
            if len(s.pending.tokens) > k:
                raise DeviceStateError(f"gdn_fold_accepted: sequence {s.seq_id} verified {len(s.pending.tokens)} "
                                       f"rows, more than k={k}")
            self._resolve_keep(s, int(n), "gdn_fold_accepted")
        self._settle_many(seqs, "gdn_fold_accepted")
        self.stats.calls["gdn_fold_accepted"] += 1
        return True

    def commit_accepted_prefix(self, seq: int, na: int, k: int) -> None:
        """Commit the first ``na`` rows (anchor included) of the sequence's k-row verify. After a
        ``gdn_fold_accepted`` of the same verify there is nothing left to do."""
        s = self._seq(seq)
        if s.pending is None:
            return
        if len(s.pending.tokens) != k:
            raise DeviceStateError(f"commit_accepted_prefix: sequence {seq} verified {len(s.pending.tokens)} rows, "
                                   f"not k={k}")
        self._resolve_keep(s, na, "commit_accepted_prefix")
        self._commit(s, na, "commit_accepted_prefix")

    def commit_ctx(self, seq: int, n: int, base: int, row: int) -> None:
        """DFlash: the drafter context covers positions [0, base + n) — the committed rows below
        ``base`` and the first n rows of the forward that started at ``base``."""
        self.commit_ctx_many([seq], [n], [base], [row])

    def commit_ctx_many(self, seqs: Sequence[int], ns: Sequence[int], bases: Sequence[int],
                        rows: Sequence[int]) -> None:
        """``commit_ctx`` of several sequences (a decode's or a batched verify's rows, in order): the
        committed rows every context lacks in one append, then the forward's rows in a second."""
        if not self.uses_dflash_context:
            return
        engine = self.engine
        caught, uptos, fresh, counts = [], [], [], []
        for seq, n, base in zip(seqs, ns, bases, strict=True):
            s = self._seq(seq)
            committed = engine.seq_len(s.slot)
            if base + n <= committed:
                caught.append(s)
                uptos.append(base + n)
            elif s.pending is not None and base == committed and n <= len(s.pending.tokens):
                caught.append(s)
                uptos.append(base)
                fresh.append(s.slot)
                counts.append(n)
            else:
                raise DeviceStateError(f"commit_ctx: sequence {seq} has {committed} committed tokens; cannot take "
                                       f"{n} context rows at {base}")
        self._ctx_catch_up_many(caught, uptos)
        if fresh:
            with self._errors("commit_ctx"):
                engine.commit_ctx_many(fresh, counts)

    def trim_proposer_state(self, seq: int, na: int, stream: int) -> None:
        """Drop drafter context rows beyond the sequence's length (a rejected branch)."""
        if not self.uses_dflash_context:
            return
        s = self._seq(seq)
        length = self.seq_len(seq)
        ctx = self.engine.ctx_len(s.slot)
        if ctx > length:
            self.engine.trim_proposer_state(s.slot, ctx - length)

    def save_hidden_for_mtp(self, row: int, stream: int) -> None:
        s, local = self._owner(row)
        with self._errors("save_hidden_for_mtp"):
            self.engine.save_hidden_for_mtp(s.slot, local)

    def save_hidden_for_mtp_from_stash(self, index: int, stream: int) -> None:
        owner, hidden = self._stash_entry(index)
        self.engine.set_mtp_hidden(self._seq(owner).slot, hidden)

    def stash_verify_hidden_rows(self, rows, stream: int) -> None:
        owners = [self._owner(row) for row in rows]
        if not owners:
            self._stash = ([], None)
            return
        with self._errors("stash_verify_hidden_rows"):
            hidden = self.engine.captured_rows([s.slot for s, _ in owners], [local for _, local in owners])
        self._stash = ([s.seq_id for s, _ in owners], hidden)

    def stash_verify_catchup_rows(self, pairs) -> None:
        """Rows for an MTP KV catch-up: nothing to keep (the internal head keeps no KV; a checkpoint's
        MTP module catches up from the committed hidden rows when it proposes)."""
        for _, row in pairs:
            self._check_rows(row, 1)

    def dflash_eagle_accept_append(self, seq: int) -> None:
        s = self._seq(seq)
        self._settle(s, "dflash_eagle_accept_append")
        self._ctx_catch_up(s)

    def start_checkpoint_async(self, seq: int) -> None:
        self._settle(self._seq(seq), "start_checkpoint_async")

    def start_rollback_and_checkpoint_async(self, seq: int, na: int) -> None:
        self._rollback(seq, na, "start_rollback_and_checkpoint_async")

    def checkpoint_ssm_states(self, seq: int) -> None:
        self._settle(self._seq(seq), "checkpoint_ssm_states")

    def rollback_ssm_states(self, seq: int, n: int) -> None:
        self._rollback(seq, n, "rollback_ssm_states")

    def _rollback(self, seq: int, n: int, what: str) -> None:
        """Keep n rows of the pending forward (write-on-accept: the state after row n - 1)."""
        s = self._seq(seq)
        if s.pending is None:
            return
        self._resolve_keep(s, n, what)
        self._commit(s, n, what)

    def decode_marconi_checkpoint(self, seq: int) -> None:
        self._settle(self._seq(seq), "decode_marconi_checkpoint")

    def save_decode_ssm_snapshot(self, seq: int, ring: int) -> None:
        s = self._seq(seq)
        self._settle(s, "save_decode_ssm_snapshot")
        self._ring[(seq, ring)] = (self.engine.seq_len(s.slot), self.engine.gdn_state(s.slot))

    def restore_decode_ssm_snapshot(self, seq: int, ring: int) -> None:
        s = self._seq(seq)
        self._settle(s, "restore_decode_ssm_snapshot")
        try:
            length, snapshot = self._ring[(seq, ring)]
        except KeyError:
            raise DeviceError(f"restore_decode_ssm_snapshot: no snapshot {ring} of sequence {seq}") from None
        if length != self.engine.seq_len(s.slot):
            raise DeviceError(f"restore_decode_ssm_snapshot: snapshot {ring} of sequence {seq} is at {length} "
                              f"tokens, the sequence at {self.engine.seq_len(s.slot)}; HybridEngine cannot rewind "
                              f"committed KV")
        self.engine.gdn.load(s.slot, snapshot)

    def save_hidden_for_catchup(self, row: int, pos: int) -> None:
        self._check_rows(row, 1)
