"""Serial verifies of one sequence: MTP bootstrap, K = 2 / 3 / 4 verifies and their verdicts
(speculation.md §6.3, §6.5–6.8).

Invariant kept: after a verdict the KV holds exactly the anchor plus the accepted drafts
(``seq_len`` rewound over the rejected ones, the device told with ``TruncateSequence``), and the
emitted tokens are the accepted drafts plus one model token.
"""

from __future__ import annotations

import attrs

from fxsched.core.planted import planted
from fxsched.core.records import replace

from fxsched.core.decode import grow
from fxsched.core.emit import spec_token, spec_tokens
from fxsched.core.events import TokenSampled, VerifyRows
from fxsched.core.flow import AskQuery, forward
from fxsched.core.machine import answer_rule, ask, find_seq, has_seq, push, put_seq, task_rule
from fxsched.core.sequence import Sequence
from fxsched.core.spec_step import propose
from fxsched.core.state import SchedulerState
from fxsched.core.verdict import acc_gain, accepted_prefix, verify_width
from fxsched.effects import device_calls as dc

VERIFY_CMD = {2: 0xFFFFFFF2, 3: 0xFFFFFFF3, 4: 0xFFFFFFF4}


@attrs.frozen
class SerialVerify:
    seq_id: int
    draft_count: int


@attrs.frozen
class AwaitKVerify:
    """A K-row verify of ``drafts`` (the verify took the first ``k - 1``); ``propose_n`` re-proposes."""

    seq_id: int
    drafts: tuple[int, ...]
    k: int
    propose_n: int
    pre_len: int
    dflash: bool


@attrs.frozen
class AwaitMtpDecode:
    seq_id: int
    draft_count: int


# --- MTP bootstrap ----------------------------------------------------------------------------


def mtp_bootstrap(state: SchedulerState, seq_id: int, draft_count: int, out: list) -> SchedulerState:
    """Decode the last token, read its successor, then propose fresh drafts."""
    seq = find_seq(state, seq_id)
    out.append(dc.EpBroadcastCmdForSeq(seq.slot, seq.last_token))
    seq = grow(seq, seq.seq_len + 1, state.model.block_size)
    state = put_seq(state, seq)
    read = AskQuery(dc.ArgmaxOnDevice(row=0, stream=0), AwaitMtpDecode(seq_id, draft_count))
    return forward(state, out, dc.DecodeCall(seq.last_token, seq_id, 0), (seq_id,), read)


@answer_rule(AwaitMtpDecode, TokenSampled)
def _mtp_decoded(state, waiting: AwaitMtpDecode, event: TokenSampled, out):
    seq = spec_token(find_seq(state, waiting.seq_id), event.token, state.config, out)
    state = put_seq(state, seq)
    if seq.finished:
        return state
    out.append(dc.SaveHiddenForMtp(0))
    return propose(state, waiting.seq_id, waiting.draft_count, out, then="checkpoint")


# --- choosing and starting a serial verify --------------------------------------------------------


from fxsched.core import dflash  # noqa: E402


@task_rule(SerialVerify)
def _serial_verify(state: SchedulerState, task: SerialVerify, out: list) -> SchedulerState:
    if not has_seq(state, task.seq_id):
        return state
    seq = find_seq(state, task.seq_id)
    if seq.finished or not seq.drafts:
        return state
    if state.config.dflash:
        keep = len(seq.drafts)
        if keep >= 4:
            return dflash.serial_verify(state, seq, task.draft_count, out)
        return start_k_verify(state, seq, seq.drafts, verify_width(task.draft_count, keep), task.draft_count, True, out)
    keep = min(len(seq.drafts), task.draft_count)
    drafts = seq.drafts[:keep]
    return start_k_verify(state, seq, drafts, verify_width(task.draft_count, keep), task.draft_count, False, out)


def start_k_verify(state: SchedulerState, seq: Sequence, drafts: tuple[int, ...], k: int, propose_n: int,
                   dflash_mode: bool, out: list) -> SchedulerState:
    """Sync, the EP words, then the K-row verify of ``[L] + drafts[:k-1]``. The drafts are consumed."""
    inputs = (seq.last_token,) + drafts[: k - 1]
    out.append(dc.SyncSecondaryCall())
    out.append(dc.EpBroadcastCmdForSeq(seq.slot, VERIFY_CMD[k]))
    for token in inputs:
        out.append(dc.EpBroadcastCmd(token))
    if k == 2:
        query = dc.DecodeVerifyGraphed(seq.seq_id, inputs)
    elif k == 3:
        query = dc.DecodeVerifyGraphedK3(seq.seq_id, inputs)
    elif dflash_mode:
        query = dc.DecodeAndVerifyFused(seq.seq_id, inputs)
    else:
        query = dc.DecodeVerifyGraphedK4(seq.seq_id, inputs)
    pre = seq.seq_len
    seq = grow(replace(seq, drafts=()), pre + k, state.model.block_size)
    state = put_seq(state, seq)
    return ask(state, out, query, AwaitKVerify(seq.seq_id, drafts, k, propose_n, pre, dflash_mode))


