"""The scripted device's proposer and speculative calls (specs/recording-device.md §3.8.6,
§3.8.8): drafts and beam hypotheses answered from the scripts, the batching gates, and the
commits, hidden-row stashes and SSM checkpoints around speculative steps, recorded as trace
lines."""

from __future__ import annotations

from fxsched.runtime.devices.script_rules import script_drafts
from fxsched.runtime.devices.scripted_book import ScriptedBook, _bool, _list, _lists


class ScriptedSpeculative(ScriptedBook):
    """The proposers and the speculative bookkeeping of ``ScriptedDevice``."""

    # --- proposers ----------------------------------------------------------------------------------

    def run_mtp_propose_multi(self, token: int, pos: int, n: int, seq: int, stream: int, mask: bool) -> list[int]:
        s = self._seq(seq)
        drafts = script_drafts(self._script(s), pos, n, self.vocab)
        if self.lines is not None:
            self.lines.append(f"run_mtp_propose_multi(token={token}, pos={pos}, n={n}, {s.sid}, stream={stream}, "
                              f"mask={_bool(mask)}) -> {_list(drafts)}")
        return drafts

    def run_mtp_propose_batched(self, tokens, positions, stash, n: int, seqs, stream: int) -> list[list[int]]:
        drafts = [script_drafts(self._script(self._seq(i)), p, n, self.vocab)
                  for i, p in zip(seqs, positions, strict=True)]
        if self.lines is not None:
            self.lines.append(f"run_mtp_propose_batched(tokens={_list(tokens)}, positions={_list(positions)}, "
                              f"stash={_list(stash)}, n={n}, stream={stream}) -> {_lists(drafts)}")
        return drafts

    def run_mtp_catchup_batched(self, tokens, slots, pos) -> int:
        if self.lines is not None:
            self.lines.append(f"run_mtp_catchup_batched(tokens={_lists(tokens)}, slots={_list(slots)}, "
                              f"pos={_list(pos)}) -> 0")
        return 0

    def generate_beam_batch(self, prompts, num_beams) -> list[list[int]]:
        hyps = []
        for prompt in prompts:
            script = self.scripts.get(prompt[0]) if prompt else None
            hyps.append(list(script.beam_hyp) if script is not None else [])
        if self.lines is not None:
            self.lines.append(f"generate_beam_batch(n={len(prompts)}) -> {_lists(hyps)}")
        return hyps

    def mtp_slot_draft_capacity(self, slot: int) -> int:
        if self.lines is not None:
            self.lines.append(f"mtp_slot_draft_capacity({slot})")
        return self.slot_capacity

    def can_batch_verify(self, ks) -> bool:
        answer = self.batch_verify_ok
        if self.lines is not None:
            self.lines.append(f"can_batch_verify({_list(ks)}) -> {_bool(answer)}")
        return answer

    # --- speculative bookkeeping --------------------------------------------------------------------

    def gdn_fold_accepted(self, slots, accepted, k: int) -> bool:
        if self.lines is not None:
            self.lines.append(f"gdn_fold_accepted(slots={_list(slots)}, accepted={_list(accepted)}, k={k}) -> true")
        return True

    def commit_accepted_prefix(self, seq: int, na: int, k: int) -> None:
        s = self._seq(seq)
        if self.lines is not None:
            self.lines.append(f"commit_accepted_prefix({s.sid}, na={na}, k={k})")

    def commit_ctx(self, seq: int, n: int, base: int, row: int) -> None:
        s = self._seq(seq)
        if self.lines is not None:
            self.lines.append(f"commit_ctx({s.sid}, n={n}, base={base}, row={row})")

    def trim_proposer_state(self, seq: int, na: int, stream: int) -> None:
        s = self._seq(seq)
        if self.lines is not None:
            self.lines.append(f"trim_proposer_state({s.sid}, na={na}, stream={stream})")

    def save_hidden_for_mtp(self, row: int, stream: int) -> None:
        if self.lines is not None:
            self.lines.append(f"save_hidden_for_mtp({row}, stream={stream})")

    def save_hidden_for_mtp_from_stash(self, index: int, stream: int) -> None:
        if self.lines is not None:
            self.lines.append(f"save_hidden_for_mtp_from_stash({index}, stream={stream})")

    def stash_verify_hidden_rows(self, rows, stream: int) -> None:
        if self.lines is not None:
            self.lines.append(f"stash_verify_hidden_rows({_list(rows)}, stream={stream})")

    def stash_verify_catchup_rows(self, pairs) -> None:
        if self.lines is not None:
            self.lines.append("stash_verify_catchup_rows([" + ", ".join(f"({a}, {b})" for a, b in pairs) + "])")

    def dflash_eagle_accept_append(self, seq: int) -> None:
        s = self._seq(seq)
        if self.lines is not None:
            self.lines.append(f"dflash_eagle_accept_append({s.sid})")

    def start_checkpoint_async(self, seq: int) -> None:
        s = self._seq(seq)
        if self.lines is not None:
            self.lines.append(f"start_checkpoint_async({s.sid})")

    def start_rollback_and_checkpoint_async(self, seq: int, na: int) -> None:
        s = self._seq(seq)
        if self.lines is not None:
            self.lines.append(f"start_rollback_and_checkpoint_async({s.sid}, na={na})")

    def checkpoint_ssm_states(self, seq: int) -> None:
        s = self._seq(seq)
        if self.lines is not None:
            self.lines.append(f"checkpoint_ssm_states({s.sid})")

    def rollback_ssm_states(self, seq: int, n: int) -> None:
        s = self._seq(seq)
        if self.lines is not None:
            self.lines.append(f"rollback_ssm_states({s.sid}, n={n})")

    def decode_marconi_checkpoint(self, seq: int) -> None:
        s = self._seq(seq)
        if self.lines is not None:
            self.lines.append(f"decode_marconi_checkpoint({s.sid})")

    def save_decode_ssm_snapshot(self, seq: int, ring: int) -> None:
        s = self._seq(seq)
        if self.lines is not None:
            self.lines.append(f"save_decode_ssm_snapshot({s.sid}, ring={ring})")

    def restore_decode_ssm_snapshot(self, seq: int, ring: int) -> None:
        s = self._seq(seq)
        if self.lines is not None:
            self.lines.append(f"restore_decode_ssm_snapshot({s.sid}, ring={ring})")

    def save_hidden_for_catchup(self, row: int, pos: int) -> None:
        if self.lines is not None:
            self.lines.append(f"save_hidden_for_catchup({row}, pos={pos})")
