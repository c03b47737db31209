"""The model checker's fast paths do what the slow ones did: the interpreter's per-type dispatch
carries out every effect class (and its subclasses) as its case says, and refuses the rest by name;
the monitor's checks gated by effect roles still fire on every effect form they read, a batch
signature's roles are the union of its effects' and an event type's kind follows the class tests;
the simulated device's ``epoch`` moves on every change to the pool or the slots, and the pool checks
``Monitor.on_state`` skips while it stands still run again once it moves; a new tuple of active
sequences is checked for its slots, its sequences and its size whenever one of them differs; the
simulated device's sampled rows are what a host copy of them picks. (That the checker as a whole
catches as much as before is measured by the mutation suite, tests/run_mutants.py.)"""

from __future__ import annotations

import inspect

import attrs
import pytest

from fxsched.core import events as ev
from fxsched.core.config import SCRIPTED_EOS, ModelInfo, SchedulerConfig
from fxsched.core.request import Request
from fxsched.core.sequence import Sequence
from fxsched.core.state import SchedulerState, initial_state
from fxsched.effects import client, device_calls as dc, lifecycle as lc, plans
from fxsched.effects import (adapter_calls, batched_calls, call_base, ep_calls, forward_calls, loop_calls,
                             readback_calls, sequence_calls, speculation_calls, verify_calls)
from fxsched.effects.base import Effect
from fxsched.effects.ep_words import RELEASE_CMD
from fxsched.runtime import effect_handlers as handlers
from fxsched.runtime.check import invariants
from fxsched.runtime.check.invariants import Monitor, Violation
from fxsched.runtime.devices.device import DeviceError
from fxsched.runtime.devices.sampling import decode_bf16_row, host_pick
from fxsched.runtime.devices.script_rules import Script
from fxsched.runtime.devices.scripted import ScriptedDevice
from fxsched.runtime.devices.simulated import SimDevice
from fxsched.runtime.interpreter import Host, Interpreter, RunError


class CallLog:
    """A device that records every call (name, arguments) and answers each with ``answers[name]``
    (None by default), or raises it when it is an exception."""

    def __init__(self, **answers):
        self.calls: list[tuple] = []
        self.answers = answers

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name, *args))
            answer = self.answers.get(name)
            if isinstance(answer, Exception):
                raise answer
            return answer

        return call


def _interpreter(device) -> Interpreter:
    return Interpreter(device, Host(), (63,))


# --- the interpreter's dispatch ---------------------------------------------------------------------


def _effect_classes() -> list[type]:
    """Every effect class the effect modules define, but the abstract bases."""
    bases = {Effect, dc.DeviceCall, lc.Lifecycle, client.ClientOutput, plans.Plan}
    found = []
    device_calls = (call_base, loop_calls, sequence_calls, adapter_calls, ep_calls, forward_calls, readback_calls,
                    verify_calls, speculation_calls, batched_calls)  # the modules behind the dc namespace
    for module in (*device_calls, lc, client, plans):
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__ and issubclass(cls, Effect) and cls not in bases:
                found.append(cls)
    return found


@pytest.mark.parametrize("cls", _effect_classes(), ids=lambda c: c.__name__)
def test_every_effect_class_has_a_case(cls):
    handler = handlers._handler_for(cls)
    if cls in (lc.ReadLogits, lc.ReserveKv, lc.Rollback):  # the asynchronous router's
        assert handler is handlers._asynchronous_only
    else:
        assert handler not in (handlers._no_case, handlers._no_lifecycle_case), cls


def test_a_fire_and_forget_call_answers_nothing_whatever_the_device_returns():
    device = CallLog(acquire_adapter_slot=3, ssm_snapshot_occupancy=0, gdn_fold_accepted=True, num_free_blocks=9)
    it = _interpreter(device)
    assert it.perform(dc.AcquireAdapterSlot(1)) is None
    assert it.perform(dc.SsmSnapshotOccupancy()) is None
    assert it.perform(dc.GdnFoldAccepted((0,), (1,), 2)) is None
    answer = it.perform_all([dc.AcquireAdapterSlot(2), dc.NumFreeBlocks()])
    assert answer == ev.FreeBlocks(9)
    assert it.perform_all([dc.SsmSnapshotOccupancy(), dc.AcquireAdapterSlot(4)]) is None  # a batch with no query
    assert device.calls == [("acquire_adapter_slot", 1), ("ssm_snapshot_occupancy",), ("gdn_fold_accepted", (0,), (1,), 2),
                            ("acquire_adapter_slot", 2), ("num_free_blocks",), ("ssm_snapshot_occupancy",),
                            ("acquire_adapter_slot", 4)]


