"""The interpreter: drives ``step``, carries out each effect on a Device, and turns answers into
events. It is the only place where effects touch the world, and ``Interpreter.run`` is the one
drive loop: the scenario runner, the model checker's walk, generation and the hypothesis machine
(step by step, through ``Interpreter.feed``) all go through it.

Order of delivery after a batch: input events that arose while it ran (the arrivals a blocking
wait returned, then the host's inputs, then scripted cancels from the device) first, then the
answer of the batch's query.

With a lane (specs/async.md §16.5), a batch's device effects run there, in order, while its client
outputs are carried out here; a late proposal is answered ahead, without waiting for the device.

Every batch that ``step`` returns ends in exactly one query, whose answer is the next event, or in
the teardown; an input event's batch is empty. Anything else is a ``BatchError``.

Each effect is carried out by the handler of its type (``runtime/effect_handlers.py``: its cases
are tried in order, the first class the type is a subclass of wins; the choice is remembered per
type, so dispatch costs one dictionary look-up). A query's handler returns its answer event; what
any other handler returns (a fire-and-forget effect's handler is its device call, result and all)
is dropped, so a batch's answer is what its last effect, the query, returned. An effect type no
case covers is a ``RunError`` naming it.

This module is also the drive loop's namespace (``__all__``): with the ``Interpreter`` it
re-exports the ``Host`` and ``Observer`` bases it is given (``runtime/host.py``) and the errors it
raises (``runtime/run_errors.py``), so that its users import the loop's whole interface from here.
"""

from __future__ import annotations

from collections import deque
from operator import attrgetter
from typing import Any, Callable, Iterable, Optional, Sequence as Seq

import structlog

from fxsched.core import events as ev
from fxsched.core.machine import step
from fxsched.core.state import SchedulerState
from fxsched.effects import device_calls as dc
from fxsched.effects import lifecycle as lc
from fxsched.effects import plans
from fxsched.runtime.devices.device import Device, DeviceError
from fxsched.runtime.devices.lane import Lane
from fxsched.runtime.devices.sampling import decode_bf16_row, host_pick
from fxsched.runtime.effect_handlers import _HANDLERS, _ON_HOST, commit_ctx_rows
from fxsched.runtime.host import Host, Observer
from fxsched.runtime.run_errors import BatchError, RunError

__all__ = ["BatchError", "Host", "Interpreter", "Observer", "RunError", "check_batch", "usual_batch"]

log = structlog.get_logger("fxsched.interpreter")

_IS_QUERY = attrgetter("QUERY")


def usual_batch(effects: Seq) -> bool:
    """An input event's empty batch, or one whose last effect is its only query (at C speed)."""
    return not effects or (effects[-1].QUERY and sum(map(_IS_QUERY, effects)) == 1)


def check_batch(event: ev.Event, effects: Seq, stopped: bool) -> None:
    """Raise ``BatchError`` unless ``effects`` is empty (an input event's batch), ends in its only
    query, or ends the run with the teardown and holds no query."""
    if usual_batch(effects):
        return
    queries = [i for i, effect in enumerate(effects) if effect.QUERY]
    last = effects[-1]
    if queries == [len(effects) - 1]:
        return
    if not queries and stopped and isinstance(last, (lc.Teardown, dc.TeardownCall)):
        return
    names = [type(effects[i]).__name__ for i in queries]
    if not queries:
        shape = f"ends in {type(last).__name__} with no query" + ("" if stopped else " and the loop has not stopped")
    elif len(queries) > 1:
        shape = f"holds {len(queries)} queries ({', '.join(names)})"
    else:
        shape = f"has its query {names[0]} at position {queries[0] + 1} of {len(effects)}, not last"
    raise BatchError(f"step({type(event).__name__}) returned a batch of {len(effects)} effects that {shape}; "
                     f"a batch must end in exactly one query or in the teardown")


