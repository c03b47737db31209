"""The phase machine as a table: every (phase, answer) pair either has a rule or is refused with a
PhaseError that names both and changes nothing."""

from __future__ import annotations

import attrs
import pytest

from fxsched.core import events as ev
from fxsched.core.machine import PhaseError, step
from fxsched.core.table import ANSWERS
from fxsched.core.state import initial_state

from factories import make_config, make_model

ANSWER_EVENTS = [ev.StreamCreated(1), ev.EventCreated(2), ev.InputReady(), ev.ForwardDone(), ev.FreeBlocks(3),
           ev.SlotAllocated(0), ev.AdapterIds((0,)), ev.TokenSampled(5), ev.TokensSampled((5,)),
           ev.VerifyRows((1, 2)), ev.Drafts((1,)), ev.BatchedDrafts(((1,),)), ev.DraftCapacity((8,)),
           ev.BatchVerifyAllowed(True), ev.BeamHypotheses(((1,),)), ev.BlocksReclaimed(0), ev.StateRestored(),
           ev.LoraApplied()]


def dummy(waiting_type):
    """A waiting record of ``waiting_type`` with placeholder fields (the refusal never reads them)."""
    values = {}
    for field in attrs.fields(waiting_type):
        values[field.name] = () if "ids" in field.name or field.name in ("new", "drafts", "before", "then", "requests") else 0
    try:
        return waiting_type(**values)
    except Exception:
        record = object.__new__(waiting_type)
        for name, value in values.items():
            object.__setattr__(record, name, value)
        return record


PAIRS = [(w, a) for w, phase in sorted(ANSWERS.items(), key=lambda kv: kv[0].__name__)
         for a in ANSWER_EVENTS if not isinstance(a, phase.accepts)]


def test_every_phase_has_a_rule_and_the_table_is_not_empty():
    assert len(ANSWERS) >= 35 and len(PAIRS) > 500


@pytest.mark.parametrize("waiting_type, answer", PAIRS, ids=[f"{w.__name__}-{type(a).__name__}" for w, a in PAIRS])
def test_an_answer_without_a_rule_is_refused_and_changes_nothing(waiting_type, answer):
    state = attrs.evolve(initial_state(make_config(), make_model()), waiting=dummy(waiting_type), tick=3)
    with pytest.raises(PhaseError) as err:
        step(state, answer)
    assert waiting_type.__name__ in str(err.value) and type(answer).__name__ in str(err.value)
    assert state.waiting is not None and state.tick == 3


@pytest.mark.parametrize("event", [ev.Arrival, ev.Cancel, ev.Clock, ev.InboxClosed, ev.RotationRequested])
def test_inputs_are_taken_in_every_phase(event):
    args = {ev.Arrival: lambda: ev.Arrival(__import__("factories").make_request(9)), ev.Cancel: lambda: ev.Cancel(9),
            ev.Clock: lambda: ev.Clock(5.0), ev.InboxClosed: ev.InboxClosed,
            ev.RotationRequested: lambda: ev.RotationRequested("a")}[event]()
    for waiting_type in ANSWERS:
        state = attrs.evolve(initial_state(make_config(), make_model()), waiting=dummy(waiting_type))
        new, effects = step(state, args)
        assert effects == () and new.waiting == state.waiting