def test_a_subclass_of_an_effect_class_is_carried_out_as_that_class():
    @attrs.frozen
    class LateFree(dc.FreeSequence):
        pass

    @attrs.frozen
    class WideVerify(dc.SerialVerify):
        CALL = "decode_verify_wide"

    device = CallLog(serial_verify=[7, 8])
    it = _interpreter(device)
    assert it.perform(LateFree(4)) is None
    assert it.perform(WideVerify(4, (1, 2))) == ev.VerifyRows((7, 8))
    assert device.calls == [("free_sequence", 4), ("serial_verify", "decode_verify_wide", 4, (1, 2))]


def test_an_effect_without_a_case_is_refused_by_name():
    @attrs.frozen
    class Stray(Effect):
        pass

    @attrs.frozen
    class StrayLifecycle(lc.Lifecycle):
        pass

    device = CallLog()
    with pytest.raises(RunError, match="no case for Stray"):
        _interpreter(device).perform(Stray())
    with pytest.raises(RunError, match="no case for StrayLifecycle"):
        _interpreter(device).perform(StrayLifecycle())
    assert device.calls == [("note_fx", "fx apply StrayLifecycle")]  # a lifecycle effect is announced first


def test_a_lifecycle_effect_is_announced_then_carried_out():
    device = CallLog()
    it = _interpreter(device)
    it.perform_all([lc.ReleaseSeq(5, 2, cache=True, reason=lc.ReleaseReason.FINISH_SEQUENCE), lc.Quiesce(1)])
    assert device.calls == [("note_fx", "fx apply ReleaseSeq{cache=true, finish_sequence}"), ("cache_sequence", 5),
                            ("free_sequence", 5), ("ep_broadcast_cmd_for_seq", 2, RELEASE_CMD),
                            ("note_fx", "fx apply Quiesce{stream=1}"), ("synchronize", 1)]


def test_a_device_error_answers_a_query_and_ends_the_run_otherwise():
    device = CallLog(num_free_blocks=DeviceError("pool gone", kv_exhausted=True), free_sequence=DeviceError("bad seq"))
    it = _interpreter(device)
    assert it.perform_all([dc.NumFreeBlocks()]) == ev.DeviceFault("pool gone", True)
    with pytest.raises(RunError, match="device error in FreeSequence: bad seq"):
        it.perform(dc.FreeSequence(1))


# --- the monitor's checks, gated by the roles of a batch's effects -----------------------------------


def _monitor(**device_args) -> tuple[Monitor, SimDevice]:
    device = SimDevice({1: Script(4, (10, 11, 12))}, **device_args)
    return Monitor((), device, counts_acc=False), device


def _released(seq: int = 5) -> Monitor:
    monitor, _ = _monitor()
    monitor.on_effects([dc.AllocSequence(seq, 1), dc.NumFreeBlocks()])
    monitor.on_effects([lc.ReleaseSeq(seq, 0, cache=False, reason=lc.ReleaseReason.SEND_ERROR), dc.NumFreeBlocks()])
    return monitor


@pytest.mark.parametrize("effect", [
    dc.FreeSequence(5),
    lc.MarconiCheckpoint(5),
    dc.DecodeVerifyBatched((1, 2), (1, 1), (4, 5)),
    plans.Decode((1,), (5,), (4,)),
    dc.TruncateSequences((5,), (3,)),
    lc.MarconiCheckpoints((4, 5)),  # a batched record: checked row by row
], ids=lambda e: type(e).__name__)
def test_an_effect_naming_a_released_sequence_is_caught_in_every_form(effect):
    monitor = _released(5)
    with pytest.raises(Violation, match="no_effect_on_released"):
        monitor.on_effects([effect, dc.NumFreeBlocks()])


def test_a_sequence_allocated_again_may_be_named_again():
    monitor = _released(5)
    monitor.on_effects([dc.AllocSequenceFor(5, 1, 8), dc.FreeSequence(5), dc.NumFreeBlocks()])


def test_a_commit_before_its_fold_is_caught():
    monitor, _ = _monitor()
    with pytest.raises(Violation, match="fold_before_commit"):
        monitor.on_effects([dc.CommitAcceptedPrefix(1, 2, 3), dc.GdnFoldAccepted((0,), (1,), 3), dc.NumFreeBlocks()])
    monitor.on_effects([dc.GdnFoldAccepted((0,), (1,), 3), dc.CommitAcceptedPrefix(1, 2, 3), dc.NumFreeBlocks()])


