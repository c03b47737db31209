"""The simulated device's ledgers and the EP words that report a result (specs/checker.md §11.8):
a resource acquired twice, released when not held, used before its acquire or left held at the end
of a run is refused where it happens; the release word names the slot the release freed, and a
verify's accept word the drafts that verify accepted."""

from __future__ import annotations

import pytest

from fxsched.effects.client import DoneOut, ErrorOut, FinishReason
from fxsched.effects.ep_words import RELEASE_CMD, SHUTDOWN_CMD, VERIFY_CMD
from fxsched.runtime.check.state_checks import ledgers_closed
from fxsched.runtime.check.violation import Violation
from fxsched.runtime.devices.ledger import ADAPTER, SLOT, SPILL, Ledger
from fxsched.runtime.devices.script_rules import Script
from fxsched.runtime.devices.sim_base import ArgumentError
from fxsched.runtime.devices.simulated import SimDevice


def test_a_ledger_refuses_a_second_acquire_and_a_release_of_what_it_does_not_hold():
    ledger = Ledger()
    assert ledger.acquire(SLOT, 0, 5) is None
    assert "while 5 holds it" in ledger.acquire(SLOT, 0, 6)
    assert ledger.holder(SLOT, 0) == 5
    assert ledger.open() == {SLOT: {0: 5}}
    assert ledger.release(SLOT, 0) is None
    assert "nothing holds it" in ledger.release(SLOT, 0)
    assert ledger.open() == {}


def _device(**kw) -> SimDevice:
    return SimDevice({1: Script(4, (10, 11, 12, 13)), 2: Script(4, (20, 21, 22))}, block_size=4, **kw)


def test_a_forward_before_the_adapter_acquire_is_refused():
    device = _device()
    device.alloc_sequence(0, 1)
    with pytest.raises(ArgumentError, match="before it acquired its adapter slot"):
        device.prefill(0, [1, 5, 6, 7], 0)


def test_an_acquire_with_no_fresh_sequence_or_of_another_adapter_is_refused():
    device = _device(adapter_of={1: 2})
    with pytest.raises(ArgumentError, match="no sequence was allocated"):
        device.acquire_adapter_slot(-1)
    device = _device(adapter_of={1: 2})
    device.alloc_sequence(0, 1)
    with pytest.raises(ArgumentError, match="whose request asked for 2"):
        device.acquire_adapter_slot(-1)
    device = _device(adapter_of={1: 2})
    device.alloc_sequence(0, 1)
    assert device.acquire_adapter_slot(2) == 2
    assert device.ledger.holder(ADAPTER, 0) == 2
    with pytest.raises(ArgumentError, match="no sequence was allocated"):  # twice for one allocation
        device.acquire_adapter_slot(2)


def test_a_free_gives_back_the_slot_and_the_adapter_and_the_release_word_names_that_slot():
    device = _device()
    device.alloc_sequence(0, 1)
    device.acquire_adapter_slot(-1)
    slot = device.alloc_sequence(1, 2)
    device.acquire_adapter_slot(-1)
    with pytest.raises(ArgumentError, match=f"release word names slot {slot}, which no release freed"):
        device.ep_broadcast_cmd_for_seq(slot, RELEASE_CMD)  # sequence 1 still holds it
    device = _device()
    device.alloc_sequence(0, 1)
    device.acquire_adapter_slot(-1)
    device.free_sequence(0)
    assert device.ledger.open() == {}
    device.ep_broadcast_cmd_for_seq(0, RELEASE_CMD)
    with pytest.raises(ArgumentError, match="which no release freed"):  # announced once
        device.ep_broadcast_cmd_for_seq(0, RELEASE_CMD)


def test_a_spill_file_is_saved_once_and_restored_only_when_saved():
    device = _device()
    device.alloc_sequence(0, 1)
    device.acquire_adapter_slot(-1)
    device.prefill(0, [1, 5, 6, 7], 0)
    device.save_sequence_state(0)
    with pytest.raises(ArgumentError, match="spill file 0 acquired"):
        device.save_sequence_state(0)
    device = _device()
    device.alloc_sequence(3, 0)
    with pytest.raises(ArgumentError, match="spill file 3 released, but nothing holds it"):
        device.restore_sequence_state(3, 1)


def _verified(accepting: bool) -> SimDevice:
    """Sequence 0 of request 1 (answers 10, 11, 12, ...) after a K = 2 verify of draft 11 or 99."""
    device = _device()
    device.alloc_sequence(0, 1)
    device.acquire_adapter_slot(-1)
    device.prefill(0, [1, 5, 6, 7], 0)
    device.decode_batch([10], [0], 0)
    device.ep_broadcast_cmd_for_seq(0, VERIFY_CMD[2])
    device.ep_broadcast_cmd(11)
    draft = 12 if accepting else 99
    device.ep_broadcast_cmd(draft)
    device.serial_verify("decode_verify_graphed", 0, [11, draft])
    return device


def test_the_accept_word_is_held_against_what_the_verify_accepted():
    _verified(True).ep_broadcast_cmd(1)
    _verified(False).ep_broadcast_cmd(0)
    with pytest.raises(ArgumentError, match="accept word says 0 for slot 0, whose verify accepted 1"):
        _verified(True).ep_broadcast_cmd(0)
    with pytest.raises(ArgumentError, match="accept word says 1 for slot 0, whose verify accepted 0"):
        _verified(False).ep_broadcast_cmd(1)


def test_at_the_end_only_the_spill_files_of_failed_requests_may_be_left():
    device = _device()
    device.alloc_sequence(0, 1)
    device.acquire_adapter_slot(-1)
    device.prefill(0, [1, 5, 6, 7], 0)
    device.save_sequence_state(0)
    device.free_sequence(0)
    ledgers_closed(device, {1: ErrorOut(1, "aborted: the scheduler shut down", True)})
    with pytest.raises(Violation, match="ledgers_closed.*spill files still held"):
        ledgers_closed(device, {1: DoneOut(1, FinishReason.STOP, 3, 0, 0, 0, None)})
    device.alloc_sequence(1, 2)
    with pytest.raises(Violation, match="slots still held"):
        ledgers_closed(device, {1: ErrorOut(1, "aborted", True)})
    assert device.ledger.open()[SPILL] == {0: 1}


def test_no_ep_word_follows_the_shutdown_word():
    device = _device()
    device.ep_broadcast_cmd_for_seq(0, SHUTDOWN_CMD)
    with pytest.raises(ArgumentError, match="after the shutdown word"):
        device.ep_broadcast_cmd_for_seq(0, 10)
