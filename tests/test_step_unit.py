"""Unit tests of ``step``: build a state, feed the event a device would send, assert effects and state."""

from __future__ import annotations

import pytest

from fxsched.core import events as ev
from fxsched.core.machine import PhaseError, step
from fxsched.core.retire import compaction_moves, finish_reason
from fxsched.core.verdict import accepted_prefix, acc_gain, base_draft_count
from fxsched.effects import device_calls as dc
from fxsched.effects import lifecycle as lc
from fxsched.effects import plans
from fxsched.effects.client import DoneOut, ErrorOut, ResponseOut

from factories import Driver, dflash_config, dflash_model, make_config, make_model, make_request, of_type




# --- the phase machine ---------------------------------------------------------------------------


def test_boot_binds_the_gpu_then_asks_for_the_prefill_stream():
    d = Driver()
    assert isinstance(d.effects[0], dc.BindGpuToThread)
    assert isinstance(d.query, dc.CreateStream)


def test_boot_twice_is_a_phase_error():
    d = Driver()
    with pytest.raises(PhaseError, match="Boot"):
        step(d.state, ev.Boot())


def test_an_answer_that_does_not_fit_the_phase_names_phase_and_event_and_changes_nothing():
    d = Driver()
    before = d.state
    with pytest.raises(PhaseError, match="AwaitStream.*TokenSampled"):
        step(d.state, ev.TokenSampled(3))
    assert d.state is before


def test_an_answer_before_boot_is_a_phase_error():
    d = Driver(boot=False)
    with pytest.raises(PhaseError, match="no query is outstanding"):
        step(d.state, ev.FreeBlocks(3))


def test_arrivals_are_taken_in_any_phase_without_effects():
    d = Driver()
    state, effects = step(d.state, ev.Arrival(make_request(7)))
    assert effects == ()
    assert [r.id for r in state.inbox] == [7]
    assert state.waiting == d.state.waiting


def test_with_nothing_to_do_the_engine_waits_blocking_for_input():
    d = Driver().run_to_query(dc.WaitForInput)
    assert d.state.active == () and d.state.pending == ()


def test_inbox_closed_while_idle_shuts_down_in_order():
    d = Driver().run_to_query(dc.WaitForInput)
    d.feed(ev.InboxClosed())
    d.feed(ev.InputReady())
    assert isinstance(d.query, dc.NumFreeBlocks)  # the final idle tick is still published
    effects = d.feed(ev.FreeBlocks(10))
    assert [type(e) for e in effects[:2]] == [dc.SsmSnapshotOccupancy, dc.SsmSnapshotOccupancy]
    tail = [type(e) for e in effects if isinstance(e, lc.Lifecycle)]
    assert tail == [lc.EpShutdown, lc.Quiesce, lc.Quiesce, lc.Teardown]
    assert [e.stream for e in effects if isinstance(e, lc.Quiesce)] == [0, 1]
    assert d.state.stopped
    with pytest.raises(PhaseError):
        step(d.state, ev.FreeBlocks(1))


# --- admission -------------------------------------------------------------------------------------


def test_admission_asks_the_cohort_adapter_then_one_per_new_request():
    d = Driver(requests=[make_request(1), make_request(2)]).run_to_query(dc.AdapterIdFor)
    assert d.query.slots == (-1, -1, -1)


def test_kv_reservation_defers_a_request_that_does_not_fit_back_to_the_front():
    model = make_model(total_blocks=3)  # each request commits blocks_for(20 + 8) = 2
    d = Driver(model=model, requests=[make_request(1, prompt_len=20, max_tokens=8),
                                      make_request(2, prompt_len=20, max_tokens=8)])
    d.run_to_query(dc.AdapterIdFor).answer()
    assert [r.id for r in d.state.new_requests] == [1]
    assert [r.id for r in d.state.pending] == [2]


def test_the_first_request_is_admitted_anyway_when_nothing_is_committed():
    d = Driver(model=make_model(total_blocks=3), requests=[make_request(1, prompt_len=40)])  # commits 4 blocks
    d.run_to_query(dc.AdapterIdFor).answer()
    assert [r.id for r in d.state.new_requests] == [1]


