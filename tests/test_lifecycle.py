"""Memory pressure, deadlines, rotation, watchdogs and faults."""

from __future__ import annotations

import pytest

from fxsched.core import events as ev
from fxsched.core.config import ModelInfo, SchedulerConfig
from fxsched.core.memory import preemption_victim, swap_victim
from fxsched.core.retire import finish_reason
from fxsched.core.sequence import Sequence
from fxsched.core.watchdog import (
    content_loop,
    fuzzy_repetition,
    ring_save,
    ring_truncate,
    rollback_boundary,
    roll_back,
)
from fxsched.effects import device_calls as dc
from fxsched.effects import lifecycle as lc
from fxsched.effects import plans
from fxsched.effects.client import DoneOut, ErrorOut
from fxsched.runtime.devices.recording import DeviceConfig
from fxsched.runtime.scenarios.runner import execute_scenario
from fxsched.runtime.scenarios.loader import RequestSpec, RunOptions, Scenario

from factories import Driver, make_config, make_request, of_type


def seq(seq_id=1, slot=0, output=(1,), blocks=1, immune_until=0, **kw) -> Sequence:
    req = make_request(seq_id, streaming=kw.pop("streaming", True))
    return Sequence(seq_id=seq_id, request=req, slot=slot, seq_len=5 + len(output) - 1, blocks=blocks,
                    output=output, remaining=10, last_token=output[-1], immune_until=immune_until, **kw)


# --- victims ----------------------------------------------------------------------------------------


def test_the_preemption_victim_has_the_fewest_outputs_then_the_lowest_slot():
    active = (seq(1, slot=2, output=(1, 2)), seq(2, slot=1, output=(1, 2)), seq(3, slot=0, output=(1, 2, 3)))
    assert preemption_victim(active).seq_id == 2


def test_an_immune_sequence_is_spared_unless_all_are_immune():
    active = (seq(1, slot=0, output=(1,), immune_until=65), seq(2, slot=1, output=(1, 2, 3)))
    assert preemption_victim(active).seq_id == 2
    all_immune = (seq(1, slot=0, output=(1,), immune_until=65), seq(2, slot=1, output=(1, 2), immune_until=66))
    assert preemption_victim(all_immune).seq_id == 1


def test_the_swap_victim_has_the_longest_block_table_ties_to_the_last():
    active = (seq(1, blocks=3), seq(2, blocks=5), seq(3, blocks=5), seq(4, blocks=2))
    assert swap_victim(active).seq_id == 3


def test_kv_exhaustion_preempts_one_victim_and_retries_the_batch_smaller():
    d = Driver(requests=[make_request(1), make_request(2), make_request(3)]).run_to_query(plans.Decode)
    effects = d.feed(ev.DeviceFault("KV cache exhausted", kv_exhausted=True))
    (release,) = of_type(effects, lc.ReleaseSeq)
    assert release.reason == "preempt_requeue" and release.cache
    assert len(d.query.seqs) == 2
    assert [p.sequence.request_id for p in d.state.preempted] == [1]
    d.answer()
    d.run_until(lambda d: not d.state.preempted)
    resumed = next(s for s in d.state.active if s.request_id == 1)
    assert resumed.immune_until == len(resumed.output) + 64


def test_kv_exhaustion_with_one_sequence_fails_its_client():
    d = Driver(requests=[make_request(1)]).run_to_query(plans.Decode)
    effects = d.feed(ev.DeviceFault("KV cache exhausted", kv_exhausted=True))
    assert of_type(effects, ErrorOut) == [ErrorOut(1, "KV cache exhausted", True)]


# --- deadlines, rotation, finish reasons ------------------------------------------------------------------


def test_a_deadline_is_enforced_only_at_the_end_of_a_tick_from_the_clock():
    d = Driver(requests=[make_request(1, deadline_ms=500.0, max_tokens=40)]).run_to_query(plans.Decode)
    d.answer()
    d.run_to_query(plans.Decode)
    assert d.outputs(DoneOut) == []
    d.feed(ev.Clock(600.0))
    d.answer()
    d.run_until(lambda d: bool(d.outputs(DoneOut)))
    assert d.outputs(DoneOut)[0].reason == "timeout"


def test_a_rotation_is_not_applied_while_a_request_is_prefilling_or_active():
    d = Driver(requests=[make_request(1, max_tokens=3)])
    d.feed(ev.RotationRequested("a"))
    d.run_to_query(plans.Decode)
    assert d.state.rotations == ("a",)
    d.run_to_query(lc.LoraRotate)
    assert d.state.active == ()


