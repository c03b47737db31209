"""The checker's rules on choices the rule book fixes (specs/checker.md §11.2), each shown to fire on
the wrong choice and to stay quiet on the right one: the swap-out victim (scheduler.md §5.9 step 3),
the compaction targets and their order (§5.19 step 3) and the rollback cap (watchdog.md §7.5).
(That they catch real scheduler bugs is measured by the mutation suite, tests/run_mutants.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fxsched.core.config import SchedulerConfig
from fxsched.effects import device_calls as dc
from fxsched.effects import lifecycle as lc
from fxsched.effects.client import TokenOut
from fxsched.runtime.check.effect_rules import EffectRules, swap_victim_rule
from fxsched.runtime.check.frames import checkpoints_stream
from fxsched.runtime.check.outputs import plain_path_only
from fxsched.runtime.check.state_checks import compaction_target_free
from fxsched.runtime.check.violation import Violation


def _seq(seq_id: int, blocks: int = 1, request: int = 0):
    return SimpleNamespace(seq_id=seq_id, blocks=blocks, request=SimpleNamespace(id=request or seq_id))


def test_the_swap_victim_has_the_longest_table_the_last_of_equals():
    active = (_seq(1, 2), _seq(2, 3), _seq(3, 1), _seq(4, 3), _seq(5, 2))
    swap_victim_rule(active, 4)
    for wrong in (1, 2, 3, 5):
        with pytest.raises(Violation, match="the rule picks 4"):
            swap_victim_rule(active, wrong)


def _device(slots: dict[int, int]):
    return SimpleNamespace(live={seq: SimpleNamespace(slot=slot) for seq, slot in slots.items()})


def test_compaction_moves_each_high_slot_into_the_largest_free_one_in_active_order():
    # a retire released sequence 2 (slot 1) and 3 (slot 2): 0, 4 and 5 survive, n = 3, free 1 and 2
    device = _device({10: 0, 2: 1, 3: 2, 14: 4, 15: 5})
    active = (_seq(10), _seq(15), _seq(2), _seq(14), _seq(3))  # active order need not be slot order
    released = [lc.ReleaseSeq(2, 1, cache=True, reason=lc.ReleaseReason.FINISH_SEQUENCE),
                lc.ReleaseSeq(3, 2, cache=True, reason=lc.ReleaseReason.FINISH_SEQUENCE)]
    right = released + [lc.CompactSlot(15, 2), lc.CompactSlot(14, 1)]
    compaction_target_free(right, device, active)
    with pytest.raises(Violation, match="largest free one below it"):  # the smallest target first
        compaction_target_free(released + [lc.CompactSlot(15, 1), lc.CompactSlot(14, 2)], device, active)
    with pytest.raises(Violation, match="active order"):  # the largest each time, but out of order
        compaction_target_free(released + [lc.CompactSlot(14, 2), lc.CompactSlot(15, 1)], device, active)
    packed = _device({10: 0, 11: 1, 12: 2, 13: 3})  # 11 released: n = 3, and only 13 (slot 3) may move
    with pytest.raises(Violation, match="moves only a slot >= 3"):
        compaction_target_free([lc.ReleaseSeq(11, 1, cache=True, reason=lc.ReleaseReason.FINISH_SEQUENCE),
                                lc.CompactSlot(12, 1)], packed, (_seq(10), _seq(12), _seq(13)))


def test_a_swap_outs_move_takes_the_victims_slot():
    # seed 66's shape: a newcomer (3) holds slot 2 already; the victim 1 leaves slot 0 to the last active
    device = _device({1: 0, 2: 1, 3: 2})
    spill = lc.ReleaseSeq(1, 0, cache=False, reason=lc.ReleaseReason.SPILL_OUT_SEQUENCE)
    compaction_target_free([spill, lc.CompactSlot(2, 0)], device, (_seq(1), _seq(2)))
    gap = _device({1: 0, 2: 2, 3: 3})  # slot 1 free: still the victim's slot is the target
    spill = lc.ReleaseSeq(2, 2, cache=False, reason=lc.ReleaseReason.SPILL_OUT_SEQUENCE)
    with pytest.raises(Violation, match="not the spilled victim's 2"):
        compaction_target_free([spill, lc.CompactSlot(3, 1)], gap, (_seq(1), _seq(2), _seq(3)))


class _Rules(EffectRules):
    def __init__(self, config: SchedulerConfig, active: tuple) -> None:
        self.config, self.rollbacks = config, {}
        self.plain = plain_path_only(config, None, None)
        self.seen_state = SimpleNamespace(active=active)  # type: ignore[assignment]


@pytest.mark.parametrize("cap", [0, 1, 2])
def test_the_checker_counts_rollbacks_from_their_effects_up_to_the_cap(cap):
    rules = _Rules(SchedulerConfig(loop_watchdog=True, boundary_tokens=(41,), max_rollbacks=cap),
                   (_seq(7, request=3), _seq(8, request=4)))
    for _ in range(cap):  # a hybrid's rollback: the restore and the truncation count once
        rules._rollback_cap([lc.SsmSnapshotRestore(7, 0), dc.TruncateSequence(7, 20)])
    if cap:
        rules._rollback_cap([dc.TruncateSequence(8, 9)])  # another request's count is its own
    with pytest.raises(Violation, match=f"request 3 rolls back {cap + 1} times"):
        rules._rollback_cap([dc.TruncateSequence(7, 20)])


def test_a_speculative_truncation_is_no_rollback_and_re_steering_off_allows_none():
    spec = _Rules(SchedulerConfig(loop_watchdog=True, use_speculative=True, num_drafts=2, max_rollbacks=1),
                  (_seq(7, request=3),))
    for _ in range(3):  # a rejected verify's rewind
        spec._rollback_cap([dc.TruncateSequence(7, 20)])
    off = _Rules(SchedulerConfig(loop_watchdog=True, rollback_resteer=False, max_rollbacks=2), (_seq(7, request=3),))
    with pytest.raises(Violation, match="the cap is 0"):
        off._rollback_cap([lc.SsmSnapshotRestore(7, 0)])


def test_the_plain_sink_checkpoints_only_the_rows_whose_token_it_streams():
    device = SimpleNamespace(live={5: SimpleNamespace(rid=1), 6: SimpleNamespace(rid=2)}, _rid=lambda s: s.rid)
    requests = {1: SimpleNamespace(streaming=True), 2: SimpleNamespace(streaming=False)}
    checkpoints_stream([lc.MarconiCheckpoint(5), TokenOut(1, 30), lc.MarconiCheckpoint(6)], device, requests)
    with pytest.raises(Violation, match="sequence 5 is checkpointed, but request 1 gets no token"):
        checkpoints_stream([lc.MarconiCheckpoint(5), TokenOut(2, 30)], device, requests)  # an EOS row of 1


def test_a_k_verify_trims_before_a_partial_commit_and_after_a_full_one():
    from fxsched.runtime.check.orderings import trim_then_partial_commit

    trim_then_partial_commit([dc.TrimProposerState(1, 0), dc.CommitAcceptedPrefix(1, 1, 2)])  # rejected
    trim_then_partial_commit([dc.CommitAcceptedPrefix(1, 3, 3), dc.SaveHiddenForMtp(2), dc.TrimProposerState(1, 2)])
    with pytest.raises(Violation, match="after the commit of a partial accept"):
        trim_then_partial_commit([dc.CommitAcceptedPrefix(1, 2, 4), dc.TrimProposerState(1, 1)])
    with pytest.raises(Violation, match="before the commit of a full accept"):
        trim_then_partial_commit([dc.TrimProposerState(1, 1), dc.CommitAcceptedPrefix(1, 2, 2)])
    trim_then_partial_commit([dc.CommitAcceptedPrefix(2, 2, 2), dc.TrimProposerState(1, 0),  # two sequences
                              dc.CommitAcceptedPrefix(1, 1, 2), dc.TrimProposerState(2, 1)])


def test_the_admission_cohort_is_the_running_sequences_adapter():
    from fxsched.core.config import ModelInfo
    from fxsched.runtime.check.state_checks import no_overtaking

    adapters = {-1: 0, 1: 1, 2: 1, 5: 2}
    state = SimpleNamespace(config=SchedulerConfig(), model=ModelInfo(total_blocks=0))
    selection = (SimpleNamespace(id=1, adapter_slot=5), SimpleNamespace(id=2, adapter_slot=1),
                 SimpleNamespace(id=3, adapter_slot=2))
    no_overtaking(selection, selection[1:], adapters, set(), 0, state, running_slot=1)  # a prompt of id 1 prefills
    with pytest.raises(Violation, match="admits \\[2, 3\\]"):  # the first new request's cohort instead
        no_overtaking(selection, selection[:1], adapters, set(), 0, state, running_slot=1)
    no_overtaking(selection, selection[:1], adapters, set(), 0, state)  # nothing runs: the first request's
    no_overtaking(selection, selection[1:], adapters, {1}, 0, state)  # ... that was not refused


def test_a_row_kept_on_the_device_is_not_fed_after_a_cancel_ended_it():
    from fxsched.core.events import LATE_TOKEN
    from fxsched.effects import plans
    from fxsched.runtime.check.state_checks import decode_rows

    device = SimpleNamespace(live={0: SimpleNamespace(slot=0, session=7), 1: SimpleNamespace(slot=1, session=8)},
                             _rid=lambda s: s.session)
    decode = plans.Decode((LATE_TOKEN, LATE_TOKEN), (0, 1), (9, 9))
    decode_rows(decode, device, {}, ended={9})
    with pytest.raises(Violation, match="after a cancel ended it"):
        decode_rows(decode, device, {}, ended={8})
    decode_rows(plans.Decode((LATE_TOKEN, 5), (0, 1), (9, 9)), device, {}, ended={8})  # its token is known: fed


def test_active_takes_promotions_later_first_and_a_swap_outs_last_in_the_victims_place():
    from fxsched.core.phases import AwaitSwapOutFree
    from fxsched.core.state import Swapped
    from fxsched.runtime.check.active_order import active_order

    def state(active, prefilling=(), swapped=(), waiting=None, slots=None):
        slot = slots or {i: n for n, i in enumerate(active)}
        return SimpleNamespace(rows=tuple(SimpleNamespace(seq_id=i, slot=slot[i]) for i in active),
                               prefilling=tuple(SimpleNamespace(seq_id=i) for i in prefilling),
                               swapped=tuple(Swapped(SimpleNamespace(seq_id=i)) for i in swapped), waiting=waiting)

    before = state((1, 2), prefilling=(3, 4))
    active_order(before, state((1, 2, 4, 3)))  # prompts 3 and 4 finish in one step: 4 joins first
    with pytest.raises(Violation, match="promoted later-first: \\[4, 3\\]"):
        active_order(before, state((1, 2, 3, 4)))
    active_order(before, state((1, 3), prefilling=(4,)))  # 2 retired, 3 promoted alone
    swap = state((1, 2, 3, 4), waiting=AwaitSwapOutFree(need=1, stage=None))
    active_order(swap, state((1, 4, 3), swapped=(2,)))  # 2 spilled: the last (4) takes its place
    with pytest.raises(Violation, match="spilled: \\[2\\]"):
        active_order(swap, state((1, 3, 4), swapped=(2,)))
    shuffled = state((3, 1, 2), slots={1: 0, 2: 1, 3: 2})
    with pytest.raises(Violation, match="active went from"):  # a reorder no rule makes
        active_order(state((1, 2, 3)), shuffled)
    active_order(state((3, 1, 2), slots={1: 0, 2: 1, 3: 2}), state((1, 2, 3)), resorted=True)  # a decode sorts by slot