def test_fifo_takes_at_most_the_free_batch_seats():
    reqs = [make_request(i) for i in range(1, 5)]
    d = Driver(config=make_config(max_batch_size=2), requests=reqs).run_to_query(dc.AdapterIdFor)
    assert [r.id for r in d.state.new_requests] == [1, 2]
    assert [r.id for r in d.state.pending] == [3, 4]


# --- lane 1: prefill and the first token ----------------------------------------------------------------


def test_prefill_has_the_ep_preamble_and_reads_the_first_token_by_device_argmax():
    d = Driver(requests=[make_request(1, prompt_len=5)]).run_to_query(dc.Prefill)
    eps = of_type(d.effects, dc.EpBroadcastCmd)
    assert [e.cmd for e in eps] == [5, 0, 5]
    assert of_type(d.effects, dc.EpBroadcastCmdForSeq)[0].cmd == 0xFFFFFFF0
    assert d.query.tokens[0] == 1
    d.feed(ev.ForwardDone())
    assert d.query.row == 0


def test_a_sampled_request_reads_its_first_token_on_the_host():
    d = Driver(requests=[make_request(1, temperature=0.7)]).run_to_query(dc.CopyLogitsToHost)
    assert d.query.n == 1 and d.query.picks[0].temperature == 0.7 and d.query.picks[0].seed == 42


def test_the_first_token_is_streamed_and_the_sequence_becomes_active():
    d = Driver(requests=[make_request(1)]).run_to_query(dc.ArgmaxOnDevice)
    d.feed(ev.TokenSampled(12))
    assert d.streamed(1) == [12]
    (seq,) = d.state.active
    assert seq.seq_len == 5 and seq.last_token == 12 and seq.remaining == 7 and len(seq.output) == 1


def test_a_first_token_that_is_eos_finishes_and_releases_at_once():
    d = Driver(requests=[make_request(1)]).run_to_query(dc.ArgmaxOnDevice)
    effects = d.feed(ev.TokenSampled(63))
    assert of_type(effects, DoneOut) == [DoneOut(1, "stop", 1, 0, 0, 0, None)]
    assert of_type(effects, lc.ReleaseSeq)[0].reason == "finish_sequence"
    assert d.state.active == ()


# --- plain decode -------------------------------------------------------------------------------------------


def test_plain_decode_feeds_the_last_tokens_sorted_by_slot_with_argmax_readback():
    d = Driver(requests=[make_request(1), make_request(2)]).run_to_query(plans.Decode)
    assert d.query.tokens == (10, 20)
    assert d.query.seq_lens == (5, 5)
    assert d.query.label == "Decode{n=2, ctx=Unified, readback=Argmax}"


def test_a_row_asking_for_logprobs_makes_the_whole_batch_host_read():
    d = Driver(requests=[make_request(1), make_request(2, top_logprobs=2)]).run_to_query(plans.Decode)
    assert d.query.readback == "HostLogits" and len(d.query.picks) == 2


def test_an_eos_row_is_appended_but_neither_streamed_nor_checkpointed():
    d = Driver(requests=[make_request(1), make_request(2)]).run_to_query(plans.Decode)
    effects = d.feed(ev.TokensSampled((63, 21)))
    marconi = [e.seq for e in of_type(effects, lc.MarconiCheckpoint)]
    assert len(marconi) == 1
    assert 63 not in d.streamed(1)
    assert of_type(effects, DoneOut) == [DoneOut(1, "stop", 2, 0, 0, 0, None)]


def test_a_row_whose_budget_runs_out_is_checkpointed_streamed_and_finished_by_length():
    d = Driver(requests=[make_request(1, max_tokens=2)]).run_to_query(plans.Decode)
    effects = d.feed(ev.TokensSampled((11,)))
    assert of_type(effects, lc.MarconiCheckpoint)
    assert of_type(effects, DoneOut) == [DoneOut(1, "length", 2, 0, 0, 0, None)]


def test_a_blocking_request_gets_one_response_with_every_token():
    d = Driver(requests=[make_request(1, max_tokens=3, streaming=False)])
    d.run_until(lambda d: bool(d.outputs(ResponseOut)))
    assert d.outputs(ResponseOut) == [ResponseOut(1, (10, 11, 12), "length", 0, 0, 0, 0)]
    assert d.streamed(1) == []


