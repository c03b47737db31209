"""The hot columns of a batched DFlash verify (specs/scheduler.md §5.2): when every active sequence
goes on from a batched verify the common way, the state keeps its sequence records and holds the
seven hot fields as columns (``state.settled``); ``state.active`` gives the records with the
columns applied. The drafts of the batch are one table (``state.drafts``)."""

from __future__ import annotations

import pickle

import attrs

import pytest

from fxsched.core import events as ev
from fxsched.core.records import replace
from fxsched.core.state import NO_DRAFTS, DraftTable, kept_facts
from fxsched.effects import device_calls as dc
from fxsched.effects import plans
from fxsched.effects.client import DoneOut

from factories import Driver, dflash_config, dflash_model, make_request

PROMPT_LEN = 5


def _batched_run(n: int = 3) -> Driver:
    """A DFlash run of ``n`` streaming requests, waiting for the proposal after a batched verify
    that every sequence went on from (not the first such verify: the records are older then)."""
    # ids from 7: the script's tokens count up from 10 * id, so none is EOS (63)
    requests = [make_request(i, prompt_len=PROMPT_LEN, max_tokens=200, streaming=True) for i in range(7, 7 + n)]
    d = Driver(config=dflash_config(), model=dflash_model(), requests=requests)
    for _ in range(2):
        d.answer()
        d.run_to_query(dc.ProposeBatched)
    return d


def _check_against_the_client(d: Driver) -> None:
    """Every sequence's output is what its client got (nothing finished, no EOS), and its KV
    length follows from it (``seq_len = prompt + output - 1``)."""
    for seq in d.state.active:
        assert list(seq.output) == d.streamed(seq.request_id)
        assert seq.seq_len == PROMPT_LEN + len(seq.output) - 1
        assert seq.last_token == seq.output[-1]
        assert seq.remaining == 200 - len(seq.output)


def test_a_steady_batched_tick_keeps_the_records_and_moves_only_columns():
    d = _batched_run()
    records, columns = d.state.rows, d.state.settled
    assert columns is not None and columns.base is records
    before = {s.seq_id: len(s.output) for s in d.state.active}
    d.answer()
    d.run_to_query(dc.ProposeBatched)  # one more tick: capacity, gate, verify
    assert d.state.rows is records  # no record was rebuilt
    assert d.state.settled is not columns and d.state.settled.base is records
    assert all(len(s.output) > before[s.seq_id] for s in d.state.active)
    _check_against_the_client(d)


def test_the_records_of_state_active_carry_the_columns():
    d = _batched_run()
    columns = d.state.settled
    active = d.state.active
    assert active is d.state.active  # built once
    assert [s.seq_len for s in active] == list(columns.seq_len)
    assert [s.output for s in active] == list(columns.output)
    assert [s.seq_len for s in d.state.rows] != list(columns.seq_len)  # the records alone are older
    _check_against_the_client(d)


def test_a_cancel_while_columns_are_held_keeps_the_newer_fields():
    d = _batched_run()
    lengths = [s.seq_len for s in d.state.active]
    d.feed(ev.Cancel(8))
    assert d.state.settled is None
    assert [s.seq_len for s in d.state.active] == lengths
    assert [s.cancel_requested for s in d.state.active] == [False, True, False]
    _check_against_the_client(d)


def test_setting_active_drops_the_columns():
    d = _batched_run()
    state = d.state
    rebuilt = state.active
    assert replace(state, active=rebuilt).settled is None
    evolved = attrs.evolve(state, active=rebuilt[:1])  # (evolve knows the init name ``active`` too)
    assert evolved.active == rebuilt[:1]  # the columns no longer apply to these records


def test_the_run_goes_on_to_the_end_as_the_client_sees_it():
    d = _batched_run()
    for _ in range(12):
        d.answer()
        d.run_to_query(dc.ProposeBatched)
        _check_against_the_client(d)


def test_the_proposal_is_one_table_and_the_verify_takes_it_away():
    d = _batched_run()
    assert d.state.drafts == {}
    d.answer()  # the batched proposal
    held = d.state.drafts
    assert isinstance(held, DraftTable) and sorted(held) == [s.seq_id for s in d.state.active]
    assert all(len(v) == 5 for v in held.values())
    d.run_to_query(dc.ProposeBatched)
    assert d.state.drafts is NO_DRAFTS


