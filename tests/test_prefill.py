"""Chunked, mixed and batched prefill: the chunk planner, the policies and the lanes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from fxsched.core import events as ev
from fxsched.core.admission import select_fifo, select_slai, slai_declines
from fxsched.core.chunking import first_chunk_budget, plan_chunks
from fxsched.effects import device_calls as dc
from fxsched.effects import plans
from fxsched.effects.client import DoneOut

from factories import Driver, make_config, make_request, of_type


# --- the planner ------------------------------------------------------------------------------------


def test_a_prompt_that_fits_the_first_budget_is_one_chunk():
    assert plan_chunks(20, 8192, 8) == [(0, 20, True)]


def test_later_chunks_use_the_prefill_budget_and_non_last_chunks_are_multiples_of_four():
    assert plan_chunks(20, 8, 8) == [(0, 8, False), (8, 8, False), (16, 4, True)]
    assert plan_chunks(20, 3, 7) == [(0, 3, False), (3, 4, False), (7, 4, False), (11, 4, False), (15, 5, True)]


def test_small_budgets_still_make_progress():
    assert plan_chunks(5, 1, 2) == [(0, 1, False), (1, 2, False), (3, 2, True)]


def test_the_first_budget_is_the_batch_budget_only_when_nothing_is_in_flight():
    config = make_config(max_prefill_tokens=8, max_batch_tokens=8192)
    assert first_chunk_budget(config, False) == 8192
    assert first_chunk_budget(config, True) == 8


def test_bad_budgets_are_refused():
    with pytest.raises(ValueError):
        plan_chunks(10, 0, 8)


@settings(max_examples=500, deadline=None)
@given(prompt_len=st.integers(1, 5000), first=st.integers(1, 9000), limit=st.integers(1, 600))
def test_chunks_cover_the_prompt_exactly_once_in_order_within_budget(prompt_len, first, limit):
    plan = plan_chunks(prompt_len, first, limit)
    offset = 0
    for index, (start, length, last) in enumerate(plan):
        assert start == offset and length > 0
        assert length <= (first if index == 0 else limit)
        offset += length
        assert last == (offset == prompt_len)
    assert offset == prompt_len and plan[-1][2]


# --- policies -------------------------------------------------------------------------------------------


def test_fifo_takes_the_front_of_the_queue():
    reqs = tuple(make_request(i, prompt_len=p) for i, p in [(1, 30), (2, 5), (3, 9)])
    assert [r.id for r in select_fifo(reqs, 2)] == [1, 2]


def test_slai_keeps_seat_zero_for_the_front_and_fills_the_rest_by_prompt_length():
    reqs = tuple(make_request(i, prompt_len=p) for i, p in [(1, 30), (2, 9), (3, 5), (4, 9)])
    assert [r.id for r in select_slai(reqs, 3)] == [1, 3, 2]
    assert select_slai(reqs, 0) == ()


def test_slai_declines_to_prefill_only_while_running_sequences_near_their_deadline():
    assert slai_declines(900.0, 0.0, 1000.0, True)
    assert not slai_declines(700.0, 0.0, 1000.0, True)
    assert not slai_declines(900.0, 0.0, 1000.0, False)


def test_an_slai_engine_holds_new_requests_back_while_decodes_are_late():
    config = make_config(policy="slai", slai_deadline_ms=100.0, max_prefill_tokens=8)
    d = Driver(config=config, requests=[make_request(1, max_tokens=50)]).run_to_query(plans.Decode)
    d.feed(ev.Clock(1000.0))  # the last decode started at 0: 1000 ms ago
    d.feed(ev.Arrival(make_request(2)))
    d.answer()
    d.run_to_query(dc.NumFreeBlocks)
    assert d.state.new_requests == () and [r.id for r in d.state.pending] == [2]


# --- the lanes ----------------------------------------------------------------------------------------------


def _slices(history):
    """Every prompt chunk the device was asked for, per sequence, in order."""
    chunks: dict[int, list] = {}
    for e in history:
        if isinstance(e, dc.PrefillChunk):
            chunks.setdefault(e.seq, []).append((e.start, e.length, e.last))
        elif isinstance(e, dc.MixedForward):
            chunks.setdefault(e.prefill.seq, []).append((e.prefill.start, e.prefill.length, e.prefill.last))
        elif isinstance(e, (dc.MixedForwardBatch, dc.PrefillBatchChunk)):
            for sl in e.prefills:
                chunks.setdefault(sl.seq, []).append((sl.start, sl.length, sl.last))
    return chunks


def test_a_continuing_prompt_rides_with_the_decode_in_a_mixed_step_and_skips_lane_3():
    config = make_config(max_prefill_tokens=8)
    d = Driver(config=config, requests=[make_request(1, prompt_len=4, max_tokens=20)]).run_to_query(plans.Decode)
    d.feed(ev.Arrival(make_request(2, prompt_len=20, max_tokens=3)))
    d.run_until(lambda d: any(isinstance(e, dc.MixedForward) for e in d.effects))
    mixed = of_type(d.effects, dc.MixedForward)[0]
    assert mixed.prefill.start == 8 and mixed.prefill.length == 8 and not mixed.prefill.last
    d.run_to_query(dc.NumFreeBlocks)
    assert not any(isinstance(e, plans.Decode) for e in d.effects)


def test_prompts_finishing_in_one_step_are_promoted_from_the_last_one_back():
    config = make_config(max_prefill_tokens=8)
    d = Driver(config=config, requests=[make_request(1, prompt_len=4, max_tokens=30)]).run_to_query(plans.Decode)
    d.feed(ev.Arrival(make_request(2, prompt_len=20, max_tokens=3)))
    d.feed(ev.Arrival(make_request(3, prompt_len=18, max_tokens=3)))
    d.run_until(lambda d: any(isinstance(e, dc.MixedForwardBatch) and all(s.last for s in e.prefills)
                              for e in d.effects))
    d.run_to_query(dc.NumFreeBlocks)
    assert [s.request_id for s in d.state.active] == [1, 3, 2]


def test_prompts_arriving_together_are_prefilled_together_when_asked():
    config = make_config(max_prefill_tokens=64, prefill_new_together=True)
    requests = [make_request(i + 1, prompt_len=n, max_tokens=3) for i, n in enumerate((20, 9, 33))]
    d = Driver(config=config, requests=requests)
    d.finish()
    assert len(d.outputs(DoneOut)) == 3
    assert not of_type(d.history, dc.PrefillChunk)  # no prompt ran alone
    wave = of_type(d.history, dc.PrefillBatchChunk)[0]
    assert [(s.start, s.length, s.last) for s in wave.prefills] == [(0, 20, True), (0, 9, True), (0, 33, True)]


def test_a_wave_of_new_prompts_stays_within_the_batch_token_budget():
    config = make_config(max_prefill_tokens=64, max_batch_tokens=45, prefill_new_together=True)
    requests = [make_request(i + 1, prompt_len=20, max_tokens=2) for i in range(3)]
    d = Driver(config=config, requests=requests)
    d.finish()
    assert len(d.outputs(DoneOut)) == 3
    waves = of_type(d.history, dc.PrefillBatchChunk)
    assert [len(w.prefills) for w in waves] == [2]  # 40 tokens; a third prompt would make 60 > 45
    assert sum(s.length for s in waves[0].prefills) <= 45


def test_while_nothing_decodes_a_chunk_takes_the_whole_budget_and_beside_decodes_one_chunk():
    config = make_config(max_prefill_tokens=8, max_batch_tokens=64, prefill_new_together=True,
                         idle_prefill_fills_budget=True)
    d = Driver(config=config, requests=[make_request(1, prompt_len=40, max_tokens=30),
                                        make_request(2, prompt_len=12, max_tokens=30)])
    d.run_to_query(plans.Decode)
    wave = of_type(d.history, dc.PrefillBatchChunk)
    assert [[(s.start, s.length, s.last) for s in w.prefills] for w in wave] == [[(0, 40, True), (0, 12, True)]]
    d.feed(ev.Arrival(make_request(3, prompt_len=30, max_tokens=2)))  # arrives while 1 and 2 decode
    d.finish()
    assert len(d.outputs(DoneOut)) == 3
    beside = [s for e in d.history if isinstance(e, (dc.MixedForward, dc.MixedForwardBatch))
              for s in (e.prefills if isinstance(e, dc.MixedForwardBatch) else (e.prefill,))]
    assert [(s.start, s.length, s.last) for s in beside] == [(0, 8, False), (8, 8, False), (16, 8, False),
                                                             (24, 6, True)]


def test_beside_decodes_a_queue_of_prompts_rides_one_chunk_of_rows_per_step():
    config = make_config(max_prefill_tokens=8, max_batch_tokens=64, prefill_new_together=True,
                         idle_prefill_fills_budget=True)
    d = Driver(config=config, requests=[make_request(1, prompt_len=4, max_tokens=40)]).run_to_query(plans.Decode)
    for i in (2, 3, 4):
        d.feed(ev.Arrival(make_request(i, prompt_len=6, max_tokens=2)))
    d.finish()
    assert len(d.outputs(DoneOut)) == 4
    mixed = [e for e in d.history if isinstance(e, (dc.MixedForward, dc.MixedForwardBatch))]
    rows = [[s.length for s in (e.prefills if isinstance(e, dc.MixedForwardBatch) else (e.prefill,))] for e in mixed]
    assert rows == [[6], [6], [6]]  # without the bound: one forward of [6, 6, 6] beside the stream


def _prompt_rows_beside_decodes(d: Driver) -> list[tuple[int, list[tuple[int, int, bool]]]]:
    """(decode rows, [(start, length, last) of each chunk]) of every mixed forward, in order."""
    out = []
    for e in d.history:
        if isinstance(e, (dc.MixedForward, dc.MixedForwardBatch)):
            chunks = e.prefills if isinstance(e, dc.MixedForwardBatch) else (e.prefill,)
            out.append((len(e.decode_seqs), [(s.start, s.length, s.last) for s in chunks]))
    return out


def test_the_mixed_prefill_bound_grows_with_the_decoding_streams():
    """§5.13 C: beside d decoding streams a step takes at most max(floor, per_decode * d) prompt rows,
    never over max_prefill_tokens; with nothing decoding the idle budget still applies."""
    config = make_config(max_prefill_tokens=16, max_batch_tokens=64, prefill_new_together=True,
                         idle_prefill_fills_budget=True, mixed_prefill_floor=4, mixed_prefill_per_decode=4)
    one = Driver(config=config, requests=[make_request(1, prompt_len=4, max_tokens=40)]).run_to_query(plans.Decode)
    one.feed(ev.Arrival(make_request(2, prompt_len=18, max_tokens=2)))
    one.finish()
    assert _prompt_rows_beside_decodes(one) == [(1, [(0, 4, False)]), (1, [(4, 4, False)]), (1, [(8, 4, False)]),
                                                (1, [(12, 4, False)]), (1, [(16, 2, True)])]
    three = Driver(config=config, requests=[make_request(i, prompt_len=4, max_tokens=40) for i in (1, 2, 3)])
    three.run_to_query(plans.Decode)
    three.feed(ev.Arrival(make_request(4, prompt_len=30, max_tokens=2)))
    three.finish()
    # 12 rows beside three streams (a non-last chunk a multiple of 4), then the rest
    assert _prompt_rows_beside_decodes(three) == [(3, [(0, 12, False)]), (3, [(12, 12, False)]),
                                                  (3, [(24, 6, True)])]
    many = Driver(config=config, requests=[make_request(i, prompt_len=4, max_tokens=40) for i in range(1, 7)])
    many.run_to_query(plans.Decode)
    many.feed(ev.Arrival(make_request(7, prompt_len=30, max_tokens=2)))
    many.finish()
    assert _prompt_rows_beside_decodes(many) == [(6, [(0, 16, False)]), (6, [(16, 14, True)])]  # max_prefill_tokens


def _three_prompts_beside_a_stream(config, prompt_len: int) -> Driver:
    """Three prompts arriving while one stream decodes, run to the end (every request done)."""
    d = Driver(config=config, requests=[make_request(1, prompt_len=4, max_tokens=60)]).run_to_query(plans.Decode)
    for i in (2, 3, 4):
        d.feed(ev.Arrival(make_request(i, prompt_len=prompt_len, max_tokens=2)))
    d.finish()
    assert len(d.outputs(DoneOut)) == 4
    return d


def test_a_queue_of_prompts_fills_the_mixed_prefill_bound():
    """§5.13 C: beside a decoding stream the queue's chunks fill the bound's 8 rows a step, the
    first prompt's chunk whole, the next one's cut to the rows left (without the bound: [6, 6] and
    [6])."""
    config = make_config(max_prefill_tokens=16, max_batch_tokens=64, prefill_new_together=True,
                         idle_prefill_fills_budget=True, mixed_prefill_floor=8)
    steps = _prompt_rows_beside_decodes(_three_prompts_beside_a_stream(config, prompt_len=6))
    assert [[length for _, length, _ in chunks] for _, chunks in steps] == [[6, 2], [4, 4], [2]]
    assert [[last for _, _, last in chunks] for _, chunks in steps] == [[True, False], [True, False], [True]]


def test_without_prompts_together_the_mixed_prefill_bound_still_holds_every_step():
    """Without prefill_new_together every prefilling prompt used to ride each mixed step; under the
    bound they fill it instead (chunk 0 of each runs alone in lane 1, cut to the bound too)."""
    config = make_config(max_prefill_tokens=16, max_batch_tokens=64, mixed_prefill_floor=8)
    d = _three_prompts_beside_a_stream(config, prompt_len=30)
    steps = _prompt_rows_beside_decodes(d)
    assert steps and all(sum(length for _, length, _ in chunks) <= 8 for _, chunks in steps), steps
    assert any(len(chunks) >= 2 for _, chunks in steps), steps  # a prompt's rest shares a step with the next
    assert all(e.length <= 8 for e in of_type(d.history, dc.PrefillChunk)), "chunk 0 beside a decoding stream"


def test_without_the_option_a_wave_keeps_the_prefill_chunk():
    config = make_config(max_prefill_tokens=8, max_batch_tokens=64, prefill_new_together=True)
    d = Driver(config=config, requests=[make_request(1, prompt_len=40, max_tokens=3)])
    d.finish()
    lone = [(e.start, e.length) for e in of_type(d.history, dc.PrefillChunk)]
    assert lone == [(0, 8), (8, 8), (16, 8), (24, 8), (32, 8)]


@settings(max_examples=150, deadline=None)
@given(lens=st.lists(st.integers(1, 70), min_size=1, max_size=5), limit=st.integers(1, 24),
       batch=st.integers(1, 64), late=st.lists(st.booleans(), min_size=5, max_size=5), together=st.booleans())
def test_the_scheduler_feeds_every_prompt_exactly_once_in_order_within_budget(lens, limit, batch, late, together):
    config = make_config(max_prefill_tokens=limit, max_batch_tokens=batch, prefill_new_together=together)
    requests = [make_request(i + 1, prompt_len=n, max_tokens=3) for i, n in enumerate(lens)]
    # five lateness flags for one to five requests: the flags past the last request are unused
    first = [r for r, l in zip(requests, late, strict=False) if not l] or requests[:1]
    rest = [r for r in requests if r not in first]
    d = Driver(config=config, requests=first)
    d.run_to_query(dc.NumFreeBlocks).answer()
    for r in rest:
        d.feed(ev.Arrival(r))
    d.finish()
    assert len(d.outputs(DoneOut)) == len(requests)
    chunks = _slices(d.history)
    seq_of = {e.seq: e.session for e in d.history if isinstance(e, (dc.AllocSequenceFor,))}
    assert sorted(seq_of.values()) == sorted(r.id for r in requests)
    for seq, plan in chunks.items():
        prompt_len = lens[seq_of[seq] - 1]
        offset = 0
        for index, (start, length, last) in enumerate(plan):
            assert start == offset and length > 0
            assert length <= (max(batch, limit) if index == 0 and not together else limit)
            offset += length
            assert last == (offset == prompt_len)
        assert offset == prompt_len
