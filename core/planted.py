"""Planted bugs: a test-only hook that switches on known-wrong behaviour.

The model checker must prove it can fail: each name below, listed in
``SchedulerConfig.planted_bugs``, turns on one realistic bug at one place in the rules. Real runs
leave the set empty; the hook is plain configuration data, so ``step`` stays pure.
"""

from __future__ import annotations

PLANTED_BUGS = {
    "leak_on_cancel": "a cancelled sequence is finished but its blocks and slot are never released",
    "accepted_prefix_off_by_one": "a partial accept keeps one rejected draft",
    "commit_before_fold": "a batched DFlash verify commits before it folds the GDN state",
    "wrong_compaction_target": "compaction moves survivors to the last slot of the packed range",
    "double_release": "a finished sequence is released twice",
    "acc_counts_bonus": "acc counts the bonus token of every verify as accepted",
    "token_after_eos": "the plain path streams the EOS token to the client",
    "slot_leak_on_preemption": "a preempted sequence is dropped without releasing its slot and blocks",
    "no_rewind_on_reject": "a rejected draft is never cut from the device's KV",
}


def planted(config, name: str) -> bool:
    """Whether the test-only bug ``name`` is switched on."""
    return name in config.planted_bugs
