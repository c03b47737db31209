"""The MTP / DFlash step (speculation.md §6.2): capacity clamp, bootstrap / verify split, dispatch
to the verifies, and the accepted-token accounting (§6.13).

Invariant kept: a sequence bootstrapped in a step is not verified in the same step, and ``acc``
grows by exactly the drafts the KV kept.
"""

from __future__ import annotations

import attrs

from fxsched.core.records import replace, with_fields

from fxsched.core.events import BatchedDrafts, DraftCapacity, Drafts
from fxsched.core.machine import answer_rule, ask, find_seq, has_seq, push, put_seq, put_seqs, task_rule
from fxsched.core.state import SchedulerState
from fxsched.core.verdict import base_draft_count
from fxsched.effects import device_calls as dc


@attrs.frozen
class SpecStep:
    pass


@attrs.frozen
class AwaitCapacity:
    base: int


@attrs.frozen
class Bootstrap:
    seq_id: int
    draft_count: int


@attrs.frozen
class Verifies:
    seq_ids: tuple[int, ...]
    draft_count: int


@attrs.frozen
class AwaitProposal:
    """Waiting for one sequence's fresh drafts; ``then`` is the call that follows them."""

    seq_id: int
    then: str = ""


@attrs.frozen
class AwaitBatchedProposal:
    seq_ids: tuple[int, ...]


@task_rule(SpecStep)
def _spec_step(state: SchedulerState, task, out: list) -> SchedulerState:
    active = state.active
    base = base_draft_count(state.config, state.model, len(active))
    query = dc.SlotDraftCapacity(tuple(s.slot for s in active))
    return ask(state, out, query, AwaitCapacity(base))


@answer_rule(AwaitCapacity, DraftCapacity)
def _capacity(state, waiting: AwaitCapacity, event: DraftCapacity, out):
    count = min((waiting.base,) + event.capacities)
    if count < 1:  # no slot can hold a draft this step: decode plainly
        from fxsched.core.decode import PlainDecode

        return push(state, PlainDecode())
    bootstrap = tuple(s.seq_id for s in state.active if not s.drafts)
    verify = tuple(s.seq_id for s in state.active if s.drafts)
    if bootstrap:
        out.append(dc.SyncSecondaryCall())
    tasks = tuple(Bootstrap(i, count) for i in bootstrap)
    return push(state, *tasks, Verifies(verify, count))


@task_rule(Bootstrap)
def _bootstrap(state: SchedulerState, task: Bootstrap, out: list) -> SchedulerState:
    if not has_seq(state, task.seq_id):
        return state
    if state.config.dflash:
        return dflash.bootstrap(state, task.seq_id, task.draft_count, out)
    return kverify.mtp_bootstrap(state, task.seq_id, task.draft_count, out)


@task_rule(Verifies)
def _verifies(state: SchedulerState, task: Verifies, out: list) -> SchedulerState:
    live = {s.seq_id for s in state.active if not s.finished}
    ids = tuple(i for i in task.seq_ids if i in live)
    if len(ids) >= 2 and state.config.dflash:
        return dflash.gate(state, ids, task.draft_count, out)
    if len(ids) >= 2 and task.draft_count >= 1:
        return kverify.mtp_gate(state, ids, task.draft_count, out)
    return push(state, *(kverify.SerialVerify(i, task.draft_count) for i in ids))


def propose(state: SchedulerState, seq_id: int, n: int, out: list, then: str = "") -> SchedulerState:
    """Ask the proposer for ``n`` drafts after the sequence's last token."""
    seq = find_seq(state, seq_id)
    query = dc.ProposeMulti(token=seq.last_token, pos=seq.seq_len, n=n, seq=seq_id)
    return ask(state, out, query, AwaitProposal(seq_id, then))


@answer_rule(AwaitProposal, Drafts)
def _proposed(state, waiting: AwaitProposal, event: Drafts, out):
    state = put_seq(state, replace(find_seq(state, waiting.seq_id), drafts=event.drafts))
    if waiting.then == "marconi":
        out.append(dc.DecodeMarconiCheckpoint(waiting.seq_id))
    elif waiting.then == "checkpoint":
        out.append(dc.StartCheckpointAsync(waiting.seq_id))
    return state


def propose_batched(state: SchedulerState, seq_ids: tuple[int, ...], stash: tuple[int, ...], n: int,
                    out: list) -> SchedulerState:
    """One batched proposal for two or more sequences whose verify rows were stashed."""
    by_id = {s.seq_id: s for s in state.active}
    seqs = [by_id[i] for i in seq_ids]
    query = dc.ProposeBatched(
        tokens=tuple(s.last_token for s in seqs), positions=tuple(s.seq_len for s in seqs),
        stash=stash, n=n, seqs=seq_ids,
    )
    return ask(state, out, query, AwaitBatchedProposal(seq_ids))


@answer_rule(AwaitBatchedProposal, BatchedDrafts)
def _batched_proposed(state, waiting: AwaitBatchedProposal, event: BatchedDrafts, out):
    by_id = {s.seq_id: s for s in state.active}
    updated = {i: with_fields(by_id[i], {"drafts": d}) for i, d in zip(waiting.seq_ids, event.drafts)}
    return put_seqs(state, updated)


def propose_after_batch(state: SchedulerState, pending: list[tuple[int, int]], n: int,
                        out: list) -> SchedulerState:
    """Re-propose for the unfinished sequences of a batched verify (``(batch index, seq_id)``)."""
    if len(pending) >= 2:
        return propose_batched(state, tuple(i for _, i in pending), tuple(b for b, _ in pending), n, out)
    if len(pending) == 1:
        index, seq_id = pending[0]
        out.append(dc.SaveHiddenForMtpFromStash(index))
        return propose(state, seq_id, n, out)
    return state


from fxsched.core import dflash, kverify, mtp_batch  # noqa: E402,F401  (rule modules that call back into this one)
