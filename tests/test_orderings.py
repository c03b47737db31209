"""The orders between two effects of runtime/check/orderings.py (specs/checker.md §11.7): each rule
passes a batch in the rule book's order and refuses the same batch with the two effects the other
way round (or the first one missing); the barrier's order, which spans batches, through
``Orderings.check`` over a run of batches; and the ``Monitor`` runs them on every batch."""

from __future__ import annotations

import pytest

from fxsched.effects import device_calls as dc
from fxsched.effects import lifecycle as lc
from fxsched.effects import plans
from fxsched.effects.client import TokenOut
from fxsched.effects.ep_words import VERIFY_CMD
from fxsched.runtime.check.invariants import Monitor
from fxsched.runtime.check.orderings import (Orderings, checkpoint_before_self_verify, snapshot_before_checkpoint,
                                             stash_before_use, sync_before_verify)
from fxsched.runtime.check.violation import Violation
from fxsched.runtime.devices.script_rules import Script
from fxsched.runtime.devices.simulated import SimDevice

PROMPT = (1, 20, 21, 22, 23, 24)
SEND_ERROR = lc.ReleaseReason.SEND_ERROR


def _k2_words(slot: int = 0) -> list:
    return [dc.EpBroadcastCmdForSeq(slot, VERIFY_CMD[2]), dc.EpBroadcastCmd(10), dc.EpBroadcastCmd(11)]


# --- sync before verify (specs/speculation.md §6.6, §6.11, §6.12) ------------------------------------------


def test_a_k_verify_after_its_sync_and_words_passes():
    sync_before_verify([dc.SyncSecondaryCall(), *_k2_words(), dc.DecodeVerifyGraphed(1, (10, 11))])
    # the accept word of an earlier verify may open the batch
    sync_before_verify([dc.EpBroadcastCmd(1), dc.CommitAcceptedPrefix(3, 2, 2), dc.SyncSecondaryCall(), *_k2_words(),
                        dc.DecodeVerifyGraphedK3(1, (10, 11, 12))])


def test_a_k_verify_whose_words_precede_its_sync_is_refused():
    with pytest.raises(Violation, match="sync_before_verify"):
        sync_before_verify([*_k2_words(), dc.SyncSecondaryCall(), dc.DecodeVerifyGraphed(1, (10, 11))])


@pytest.mark.parametrize("verify", [dc.DecodeVerifyBatched((10, 11, 20, 21), (2, 2), (1, 2)),
                                    dc.DecodeVerifyDflash(1, (10, 11, 12, 13, 14)),
                                    dc.DecodeAndVerifyFused(1, (10, 11, 12, 13))], ids=lambda v: type(v).__name__)
def test_a_verify_without_a_sync_is_refused(verify):
    sync_before_verify([dc.SyncSecondaryCall(), verify])
    with pytest.raises(Violation, match="no sync_secondary"):
        sync_before_verify([dc.StartCheckpointAsync(1), verify])


def test_the_self_speculative_verify_needs_no_sync():
    sync_before_verify([dc.CheckpointSsmStates(1), dc.DecodeVerify(1, (10, 11, 12))])


# --- stash before use (specs/speculation.md §6.11, §6.12) -----------------------------------------------------


def _propose_batched() -> dc.ProposeBatched:
    return dc.ProposeBatched((12, 22), (9, 9), (0, 1), 2, (1, 2))


def test_a_batched_proposal_after_its_stash_passes_and_before_it_is_refused():
    stash = dc.StashVerifyHiddenRows((2, 5))
    stash_before_use([stash, dc.TrimProposerStateBatch((1, 2), (1, 1)), _propose_batched()])
    with pytest.raises(Violation, match="stash_before_use"):
        stash_before_use([dc.TrimProposerStateBatch((1, 2), (1, 1)), _propose_batched()])
    stash_before_use([stash, dc.SaveHiddenForMtpFromStash(1), dc.ProposeMulti(12, 9, 2, 2)])
    with pytest.raises(Violation, match="save_hidden_for_mtp_from_stash|SaveHiddenForMtpFromStash"):
        stash_before_use([dc.SaveHiddenForMtpFromStash(1), stash, dc.ProposeMulti(12, 9, 2, 2)])


def test_a_catch_up_before_its_rows_are_stashed_is_refused():
    catchup = dc.CatchupBatched(((12,), (22,)), (0, 4), (8, 8))
    rows = dc.StashVerifyCatchupRows(((0, 0), (4, 3)))
    stash = dc.StashVerifyHiddenRows((1, 4))
    stash_before_use([stash, rows, catchup, _propose_batched()])
    with pytest.raises(Violation, match="run_mtp_catchup_batched"):
        stash_before_use([stash, catchup, rows, _propose_batched()])


# --- checkpoint before the self-speculative verify (specs/speculation.md §6.15) ------------------------------


def test_the_self_speculative_checkpoint_goes_between_the_rewind_and_the_verify():
    verify = dc.DecodeVerify(1, (11, 12, 13))
    checkpoint_before_self_verify([dc.TruncateSequence(1, 6), dc.CheckpointSsmStates(1), verify])
    checkpoint_before_self_verify([dc.CheckpointSsmStates(1), verify])  # no draft decodes: nothing to rewind
    with pytest.raises(Violation, match="rewound after its checkpoint_ssm_states"):
        checkpoint_before_self_verify([dc.CheckpointSsmStates(1), dc.TruncateSequence(1, 6), verify])
    with pytest.raises(Violation, match="no checkpoint_ssm_states"):
        checkpoint_before_self_verify([dc.TruncateSequence(1, 6), verify])
    with pytest.raises(Violation, match="no checkpoint_ssm_states"):  # another sequence's checkpoint
        checkpoint_before_self_verify([dc.TruncateSequence(1, 6), dc.CheckpointSsmStates(2), verify])