def test_a_failed_prefill_fails_only_its_request():
    d = Driver(requests=[make_request(1), make_request(2)]).run_to_query(dc.Prefill)
    effects = d.feed(ev.DeviceFault("out of KV blocks"))
    assert of_type(effects, ErrorOut) == [ErrorOut(1, "out of KV blocks", True)]
    assert of_type(effects, lc.ReleaseSeq)[0].reason == "send_error"
    assert isinstance(d.query, dc.AllocSequence) and d.query.session == 2


def test_a_device_fault_fails_only_the_batch_and_frees_it_without_caching():
    d = Driver(requests=[make_request(1)]).run_to_query(plans.Decode)
    effects = d.feed(ev.DeviceFault("boom"))
    release = of_type(effects, lc.ReleaseSeq)
    assert release and not release[0].cache and release[0].reason == "send_error"
    assert d.state.active == ()


# --- retirement, compaction, finish reasons ---------------------------------------------------------------------


def test_retirement_releases_finished_sequences_in_active_order_and_compacts_survivors():
    d = Driver(requests=[make_request(1), make_request(2), make_request(3)]).run_to_query(plans.Decode)
    effects = d.feed(ev.TokensSampled((63, 21, 31)))
    assert [e.seq for e in of_type(effects, lc.ReleaseSeq)] == [1]
    assert [(e.target) for e in of_type(effects, lc.CompactSlot)] == [0]
    assert sorted(s.slot for s in d.state.active) == [0, 1]


@pytest.mark.parametrize("slots, moves", [
    ([0, 1, 3], [(2, 2)]),
    ([3, 1, 4], [(0, 2), (2, 0)]),
    ([0, 1, 2], []),
    ([5], [(0, 0)]),
])
def test_compaction_moves_take_the_largest_free_target(slots, moves):
    assert compaction_moves(slots) == moves


@pytest.mark.parametrize("guard, last, remaining, seq_len, reason", [
    ("request_timeout", 63, 0, 10, "timeout"),
    (None, 63, 0, 10, "stop"),
    ("content_loop_watchdog", 63, 3, 10, "stop"),
    ("content_loop_watchdog", 12, 3, 10, "length"),
    (None, 12, 0, 10, "length"),
    (None, 12, 3, 4095, "length"),
    (None, 12, 3, 10, "stop"),
])
def test_finish_reason_precedence(guard, last, remaining, seq_len, reason):
    assert finish_reason(guard, last, remaining, seq_len, make_config()) == reason


def test_a_tool_call_end_token_finishes_with_tool_calls_after_eos():
    config = make_config()
    assert finish_reason(None, 50, 3, 10, config, tool_call_end=50) == "tool_calls"
    assert finish_reason("x", 50, 3, 10, config, tool_call_end=50) == "tool_calls"


def test_an_expired_deadline_finishes_with_the_timeout_guard_at_end_of_tick():
    d = Driver(requests=[make_request(1, deadline_ms=-1.0), make_request(2)])
    d.run_until(lambda d: bool(d.outputs(DoneOut)))
    done = d.outputs(DoneOut)[0]
    assert done.request_id == 1 and done.reason == "timeout" and done.guard == "request_timeout"
    assert done.n == 2  # prefilled, then one decode step before the end of the tick


# --- speculation ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("drafts, rows, na", [
    ((1, 2, 3), (1, 2, 3, 4), 3),
    ((1, 2, 3), (1, 9, 3, 4), 1),
    ((1, 2, 3), (9, 2, 3, 4), 0),
    ((), (5,), 0),
    ((1, 2, 3, 4, 5), (1, 2), 1),
])
def test_accepted_prefix(drafts, rows, na):
    assert accepted_prefix(drafts, rows) == na


def test_acc_gain_counts_only_kept_drafts():
    assert acc_gain(10, 11) == 0 and acc_gain(10, 15) == 4 and acc_gain(10, 9) == 0


def test_mtp_draft_ladder_and_clamp():
    model = make_model(has_proposer=True)
    assert base_draft_count(make_config(use_speculative=True, num_drafts=3), model, 8) == 3
    assert base_draft_count(make_config(use_speculative=True, num_drafts=3), model, 9) == 1
    assert base_draft_count(make_config(use_speculative=True, num_drafts=2), model, 1) == 2