def test_a_draft_table_is_an_immutable_hashable_value():
    table = DraftTable({1: (2, 3)})
    assert hash(table) == hash(DraftTable({1: (2, 3)})) and table == {1: (2, 3)}
    for change in (lambda: table.__setitem__(1, (4,)), lambda: table.pop(1), lambda: table.update({2: (5,)}),
                   table.clear):
        with pytest.raises(TypeError):
            change()
    assert table == {1: (2, 3)}


def test_a_batch_table_gives_its_drafts_as_one_column_for_exactly_its_sequences():
    ids, drafts = (4, 9, 2), ((1, 2), (3,), (5, 6, 7))
    table = DraftTable.of_batch(ids, drafts)
    assert table == {4: (1, 2), 9: (3,), 2: (5, 6, 7)} and hash(table) == hash(DraftTable(table))
    assert table.column_for(ids) is drafts
    assert table.column_for(tuple(list(ids))) is drafts  # an equal tuple of ids will do
    assert table.column_for((4, 9)) is None and table.column_for((9, 4, 2)) is None
    assert DraftTable(table).column_for(ids) is None  # a table built any other way: look each up
    assert pickle.loads(pickle.dumps(table)) == table


def test_the_gate_and_the_verify_read_the_proposal_as_its_column():
    d = _batched_run()
    d.answer()  # the batched proposal
    ids = tuple(s.seq_id for s in d.state.active)
    column = d.state.drafts.column_for(ids)
    assert column is not None and column == tuple(d.state.drafts[i] for i in ids)
    query = d.run_to_query(dc.DecodeVerifyBatched).query
    assert d.state.waiting.drafts is column  # the verify holds the very column, not a copy
    rows = zip(d.state.active, column, strict=True)
    assert query.tokens == tuple(t for s, drafts in rows for t in (s.last_token, *drafts))


def _plain_run(n: int = 3) -> Driver:
    """A plain-decode run of ``n`` streaming requests, waiting for a decode a few ticks in."""
    requests = [make_request(i, prompt_len=PROMPT_LEN, max_tokens=200, streaming=True) for i in range(7, 7 + n)]
    d = Driver(requests=requests)
    for _ in range(3):
        d.answer()
        d.run_to_query(plans.Decode)
    return d


def test_a_steady_plain_decode_keeps_the_records_and_moves_only_columns():
    d = _plain_run()
    records = d.state.rows
    assert d.state.settled is not None and d.state.settled.base is records
    for _ in range(5):
        d.answer()
        d.run_to_query(plans.Decode)
        assert d.state.rows is records
        # (the decode is asked before its answer: the KV holds every token but the pending last one)
        _check_against_the_client(d)


def test_a_steady_tick_leaves_the_offset_columns_as_they_were():
    """A row that goes on the common way grows its output and content count and spends its budget
    by the tokens it takes, as its seq_len: the columns of those offsets pass on unchanged (the same
    tuples), while seq_len moves."""
    for d, query in ((_batched_run(), dc.ProposeBatched), (_plain_run(), plans.Decode)):
        before = d.state.settled
        d.answer()
        d.run_to_query(query)
        after = d.state.settled
        assert after is not before and after.base is before.base
        assert after.out_base is before.out_base and after.end is before.end
        assert after.content_base is before.content_base
        assert all(new > old for new, old in zip(after.seq_len, before.seq_len, strict=True))
        _check_against_the_client(d)


def test_kept_columns_decode_with_host_picks_until_every_row_has_its_min_tokens():
    """A request with ``min_tokens`` is not greedy until it has produced them: the decode asks for
    host picks (EOS masked) until then, and from the first decode after takes the device argmax;
    both straight from the kept columns (the picks' positions are the columns' output lengths)."""
    requests = [make_request(7, prompt_len=PROMPT_LEN, max_tokens=200, streaming=True),
                make_request(8, prompt_len=PROMPT_LEN, max_tokens=200, streaming=True, min_tokens=6)]
    d = Driver(requests=requests)
    seen = []
    for _ in range(10):
        d.run_to_query(plans.Decode)
        produced = {s.request_id: len(s.output) for s in d.state.active}
        seen.append((produced[8], bool(d.query.picks), d.state.settled is not None))
        d.answer()
    assert [picks for _, picks, _ in seen] == [produced < 6 for produced, _, _ in seen]
    assert {produced for produced, _, _ in seen} >= {5, 6}
    assert all(kept for _, _, kept in seen[2:])


