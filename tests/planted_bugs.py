"""Planted bugs: known-wrong versions of core/, written as source mutations, that the model checker
must catch (tests/test_planted.py).

Each ``PlantedBug`` names one realistic bug, the text edits that make it (``Edit``: a file under
core/, the original text, which must occur exactly once in that file, and its replacement) and the
invariant of runtime/check/invariants.py that is meant to catch it. The machinery that builds a
mutated copy of the package and runs the checker on it is shared with the mutation suite
(tests/mutants.py) and lives in tests/support/mutation.py.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from support.mutation import Edit, walk_mutant

# steps of the random walk a mutant is given to be caught in (and the clean code must survive)
BUDGET = 20_000


@dataclass(frozen=True)
class PlantedBug:
    name: str
    description: str
    invariant: str  # the ``Violation.invariant`` that is meant to catch it
    edits: tuple[Edit, ...]
    seed: int = 7  # the walk's seed that catches it within ``BUDGET``


PLANTED_BUGS: tuple[PlantedBug, ...] = (
    PlantedBug(
        "leak_on_cancel",
        "a cancelled sequence is finished but its blocks and slot are never released: only its final "
        "frame is sent",
        "no_orphan_sequence",
        (
            Edit("core/tick.py",
                 "from fxsched.core.retire import compact, compaction_moves, finish_and_release\n",
                 "from fxsched.core.retire import compact, compaction_moves, finish_and_release, finish_frame\n"),
            Edit("core/tick.py",
                 "            if not s.finished:\n"
                 "                survivors.append(s)\n"
                 "            else:\n"
                 "                finish_and_release(s, config, out)\n",
                 "            if not s.finished:\n"
                 "                survivors.append(s)\n"
                 "            elif s.cancel_requested:\n"
                 "                out.append(finish_frame(s, config))\n"
                 "            else:\n"
                 "                finish_and_release(s, config, out)\n"),
        ),
        # seed 7 first shows the leak as a compaction into the leaked slot (compaction_target_free)
        seed=5,
    ),
    PlantedBug(
        "accepted_prefix_off_by_one",
        "a partial accept keeps one rejected draft (the serial K-verify and the batched DFlash verify)",
        # the simulated device checks that a commit covers exactly the accepted drafts + 1, which
        # refuses the bad commit before the kept draft reaches a client (lossless)
        "device_arguments",
        (
            Edit("core/kverify.py",
                 "    na = min(accepted_prefix(waiting.drafts[:nd], rows), nd)\n",
                 "    na = min(accepted_prefix(waiting.drafts[:nd], rows), nd)\n"
                 "    if na < nd:\n"
                 "        na += 1\n"),
            Edit("core/dflash.py",
                 "        while na < limit and drafts[na] == rows_all[base + na]:\n"
                 "            na += 1\n",
                 "        while na < limit and drafts[na] == rows_all[base + na]:\n"
                 "            na += 1\n"
                 "        if na < len(drafts):\n"
                 "            na += 1\n"),
        ),
        # seed 7 first meets it in a batched DFlash verify, which streams before it commits
        # (specs/speculation.md §6.12): the kept draft reaches the client first (lossless)
        seed=5,
    ),
    PlantedBug(
        "commit_before_fold",
        "a batched DFlash verify emits CommitAcceptedPrefixBatch before GdnFoldAccepted",
        "fold_before_commit",
        (
            Edit("core/dflash.py",
                 "    out.append(dc.GdnFoldAccepted(facts.slots if facts is not None else tuple([s.slot for s in seqs]), "
                 "accepted, k))\n"
                 "    out.append(dc.CommitAcceptedPrefixBatch(ids, accepted, (k,) * count))\n",
                 "    out.append(dc.CommitAcceptedPrefixBatch(ids, accepted, (k,) * count))\n"
                 "    out.append(dc.GdnFoldAccepted(facts.slots if facts is not None else tuple([s.slot for s in seqs]), "
                 "accepted, k))\n"),
        ),
    ),
    PlantedBug(
        "wrong_compaction_target",
        "compaction moves survivors to the last slot of the packed range",
        "compaction_target_free",
        (
            Edit("core/retire.py",
                 "    moves = compaction_moves([s.slot for s in active], pinned_slots)\n",
                 "    moves = compaction_moves([s.slot for s in active], pinned_slots)\n"
                 "    moves = [(index, len(active) - 1) for index, _ in moves]\n"),
        ),
    ),
    PlantedBug(
        "double_release",
        "a finished sequence's ReleaseSeq is emitted twice",
        "no_effect_on_released",
        (
            Edit("core/tick.py",
                 "            else:\n"
                 "                finish_and_release(s, config, out)\n",
                 "            else:\n"
                 "                finish_and_release(s, config, out)\n"
                 "                out.append(lc.ReleaseSeq(s.seq_id, s.slot, cache=True, "
                 "reason=lc.ReleaseReason.FINISH_SEQUENCE))\n"),
        ),
    ),
    PlantedBug(
        "acc_counts_bonus",
        "acc counts the bonus token of every verify as an accepted draft",
        "acc_accounting",
        (
            Edit("core/verifying.py",
                 '    return {"seq_len": seq_len, "acc": seq.acc + acc_gain(pre_len, seq_len)}\n',
                 '    return {"seq_len": seq_len, "acc": seq.acc + acc_gain(pre_len, seq_len) + 1}\n'),
            Edit("core/dflash.py",
                 '            new_acc.append(acc0 + na if na else acc0)\n',
                 '            new_acc.append(acc0 + na + 1)\n'),
            Edit("core/dflash.py",
                 '"acc": acc0 + na})\n',
                 '"acc": acc0 + na + 1})\n'),
        ),
    ),
    PlantedBug(
        "token_after_eos",
        "the plain path streams the EOS token to the client",
        "lossless",
        (
            Edit("core/emit.py",
                 "    if token in config.eos_set:\n"
                 "        return replace(seq, output=seq.output.append(token), remaining=remaining,\n",
                 "    if token in config.eos_set:\n"
                 "        stream_token(seq, token, out)\n"
                 "        return replace(seq, output=seq.output.append(token), remaining=remaining,\n"),
        ),
    ),
    PlantedBug(
        "slot_leak_on_preemption",
        "a preempted sequence is dropped without releasing its slot and blocks",
        "no_orphan_sequence",
        (
            Edit("core/memory.py",
                 "    out.append(ReleaseSeq(victim.seq_id, victim.slot, cache=True, "
                 "reason=ReleaseReason.PREEMPT_REQUEUE))\n",
                 ""),
        ),
    ),
    PlantedBug(
        "no_rewind_on_reject",
        "a rejected draft is never cut from the device's KV: no TruncateSequence (serial verifies, "
        "the batched DFlash verify, n-gram); the simulated device refuses the next proposal, asked at a "
        "position the KV has passed",
        "device_arguments",
        (
            Edit("core/verifying.py",
                 "    if seq_len < seq.seq_len:\n"
                 "        out.append(dc.TruncateSequence(seq.seq_id, seq_len))\n",
                 ""),
            Edit("core/dflash.py",
                 "    if nas.count(short) != len(nas):  # the rows that rejected a draft are cut back\n",
                 "    if False:  # the rows that rejected a draft are cut back\n"),
            Edit("core/ngram.py",
                 "        out.append(dc.TruncateSequence(seq.seq_id, waiting.pre_len + 1))\n",
                 ""),
        ),
    ),
)

BY_NAME = {bug.name: bug for bug in PLANTED_BUGS}


if __name__ == "__main__":  # python tests/planted_bugs.py [seed ...]: which seed catches what, how fast
    seeds = [int(a) for a in sys.argv[1:]] or [7]
    for bug in PLANTED_BUGS:
        for seed in seeds:
            r = walk_mutant(bug.edits, seed, BUDGET)
            v = r["violation"]
            got = "-" if v is None else f"{v['invariant']} after {r['steps']} steps ({v['message'][:80]})"
            print(f"{bug.name:28} seed {seed:3}: want {bug.invariant:26} got {got}")
