"""The checker's rules over a batch of effects that need the run's memory (specs/checker.md §11.2):
which sequence a KV-exhausted decode preempts and which one an admission-time swap-out spills,
how many times a request rolls back, and how many drafts a step asks and for whom; and the order
in which admission selects the queue's requests (specs/scheduler.md §5.4).

``EffectRules`` is a part of ``invariants.Monitor`` (a base class): its methods read and update the
monitor's records (the last decode's rows, the active sequences before the step, the immunity and
cancel records, the device's capacity log), which ``Monitor.__init__`` sets up.
"""

from __future__ import annotations

from typing import Any, Optional

from fxsched.core.phases import AwaitSwapOutFree
from fxsched.core.state import SchedulerState

from fxsched.effects import device_calls as dc
from fxsched.effects import lifecycle as lc
from fxsched.effects import plans
from fxsched.effects.client import TokenOut, TokensOut
from fxsched.runtime.check.fault_scope import finishes_on
from fxsched.runtime.check.progress import Progress
from fxsched.runtime.check.roles import DRAFT, OUT, ROLES
from fxsched.runtime.check.state_checks import admission_order
from fxsched.runtime.check.violation import Violation


class EffectRules:
    """The preemption and swap-out victims, the rollback cap and the draft rules, checked over one
    batch of effects; and the admission order of each new selection (``_selection``)."""

    # the monitor's records these rules read and keep (set by Monitor.__init__)
    config: Any
    device: Any
    requests: dict[int, Any]
    streamed: dict[int, list[int]]
    progress: Progress
    cancelled: set[int]
    capacity_query: tuple[int, int]
    kv_fault: bool
    fault_resolved: dict[int, int]
    requeued_kv: dict[int, int]
    last_decode_rows: tuple[int, ...]
    prev_active: dict[int, tuple]
    evicted: set[int]
    moved: set[int]
    flagless: set[int]
    immune: dict[int, int]
    seen_state: Optional[SchedulerState]
    rollbacks: dict[int, int]
    plain: bool
    queue: list
    selection: tuple
    selected: tuple
    served: set[int]

    def _rollback_cap(self, effects) -> None:
        """rollback cap (specs/watchdog.md §7.5): a request's sequence rolls back at most
        ``max_rollbacks`` times (none with ``rollback_resteer`` off), counted by the checker from the
        rollbacks' own effects, whatever the scheduler's counter says: a snapshot restore
        (``SsmSnapshotRestore``: only a rollback emits one, on a model with SSM layers) or, where
        nothing speculates, a truncation (``TruncateSequence``: otherwise only speculation rewinds
        a sequence); one rollback per sequence and batch. Swapped or requeued, it keeps its count."""
        config = self.config
        cap = config.max_rollbacks if config.rollback_resteer else 0
        cuts = self.plain  # nothing speculates: a truncation is a rollback
        owner = {s.seq_id: s.request.id for s in (self.seen_state.active if self.seen_state is not None else ())}
        rolled = {e.seq for e in effects
                  if type(e) is lc.SsmSnapshotRestore or (cuts and type(e) is dc.TruncateSequence)}
        for seq in rolled:
            rid = owner.get(seq)
            if rid is None:
                continue
            n = self.rollbacks[rid] = self.rollbacks.get(rid, 0) + 1
            if n > cap:
                raise Violation("rollback_cap", f"request {rid} rolls back {n} times; the cap is {cap} "
                                                f"(max_rollbacks {config.max_rollbacks}, rollback_resteer "
                                                f"{config.rollback_resteer})")

    def _preemption(self, effects) -> None:
        """preemption victim (specs/scheduler.md §5.18): after a KV-exhausted decode, the sequence
        preempted (requeued or spilled) is, among the failed decode's rows, the smallest
        (output length, slot), ignoring the rows still immune unless all are. Immunity is the
        checker's own record: a sequence requeue-resumed after a preemption is immune until its
        output grows by ``preemption_immunity_tokens`` (§5.19 step 5; a swap-in keeps what it had)."""
        rows: tuple[int, ...] = self.last_decode_rows
        # a sequence ahead has produced one token more than its output holds (specs/async.md §16.6)
        self.prev_active = {seq.seq_id: (len(seq.output) + (1 if seq.ahead else 0), seq.slot, seq.request.id,
                                         seq.seq_id)
                            for seq in (self.seen_state.active if self.seen_state is not None else ())}
        resolved = self.fault_resolved
        if resolved and self.seen_state is not None:  # rows a resolved token ended are no victims
            rows = tuple(i for i in rows if not (i in resolved and finishes_on(self.seen_state, i, resolved[i])))
        for effect in effects:
            if isinstance(effect, plans.Decode):
                rows = effect.seqs
            elif (isinstance(effect, lc.ReleaseSeq) and self.kv_fault
                  and str(effect.reason) in ("preempt_requeue", "spill_out_sequence")):
                known = [self.prev_active[i] for i in rows if i in self.prev_active]
                if len(known) == len(rows) and effect.seq in rows:
                    mortal = [k for k in known if k[0] >= self.immune.get(k[2], 0)] or known
                    want = min(mortal)
                    if want[3] != effect.seq:
                        raise Violation("preemption_victim", f"preempted sequence {effect.seq}; of the failed rows "
                                                             f"(output, slot, request, seq) {sorted(known)} with "
                                                             f"immunity {self.immune} the rule picks {want[3]}")
                self.kv_fault = False
            if (isinstance(effect, lc.ReleaseSeq) and str(effect.reason) == "spill_out_sequence" and not self.kv_fault
                    and self.seen_state is not None and type(self.seen_state.waiting) is AwaitSwapOutFree):
                swap_victim_rule(self.seen_state.active, effect.seq)
            if isinstance(effect, lc.ReleaseSeq) and str(effect.reason) in ("preempt_requeue", "spill_out_sequence"):
                rid = self.prev_active.get(effect.seq, (0, 0, None, 0))[2]
                if rid is not None:
                    self.moved.add(rid)
                    self.progress.let_go(rid)
                    if str(effect.reason) == "spill_out_sequence":  # it comes back without its cancel flag
                        self.flagless.add(rid)
                        self.cancelled.discard(rid)
                    if str(effect.reason) == "preempt_requeue":
                        self.evicted.add(rid)
                        held = self.device.live.get(effect.seq)
                        if held is not None:
                            self.requeued_kv[rid] = held.seq_len
        self.last_decode_rows = rows

    def _draft_rules(self, effects) -> None:
        """The draft count of a step and who may get drafts (specs/speculation.md §6.2, §6.15):
        every proposal asks for count = min(base, the step's capacities) drafts, where base is
        ``num_drafts`` for DFlash and the MTP ladder (3 while at most 8 sequences are active,
        else 1, clamped to [1, num_drafts]) for MTP; a self-speculative verify feeds
        min(num_drafts, capacity) drafts; and no proposal or catch-up names a sequence whose
        request has spent its budget (its last token is out, earlier in the same batch or before)."""
        config = self.config
        device = self.device
        out: dict[int, int] = {}
        roles = ROLES
        for effect in effects:
            if not roles[type(effect)] & (DRAFT | OUT):
                continue
            if isinstance(effect, dc.SlotDraftCapacity):
                self.capacity_query = (len(device.capacity_log), len(effect.slots))
            elif isinstance(effect, (TokenOut, TokensOut)):
                rid = effect.request_id
                out[rid] = out.get(rid, len(self.streamed.get(rid, ()))) + (
                    1 if isinstance(effect, TokenOut) else len(effect.tokens))
            elif isinstance(effect, (dc.ProposeMulti, dc.ProposeBatched, dc.CatchupBatched, dc.DecodeVerify)):
                start, n_active = self.capacity_query
                caps = device.capacity_log[start:start + n_active]
                if isinstance(effect, dc.DecodeVerify):
                    if config.self_speculative and caps:
                        count = min([config.num_drafts] + caps)
                        if len(effect.tokens) - 1 != count:
                            raise Violation("draft_count", f"a self-speculative verify feeds {len(effect.tokens) - 1} "
                                                           f"drafts, the step's count is {count}")
                    continue
                if isinstance(effect, dc.CatchupBatched):
                    batch = device.batch_seqs
                    seqs = tuple(batch[s // 4] for s in effect.slots if s // 4 < len(batch))
                else:
                    seqs = (effect.seq,) if isinstance(effect, dc.ProposeMulti) else effect.seqs
                    if config.dflash:
                        base = config.num_drafts
                    else:
                        base = max(1, min(3 if n_active <= 8 else 1, config.num_drafts))
                    count = min([base] + caps)
                    if len(caps) == n_active and effect.n != count:
                        raise Violation("draft_count", f"{type(effect).__name__} asks {effect.n} drafts with "
                                                       f"{n_active} active and capacities {caps}; the count is {count}")
                for seq_id in seqs:
                    s = device.live.get(seq_id)
                    request = self.requests.get(device._rid(s)) if s is not None else None
                    if request is None or not getattr(request, "streaming", True):
                        continue
                    rid = request.id
                    if out.get(rid, len(self.streamed[rid])) >= request.max_tokens:
                        raise Violation("finished_gets_drafts", f"{type(effect).__name__} names sequence {seq_id} "
                                                                f"of request {rid}, whose budget is spent")

    def _selection(self, state: SchedulerState) -> None:
        """admission order (``state_checks.admission_order``) of a new selection, against the checker's
        own model of the queue (``queue``: arrivals in order, deferred requests back at the front)."""
        new = state.new_requests
        if not new or new is self.selected:
            return
        previous = {r.id for r in self.selected}
        if previous and {r.id for r in new} <= previous:
            self.selected = new  # an admission or a fault kept part of the selection
            return
        deferred = [r for r in self.selection if r.id not in self.served]
        waiting = {r.id for r in deferred}
        self.queue = deferred + [r for r in self.queue if r.id not in waiting and r.id not in self.served]
        cap = state.config.max_batch_size - len(state.rows) - len(state.prefilling)
        admission_order(state.config.policy, self.queue, new, cap)
        taken = {r.id for r in new}
        self.queue = [r for r in self.queue if r.id not in taken]
        self.selected = self.selection = new


def swap_victim_rule(active, spilled: int) -> None:
    """swap victim (specs/scheduler.md §5.9 step 3): the sequence an admission-time swap-out spills
    is the active one with the longest block table, ties going to the last in active order. Each
    spill of that stage is the answer to its own free-blocks query (``AwaitSwapOutFree``), so the
    active records of the state that asked it are the candidates."""
    most = max((s.blocks for s in active), default=None)
    want = next((s.seq_id for s in reversed(active) if s.blocks == most), None)
    if want is not None and want != spilled:
        raise Violation("swap_victim", f"the swap-out spilled sequence {spilled}; of the active (sequence, blocks) "
                                       f"{[(s.seq_id, s.blocks) for s in active]} the rule picks {want} (most blocks, "
                                       f"the last in active order on ties)")