class Interpreter:
    """``lane``: carry the device's effects out on a device lane (specs/async.md §16.5): a batch's
    device effects run there, in order, while its client outputs are carried out here, and a query
    the device answers ahead (``late_proposal``: a late proposal) does not wait at all."""

    def __init__(self, device: Device, host: Host, eos_ids: tuple[int, ...],
                 observer: Optional[Observer] = None, lane: Optional[Lane] = None):
        # the step function the loop calls: the core's ``step`` (a checker may wrap it, as the walk's
        # purity probe does: runtime/check/walk.py)
        self.stepper: Callable[[SchedulerState, ev.Event], tuple[SchedulerState, tuple[Any, ...]]] = step
        self.device = device
        self.lane = lane
        # how many drafts each sequence of a proposal gets when the device answers it late (None: not late)
        self._late_proposal: Optional[Callable[[tuple[int, ...], int], Optional[int]]] = (
            getattr(device, "late_proposal", None) if lane is not None else None)
        self._ahead: Optional[tuple[Any, ev.Event]] = None  # a launched query answered ahead, unchecked
        self.answered_ahead = 0  # queries answered before the device ran them
        self.host = host
        self.eos_ids = eos_ids
        self.observer = observer if observer is not None else Observer()
        self.steps = 0
        self._waited: list[ev.Event] = []  # what a blocking wait of the current batch returned
        self._take_cancels = getattr(device, "take_cancels", None)  # scripted devices' client cancels
        # keeps a decode's tokens on the device, answering it ahead (specs/async.md §16.6)
        self._keep_ahead: Optional[Callable[..., bool]] = getattr(device, "keep_ahead", None)
        # a host that keeps ``Host.take_inputs`` has posted nothing while its list is empty
        self._plain_inputs = type(host).take_inputs is Host.take_inputs

    def run(self, state: SchedulerState, first: Iterable[ev.Event]) -> SchedulerState:
        """Feed ``first`` then every event that follows until the loop stops (or no event is left).
        (``_turn`` written out in the loop, with what it looks up per turn looked up once.)"""
        queue = deque(first)
        take, follow = queue.popleft, queue.extend
        observer = self.observer
        before_step, stepped, performed = observer.before_step, observer.stepped, observer.performed
        perform = self.perform_all if self.lane is None else self._perform_on_lane
        host, plain_inputs, take_cancels = self.host, self._plain_inputs, self._take_cancels
        stepper = self.stepper
        while queue:
            event = take()
            before_step(event)
            state, effects = stepper(state, event)
            self.steps += 1
            if effects and not (effects[-1].QUERY and (len(effects) == 1 or sum(map(_IS_QUERY, effects)) == 1)):
                check_batch(event, effects, state.stopped)
            stepped(event, state, effects)
            answer = perform(effects)
            performed(state)
            if self._waited:
                follow(self._waited)
                self._waited = []
            if not plain_inputs or host.inputs:
                inputs = host.take_inputs()
                if inputs:
                    follow(inputs)
            if take_cancels is not None:
                cancels = take_cancels()
                if cancels:
                    follow(ev.Cancel(r) for r in cancels)
            if answer is not None:
                queue.append(answer)
            if state.stopped:
                break
        self.drain()
        return state

    def drain(self) -> None:
        """With a lane: wait for everything launched, and check an answer given ahead."""
        if self.lane is not None:
            self._settle_ahead()
            self.lane.fence()

    def feed(self, state: SchedulerState, event: ev.Event) -> tuple[SchedulerState, list[ev.Event]]:
        """One step of the loop: step on ``event``, check the batch, carry it out. Returns the new
        state and the events that follow, in delivery order (inputs first, the answer last)."""
        follow: list[ev.Event] = []
        return self._turn(state, event, follow), follow

    def _turn(self, state: SchedulerState, event: ev.Event, follow: Any) -> SchedulerState:
        """``feed``'s step, appending the events that follow to ``follow`` (a list or the run's queue)."""
        observer = self.observer
        observer.before_step(event)
        state, effects = self.stepper(state, event)
        self.steps += 1
        if not usual_batch(effects):
            check_batch(event, effects, state.stopped)
        observer.stepped(event, state, effects)
        answer = self.perform_all(effects) if self.lane is None else self._perform_on_lane(effects)
        observer.performed(state)
        if self._waited:
            follow.extend(self._waited)
            self._waited = []
        host = self.host
        if not self._plain_inputs or host.inputs:
            inputs = host.take_inputs()
            if inputs:
                follow.extend(inputs)
        if self._take_cancels is not None:
            cancels = self._take_cancels()
            if cancels:
                follow.extend(ev.Cancel(r) for r in cancels)
        if answer is not None:
            follow.append(answer)
        return state

    # --- carrying out effects: one handler per effect type -----------------------------------------

    def perform(self, effect) -> Optional[ev.Event]:
        """Carry out one effect; its answer (``None`` for a fire-and-forget effect)."""
        handler = _HANDLERS[type(effect)]
        try:
            result = handler(self, effect)
        except DeviceError as err:
            return self._device_error(effect, err)
        return result if effect.QUERY else None

    def perform_all(self, effects) -> Optional[ev.Event]:
        """Carry out a batch in order; the answer of its query, its last effect (``None`` for a
        batch that holds none)."""
        result = None
        handlers = _HANDLERS
        for effect in effects:
            try:
                result = handlers[type(effect)](self, effect)
            except DeviceError as err:
                result = self._device_error(effect, err)
        return result if effects and effects[-1].QUERY else None

    def _perform_on_lane(self, effects: Seq) -> Optional[ev.Event]:
        """``perform_all`` with a lane (specs/async.md §16.5): the device effects are launched on the
        lane in order, then the client outputs are carried out here while they run; the answer is the
        lane's, waited for, or the device's answer ahead, which is checked at the next wait."""
        lane = self.lane
        if not effects or lane is None:
            return None
        handlers, host_side = _HANDLERS, _ON_HOST
        on_device: list = []
        on_host: list = []
        for effect in effects:
            (on_host if host_side[type(effect)] else on_device).append(effect)
        query = effects[-1] if effects[-1].QUERY else None
        if query is not None and host_side[type(query)]:  # the host's own query: a wait for input
            if on_device:
                self._wait(lane.launch(self.perform_all, on_device))
            return self.perform_all(on_host)
        ahead = self._answer_ahead(query) if query is not None else None
        job = lane.launch(self.perform_all, on_device) if on_device else None
        for effect in on_host:
            handlers[type(effect)](self, effect)
        if job is None:
            return None
        if query is None:  # the run's last batch (the teardown): its errors are the run's
            self._wait(job)
            return None
        if ahead is not None:
            self._settle_ahead()  # at most one unchecked: a late proposal is followed by its verify
            self._ahead = (job, ahead)
            self.answered_ahead += 1
            return ahead
        return self._wait(job)

    def _answer_ahead(self, query) -> Optional[ev.Event]:
        """The answer a proposal gets from a device that answers it late, known before it runs: a
        ``LATE_DRAFT`` for each draft (specs/async.md §16.3); None for any other query."""
        late = self._late_proposal
        if late is None:
            return None
        if isinstance(query, dc.ProposeMulti):
            n = late((query.seq,), query.n)
            return None if n is None else ev.Drafts([ev.LATE_DRAFT] * n)
        if isinstance(query, dc.ProposeBatched):
            n = late(tuple(query.seqs), query.n)
            return None if n is None else ev.BatchedDrafts([[ev.LATE_DRAFT] * n for _ in query.seqs])
        return None

    def _wait(self, job: Any) -> Any:
        self._settle_ahead()
        assert self.lane is not None
        return self.lane.wait(job)

    def _settle_ahead(self) -> None:
        """Check the lane's answer to a query answered ahead: anything else breaks the protocol."""
        if self._ahead is None:
            return
        job, promised = self._ahead
        self._ahead = None
        assert self.lane is not None
        got = self.lane.wait(job)
        if got != promised:
            raise RunError(f"the device answered {got!r} to a query it had answered ahead with {promised!r}")

    def _device_error(self, effect, err: DeviceError) -> ev.Event:
        """A device error in ``effect``: the answer of a query, the end of the run otherwise."""
        if not effect.QUERY:
            raise RunError(f"device error in {type(effect).__name__}: {err.message}") from err
        log.info("device_fault", effect=type(effect).__name__, message=err.message)
        return ev.DeviceFault(err.message, err.kv_exhausted)

    def _host_picks(self, row: int, picks) -> ev.TokensSampled:
        """Tokens of ``len(picks)`` rows from ``row`` by their picks: the device's own batched
        sampler when its class defines ``sample_rows`` (the torch and simulated devices; a wrapper that only
        forwards attributes does not count, so it keeps its own ``copy_logits_to_host``), else
        a host copy of the rows picked by ``sampling.host_pick`` (specs/scheduler.md §5.11)."""
        logprobs = tuple(pick.top_logprobs for pick in picks)
        if callable(getattr(type(self.device), "sample_rows", None)):
            sampled = self.device.sample_rows(row, len(picks), picks, self.eos_ids)  # type: ignore[attr-defined]
            return ev.TokensSampled(tuple(sampled.tokens), logprobs)
        vocab = self.device.vocab_size()
        slab = self.device.copy_logits_to_host(row, 0, len(picks) * vocab * 2)
        tokens = [host_pick(decode_bf16_row(slab, vocab, r), pick, self.eos_ids) for r, pick in enumerate(picks)]
        return ev.TokensSampled(tuple(tokens), logprobs)

    def _verify_rows(self, effect, rows) -> ev.VerifyRows:
        """A verify's answer: the device's greedy rows, or (the effect carries picks and the device's
        class defines ``sample_verify``: the torch device) the rows of its rejection-sampled verify
        (specs/speculation.md §6.16). A device without it (recording, scripted, simulated) answers
        its own rows: their logits put all the mass on the scripted answer. When the query's tokens
        hold late drafts, the answer carries the inputs the device ran (specs/async.md §16.3)."""
        if effect.picks and callable(getattr(type(self.device), "sample_verify", None)):
            rows = self.device.sample_verify(effect.picks, self.eos_ids)  # type: ignore[attr-defined]
        if ev.LATE_DRAFT in effect.tokens:
            return ev.VerifyRows(rows, self.device.verify_inputs())
        return ev.VerifyRows(rows)

    def _decode_plan(self, plan: plans.Decode) -> ev.Event:
        """A plain decode. With ``plan.ahead`` and a device that keeps a decode's tokens
        (``keep_ahead``), it is answered before its tokens are read: a ``LATE_TOKEN`` per row
        (specs/async.md §16.6). The tokens of ``plan.resolve`` (kept by earlier decodes) are read
        after this decode is launched, so on a GPU the read waits for the earlier decode only."""
        d = self.device
        d.note_fx(f"fx launch {plan.label}")
        try:
            d.decode_batch(plan.tokens, plan.seqs, 0)
        except DeviceError as err:
            return self._launch_fault(err, plan.resolve, plan.seqs)
        count = len(plan.seqs)
        commit_ctx_rows(d, plan.seqs, (1,) * count, plan.seq_lens, range(count))
        keep = self._keep_ahead if plan.ahead else None
        if keep is not None and keep(0, len(plan.seqs), plan.picks, self.eos_ids):
            earlier = self._read_ahead(plan.resolve, plan.seqs)
            return ev.TokensSampled((ev.LATE_TOKEN,) * len(plan.seqs), (), earlier)
        answer = self._host_picks(0, plan.picks) if plan.picks else ev.TokensSampled(
            d.argmax_batch(0, len(plan.seqs), 0))
        if not plan.resolve:
            return answer
        return ev.TokensSampled(answer.tokens, answer.logprobs, self._read_ahead(plan.resolve, plan.seqs))

    def _read_ahead(self, seqs: Seq[int], fed: Seq[int] = ()) -> tuple[int, ...]:
        """The tokens the device kept for ``seqs`` (a ``DeviceError`` when it cannot give them: the
        decode that kept them failed after it was answered; ``fed``: the sequences of the decode this
        read answers with, which the failure takes too)."""
        if not seqs:
            return ()
        read = getattr(self.device, "read_ahead", None)
        if read is None:
            raise RunError("a decode resolves kept tokens, but the device keeps none (no read_ahead)")
        return tuple(read(seqs, fed))

    def _launch_fault(self, err: DeviceError, resolve: Seq[int], fed: Seq[int]) -> ev.DeviceFault:
        """The answer of a decode of ``fed`` that failed at its launch: its fault, with the kept tokens
        it was to resolve when the device can still give them. When it cannot (the decode that kept
        them failed after it was answered), that failure is the answer: it covers the sequences of
        both decodes, and a launch that merely found the KV cache full must not pass for one a
        preemption mends (specs/async.md §16.6 rule 6)."""
        try:
            earlier = self._read_ahead(resolve, fed)
        except DeviceError as lost:
            return ev.DeviceFault(lost.message, lost.kv_exhausted)
        return ev.DeviceFault(err.message, err.kv_exhausted, earlier)
