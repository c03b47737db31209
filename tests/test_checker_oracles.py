"""The model checker's value and policy oracles of issue 16 round 2, each shown to fire on a
wrong value and to stay quiet on the right one: the simulated device's own checks of commit
counts, verify inputs, SSM rollbacks and catch-up positions, and the monitor's checks of release
flags, refused prompts and decode rows. (That they catch real scheduler bugs is measured by the
mutation suite, tests/run_mutants.py.)"""

from __future__ import annotations

import pytest

from fxsched.effects import lifecycle as lc
from fxsched.effects import plans
from fxsched.effects import device_calls as dc
from fxsched.effects.client import DoneOut, ErrorOut
from fxsched.effects.ep_words import RELEASE_CMD
from fxsched.runtime.check.invariants import Violation, decode_rows, refused_prompt, release_cache_flag
from fxsched.runtime.check.episode import SimRequest
from fxsched.runtime.devices.script_rules import Script
from fxsched.runtime.devices.sim_base import ArgumentError
from fxsched.runtime.devices.simulated import SimDevice


def _device(**kwargs) -> SimDevice:
    """One request (id 1): a 4-token prompt, then the script 10 11 12 13 14 15."""
    scripts = {1: Script(4, (10, 11, 12, 13, 14, 15))}
    device = SimDevice(scripts, **kwargs)
    device.alloc_sequence(0, 1)
    device.acquire_adapter_slot(-1)
    device.prefill(0, [1, 2, 3, 4], 0)
    return device


def test_a_commit_must_cover_the_accepted_drafts_plus_one():
    device = _device()
    rows = device.serial_verify("decode_verify_graphed_k3", 0, [10, 11, 99])  # 11 accepted, 99 rejected
    assert rows[:2] == [11, 12]
    with pytest.raises(ArgumentError, match="accepted 1"):
        device.commit_accepted_prefix(0, 3, 3)
    device.refused = None
    device.commit_accepted_prefix(0, 2, 3)
    assert device.refused is None


def test_the_proposer_is_trimmed_to_the_accepted_drafts():
    device = _device()
    device.serial_verify("decode_verify_graphed_k3", 0, [10, 11, 99])  # 11 accepted, 99 rejected
    with pytest.raises(ArgumentError, match="accepted 1"):
        device.trim_proposer_state(0, 2, 0)  # the refused draft's state kept
    device.refused = None
    device.trim_proposer_state(0, 1, 0)
    assert device.refused is None


def test_a_release_word_names_the_slot_its_release_freed():
    scripts = {1: Script(4, (10, 11)), 2: Script(4, (20, 21))}
    device = SimDevice(scripts)
    first, second = device.alloc_sequence(0, 1), device.alloc_sequence(1, 2)
    device.free_sequence(1)
    device.ep_broadcast_cmd_for_seq(second, RELEASE_CMD)
    assert device.refused is None
    device.free_sequence(0)  # its word must name slot `first`, not a slot freed earlier
    device.freed_slots.add(second)
    with pytest.raises(ArgumentError, match=f"release it follows freed slot {first}"):
        device.ep_broadcast_cmd_for_seq(second, RELEASE_CMD)


def test_a_dflash_verify_commits_its_drafter_context_before_its_verdict():
    device = _device()
    device.dflash = True
    device.serial_verify("decode_verify_graphed_k3", 0, [10, 11, 99])
    with pytest.raises(ArgumentError, match="has not committed its drafter context"):
        device.commit_accepted_prefix(0, 2, 3)
    device.refused = None
    device.commit_ctx(0, 2, 4, 0)
    device.commit_accepted_prefix(0, 2, 3)
    assert device.refused is None


def test_a_verify_feeds_a_prefix_of_the_device_s_own_proposal():
    device = _device()
    device.strict_drafts = True
    device.save_hidden_for_mtp(0, 0)  # the prefill's row
    drafts = device.run_mtp_propose_multi(10, 4, 2, 0, 0, False)
    assert drafts == [11, 12]
    with pytest.raises(ArgumentError, match="proposed in this step"):  # MTP verifies from the next step on
        device.serial_verify("decode_verify_graphed_k3", 0, [10] + drafts)
    device.refused = None
    device.proposed[0], device.proposed_at[0] = drafts, -1
    with pytest.raises(ArgumentError, match="whose proposal was"):
        device.serial_verify("decode_verify_graphed_k3", 0, [10, 12, 11])
    device.refused = None
    device.tick += 1
    device.proposed[0], device.proposed_at[0] = drafts, device.tick - 1
    device.serial_verify("decode_verify_graphed_k3", 0, [10] + drafts)
    assert device.refused is None


def test_a_fixed_width_verify_gets_its_width():
    device = _device()
    with pytest.raises(ArgumentError, match="width-4"):
        device.serial_verify("decode_verify_graphed_k4", 0, [10, 11, 12])


def test_the_ssm_rollback_counts_the_rows_the_kv_kept():
    device = _device()
    device.serial_verify("decode_verify", 0, [10, 11, 99])
    device.truncate_sequence(0, 6)  # anchor + one accepted draft kept past the base of 4
    with pytest.raises(ArgumentError, match="n=1"):
        device.rollback_ssm_states(0, 1)
    device.refused = None
    device.rollback_ssm_states(0, 2)
    assert device.refused is None