def test_slot_capacity_clamps_the_draft_count():
    d = Driver(config=dflash_config(), model=dflash_model(), requests=[make_request(1), make_request(2)])
    d.run_to_query(dc.SlotDraftCapacity)
    d.feed(ev.DraftCapacity((8, 3)))
    assert d.query.n == 3


def _dflash_pair_at_batched_verify():
    requests = [make_request(1, max_tokens=100), make_request(2, max_tokens=100)]
    d = Driver(config=dflash_config(), model=dflash_model(), requests=requests)
    d.run_to_query(dc.DecodeVerifyBatched)
    return d


def test_a_dflash_pair_is_verified_in_one_batch_after_the_gate():
    d = _dflash_pair_at_batched_verify()
    gate = [e for e in d.history if isinstance(e, dc.CanBatchVerify)]
    assert gate[-1].ks == (6, 6)
    assert d.query.ks == (6, 6) and d.query.woa


def test_batched_full_accept_keeps_every_draft_and_reproposes_in_one_batch():
    d = _dflash_pair_at_batched_verify()
    pre = {s.seq_id: s.seq_len for s in d.state.active}
    d.answer()
    assert all(s.seq_len == pre[s.seq_id] + 6 for s in d.state.active)
    assert isinstance(d.query, dc.ProposeBatched) and d.query.stash == (0, 1)
    assert [s.acc for s in d.state.active] == [8, 8]  # 3 from the bootstrap's K = 4, 5 now


def test_batched_partial_accept_rewinds_to_the_accepted_prefix():
    d = _dflash_pair_at_batched_verify()
    tokens, pre = d.query.tokens, {s.seq_id: s.seq_len for s in d.state.active}
    rows = (tokens[1], tokens[2], 0, 0, 0, 0) + (0,) * 6  # seq 1 keeps 2 drafts, seq 2 none
    effects = d.feed(ev.VerifyRows(rows))
    trunc = dict(of_type(effects, dc.TruncateSequences)[0].entries)
    assert trunc == {1: pre[1] + 3, 2: pre[2] + 1}
    assert [s.seq_len for s in d.state.active] == [pre[1] + 3, pre[2] + 1]
    ctx = of_type(effects, dc.CommitCtxBatch)[0].entries
    assert ctx == ((1, 3, pre[1], 0), (2, 1, pre[2], 1))
    assert d.streamed(2)[-1] == 0


def test_gdn_fold_comes_before_any_commit_of_the_batch():
    d = _dflash_pair_at_batched_verify()
    effects = d.answer()
    kinds = [type(e) for e in effects]
    assert kinds.index(dc.GdnFoldAccepted) < kinds.index(dc.CommitAcceptedPrefixBatch)


def test_eos_inside_the_accepted_drafts_finishes_without_trim_or_propose_but_still_commits():
    d = _dflash_pair_at_batched_verify()
    tokens = d.query.tokens
    rows = (63, 63, 63, 63, 63, 1) * 2
    effects = d.feed(ev.VerifyRows(rows))
    assert len(of_type(effects, dc.CommitAcceptedPrefixBatch)[0].entries) == 2
    assert not of_type(effects, dc.TrimProposerStateBatch)
    assert not of_type(effects, dc.ProposeBatched)
    assert [o.reason for o in of_type(effects, DoneOut)] == ["stop", "stop"]
    assert tokens[0] not in (63,)


def test_a_refused_batch_falls_back_to_serial_dflash_verifies():
    d = Driver(config=dflash_config(), model=dflash_model(), requests=[make_request(1), make_request(2)])
    d.run_to_query(dc.CanBatchVerify)
    d.run_until(lambda d: isinstance(d.query, dc.CanBatchVerify) and d.state.tick >= 2)
    d.feed(ev.BatchVerifyAllowed(False))
    assert isinstance(d.query, dc.DecodeVerifyDflash)


def test_a_cancel_is_seen_by_the_next_speculative_emit_and_nothing_is_streamed():
    d = _dflash_pair_at_batched_verify()
    before = len(d.streamed(1))
    d.feed(ev.Cancel(1))
    d.answer()
    assert len(d.streamed(1)) == before
    assert isinstance(d.query, dc.ProposeMulti)  # only the other sequence re-proposes
    d.run_until(lambda d: bool(d.outputs(DoneOut)))
    assert [o.request_id for o in d.outputs(DoneOut)] == [1]
    assert d.outputs(DoneOut)[0].reason == "stop"