@pytest.mark.parametrize("guard, reason", [("fuzzy_repetition", "length"), ("content_loop_watchdog", "length"),
                                           ("request_timeout", "timeout")])
def test_guards_finish_with_their_reason_even_on_eos(guard, reason):
    config = make_config()
    want = "timeout" if guard == "request_timeout" else "stop"
    assert finish_reason(guard, 63, 5, 10, config) == want
    assert finish_reason(guard, 12, 5, 10, config) == reason


# --- watchdogs ------------------------------------------------------------------------------------------------


def test_content_loop_needs_three_copies_of_a_period():
    assert content_loop((9, 1, 2, 3, 1, 2, 3, 1, 2, 3))
    assert not content_loop((9, 1, 2, 3, 1, 2, 3, 1, 2, 4))
    assert not content_loop((1, 1))


def test_fuzzy_repetition_tolerates_a_few_mismatches_per_window():
    block = list(range(20, 39))
    out = list(range(100, 150)) + [12] + list(range(151, 160)) + (block + [12]) * 2 + block  # specs/watchdog.md §7.6
    assert len(out) == 119
    assert fuzzy_repetition(tuple(out)) == 20
    assert fuzzy_repetition(tuple(range(100, 200))) is None
    assert fuzzy_repetition(tuple(block * 3)) is None  # below 90 tokens


def test_the_ring_overwrites_its_oldest_slot_and_truncation_moves_the_cursor():
    ring, cursor = (), 0
    for pos in (10, 20, 30):
        ring, cursor, _ = ring_save(ring, cursor, 2, pos)
    assert sorted(ring) == [(0, 30), (1, 20)] and cursor == 1
    kept, cursor = ring_truncate(ring, 25, 2)
    assert kept == ((1, 20),) and cursor == 0


def test_rollback_goes_to_the_last_boundary_with_a_snapshot_and_rewinds_everything():
    model = ModelInfo(has_ssm_layers=True, ring_slots=8)
    config = SchedulerConfig(loop_watchdog=True, boundary_tokens=(12,))
    out = (1, 2, 12, 3, 4, 12, 5, 6, 7, 8)
    s = seq(output=out, streaming=False, ring=((0, 3), (1, 6)), ring_cursor=2, has_cancel_flag=False)
    assert rollback_boundary(s, 4, config, model) == (5, 1)
    assert rollback_boundary(s, 5, config, model) == (2, 0)
    effects: list = []
    rolled = roll_back(s, 2, 0, model, effects)
    assert rolled.output.tokens() == (1, 2, 12) and rolled.last_token == 12
    assert rolled.seq_len == s.seq_len - 7 and rolled.remaining == s.remaining + 7 and rolled.rollbacks == 1
    assert rolled.ring == ((0, 3),) and rolled.ring_cursor == 1
    assert isinstance(effects[0], lc.SsmSnapshotRestore) and effects[0].slot == 0


def test_rollback_is_declined_for_streams_after_two_rollbacks_and_without_snapshots():
    model = ModelInfo(has_ssm_layers=True, ring_slots=8)
    config = SchedulerConfig(loop_watchdog=True, boundary_tokens=(12,))
    out = (1, 12, 3, 4, 5, 6)
    blocking = dict(streaming=False, has_cancel_flag=False, ring=((0, 2),))
    assert rollback_boundary(seq(output=out, **blocking), 2, config, model) == (1, 0)
    assert rollback_boundary(seq(output=out, ring=((0, 2),)), 2, config, model) is None
    assert rollback_boundary(seq(output=out, rollbacks=2, **blocking), 2, config, model) is None
    assert rollback_boundary(seq(output=out, streaming=False, has_cancel_flag=False), 2, config, model) is None
    assert rollback_boundary(seq(output=out, **blocking), 2, config, ModelInfo(has_ssm_layers=True)) is None


# --- faults, through the recording device -----------------------------------------------------------------------


def _run(model: dict, options: dict, requests: list[RequestSpec]):
    scenario = Scenario("fault", DeviceConfig(**model), RunOptions(**options), tuple(requests))
    return execute_scenario(scenario)