# --- snapshot before checkpoint (specs/watchdog.md §7.4) -----------------------------------------------------


def test_a_snapshot_save_goes_before_its_token_s_checkpoint():
    snapshot_before_checkpoint([lc.SsmSnapshotSave(1, 0), lc.MarconiCheckpoint(1), TokenOut(7, 12)])
    # another sequence's checkpoint may come first (one row after another)
    snapshot_before_checkpoint([lc.MarconiCheckpoint(2), lc.SsmSnapshotSave(1, 0), lc.MarconiCheckpoint(1)])
    with pytest.raises(Violation, match="snapshot_before_checkpoint"):
        snapshot_before_checkpoint([lc.MarconiCheckpoint(1), lc.SsmSnapshotSave(1, 0), TokenOut(7, 12)])
    with pytest.raises(Violation, match="snapshot_before_checkpoint"):
        snapshot_before_checkpoint([lc.MarconiCheckpoints((2, 1)), lc.SsmSnapshotSave(1, 0)])


# --- the barrier on the prefill stream, across batches (specs/scheduler.md §5.10, §5.13, §5.15) --------------


def _run(*batches, faults: tuple[int, ...] = ()) -> None:
    """Each batch in turn through one ``Orderings``; the batches at ``faults`` answer a fault."""
    orderings = Orderings()
    for at, batch in enumerate(batches):
        orderings.check(batch, tuple(map(type, batch)), at in faults)


def _chunk(seq: int = 5, last: bool = False) -> list:
    return [dc.PrefillChunk(seq, PROMPT, 0, 4, last, 1)]


BARRIER = [dc.RecordEvent(2, 1), dc.StreamWaitEvent(0, 2)]
FIRST_TOKEN = [dc.ArgmaxOnDevice(0, 0)]
DECODE = [plans.Decode((10,), (3,), (7,))]


def test_a_read_after_the_barrier_passes():
    _run(_chunk(last=True), BARRIER + FIRST_TOKEN)
    _run(_chunk(), [dc.NormalizeSsmStates(5, 1), dc.NumFreeBlocks()], BARRIER + DECODE)
    _run(_chunk(), [dc.SyncSecondaryCall(), *_k2_words(), dc.DecodeVerifyGraphed(3, (10, 11))])  # a sync waits too


@pytest.mark.parametrize("read", [FIRST_TOKEN, DECODE, [dc.DecodeCall(10, 3)], [dc.CopyLogitsToHost(0, 1, ())]],
                         ids=lambda r: type(r[0]).__name__)
def test_a_read_before_the_barrier_is_refused(read):
    with pytest.raises(Violation, match="barrier_before_read"):
        _run(_chunk(), [dc.NumFreeBlocks()], read)
    with pytest.raises(Violation, match="barrier_before_read"):  # a wait before its record waits for nothing
        _run(_chunk(), [dc.StreamWaitEvent(0, 2), dc.RecordEvent(2, 1)] + read)


def test_work_after_the_record_is_not_covered_by_its_wait():
    with pytest.raises(Violation, match=r"sequences \[6\]"):
        _run(_chunk(5), [dc.RecordEvent(2, 1), dc.NormalizeSsmStates(6, 1), dc.StreamWaitEvent(0, 2)] + DECODE)


def test_a_wait_covers_only_the_work_recorded_before_it():
    _run(_chunk(5, last=True), BARRIER + FIRST_TOKEN, [dc.NumFreeBlocks()], DECODE)
    with pytest.raises(Violation, match=r"sequences \[5\]"):  # the same prompt's next chunk, then a stale wait
        _run(_chunk(5), BARRIER + [dc.NumFreeBlocks()], _chunk(5), [dc.StreamWaitEvent(0, 2)] + DECODE)


def test_the_decode_stream_s_own_work_needs_no_barrier():
    _run([dc.Prefill(5, PROMPT, 0)], FIRST_TOKEN)
    _run([dc.MixedForward((10,), (3,), dc.PrefillSlice(5, PROMPT, 0, 4, False), 1)], BARRIER + FIRST_TOKEN, DECODE)


def test_a_released_prompt_or_a_failed_chunk_needs_no_barrier():
    release = [lc.ReleaseSeq(5, 1, cache=False, reason=SEND_ERROR), dc.NumFreeBlocks()]
    _run(_chunk(5), release, DECODE)
    _run(_chunk(5), [dc.NumFreeBlocks()], DECODE, faults=(1,))  # the chunk failed: nothing was queued
    with pytest.raises(Violation, match="barrier_before_read"):  # but the work queued before it stays
        _run(_chunk(5), _chunk(5), [dc.NumFreeBlocks()], DECODE, faults=(2,))


# --- the monitor runs them -------------------------------------------------------------------------------


def test_the_monitor_checks_the_orders_of_every_batch():
    monitor = Monitor((), SimDevice({1: Script(4, (10, 11, 12))}), counts_acc=False)
    monitor.on_effects([dc.SyncSecondaryCall(), *_k2_words(), dc.DecodeVerifyGraphed(1, (10, 11))])
    with pytest.raises(Violation, match="sync_before_verify"):
        monitor.on_effects([*_k2_words(), dc.SyncSecondaryCall(), dc.DecodeVerifyGraphed(1, (10, 11))])
    monitor = Monitor((), SimDevice({1: Script(4, (10, 11, 12))}), counts_acc=False)
    monitor.on_effects(_chunk())
    with pytest.raises(Violation, match="barrier_before_read"):
        monitor.on_effects(DECODE)
