"""Rules of the MTP / DFlash step (specs/speculation.md §6.2): the capacity clamp, the bootstrap /
verify split, dispatch to the verifies, and taking proposals.

Invariant kept: a sequence bootstrapped in a step is not verified in the same step, and ``acc``
grows by exactly the drafts the KV kept.
"""

from __future__ import annotations

from fxsched.core.agenda import ask, has_seq, push, set_drafts
from fxsched.core.events import BatchedDrafts, DraftCapacity, Drafts
from fxsched.core.phases import (
    AfterProposal,
    AwaitBatchedProposal,
    AwaitCapacity,
    AwaitProposal,
    Bootstrap,
    DflashGate,
    MtpGate,
    PlainDecode,
    SerialVerify,
    SpecStep,
    Verifies,
)
from fxsched.core.records import with_fields
from fxsched.core.state import DraftTable, SchedulerState, kept_facts
from fxsched.core.verdict import base_draft_count
from fxsched.core.verifying import dflash_bootstrap, mtp_bootstrap
from fxsched.effects import device_calls as dc
from fxsched.effects.base import Effect


def spec_step(state: SchedulerState, task: SpecStep, out: list[Effect]) -> SchedulerState:
    active = state.rows  # the slots: exact in the records
    base = base_draft_count(state.config, state.model, len(active))
    facts = kept_facts(state)
    query = dc.SlotDraftCapacity(facts.slots if facts is not None else tuple(s.slot for s in active))
    return ask(state, out, query, AwaitCapacity(base))


def capacity(state: SchedulerState, waiting: AwaitCapacity, event: DraftCapacity, out: list[Effect]) -> SchedulerState:
    count = min((waiting.base,) + event.capacities)
    if count < 1:  # no slot can hold a draft this step: decode plainly
        return push(state, PlainDecode())
    held = state.drafts
    facts = kept_facts(state)
    ids = facts.ids if facts is not None else tuple([s.seq_id for s in state.rows])
    bootstrap: tuple[int, ...] = ()
    if held.column_for(ids) is not None or all(map(held.__contains__, ids)):  # the common case: all hold drafts
        verify = ids
    else:
        verify = tuple(i for i in ids if i in held)
        bootstrap = tuple(i for i in ids if i not in held)
    if not bootstrap:  # the verifies are the next task: run them now (the same as pushing them)
        return verifies(state, Verifies(verify, count), out)
    out.append(dc.SyncSecondaryCall())
    tasks = tuple(Bootstrap(i, count) for i in bootstrap)
    return push(state, *tasks, Verifies(verify, count))


def bootstrap(state: SchedulerState, task: Bootstrap, out: list[Effect]) -> SchedulerState:
    if not has_seq(state, task.seq_id):
        return state
    if state.config.dflash:
        return dflash_bootstrap(state, task.seq_id, task.draft_count, out)
    return mtp_bootstrap(state, task.seq_id, task.draft_count, out)


def verifies(state: SchedulerState, task: Verifies, out: list[Effect]) -> SchedulerState:
    active = state.rows  # ids and finished flags: exact in the records
    facts = kept_facts(state)
    if (facts.ids == task.seq_ids and not facts.any_finished if facts is not None else
            len(active) == len(task.seq_ids) and all(s.seq_id == i and not s.finished
                                                     for s, i in zip(active, task.seq_ids, strict=True))):
        ids = task.seq_ids  # the common case: every active sequence, none finished
    else:
        live = {s.seq_id for s in active if not s.finished}
        ids = tuple(i for i in task.seq_ids if i in live)
    if len(ids) >= 2 and state.config.dflash:
        return push(state, DflashGate(ids, task.draft_count))
    if len(ids) >= 2 and task.draft_count >= 1:
        return push(state, MtpGate(ids, task.draft_count))
    return push(state, *(SerialVerify(i, task.draft_count) for i in ids))


def proposed(state: SchedulerState, waiting: AwaitProposal, event: Drafts, out: list[Effect]) -> SchedulerState:
    state = set_drafts(state, {waiting.seq_id: event.drafts})
    if waiting.then is AfterProposal.MARCONI:
        out.append(dc.DecodeMarconiCheckpoint(waiting.seq_id))
    elif waiting.then is AfterProposal.CHECKPOINT:
        out.append(dc.StartCheckpointAsync(waiting.seq_id))
    return state


def batched_proposed(state: SchedulerState, waiting: AwaitBatchedProposal, event: BatchedDrafts,
                     out: list[Effect]) -> SchedulerState:
    """The drafts of the batch: one table built from the answer, no sequence record copied."""
    ids, drafts = waiting.seq_ids, event.drafts
    if not state.drafts and all(drafts):  # the common case: nobody else holds drafts
        return with_fields(state, {"drafts": DraftTable.of_batch(ids, drafts)})
    return set_drafts(state, dict(zip(ids, drafts, strict=True)))
