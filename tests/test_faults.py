"""A ``DeviceFault`` in every waiting phase gives the outcome the rule book declares for it
(specs/faults.md §8.1, §8.3): the affected requests get exactly one ``Error`` each, device-held ones
give their slot back without caching, they are gone from every collection, and everyone else goes
on. The expected scope of each phase is the checker's ``RULE_BOOK`` (runtime/check/fault_scope.py),
copied from the table of §8.3 by hand, not read from ``core/table.py`` (the code under test): a wrong
scope there fails here.

The states come from real runs: every reference scenario on the recording device and random-walk
episodes on the simulated device, snapshotted the first time each phase is entered.
"""

from __future__ import annotations

import random

import pytest

from fxsched.core import events as ev
from fxsched.core.agenda import PhaseError
from fxsched.core.faults import held_ids
from fxsched.core.machine import step
from fxsched.core.state import SchedulerState, initial_state
from fxsched.core.table import ANSWERS
from fxsched.effects.client import DoneOut, ErrorOut, ResponseOut, RotationAck
from fxsched.effects.lifecycle import ReleaseReason, ReleaseSeq
from fxsched.runtime.check.fault_scope import RULE_BOOK, declared, requests_held
from fxsched.runtime.check.observers import WalkHost
from fxsched.runtime.check.walk import random_episode
from fxsched.runtime.devices.simulated import SimDevice
from fxsched.runtime.interpreter import Interpreter, Observer, check_batch
from fxsched.runtime.scenarios.loader import load_scenario, scenario_names
from fxsched.runtime.scenarios.runner import prepare_scenario

MESSAGE = "device fault: injected"


class FirstOfEachPhase(Observer):
    """Keeps the first state seen waiting in each phase."""

    def __init__(self, found: dict[type, SchedulerState]):
        self.found = found

    def stepped(self, event, state, effects) -> None:
        if state.waiting is not None and type(state.waiting) not in self.found:
            self.found[type(state.waiting)] = state


def _scenario_states(found: dict[type, SchedulerState]) -> None:
    for name in scenario_names():
        setup = prepare_scenario(load_scenario(name), observer=FirstOfEachPhase(found))
        setup.interpreter.run(setup.state, setup.first_events())


def _walk_states(found: dict[type, SchedulerState], episodes: int) -> None:
    for seed in range(episodes):
        if len(found) == len(ANSWERS):
            return
        episode = random_episode(random.Random(seed))
        device = SimDevice({r.id: r.script() for r in episode.requests}, total_blocks=episode.total_blocks,
                           held_blocks=episode.held_blocks, kv_exhaust_at=episode.kv_exhaust_at,
                           decode_fault_at=episode.decode_fault_at, verify_fault_at=episode.verify_fault_at,
                           spill_corrupt_for=episode.spill_corrupt_for,
                           cancel_flags={r.id for r in episode.requests if r.streaming},
                           can_batch_verify=episode.can_batch_verify,
                           keep_decodes=seed if episode.async_scheduling else None)
        host = WalkHost(episode)
        device.on_tick = host.on_tick
        interpreter = Interpreter(device, host, episode.config().eos_ids, observer=FirstOfEachPhase(found))
        try:
            interpreter.run(initial_state(episode.config(), episode.model()), host.initial_events() + [ev.Boot()])
        except Exception:  # an episode that ends in a scripted fault still gave its states
            pass


def _collect() -> dict[type, SchedulerState]:
    found: dict[type, SchedulerState] = {}
    _scenario_states(found)
    _walk_states(found, 400)
    return found


STATES = _collect()
PHASES = sorted(ANSWERS, key=lambda t: t.__name__)


def test_the_runs_reach_every_waiting_phase():
    assert sorted(t.__name__ for t in set(ANSWERS) - set(STATES)) == []


def test_the_rule_book_names_every_waiting_phase():
    assert sorted(RULE_BOOK) == sorted(t.__name__ for t in ANSWERS)


@pytest.mark.parametrize("phase", PHASES, ids=[p.__name__ for p in PHASES])
def test_a_device_fault_gives_the_declared_outcome(phase):
    state = STATES[phase]
    scope = RULE_BOOK[phase.__name__]
    if scope[0] == "halt":
        with pytest.raises(PhaseError, match=scope[1] or ""):
            step(state, ev.DeviceFault(MESSAGE))
        return
    after, effects = step(state, ev.DeviceFault(MESSAGE))
    check_batch(ev.DeviceFault(MESSAGE), effects, after.stopped)
    if scope[0] == "rotation":
        assert RotationAck(state.waiting.name, MESSAGE) in effects
        return
    errors = [e.request_id for e in effects if isinstance(e, ErrorOut)]
    failed, gone = declared(state)
    assert sorted(errors) == sorted(failed), "every affected request gets exactly one Error"
    assert all(e.message == MESSAGE for e in effects if isinstance(e, ErrorOut))
    held_before = {s.seq_id: s.slot for s in state.active} | {e.seq_id: e.slot for e in state.prefilling}
    releases = {(e.seq, e.slot) for e in effects if isinstance(e, ReleaseSeq) and e.reason == ReleaseReason.SEND_ERROR}
    for seq_id in gone:
        if seq_id in held_before:
            assert (seq_id, held_before[seq_id]) in releases, f"sequence {seq_id} gives its slot back"
    assert not (gone & held_ids(after)), "failed sequences are gone from every collection"
    for seq_id, request_id in requests_held(state).items():
        if seq_id in gone:
            continue
        finished = any(isinstance(e, (DoneOut, ResponseOut)) and e.request_id == request_id for e in effects)
        assert seq_id in held_ids(after) or finished, f"request {request_id} goes on"
    assert not set(errors) & {e.request_id for e in effects if isinstance(e, (DoneOut, ResponseOut))}


def test_a_fault_while_a_beam_group_generates_fails_the_group_and_the_loop_goes_on():
    state = STATES[next(p for p in ANSWERS if p.__name__ == "AwaitBeamGroup")]
    after, effects = step(state, ev.DeviceFault(MESSAGE))
    group = {r.id for r in state.waiting.requests}
    assert len(group) >= 2
    assert sorted(e.request_id for e in effects if isinstance(e, ErrorOut)) == sorted(group)
    assert after.waiting is not None or after.stopped