@answer_rule(AwaitKVerify, VerifyRows)
def _k_verified(state, waiting: AwaitKVerify, event: VerifyRows, out):
    seq = find_seq(state, waiting.seq_id)
    k, rows = waiting.k, event.rows
    nd = min(len(waiting.drafts), k - 1)
    na = min(accepted_prefix(waiting.drafts[:nd], rows), nd)
    if planted(state.config, "accepted_prefix_off_by_one") and na < nd:
        na += 1
    out.append(dc.EpBroadcastCmd(na))
    if waiting.dflash and k >= 3:
        out.append(dc.CommitCtx(seq.seq_id, na + 1, waiting.pre_len, 0))
    if k == 2:
        return k2_verdict(state, seq, waiting.drafts[0], rows, waiting.pre_len, waiting.propose_n, out)
    return shared_verdict(state, seq, waiting.drafts, rows, k, na, nd, waiting.pre_len, waiting.propose_n, out)


def settled(seq: Sequence, pre_len: int, seq_len: int, out: list, config=None) -> dict:
    """Rewind to ``seq_len`` (telling the device) and count the kept drafts into ``acc``.

    ``acc`` grows by ``seq_len - pre_len - 1`` (speculation.md §6.13): a sequence is verified at
    most once per step and nothing else in that step changes its length, so the KV length before
    the verify is the length at the start of the step.
    """
    if seq_len < seq.seq_len and not (config is not None and planted(config, "no_rewind_on_reject")):
        out.append(dc.TruncateSequence(seq.seq_id, seq_len))
    bonus = 1 if config is not None and planted(config, "acc_counts_bonus") else 0
    return {"seq_len": seq_len, "acc": seq.acc + acc_gain(pre_len, seq_len) + bonus}


def k2_verdict(state: SchedulerState, seq: Sequence, draft: int, rows, pre_len: int, propose_n: int, out: list):
    """K = 2 (speculation.md §6.6): full accept emits first; a reject commits first."""
    config = state.config
    if draft == rows[0]:
        seq = spec_tokens(seq, (draft, rows[1]), config, out, settled(seq, pre_len, pre_len + 2, out, config))
        state = put_seq(state, seq)
        if seq.finished:
            return state
        out.append(dc.CommitAcceptedPrefix(seq.seq_id, 2, 2))
        out.append(dc.DflashEagleAcceptAppend(seq.seq_id))
        out.append(dc.SaveHiddenForMtp(1))
        out.append(dc.TrimProposerState(seq.seq_id, 1))
    else:
        changes = settled(seq, pre_len, pre_len + 1, out, config)
        out.append(dc.TrimProposerState(seq.seq_id, 0))
        out.append(dc.CommitAcceptedPrefix(seq.seq_id, 1, 2))
        seq = spec_tokens(seq, (rows[0],), config, out, changes)
        state = put_seq(state, seq)
        if seq.finished:
            return state
        out.append(dc.SaveHiddenForMtp(0))
    return propose(state, seq.seq_id, propose_n, out, then="marconi")


def shared_verdict(state: SchedulerState, seq: Sequence, drafts, rows, k: int, na: int, nd: int, pre_len: int,
                   propose_n: int, out: list, deferred: bool = False):
    """The verdict of K = 3 / K = 4 verifies (speculation.md §6.7).

    Full accept (na == nd): emit, then commit. Partial: rewind and commit, then emit. With
    ``deferred`` (batched MTP) there is no hidden save and no proposal here.
    """
    config = state.config
    if na == nd:
        seq = spec_tokens(seq, tuple(drafts[:nd]) + (rows[nd],), config, out, settled(seq, pre_len, pre_len + k, out, config))
        state = put_seq(state, seq)
        if seq.finished:
            return state
        out.append(dc.CommitAcceptedPrefix(seq.seq_id, k, k))
        if not deferred:
            out.append(dc.SaveHiddenForMtp(na))
        out.append(dc.TrimProposerState(seq.seq_id, na))
    else:
        changes = settled(seq, pre_len, pre_len + k - (nd - na), out, config)
        out.append(dc.TrimProposerState(seq.seq_id, na))
        out.append(dc.CommitAcceptedPrefix(seq.seq_id, na + 1, k))
        seq = spec_tokens(seq, tuple(drafts[:na]) + (rows[na],), config, out, changes)
        state = put_seq(state, seq)
        if seq.finished or deferred:
            return state
        out.append(dc.SaveHiddenForMtp(na))
    if deferred:
        return state
    return propose(state, seq.seq_id, propose_n, out)


def mtp_gate(state: SchedulerState, seq_ids: tuple[int, ...], draft_count: int, out: list) -> SchedulerState:
    """Two or more MTP verify sequences: the batching gate decides (``mtp_batch``)."""
    from fxsched.core import mtp_batch

    return mtp_batch.gate(state, seq_ids, draft_count, out)