def test_the_release_flag_follows_its_reason():
    release_cache_flag(lc.ReleaseSeq(0, 0, cache=True, reason="finish_sequence"))
    release_cache_flag(lc.ReleaseSeq(0, 0, cache=False, reason="send_error"))
    with pytest.raises(Violation, match="release_cache_flag"):
        release_cache_flag(lc.ReleaseSeq(0, 0, cache=True, reason="send_error"))
    with pytest.raises(Violation, match="release_cache_flag"):
        release_cache_flag(lc.ReleaseSeq(0, 0, cache=False, reason="finish_sequence"))


def test_a_prompt_as_long_as_the_context_must_be_refused():
    request = SimRequest(id=1, prompt_len=24, tokens=(5,), max_tokens=3)
    refused_prompt(request, ErrorOut(1, "prompt too long"), 24)
    with pytest.raises(Violation, match="refused_prompt"):
        refused_prompt(request, DoneOut(1, "length", 1, 0, 0, 0, None), 24)


def test_decode_rows_come_in_slot_order_with_seeds_by_output_length():
    scripts = {1: Script(4, (10, 11, 12)), 2: Script(4, (20, 21, 22))}
    device = SimDevice(scripts)
    for seq, rid in ((0, 1), (1, 2)):
        device.alloc_sequence(seq, rid)
        device.acquire_adapter_slot(-1)
        device.prefill(seq, [rid, 2, 3, 4], 0)
    requests = {1: SimRequest(id=1, prompt_len=4, tokens=(10,), max_tokens=3),
                2: SimRequest(id=2, prompt_len=4, tokens=(20,), max_tokens=3)}
    pick = dc.HostPick(0.5, 42 + 1, False)  # one token out: the KV holds the prompt only
    decode_rows(plans.Decode((10, 20), (0, 1), (4, 4), (pick, pick)), device, requests)
    with pytest.raises(Violation, match="slot order"):
        decode_rows(plans.Decode((20, 10), (1, 0), (4, 4)), device, requests)
    with pytest.raises(Violation, match="seed"):
        decode_rows(plans.Decode((10,), (0,), (4,), (dc.HostPick(0.5, 42, False),)), device, requests)


def test_every_pick_carries_the_seed_mask_and_records_its_output_position_fixes():
    request = SimRequest(id=1, prompt_len=4, tokens=(10, 11, 12, 13, 14, 15), max_tokens=6, temperature=0.5,
                         min_tokens=2, top_logprobs=3).request()
    device = _device(requests={1: request})
    first = dc.HostPick(0.5, 42, True, 0)  # output position 0: the bare seed, no logprob records
    device.sample_rows(0, 1, (first,), (63,))
    assert device.refused is None
    with pytest.raises(ArgumentError, match="output position 0"):
        device.sample_rows(0, 1, (dc.HostPick(0.5, 42, True, 3),), (63,))
    device.refused = None
    device.serial_verify("decode_verify_graphed_k3", 0, [10, 11, 12])  # rows fill positions 1, 2, 3
    rows = tuple(dc.HostPick(0.5, 42 + g, g < 2, 3) for g in (1, 2, 3))
    device.sample_verify(rows, (63,))
    assert device.refused is None
    for wrong in ((rows[0], rows[0], rows[2]),  # the second row with the first one's seed
                  (rows[0], rows[1], dc.HostPick(0.5, 45, True, 3))):  # EOS masked past min_tokens
        with pytest.raises(ArgumentError, match="sample_verify: row"):
            device.sample_verify(wrong, (63,))
        device.refused = None


def test_four_dflash_drafts_take_the_block_verify():
    device = _device()
    device.dflash = True
    device.proposed[0], device.proposed_at[0] = [11, 12, 13, 14], -1
    with pytest.raises(ArgumentError, match="take the DFlash block verify"):
        device.serial_verify("decode_verify_graphed_k4", 0, [10, 11, 12, 13])
    device.refused = None
    device.proposed[0], device.proposed_at[0] = [11, 12, 13], -1  # three: the K = 4 verify
    device.serial_verify("decode_verify_graphed_k4", 0, [10, 11, 12, 13])
    assert device.refused is None


def test_content_loop_due_fires_when_a_loop_by_48_tokens_was_let_through():
    """The plain sink checks the output before the token that brings the content count to 48 (then
    every 16): a final output whose first 48 tokens end in a loop, yet goes on, broke that rule;
    one whose loop only completes after 48 did not."""
    from fxsched.runtime.check.invariants import Violation, content_loop_checked_when_due

    lead = list(range(10, 40))  # 30 distinct tokens, then a period-6 block three times: a loop at 48
    looped = lead + [2, 3, 4, 5, 6, 7] * 3
    with pytest.raises(Violation, match="content_loop_due"):
        content_loop_checked_when_due(1, tuple(looped + [8]))
    content_loop_checked_when_due(1, tuple(looped))  # it ends there: the guard may have fired at 48
    late = list(range(10, 45)) + [2, 3, 4, 5, 6] * 3  # 35 + 15 = 50: the loop completes after 48
    content_loop_checked_when_due(1, tuple(late + [9, 9]))