SPILL = dict(total_blocks=10, held_blocks=4)
SPILL_REQUESTS = [RequestSpec(id=1, prompt_len=32, tokens=(10, 11, 12, 13, 14, 15, 63), max_tokens=7),
                  RequestSpec(id=2, prompt_len=96, tokens=(20, 21, 22, 63), max_tokens=4, arrive_at_tick=2)]


def test_a_spill_round_trip_restores_the_stream_exactly():
    result = _run(SPILL, dict(swap_space_gb=1), SPILL_REQUESTS)
    assert result.host.streams[1][-1].startswith("Done(stop, n=7")
    assert " ".join(result.host.streams[1][:-1]) == "T10 T11 T12 T13 T14 T15"


@pytest.mark.parametrize("fault, words", [("spill_corrupt_for", "checksum mismatch"), ("spill_missing_for", "missing")])
def test_a_bad_spill_file_fails_only_its_request_and_frees_its_blocks(fault, words):
    result = _run(dict(SPILL, **{fault: (1,)}), dict(swap_space_gb=1), SPILL_REQUESTS)
    frames = result.host.streams[1]
    assert frames[-1].startswith("Error(spill file") and words in frames[-1]
    assert frames[:-1] == ["T10", "T11", "T12"]
    assert result.host.streams[2][-1].startswith("Done(stop, n=4")
    assert any("restore_sequence_state" in line and "-> ERR" in line for line in result.lines)
    free_counts = [int(line.split("-> ")[1]) for line in result.lines if line.startswith("num_free_blocks()")]
    assert free_counts[-1] == 6  # every block is back at the end


def test_a_fatal_decode_error_fails_only_the_sequences_of_that_batch():
    requests = [RequestSpec(id=1, prompt_len=5, tokens=(10, 11, 12, 13, 63), max_tokens=5),
                RequestSpec(id=2, prompt_len=5, tokens=(20, 21, 22, 63), max_tokens=4, arrive_at_tick=2)]
    result = _run(dict(decode_fault_at=(1,)), {}, requests)
    assert result.host.streams[1] == ["T10", "T11", "Error(scripted device fault)"]
    assert result.host.streams[2][-1].startswith("Done(stop, n=4")
    assert any(line == "fx apply ReleaseSeq{cache=false, send_error}" for line in result.lines)
    free_counts = [int(line.split("-> ")[1]) for line in result.lines if line.startswith("num_free_blocks()")]
    assert free_counts[-1] == 1000


def test_a_blocking_request_failed_by_a_fault_gets_err():
    requests = [RequestSpec(id=1, prompt_len=5, tokens=(10, 11, 12, 63), max_tokens=4, streaming=False)]
    result = _run(dict(decode_fault_at=(0,)), {}, requests)
    assert result.host.answers[1] == "Err(scripted device fault)"


def test_two_blocking_beam_requests_are_answered_by_one_beam_batch_without_slots():
    from fxsched.core.config import ModelInfo
    from fxsched.effects.client import ResponseOut

    reqs = [make_request(1, streaming=False, num_beams=2), make_request(2, streaming=False, num_beams=3),
            make_request(3)]
    d = Driver(model=ModelInfo(supports_beam=True), requests=reqs).run_to_query(dc.GenerateBeamBatch)
    assert d.query.num_beams == (2, 3)
    assert not any(isinstance(e, dc.AllocSequence) for e in d.history)
    d.answer()
    assert [(o.request_id, o.tokens, o.reason) for o in d.outputs(ResponseOut)] == [(1, (10, 63), "stop"), (2, (10, 63), "stop")]
    assert isinstance(d.query, dc.AllocSequence) and d.query.session == 3


def test_a_swap_out_moves_the_last_sequence_into_the_victims_slot_only_after_the_spill_frees_it():
    # found by the model checker: the move targeted a slot the victim still held
    from fxsched.core.memory import swap_out
    from fxsched.core.state import initial_state
    import attrs as _attrs

    state = _attrs.evolve(initial_state(SchedulerConfig(swap_space_gb=1.0), ModelInfo()),
                          active=(seq(1, slot=0, blocks=5), seq(2, slot=1), seq(3, slot=2)))
    effects: list = []
    state = swap_out(state, state.active[0], effects)
    kinds = [type(e).__name__ for e in effects]
    assert kinds == ["SaveSequenceState", "ReleaseSeq", "CompactSlot", "DetachSlot"]
    assert effects[2].target == 0 and [(s.seq_id, s.slot) for s in state.active] == [(3, 0), (2, 1)]