def test_a_rotation_waits_until_nothing_is_in_flight():
    d = Driver(requests=[make_request(1, max_tokens=2)])
    d.feed(ev.RotationRequested("adapter-x"))
    d.run_to_query(lc.LoraRotate)
    assert d.state.active == () and d.outputs(DoneOut)


def test_compaction_never_targets_a_slot_held_by_a_prefilling_prompt():
    # found by the model checker: survivors at slots 0 and 3, prompts prefilling in slots 1 and 2
    assert compaction_moves([0, 3], pinned_slots=(1, 2)) == []
    assert compaction_moves([0, 5], pinned_slots=(1,)) == [(1, 2)]


def test_a_prompt_longer_than_the_context_is_refused_at_admission_with_a_clear_error():
    d = Driver(config=make_config(max_seq_len=8), requests=[make_request(1, prompt_len=9), make_request(2)])
    effects = d.run_to_query(dc.AdapterIdFor).answer()
    assert of_type(effects, ErrorOut) == [ErrorOut(1, "request 1: the prompt has 9 tokens, the context holds 8", True)]
    assert [r.id for r in d.state.new_requests] == [2]


def test_a_prompt_that_needs_more_blocks_than_the_device_has_is_refused():
    d = Driver(model=make_model(total_blocks=2), requests=[make_request(1, prompt_len=40)])
    effects = d.run_to_query(dc.AdapterIdFor).answer()
    assert "needs 3 KV blocks, the device has 2" in of_type(effects, ErrorOut)[0].message


def test_a_request_drained_by_the_idle_check_is_still_served_after_the_inbox_closes():
    # found by the hypothesis state machine: a rotation made the tick non-blocking, the idle
    # check drained a new request together with the closure, and the loop shut down without it
    d = Driver(requests=[make_request(1, max_tokens=2)])
    d.feed(ev.RotationRequested("a"))
    d.run_to_query(lc.LoraRotate)
    d.feed(ev.Arrival(make_request(2, max_tokens=2)))
    d.feed(ev.InboxClosed())
    d.finish()
    assert sorted(o.request_id for o in d.outputs(DoneOut)) == [1, 2]


def test_a_request_for_an_unknown_adapter_is_refused_by_name():
    d = Driver(requests=[make_request(1, adapter_slot=7), make_request(2)]).run_to_query(dc.AdapterIdFor)
    assert d.query.slots == (7, 7, -1)
    effects = d.feed(ev.AdapterIds((-1, -1, 0)))
    assert of_type(effects, ErrorOut) == [ErrorOut(1, "request 1: unknown adapter slot 7", True)]
    assert [r.id for r in d.state.new_requests] == [2]


def test_a_cancel_for_a_running_request_goes_to_its_flag_and_is_not_kept_around():
    d = Driver(requests=[make_request(1, max_tokens=9)]).run_to_query(plans.Decode)
    d.feed(ev.Cancel(1))
    assert d.state.active[0].cancel_requested and d.state.cancels == frozenset()


def test_a_cancel_before_the_request_is_admitted_ends_its_stream_at_the_first_tick():
    d = Driver(requests=[make_request(1), make_request(2)], boot=False)
    d.feed(ev.Cancel(1))
    d.feed(ev.Boot())
    d.run_to_query(plans.Decode)
    assert [s.request_id for s in d.state.active] == [2] and d.state.cancels == frozenset()
    assert d.outputs(DoneOut) == [DoneOut(1, "stop", 0, 0, 0, 0, None)]


def test_a_cancel_during_a_chunked_prefill_is_consumed_when_the_request_becomes_active():
    """Admitted but still prefilling: the cancel waits for the sequence and moves to its flag."""
    config = make_config(max_prefill_tokens=4)
    d = Driver(config=config, requests=[make_request(1, prompt_len=12)]).run_to_query(dc.PrefillChunk)
    d.feed(ev.Cancel(1))
    assert d.state.cancels == frozenset({1})
    d.run_until(lambda d: bool(d.state.active))
    assert d.state.active[0].cancel_requested and d.state.cancels == frozenset()
