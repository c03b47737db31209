"""A ``DeviceFault`` in every waiting phase gives the outcome the rule book declares for it
(specs/faults.md §8.1, §8.3): the affected requests get exactly one ``Error`` each, device-held ones
give their slot back without caching, they are gone from every collection, and everyone else goes
on. The expected scope of each phase is ``RULE_BOOK``, copied from the table of §8.3 by hand, not
read from ``core/table.py`` (the code under test): a wrong scope there fails here.

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
from fxsched.runtime.check.walk import WalkHost, random_episode
from fxsched.runtime.devices.simulated import SimDevice
from fxsched.runtime.interpreter import Interpreter, Observer, check_batch
from fxsched.runtime.scenarios.loader import load_scenario, scenario_names
from fxsched.runtime.scenarios.runner import prepare_scenario

MESSAGE = "device fault: injected"

_NO_COUNT = "the device cannot count its free blocks"
_NO_RECLAIM = "the device cannot reclaim prefix-cache blocks"

RULE_BOOK: dict[str, tuple] = {
    # specs/faults.md §8.3, row by row: ("halt", reason or None), ("requests", field of the waiting
    # record), ("rotation",), ("active",), ("rule",) for a fault the phase's rule takes (§8.4), or
    # ("seqs", fields naming the sequences, the field of a request not yet held or None, whether
    # every prefilling prompt fails too)
    "AwaitStream": ("halt", None), "AwaitEvent": ("halt", None), "AwaitInput": ("halt", None),
    "AwaitPublishBlocks": ("halt", _NO_COUNT), "AwaitSwapOutFree": ("halt", _NO_COUNT),
    "AwaitSwapInFree": ("halt", _NO_COUNT), "AwaitSwapOutReclaim": ("halt", _NO_RECLAIM),
    "AwaitSwapInReclaim": ("halt", _NO_RECLAIM),
    "AwaitAdapterIds": ("requests", "new"),
    "AwaitRotation": ("rotation",),
    "AwaitForward": ("seqs", ("seq_ids",), "request", False),
    "AwaitSlot": ("seqs", ("seq_id",), "request", False),
    "AwaitLaneAdapter": ("seqs", ("seq_id",), "request", False),
    "AwaitFirstToken": ("seqs", ("seq_id",), "request", False),
    "AwaitBeam": ("seqs", ("seq_id",), "request", False),
    "AwaitBeamGroup": ("requests", "requests"),
    "AwaitPrefillToken": ("seqs", ("seq_id",), None, False),
    "AwaitMixedReadback": ("seqs", ("seq_ids",), None, True),
    "AwaitDecode": ("rule",),
    "AwaitCapacity": ("active",), "AwaitSelfCapacity": ("active",),
    **{name: ("seqs", ("seq_id",), None, False) for name in (
        "AwaitProposal", "AwaitKVerify", "AwaitMtpDecode", "AwaitDflashDrafts", "AwaitDflashVerify",
        "AwaitNgramDecode", "AwaitNgramVerify", "AwaitSelfToken", "AwaitSelfVerify")},
    **{name: ("seqs", ("seq_ids",), None, False) for name in ("AwaitBatchedProposal", "AwaitBatchedDflash",
                                                               "AwaitMtpBatch")},
    "AwaitDflashGate": ("seqs", ("batchable", "rest"), None, False),
    "AwaitMtpGate": ("seqs", ("batch.seq_ids",), None, False),
    "AwaitSwapInSlot": ("seqs", ("seq_id",), None, False),
    "AwaitRestore": ("rule",),
    "AwaitResumeFree": ("seqs", ("seq_id",), None, False), "AwaitResumeReclaim": ("seqs", ("seq_id",), None, False),
    "AwaitResumeSlot": ("seqs", ("seq_id",), None, False),
}


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
                           can_batch_verify=episode.can_batch_verify)
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


def _requests_of(state: SchedulerState) -> dict[int, int]:
    """seq id -> request id of everything the scheduler holds."""
    held = {s.seq_id: s.request_id for s in state.active}
    held.update({e.seq_id: e.request.id for e in state.prefilling})
    held.update({s.seq_id: s.request_id for s in state.restoring})
    held.update({p.sequence.seq_id: p.sequence.request_id for p in state.preempted})
    return held


def _get(record, path: str):
    for name in path.split("."):
        record = getattr(record, name)
    return record


def _declared(state: SchedulerState) -> tuple[set[int], set[int]]:
    """(request ids that must get an Error, seq ids that must be gone) for a fault in ``state``, by
    the rule book (``RULE_BOOK``)."""
    waiting, scope = state.waiting, RULE_BOOK[type(state.waiting).__name__]
    held = _requests_of(state)
    if scope[0] == "seqs":
        _, fields, request_field, all_prefilling = scope
        ids: list[int] = []
        for path in fields:
            value = _get(waiting, path)
            ids.extend(value if isinstance(value, tuple) else (value,))
        request = _get(waiting, request_field) if request_field else None
        if request is not None and not set(ids) & set(held):
            return {request.id}, set()
        gone = set(ids) & set(held)
        if all_prefilling:
            gone |= {e.seq_id for e in state.prefilling}
        return {held[i] for i in gone}, gone
    if scope[0] == "requests":
        return {r.id for r in _get(waiting, scope[1])}, set()
    if scope[0] == "active":
        return {s.request_id for s in state.active}, {s.seq_id for s in state.active}
    if scope[0] == "rule":
        seqs = getattr(waiting, "seq_ids", None) or (waiting.seq_id,)
        return {held[i] for i in seqs if i in held}, set(seqs)
    return set(), set()


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
    failed, gone = _declared(state)
    assert sorted(errors) == sorted(failed), "every affected request gets exactly one Error"
    assert all(e.message == MESSAGE for e in effects if isinstance(e, ErrorOut))
    held_before = {s.seq_id: s.slot for s in state.active} | {e.seq_id: e.slot for e in state.prefilling}
    releases = {(e.seq, e.slot) for e in effects if isinstance(e, ReleaseSeq) and e.reason == ReleaseReason.SEND_ERROR}
    for seq_id in gone:
        if seq_id in held_before:
            assert (seq_id, held_before[seq_id]) in releases, f"sequence {seq_id} gives its slot back"
    assert not (gone & held_ids(after)), "failed sequences are gone from every collection"
    for seq_id, request_id in _requests_of(state).items():
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