def test_a_plain_row_that_finishes_gets_its_record_rebuilt():
    requests = [make_request(i, prompt_len=PROMPT_LEN, max_tokens=m, streaming=True)
                for i, m in ((7, 200), (8, 6), (9, 200))]
    d = Driver(requests=requests)
    d.run_until(lambda d: any(type(o).__name__ == "DoneOut" for o in d.outputs()))
    assert [s.request_id for s in d.state.active] == [7, 9]
    d.run_to_query(plans.Decode)
    for seq in d.state.active:
        assert list(seq.output) == d.streamed(seq.request_id)
        assert seq.seq_len == PROMPT_LEN + len(seq.output) - 1


def test_two_answers_to_one_batched_verify_each_see_only_their_own_tokens():
    """The rows' output arrays grow in place for the newest version only: a second step from the
    same state (as the model checker takes) copies instead, and the first state stays as it was."""
    from fxsched.core.machine import step

    d = _batched_run()
    d.answer()  # the batched proposal
    d.run_to_query(dc.DecodeVerifyBatched)
    state, waiting = d.state, d.state.waiting
    before = [s.output.tokens() for s in state.active]
    k = waiting.k
    reject = tuple(1 for _ in waiting.seq_ids for _ in range(k))  # every first draft rejected: one token each
    accept = tuple(t for drafts in waiting.drafts for t in (*drafts[:k - 1], 2))  # all k - 1 drafts, then 2
    first, _ = step(state, ev.VerifyRows(reject))
    second, _ = step(state, ev.VerifyRows(accept))
    third, _ = step(state, ev.VerifyRows(reject))
    assert [s.output.tokens() for s in state.active] == before
    assert [s.output.tokens() for s in first.active] == [b + (1,) for b in before]
    assert [s.output.tokens() for s in second.active] == [b + tuple(drafts[:k - 1]) + (2,)
                                                         for b, drafts in zip(before, waiting.drafts, strict=True)]
    assert [s.output.tokens() for s in third.active] == [s.output.tokens() for s in first.active]


# --- what a tick reads of all the rows (RowFacts) ---------------------------------------------------


def test_the_facts_kept_with_the_columns_are_those_of_the_records_tick_after_tick():
    d = _batched_run()
    kept = 0
    for _ in range(60):
        facts = kept_facts(d.state)
        if facts is not None:  # carried from column to column: still the records' own
            kept += 1
            rows = d.state.rows
            assert facts.ids == tuple(s.seq_id for s in rows)
            assert facts.slots == tuple(s.slot for s in rows)
            assert facts.any_finished == any(s.finished for s in rows)
            assert facts.all_unguarded == all(s.guard is None for s in rows)
            assert facts.all_going == all(not (s.finished or s.cancel_requested) for s in rows)
            assert facts.streaming == tuple(s.request.streaming for s in rows)
            assert facts.stream_ids == tuple(s.request.id for s in rows if s.request.streaming)
            sizes = tuple(s.request.top_logprobs if s.logprob_records else 0 for s in rows if s.request.streaming)
            assert facts.stream_logprobs == (sizes if any(sizes) else ())
        d.answer()
    assert kept >= 20


def test_a_deadline_passes_while_the_columns_and_their_facts_are_kept():
    requests = [make_request(i, prompt_len=PROMPT_LEN, max_tokens=200, streaming=True,
                             deadline_ms=500.0 if i == 8 else None) for i in range(7, 10)]
    d = Driver(config=dflash_config(), model=dflash_model(), requests=requests)
    for _ in range(2):
        d.answer()
        d.run_to_query(dc.ProposeBatched)
    facts = kept_facts(d.state)
    assert facts is not None and facts.next_deadline == 500.0
    d.feed(ev.Clock(400.0))  # not yet: the tick goes on from the columns
    d.answer()
    d.run_to_query(dc.ProposeBatched)
    assert not d.outputs(DoneOut)
    d.feed(ev.Clock(600.0))
    d.run_until(lambda d: bool(d.outputs(DoneOut)))
    assert [(o.request_id, str(o.reason)) for o in d.outputs(DoneOut)] == [(8, "timeout")]