def test_the_shutdown_goes_in_order_and_nothing_follows_it():
    monitor, _ = _monitor()
    with pytest.raises(Violation, match="shutdown_order"):
        monitor.on_effects([lc.EpShutdown(), lc.Teardown()])
    monitor, _ = _monitor()
    monitor.on_effects([lc.EpShutdown(), lc.Quiesce(0)])
    monitor.on_effects([lc.Quiesce(1), lc.Teardown()])
    with pytest.raises(Violation, match="shutdown_order"):
        monitor.on_effects([dc.NumFreeBlocks()])


# --- the simulated device's epoch and the pool checks that follow it ------------------------------------


def test_every_change_to_the_pool_or_the_slots_moves_the_epoch():
    device = SimDevice({1: Script(3, (10, 11, 12)), 2: Script(3, (20, 21))}, block_size=4, held_blocks=2,
                       reclaimable=2, total_blocks=20)

    def moves(call, *args) -> None:
        before = device.epoch
        call(*args)
        assert device.epoch > before, call.__name__

    moves(device.alloc_sequence, 0, 1)
    device.acquire_adapter_slot(-1)
    moves(device.alloc_sequence, 1, 2)
    device.acquire_adapter_slot(-1)
    moves(device.prefill, 0, [1, 2, 3], 0)  # its first block
    moves(device.decode_batch, [10], [0], 0)  # 4 tokens: a second block
    moves(device.free_sequence, 1)
    moves(device.compact_sequence, 0, 1)  # into the slot the free gave back
    moves(device.reclaim_prefix_blocks, 1)
    device.save_sequence_state(0)
    device.free_sequence(0)
    device.alloc_sequence(0, 1)
    moves(device.restore_sequence_state, 0, 2)
    device.acquire_adapter_slot(-1)
    assert device.used_blocks == 2 and device.live[0].blocks == 2


def test_the_pool_checks_run_again_once_the_device_changes():
    config, model = SchedulerConfig(), ModelInfo()
    monitor, device = _monitor(total_blocks=10)
    state = initial_state(config, model)
    monitor.on_state(state)
    device.used_blocks += 1  # a leak the pool no longer balances
    device.alloc_sequence(0, 1)
    device.acquire_adapter_slot(-1)
    with pytest.raises(Violation, match="blocks_balance"):
        monitor.on_state(state)


# --- what the monitor works out once per type or per batch signature -------------------------------------


def test_a_batch_signature_has_the_union_of_its_effects_roles():
    classes = _effect_classes()
    for start in range(0, len(classes), 3):
        kinds = tuple(classes[start:start + 5])
        union = 0
        for cls in kinds:
            union |= invariants.effect_role(cls)
        assert invariants.BATCH_ROLES[kinds] == union == invariants.batch_roles(kinds), kinds
    assert invariants.effect_role(client.TokenOut) & invariants.OUT
    assert invariants.effect_role(client.TokensOut) & invariants.OUT
    assert not invariants.effect_role(client.DoneOut) & invariants.OUT


def _event_classes() -> list[type]:
    return [cls for _, cls in inspect.getmembers(ev, inspect.isclass)
            if cls.__module__ == ev.__name__ and issubclass(cls, ev.Event)]


@pytest.mark.parametrize("cls", _event_classes(), ids=lambda c: c.__name__)
def test_an_event_kind_follows_the_class_tests(cls):
    kind = invariants.EVENT_KINDS[cls]
    assert bool(kind & invariants.INPUT) == issubclass(cls, ev.INPUT_EVENTS)
    assert bool(kind & invariants.CLOCK) == issubclass(cls, ev.Clock)
    assert bool(kind & invariants.CANCEL) == issubclass(cls, ev.Cancel)
    assert bool(kind & invariants.ARRIVAL) == issubclass(cls, ev.Arrival)
    assert bool(kind & invariants.FAULT) == issubclass(cls, ev.DeviceFault)


def test_a_subclass_of_an_event_is_watched_as_its_class():
    @attrs.frozen
    class LateClock(ev.Clock):
        pass

    monitor, _ = _monitor()
    monitor.on_event(LateClock(250.0))
    assert monitor.now_ms == 250.0 and monitor.nothing_new


# --- the state checks of a new tuple of active sequences ---------------------------------------------------


def _sequence(seq_id: int, slot: int) -> Sequence:
    request = Request(id=seq_id, prompt=(seq_id, 3, 3), max_tokens=4)
    return Sequence(seq_id=seq_id, request=request, slot=slot, seq_len=3, blocks=0, output=(), remaining=4,
                    last_token=3)


