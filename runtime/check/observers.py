"""What one episode of the random walk runs with (runtime/check/walk.py): the inbox that delivers
its arrivals, clock readings, rotations and closure (``WalkHost``), the observers that feed every
event, batch of effects and client output to the invariants (``MonitorObserver``, and
``WalkObserver``, which also counts the features the walk reached and schedules the episode's
faults), and the interpreter that injects a fault in a chosen waiting phase (``FaultingInterpreter``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Optional


from fxsched.core.config import SCRIPTED_EOS as EOS
from fxsched.core import events as ev
from fxsched.core.phases import (AwaitAhead, AwaitBatchedDflash, AwaitDecode, AwaitMtpBatch, AwaitPublishBlocks,
                                 AwaitSwapOutFree, EndOfTick)
from fxsched.core.state import hot_columns
from fxsched.effects import device_calls as dc
from fxsched.effects import plans
from fxsched.effects.client import DoneOut, ErrorOut, ResponseOut, RotationAck
from fxsched.runtime.interpreter import Host, Interpreter, Observer
from fxsched.runtime.check.episode import TICK_MS, Episode
from fxsched.runtime.check.invariants import CANCEL, EVENT_KINDS, FAULT, Monitor, Violation
from fxsched.runtime.check.active_order import swapped_out
from fxsched.runtime.check.orderings import SIGNATURES, Signature
from fxsched.runtime.check.roles import _Memo
from fxsched.runtime.devices.lane import DeferredLane
from fxsched.runtime.devices.sim_decodes import AHEAD_FAILURE
from fxsched.runtime.devices.sim_proposals import LATE_FAILURE

# the late-draft feature a verify's answer counts, by the phase it waited in
_LATE = {AwaitMtpBatch: "feature:late_drafts_mtp_batched", AwaitBatchedDflash: "feature:late_drafts_dflash_batched"}


class WalkHost(Host):
    """The inbox of one episode: delivers arrivals, clock readings, rotation requests and the
    closure."""

    def __init__(self, episode: Episode):
        super().__init__()
        self.episode = episode
        self.pending: dict[int, list] = {}
        for r in episode.requests:
            if r.arrive_tick > 0:
                self.pending.setdefault(r.arrive_tick, []).append(ev.Arrival(r.request()))
        self.cancels: dict[int, list] = {}
        for r in episode.requests:
            if r.host_cancel_tick is not None:
                self.cancels.setdefault(r.host_cancel_tick, []).append(ev.Cancel(r.id))
        self.closed = False

    def initial_events(self) -> list:
        return [ev.Arrival(r.request()) for r in self.episode.requests if r.arrive_tick == 0]

    def on_tick(self, tick: int) -> None:
        self.inputs.append(ev.Clock(tick * TICK_MS))
        self.inputs.extend(self.pending.pop(tick, []))
        self.inputs.extend(self.cancels.pop(tick, []))
        if self.episode.rotation_tick == tick:
            self.inputs.append(ev.RotationRequested("adapter-x"))
        if tick >= self.episode.close_tick and not self.pending and not self.closed:
            self.closed = True
            self.inputs.append(ev.InboxClosed())

    def wait_for_input(self) -> list:
        events = []
        for tick in sorted(self.pending):
            events.extend(self.pending.pop(tick))
        if not events and not self.closed:
            self.closed = True
            events.append(ev.InboxClosed())
        return events


class LateCancelHost(WalkHost):
    """``WalkHost`` for an episode whose clients cancel at a tick: each cancel reaches the scheduler
    0 to 4 steps after its tick begins (the same for every run of the episode), so it lands in
    whatever phase the tick is in then, as a client's cancel does, not only beside the tick's first
    query (specs/async.md §16.6 rules 2 and 3 tell a cancel before a decode's answer from one after
    it). Every step asks it for its inputs; the others are given at once."""

    def __init__(self, episode: Episode):
        super().__init__(episode)
        self.held: list[tuple[int, ev.Event]] = []  # (steps still to wait, cancel)

    def on_tick(self, tick: int) -> None:
        due = self.cancels.pop(tick, [])
        super().on_tick(tick)
        self.held.extend(((event.request_id * 2_654_435_761 + tick * 40_503) % 5, event) for event in due)
        if self.closed:  # nothing may follow the inbox's closure
            self._release(all_held=True)

    def take_inputs(self) -> list:
        if self.held:
            self._release()
        return super().take_inputs()

    def wait_for_input(self) -> list:
        """A blocking wait gets every input held back, before whatever the wait itself brings."""
        self._release(all_held=True)
        return super().take_inputs() + super().wait_for_input()

    def _release(self, all_held: bool = False) -> None:
        late = [event for steps, event in self.held if all_held or steps <= 0]
        self.held = [] if all_held else [(steps - 1, event) for steps, event in self.held if steps > 0]
        if late:
            at = len(self.inputs) - (1 if self.inputs and isinstance(self.inputs[-1], ev.InboxClosed) else 0)
            self.inputs[at:at] = late


def walk_host(episode: Episode) -> WalkHost:
    """The host of an episode: cancels at a tick held back a few steps where it has any."""
    if any(r.host_cancel_tick is not None for r in episode.requests):
        return LateCancelHost(episode)
    return WalkHost(episode)


_NOTED = frozenset((dc.GenerateBeamBatch, dc.DecodeVerifyBatched, dc.TruncateSequence, dc.AdapterIdFor, plans.Decode))
"""The effect types ``WalkObserver._note_features`` looks into."""

_WATCHED: dict[tuple, tuple[Signature, bool]] = _Memo(lambda kinds: (SIGNATURES[kinds], not _NOTED.isdisjoint(kinds)))
"""A batch's signature -> (its ``orderings.SIGNATURES`` entry, whether it holds a type of ``_NOTED``),
worked out once per signature."""


class MonitorObserver(Observer):
    """The invariants on the drive loop: the monitor sees every event before it is stepped, every
    batch before it is carried out, the device after it, and every client output."""

    def __init__(self, monitor: Monitor):
        self.monitor = monitor

    def before_step(self, event) -> None:
        self.monitor.on_event(event)

    def stepped(self, event, state, effects) -> None:
        self.monitor.on_effects(effects)

    def performed(self, state) -> None:
        self.monitor.on_state(state)

    def output(self, output) -> None:
        if not isinstance(output, RotationAck):
            self.monitor.on_output(output)


class WalkObserver(MonitorObserver):
    """The random walk's watch: the invariants, coverage counts, the event log of a replay, the
    end-of-run checks and the step limit."""

    def __init__(self, monitor: Monitor, coverage: Counter, step_limit: int, keep_log: bool,
                 episode: Optional["Episode"] = None):
        super().__init__(monitor)
        self.coverage = coverage
        self.step_limit = step_limit
        self.log: Optional[list[str]] = [] if keep_log else None
        self.steps = 0
        self.stepping: Optional[ev.Event] = None  # the event ``step`` is working on
        self.episode = episode
        self.waiting: Any = None  # the phase the last batch left the scheduler waiting in
        self.signatures: list[Signature] = []  # the signature of every batch stepped, counted by ``count_effects``
        self.lane: Optional[DeferredLane] = None  # the episode's lane: device work runs behind the host
        self.outputs: Optional[list] = None  # every client output, when the episode's twin compares them

    def before_step(self, event) -> None:
        self.stepping = event
        if self.log is not None:
            self.log.append(repr(event))
        kind = EVENT_KINDS[type(event)]
        if not kind:  # an answer, most events: what ``Monitor.on_event`` does with one, without the call
            monitor = self.monitor
            monitor.fault_step = monitor.kv_fault = monitor.nothing_new = False
            if type(event) is ev.VerifyRows and event.inputs:
                self.coverage[_LATE.get(type(self.waiting), "feature:late_drafts_serial")] += 1
            elif type(event) is ev.TokensSampled and (event.earlier or ev.LATE_TOKEN in event.tokens):
                self._note_ahead(event)
            return
        if kind & (FAULT | CANCEL):
            if kind & FAULT:
                self.coverage["fault:kv_exhausted" if event.kv_exhausted else "fault:fatal"] += 1
                if LATE_FAILURE in event.message:
                    self.coverage["feature:late_failure"] += 1
                if AHEAD_FAILURE in event.message:
                    self.coverage["feature:ahead_failure"] += 1
                if event.earlier:
                    self.coverage["feature:fault_brings_kept"] += 1
            else:
                self.coverage["fault:cancel"] += 1
                if event.request_id in self.monitor.requests and not self.monitor._cancel_lands(event.request_id):
                    self.coverage["rare:cancel_without_flag"] += 1
        self.monitor.on_event(event, kind)

    def _note_ahead(self, event: ev.TokensSampled) -> None:
        """Coverage of async scheduling (specs/async.md §16.6): decodes answered ahead, kept tokens
        resolved by a decode or read alone, and rows computed ahead for a sequence the resolved EOS
        ended (dropped)."""
        coverage, waiting = self.coverage, self.waiting
        if ev.LATE_TOKEN in event.tokens:
            coverage["feature:decode_ahead"] += 1
        if not event.earlier:
            return
        if isinstance(waiting, AwaitAhead):
            coverage["feature:kept_read_alone"] += 1
            return
        coverage["feature:kept_resolved"] += 1
        if isinstance(waiting, AwaitDecode):
            fed = set(waiting.seq_ids)
            if any(t == EOS and s in fed for s, t in zip(waiting.resolve, event.earlier, strict=False)):
                coverage["feature:computed_ahead_dropped"] += 1

    def stepped(self, event, state, effects) -> None:
        self.stepping = None
        self.steps += 1
        self.waiting = state.waiting
        if type(state.waiting) is AwaitAhead and state.agenda and type(state.agenda[0]) is EndOfTick:
            self.coverage["feature:ahead_deadline_read"] += 1
        if type(event) is ev.TokensSampled and event.earlier and ev.LATE_TOKEN in event.tokens:
            columns = hot_columns(state)  # a steady batch answered over the columns (specs/async.md §16.6 rule 7)
            if columns is not None and ev.LATE_TOKEN in columns.last_token:
                self.coverage["feature:ahead_columns"] += 1
        if effects:
            n = len(effects)  # (most batches hold one to three effects: their signature written out is quicker)
            kinds = ((type(effects[0]),) if n == 1 else (type(effects[0]), type(effects[1])) if n == 2
                     else (type(effects[0]), type(effects[1]), type(effects[2])) if n == 3
                     else tuple(map(type, effects)))
            known, noted = _WATCHED[kinds]
            self.monitor.on_effects(effects, known=known)
            self.signatures.append(known)
            if noted:
                self._note_features(effects)

    def _note_features(self, effects) -> None:
        """The features some effects show (beams, batched verifies, rollbacks, adapters)."""
        coverage = self.coverage
        for effect in effects:
            kind = type(effect)
            if kind is dc.GenerateBeamBatch:
                coverage["feature:beam_grouped" if len(effect.prompts) > 1 else "feature:beam_single"] += 1
            elif kind is dc.DecodeVerifyBatched and self.episode is not None:
                coverage["feature:dflash_batched" if self.episode.mode == "dflash" else "feature:mtp_batched"] += 1
            elif kind is dc.TruncateSequence and self.episode is not None and self.episode.watchdog:
                coverage["feature:watchdog_rollback"] += 1
            elif kind is dc.AdapterIdFor and any(slot != -1 for slot in effect.slots):
                coverage["feature:adapters"] += 1
            elif kind is plans.Decode:
                # a plain decode of a sequence whose table is larger than its length needs: a verify
                # that crossed a block boundary was rejected before it (the count must not fall)
                live, bs = self.monitor.device.live, self.monitor.device.block_size
                if any(s in live and live[s].blocks > live[s].seq_len // bs + 1 for s in effect.seqs):
                    coverage["rare:plain_after_rejected_cross"] += 1

    def count_effects(self) -> None:
        """Add the effects stepped so far to the coverage, one count per effect under its type's name
        (the types in the order they were first stepped)."""
        counts: dict[type, int] = {}
        for known, n in Counter(self.signatures).items():
            for kind in known.kinds:
                counts[kind] = counts.get(kind, 0) + n
        coverage = self.coverage
        for kind, n in counts.items():
            coverage[kind.__name__] += n
        self.signatures = []

    def performed(self, state) -> None:
        if self.lane is not None:  # the checks read the device: let it catch up with the batch
            self.lane.fence()
        before = self.monitor.seen_state
        self.monitor.on_state(state)
        if before is not None and type(before.waiting) is AwaitSwapOutFree:
            spilled = swapped_out(before, state)
            if spilled and before.rows[-1].seq_id not in spilled:  # the victim gave its place to the last
                self.coverage["feature:swap_out_not_last"] += 1
        if (state.swapped or state.preempted) and isinstance(state.waiting, AwaitPublishBlocks):
            if (len(state.rows) + len(state.prefilling) + len(state.new_requests) >= state.config.max_batch_size
                    and self.monitor.device.free_count() > 0):
                self.coverage["feature:full_batch_while_waiting"] += 1
            if not state.rows and not state.prefilling:
                self.coverage["rare:nothing_runs_while_work_waits"] += 1
            bs, total = state.model.block_size, state.model.total_blocks
            if any(len(q.tokens) // bs + 2 == total for q in state.preempted):
                self.coverage["rare:requeue_needs_whole_pool"] += 1
        if state.stopped:
            self.monitor.at_end(state)
        elif self.steps >= self.step_limit:
            raise Violation("step_limit", f"the episode did not end within {self.step_limit} steps")

    def output(self, output) -> None:
        if self.outputs is not None:
            self.outputs.append(output)
        if isinstance(output, RotationAck):
            self.coverage["rotation_ack"] += 1
            return
        self.monitor.on_output(output)
        if isinstance(output, (DoneOut, ResponseOut)):
            self.coverage[f"finish:{output.reason}"] += 1
            guard = output.guard if isinstance(output, DoneOut) else None
            if guard:
                self.coverage[f"guard:{guard}"] += 1
            if output.cached:
                self.coverage["feature:prefix_hit"] += 1
            due = getattr(self.monitor.requests.get(output.request_id), "deadline_ms", None)
            if str(output.reason) == "timeout" and due is not None and due == self.monitor.now_ms:
                self.coverage["rare:deadline_on_the_clock"] += 1
            if isinstance(output, ResponseOut) and output.logprobs:
                self.coverage["feature:logprobs"] += 1
            request = self.monitor.requests[output.request_id]
            n = output.n if isinstance(output, DoneOut) else len(output.tokens)
            if (str(output.reason) == "length" and n < request.max_tokens and self.episode is not None
                    and request.prompt_len + n >= self.episode.max_seq_len):
                self.coverage["feature:context_ceiling"] += 1
            if str(output.reason) == "length" and not guard and n < request.max_tokens and self.episode is not None \
                    and self.episode.watchdog and isinstance(output, ResponseOut):
                self.coverage["guard:blocking"] += 1
        elif isinstance(output, ErrorOut):
            self.coverage["finish:error"] += 1
            if "spill file" in output.message:
                self.coverage["feature:spill_fault"] += 1


class FaultingInterpreter(Interpreter):
    """The interpreter of an episode with ``fault_phase``: the ``fault_phase_at``-th time a batch
    leaves the scheduler waiting in that phase, the batch's query (its last effect) fails before it
    does anything: the rest of the batch is carried out and the answer is a ``DeviceFault``."""

    def __init__(self, *args, watch: WalkObserver, phase: str, at: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.watch = watch
        self.phase = phase
        self.at = at
        self.seen = 0

    def perform_all(self, effects) -> Optional[ev.Event]:
        waiting = self.watch.waiting
        if (self.phase and waiting is not None and type(waiting).__name__ == self.phase and effects
                and effects[-1].QUERY):
            self.seen += 1
            if self.seen == self.at + 1:
                super().perform_all(effects[:-1])
                self.watch.coverage[f"fault_phase:{self.phase}"] += 1
                return ev.DeviceFault(f"injected fault in {self.phase}", False)
        return super().perform_all(effects)

    def _answer_ahead(self, query) -> Optional[ev.Event]:
        """Never ahead in the fault phase: the injected fault is the answer there."""
        waiting = self.watch.waiting
        if self.phase and waiting is not None and type(waiting).__name__ == self.phase:
            return None
        return super()._answer_ahead(query)
