"""The order of ``active`` across a step (specs/checker.md §11.2): the rule book fixes where a
sequence joins or takes a place in it, and the checker otherwise takes the scheduler's own order as
given where a rule reads it (the swap-out victim's ties, the compaction's order), so a wrong order
would be self-consistent there.

Three transitions fix it, each judged on the states before and after one step:

- **Promotion** (scheduler.md §5.14): prompts whose first token is known leave ``prefilling``
  walked last to first, each appended to ``active``: those of one step follow every sequence that
  was active before it, later prompt first.
- **Swap-out** (§5.9 step 4): the victim leaves ``active`` for the swap pool and the last active
  sequence takes its place; the others keep theirs. (A preemption that spills, §5.18, only removes
  its victim: the swap-out's rule applies to the step that answers the swap-out stage's read.)
- **Re-sort** (§5.16 step 1, §5.13): a plain decode or a mixed step sorts ``active`` by slot, and
  the sorted order is kept. A step that ends by planning one (a prompt's answer that promotes it and
  goes on to the decode lane) leaves ``active`` in slot order whatever came before in it.

Other changes a step may make (retirement removes sequences, compaction moves slots only) keep the
relative order of the sequences that stay, which both rules require of the rest too.
"""

from __future__ import annotations

from fxsched.core.phases import AwaitSwapOutFree
from fxsched.core.state import SchedulerState
from fxsched.effects import device_calls as dc
from fxsched.effects import plans
from fxsched.runtime.check.violation import Violation

RESORTS = frozenset((plans.Decode, dc.MixedForward, dc.MixedForwardBatch))
"""The effects a step that re-sorts ``active`` by slot emits (the plain decode, the mixed steps)."""


def _by_slot(state: SchedulerState) -> bool:
    slots = [s.slot for s in state.rows]
    return all(a < b for a, b in zip(slots, slots[1:], strict=False))


def swapped_out(before: SchedulerState, after: SchedulerState) -> set[int]:
    """The sequences a step's swap-out spilled (none unless the step answers the swap-out stage's read:
    a preemption's spill is not a swap-out)."""
    if type(before.waiting) is not AwaitSwapOutFree or after.swapped is before.swapped:
        return set()
    return {x.sequence.seq_id for x in after.swapped} - {x.sequence.seq_id for x in before.swapped}


def active_order(before: SchedulerState, after: SchedulerState, resorted: bool = False) -> None:
    """active order: a step's promotions join ``active`` after every sequence active before it, later
    prompt first; a swap-out's victim gives its place to the last active sequence; the sequences
    that stay keep their relative order (scheduler.md §5.14, §5.9 step 4, §5.19); unless the step
    re-sorted ``active`` by slot (``resorted``: it planned a decode or a mixed step, §5.16 step 1,
    §5.13) and left it so."""
    old = [s.seq_id for s in before.rows]
    new = [s.seq_id for s in after.rows]
    if old == new:
        return
    spilled = swapped_out(before, after)
    stay = set(new)
    expected = list(old)
    for victim in [i for i in old if i in spilled]:  # (one a step: each spill ends with its query)
        at = expected.index(victim)
        last = expected.pop()
        if last != victim:
            expected[at] = last
    expected = [i for i in expected if i in stay]
    was = set(old)
    promoted = [e.seq_id for e in reversed(before.prefilling) if e.seq_id in stay and e.seq_id not in was]
    joined = [i for i in new if i not in was and i not in promoted]  # (a swap-in or resume: its place is not judged)
    judged = [i for i in new if i not in joined]
    if judged != expected + promoted and not (resorted and _by_slot(after)):
        raise Violation("active_order", f"active went from {old} to {new}; the rule book's order is "
                                        f"{expected + promoted} (promoted later-first: {promoted}, spilled: "
                                        f"{sorted(spilled & was)})")