def _running_two(max_batch_size: int = 8) -> tuple[Monitor, SimDevice, SchedulerState]:
    """A monitor that has seen sequences 1 and 2 active in slots 0 and 1, on a device holding both."""
    monitor, device = _monitor()
    device.alloc_sequence(1, 1)
    device.acquire_adapter_slot(-1)
    device.alloc_sequence(2, 2)
    device.acquire_adapter_slot(-1)
    state = attrs.evolve(initial_state(SchedulerConfig(max_batch_size=max_batch_size), ModelInfo()),
                         active=(_sequence(1, 0), _sequence(2, 1)))
    monitor.on_state(state)
    return monitor, device, state


def test_the_same_sequences_one_token_on_pass():
    monitor, _, state = _running_two()
    grown = tuple(attrs.evolve(s, seq_len=s.seq_len + 1) for s in state.active)
    monitor.on_state(attrs.evolve(state, active=grown))  # new tuples, the same slots and sequences


def test_the_same_sequences_in_one_slot_are_caught():
    monitor, _, state = _running_two()
    first, second = state.active
    with pytest.raises(Violation, match="slots_unique"):
        monitor.on_state(attrs.evolve(state, active=(first, attrs.evolve(second, slot=0))))


def test_a_sequence_dropped_without_its_release_is_caught():
    monitor, _, state = _running_two()
    with pytest.raises(Violation, match="no_orphan_sequence"):
        monitor.on_state(attrs.evolve(state, active=state.active[:1]))


def test_a_sequence_replaced_by_another_in_its_slot_is_caught_when_the_old_one_is_held():
    monitor, device, state = _running_two()
    device.alloc_sequence(3, 3)
    device.acquire_adapter_slot(-1)
    monitor.on_state(state)  # the device changed: three held, two running (the tick checks catch the third)
    replaced = (state.active[0], _sequence(3, 1))  # the same slots, another sequence: 2 stopped running
    with pytest.raises(Violation, match="no_orphan_sequence"):
        monitor.on_state(attrs.evolve(state, active=replaced))


def test_a_batch_grown_past_its_bound_is_caught():
    monitor, device, state = _running_two(max_batch_size=2)
    device.alloc_sequence(3, 3)
    device.acquire_adapter_slot(-1)
    with pytest.raises(Violation, match="batch_bound"):
        monitor.on_state(attrs.evolve(state, active=state.active + (_sequence(3, 2),)))


# --- the simulated device's sampled rows -------------------------------------------------------------------


def test_the_simulated_device_samples_a_row_as_its_host_copy_is_picked():
    device = SimDevice({1: Script(4, (10, 11, 12))})
    vocab = device.vocab_size()
    device.rows = [5, SCRIPTED_EOS, 0, vocab - 1, vocab + 3]  # the last answer is off the vocabulary: a row of 0s
    picks = [dc.HostPick(temperature=t, seed=seed, mask_eos=mask, top_p=top_p, top_k=top_k, min_p=min_p)
             for t in (0.0, 0.7, 1.5) for seed in (0, 42, 43) for mask in (False, True)
             for top_p, top_k, min_p in ((1.0, 0, 0.0), (0.9, 5, 0.0), (0.5, 0, 0.1))]
    for eos_ids in ((SCRIPTED_EOS,), (SCRIPTED_EOS, 5)):
        for row in range(len(device.rows)):
            slab = ScriptedDevice.copy_logits_to_host(device, row, 0, vocab * 2)  # what the interpreter copies
            want = [host_pick(decode_bf16_row(slab, vocab, 0), pick, eos_ids) for pick in picks]
            for _ in range(2):  # worked out, then remembered
                assert [device.sample_rows(row, 1, (pick,), eos_ids).tokens[0] for pick in picks] == want
    assert device.sample_rows(1, 3, picks[:3], (SCRIPTED_EOS,)).tokens == [
        device.sample_rows(row, 1, (pick,), (SCRIPTED_EOS,)).tokens[0] for row, pick in zip((1, 2, 3), picks[:3], strict=True)]
    with pytest.raises(DeviceError, match="row 5 was not produced"):
        device.sample_rows(4, 2, picks[:2], (SCRIPTED_EOS,))


def test_the_interpreter_asks_the_simulated_device_for_sampled_rows():
    device = SimDevice({1: Script(4, (10, 11, 12))})
    device.rows = [7, 9]
    pick = dc.HostPick(temperature=0.0, seed=1, mask_eos=False, top_logprobs=2)
    answer = Interpreter(device, Host(), (SCRIPTED_EOS,)).perform(dc.CopyLogitsToHost(0, 2, (pick, pick)))
    assert answer == ev.TokensSampled((7, 9), (2, 2))
