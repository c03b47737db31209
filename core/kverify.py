"""Rules of serial verifies of one sequence: the MTP bootstrap's decode, K = 2 / 3 / 4 verifies and
their verdicts (specs/speculation.md §6.3, §6.5–6.8). The shared pieces (starting a verify,
settling, the verdicts) are in ``core/verifying.py``."""

from __future__ import annotations

from fxsched.core.agenda import find_seq, has_seq, held, put_seq
from fxsched.core.emit import spec_token
from fxsched.core.events import TokenSampled, TokensSampled, VerifyRows
from fxsched.core.phases import AfterProposal, AwaitKVerify, AwaitMtpDecode, SerialVerify
from fxsched.core.rows import answered_token
from fxsched.core.state import SchedulerState
from fxsched.core.verdict import accepted_prefix, verify_width
from fxsched.core.verifying import dflash_serial_verify, k2_verdict, propose, shared_verdict, start_k_verify
from fxsched.effects import device_calls as dc
from fxsched.effects.base import Effect


def mtp_decoded(state: SchedulerState, waiting: AwaitMtpDecode, event: TokenSampled | TokensSampled,
                out: list[Effect]) -> SchedulerState:
    seq = spec_token(find_seq(state, waiting.seq_id), answered_token(event), state.config, out)
    state = put_seq(state, seq)
    if seq.finished:
        return state
    out.append(dc.SaveHiddenForMtp(0))
    return propose(state, waiting.seq_id, waiting.draft_count, out, then=AfterProposal.CHECKPOINT)


def serial_verify(state: SchedulerState, task: SerialVerify, out: list[Effect]) -> SchedulerState:
    if not has_seq(state, task.seq_id):
        return state
    seq = find_seq(state, task.seq_id)
    mine = held(state, task.seq_id)
    if seq.finished or not mine:
        return state
    if state.config.dflash:
        keep = len(mine)
        if keep >= 4:
            return dflash_serial_verify(state, seq, task.draft_count, out)
        return start_k_verify(state, seq, mine, verify_width(task.draft_count, keep), task.draft_count, True, out)
    keep = min(len(mine), task.draft_count)
    drafts = mine[:keep]
    return start_k_verify(state, seq, drafts, verify_width(task.draft_count, keep), task.draft_count, False, out)


def k_verified(state: SchedulerState, waiting: AwaitKVerify, event: VerifyRows, out: list[Effect]) -> SchedulerState:
    seq = find_seq(state, waiting.seq_id)
    k, rows = waiting.k, event.rows
    nd = min(len(waiting.drafts), k - 1)
    na = min(accepted_prefix(waiting.drafts[:nd], rows), nd)
    out.append(dc.EpBroadcastCmd(na))
    if waiting.dflash and k >= 3:
        out.append(dc.CommitCtx(seq.seq_id, na + 1, waiting.pre_len, 0))
    if k == 2:
        return k2_verdict(state, seq, waiting.drafts[0], rows, waiting.pre_len, waiting.propose_n, out)
    return shared_verdict(state, seq, waiting.drafts, rows, k, na, nd, waiting.pre_len, waiting.propose_n, out)
