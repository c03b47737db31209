"""The random walk of the model checker: random episodes of ``step`` on the simulated device with
invariants checked after every step; a seed replays any failure exactly (``replay``).

An episode is drawn from a seeded generator: a drafting mode, batch size, chunking, a spill pool,
a block pool (part of it perhaps held by a reclaimable prefix cache), the admission policy, a
context ceiling, 1–12 requests with random scripts (EOS placement, budgets, draft errors, cancel
points, deadlines, late arrivals, blocking or streaming, beams, sampling parameters, min_tokens,
logprobs, adapter slots), scheduled faults (KV exhaustion, fatal decode and verify errors,
corrupted or missing spill files, a ``DeviceFault`` answered in a chosen waiting phase), perhaps
armed watchdogs with long looping scripts, perhaps a LoRA rotation, and the inbox closing at a
random tick after the last arrival. ``_proposer_quirks`` then adds what a real device and client
vary: short or empty proposals, draft capacities changing per step (0 included), a prompt as long
as the context, DFlash gates over uneven draft blocks, MTP batches wider than the ladder, more
requests than seats on a small pool with early KV exhaustion (aimed at a full batch while
sequences wait preempted or swapped, which coverage still shows unreached), greedy rows whose
script says EOS below ``min_tokens``, and host-side cancels (perhaps while the prompt still
prefills). Half the proposer episodes answer proposals late now and then (some of which then
fail, at their verify), and half of all episodes run the device's work behind the host on a
deferred lane (specs/async.md §16.3, §16.5). ``options.with_options`` then draws production's
settings (chunked prefill under a token budget, prompts prefilled together) in over half the
random episodes (over a third of all), and every other scheduler knob now and then.

Coverage: ``FEATURES`` names every feature the walk must reach; ``feature_counts`` reads a
walk's counts for them, one per feature (``fxsched check`` prints one line each, and
tests/test_checker_coverage.py fails on a zero).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import multiprocessing
import multiprocessing.connection
import os
import random
import signal
import time
from collections import Counter
from typing import Any, Optional

import attrs

from fxsched.core.config import SCRIPTED_EOS as EOS
from fxsched.core import events as ev
from fxsched.core.records import replace
from fxsched.core.phases import (AwaitAhead, AwaitBatchedDflash, AwaitDecode, AwaitMtpBatch, AwaitPublishBlocks,
                                 EndOfTick)
from fxsched.core.state import hot_columns, initial_state
from fxsched.effects import device_calls as dc
from fxsched.effects import plans
from fxsched.effects.client import DoneOut, ErrorOut, ResponseOut, RotationAck
from fxsched.runtime.interpreter import BatchError, Host, Interpreter, Observer
from fxsched.runtime.check.aimed import AIMED_SHARE, aimed_episode
from fxsched.runtime.check.episode import (ADAPTERS, BOUNDARY, FAULT_PHASES, MODES, TICK_MS, Episode, SimRequest,
                                           _randints)
from fxsched.runtime.check.invariants import CANCEL, EVENT_KINDS, FAULT, Monitor, Violation
from fxsched.runtime.check.options import with_options
from fxsched.runtime.devices.lane import DeferredLane
from fxsched.runtime.devices.simulated import AHEAD_FAILURE, LATE_FAILURE, SimDevice

try:
    import resource
except ImportError:  # not on Windows, where the walk runs in one process
    resource = None  # type: ignore[assignment]

def _looping_script(rng: random.Random) -> list[int]:
    """A long script for the watchdogs: a lead-in holding the boundary token, then a block repeated
    (each copy perhaps with one token changed, which only the fuzzy check forgives)."""
    lead = _randints(rng, 2, 40, rng.randint(5, 70))
    lead[rng.randrange(len(lead))] = BOUNDARY
    early = len(lead) < 30  # with a short block, a loop complete before the first content-loop check (48)
    noisy = rng.random() < 0.5 and not early
    block = _randints(rng, 2, 40, rng.randint(24, 36) if noisy else rng.randint(2, 6 if early else 20))
    tokens = list(lead)
    while len(tokens) < 260:
        copy = list(block)
        if noisy:  # one token off per copy: within the fuzzy tolerance of max(P // 12, 1) = 2
            copy[rng.randrange(len(copy))] = rng.randint(2, 40)
        tokens.extend(copy)
    return tokens


def random_episode(rng: random.Random) -> Episode:
    if rng.random() < AIMED_SHARE:
        return aimed_episode(rng)
    mode = rng.choice(MODES)
    watchdog = rng.random() < 0.06
    n = rng.randint(1, 6) if rng.random() < 0.8 else rng.randint(7, 12)
    if watchdog:
        n = rng.randint(1, 3)
    beams = rng.random() < 0.15  # beam-heavy episodes: several blocking beam requests at once
    sampling = rng.random() < 0.2
    adapters = rng.random() < 0.3  # adapter slots: the acquire rules and the cohorts of every path
    requests = []
    last_arrival = 0
    for i in range(n):
        length = rng.randint(1, 14)
        tokens = _randints(rng, 2, 40, length)
        if rng.random() < 0.3:  # repeated content, so n-gram proposals happen
            tokens = (tokens[:3] * 6)[:length]
        if rng.random() < 0.75:
            tokens.append(EOS)
        budget = rng.randint(1, 18)
        if watchdog:
            tokens, budget = _looping_script(rng), rng.randint(100, 300)
        arrive = rng.choice([0, 0, 0, rng.randint(1, 8)])
        last_arrival = max(last_arrival, arrive)
        streaming = rng.random() < (0.3 if beams or watchdog else 0.8)
        beam = not streaming and rng.random() < (0.8 if beams else 0.3)
        fields: dict[str, Any] = {}
        if sampling and rng.random() < 0.6:
            fields = dict(temperature=rng.choice([0.0, 0.5, 1.0]), top_p=rng.choice([1.0, 0.9, 0.5]),
                          top_k=rng.choice([0, 1, 5]), min_p=rng.choice([0.0, 0.1]),
                          top_logprobs=rng.choice([0, 0, 2]), min_tokens=rng.choice([0, 0, 2, 5]))
        if beam or mode == "self_spec":
            # a beam hypothesis is the device's, min_tokens or not. The self-speculative step picks its
            # first token by the host pick (EOS masked below min_tokens) but verifies its drafts
            # greedily (specs/speculation.md §6.15), so an EOS there may be masked or kept unstreamed in
            # the output (§6.1 step 4) depending on which row it falls on: no fixed expected output
            fields.pop("min_tokens", None)
        if adapters:
            fields["adapter_slot"] = rng.choice([-1, -1, -1, 1, 2, 3])
        requests.append(SimRequest(
            id=i + 1, prompt_len=rng.randint(1, 40), tokens=tuple(tokens), max_tokens=budget,
            streaming=streaming, wrong_every=rng.choice([0, 0, 2, 3, 4, 5]),
            cancel_at=rng.randint(1, 10) if streaming and rng.random() < 0.15 else None,
            deadline_ms=(arrive * TICK_MS + rng.randint(20, 200)) if rng.random() < 0.1 else None,
            arrive_tick=arrive,
            num_beams=rng.choice([2, 3]) if beam else 1,
            **fields,
        ))
    spill = rng.random() < 0.3
    held = rng.choice([0, 0, 1, 2, 4])
    fault_phase = rng.choice(FAULT_PHASES) if rng.random() < 0.3 else ""
    episode = Episode(
        mode=mode, max_batch_size=rng.choice([1, 2, 3, 4, 8, 12]),
        max_prefill_tokens=0 if beams and rng.random() < 0.7 else rng.choice([0, 0, 4, 6, 8, 10, 16]),
        spill=spill, total_blocks=rng.choice([6, 8, 12, 24, 1000]) if not watchdog else 1000,
        held_blocks=held, requests=tuple(requests),
        kv_exhaust_at=tuple(sorted(rng.sample(range(30), rng.randint(0, 2)))),
        decode_fault_at=tuple(sorted(rng.sample(range(40), 1))) if rng.random() < 0.1 else (),
        verify_fault_at=tuple(sorted(rng.sample(range(30), 1))) if rng.random() < 0.1 else (),
        spill_corrupt_for=(rng.randint(1, n),) if spill and rng.random() < 0.3 else (),
        can_batch_verify=rng.random() < 0.85,
        rotation_tick=rng.randint(1, 10) if rng.random() < 0.15 else None,
        close_tick=last_arrival + rng.randint(0, 6),
        policy="slai" if rng.random() < 0.2 else "fifo",
        slai_deadline_ms=rng.choice([1_000_000.0, 1_000_000.0, 30.0]),
        watchdog=watchdog,
        max_seq_len=rng.choice([4096, 4096, 4096, 4096, 24, 40, 64]) if not watchdog else 4096,
        prefix_cache=rng.random() < 0.3,
        reclaimable=rng.randint(0, held),
        spill_missing_for=(rng.randint(1, n),) if spill and rng.random() < 0.2 else (),
        fault_phase=fault_phase,
        fault_phase_at=rng.choice([0, 0, 0, 1, 3]) if fault_phase else 0,
    )
    episode = _proposer_quirks(episode, rng)
    episode = with_options(episode, (hash_seed(episode) * 2_654_435_761 + 97) & 0xFFFFFFFF)
    return _suited_to_fault(episode, rng) if fault_phase else episode


def _proposer_quirks(episode: Episode, rng: random.Random) -> Episode:
    """What a real device and client vary and the scripts alone never do (see the module
    docstring); each quirk is drawn on its own."""
    changes: dict[str, Any] = {}
    if episode.mode != "plain" and rng.random() < 0.35:
        changes["short_proposals"] = True
    if episode.mode != "plain" and rng.random() < 0.3:
        changes["capacities"] = tuple(rng.choice((0, 1, 2, 3, 8, 8)) for _ in range(rng.randint(2, 7)))
    if episode.mode == "dflash" and not episode.watchdog and rng.random() < 0.5:
        # a gate with uneven blocks: three or more sequences verified at once, short proposals
        requests = tuple(replace(r, arrive_tick=0, max_tokens=max(r.max_tokens, 12), cancel_at=None,
                                      num_beams=1, tokens=tuple(t for t in r.tokens if t != EOS) or (5,))
                         for r in episode.requests)
        while len(requests) < 3:
            requests += tuple(replace(r, id=r.id + len(requests)) for r in requests)
        changes.update(short_proposals=True, can_batch_verify=True, requests=requests[:6],
                       max_batch_size=max(episode.max_batch_size, 4))
    if episode.mode.startswith("mtp") and not episode.watchdog and rng.random() < 0.12:
        # a wide batch: nine or more sequences at once, past the MTP ladder's width of 8
        requests = tuple(replace(r, arrive_tick=0, max_tokens=max(r.max_tokens, 8), cancel_at=None,
                                      num_beams=1, streaming=True) for r in episode.requests)
        while len(requests) < 10:
            requests += tuple(replace(r, id=r.id + len(requests)) for r in requests)
        changes.update(requests=requests[:rng.randint(9, 12)], max_batch_size=12, total_blocks=1000,
                       kv_exhaust_at=(), max_seq_len=4096)
    if not episode.watchdog and not episode.fault_phase and rng.random() < 0.06:
        # more requests than seats on a small block pool, KV exhaustion early, a spill pool half the
        # time (aimed at a full batch while preempted or swapped sequences wait; one adapter cohort, so
        # that no request is deferred for its adapter)
        requests = tuple(replace(r, arrive_tick=0, max_tokens=max(r.max_tokens, 10), num_beams=1, adapter_slot=-1,
                                      prompt_len=min(r.prompt_len, 20), tokens=tuple(t for t in r.tokens if t != EOS)
                                      or (5,)) for r in changes.get("requests", episode.requests))
        while len(requests) < 5:
            requests += tuple(replace(r, id=r.id + len(requests)) for r in requests)
        total = rng.choice((10, 12, 16))
        # half the pool held by the prefix cache and not given back: the free blocks (which a requeue
        # resume and a swap-in need) run short while the KV reservation (which counts the pool
        # whole) still admits new requests, so the batch fills while preempted sequences wait
        changes.update(requests=requests[:8], max_batch_size=rng.choice((2, 3)), spill=rng.random() < 0.5,
                       total_blocks=total, held_blocks=total // 2, reclaimable=0,
                       kv_exhaust_at=(1, 3, 6), max_seq_len=4096, spill_corrupt_for=(), spill_missing_for=())
    if episode.mode != "self_spec" and rng.random() < 0.1:
        # greedy rows below min_tokens whose script says EOS early: the EOS must be masked
        rs: list[SimRequest] = list(changes.get("requests", episode.requests))
        i = rng.randrange(len(rs))
        r = rs[i]
        if r.num_beams == 1:
            lead = tuple(r.tokens[:rng.randint(0, 2)])
            rs[i] = replace(r, tokens=lead + (EOS,) + tuple(t for t in r.tokens if t != EOS) + (EOS,),
                                 min_tokens=rng.randint(len(lead) + 1, len(lead) + 4), temperature=0.0,
                                 top_logprobs=0, max_tokens=max(r.max_tokens, 8))
            changes["requests"] = tuple(rs)
    if episode.watchdog and rng.random() < 0.5:
        # a hybrid model: rollbacks need a snapshot of the SSM state in the ring
        changes["ssm_ring"] = rng.choice((1, 2, 3, 4))
        if rng.random() < 0.7:  # boundary tokens all through the lead-in: saves that go round the ring
            step = rng.randint(5, 12)
            changes["requests"] = tuple(replace(r, tokens=tuple(
                BOUNDARY if i % step == step - 1 and i < 90 else t for i, t in enumerate(r.tokens)))
                for r in changes.get("requests", episode.requests))
    if rng.random() < 0.15:
        # a client cancel from the host, perhaps while the prompt still prefills
        rs = list(changes.get("requests", episode.requests))
        i = rng.randrange(len(rs))
        if rs[i].streaming:
            rs[i] = replace(rs[i], host_cancel_tick=rs[i].arrive_tick + rng.randint(1, 4))
            changes["requests"] = tuple(rs)
    if episode.max_seq_len < 4096 and rng.random() < 0.3:
        rs = list(changes.get("requests", episode.requests))
        i = rng.randrange(len(rs))
        rs[i] = replace(rs[i], prompt_len=episode.max_seq_len)
        changes["requests"] = tuple(rs)
    episode = replace(episode, **changes) if changes else episode
    if episode.mode.startswith(("mtp", "dflash")) and hash_seed(episode) % 2:
        # half the proposer episodes answer late now and then; decided from the episode, so the
        # generator's draws (and every episode a seed drew before) stay as they were
        episode = replace(episode, late_drafts=True)
    if hash_seed(episode) // 2 % 2:  # half of all episodes run their device behind the host (a lane)
        episode = replace(episode, lane=True)
    if episode.mode == "plain" and hash_seed(episode) // 4 % 3:
        # two plain episodes in three schedule asynchronously: decodes answered ahead now and then
        episode = replace(episode, async_scheduling=True)
    return episode


def _suited_to_fault(episode: Episode, rng: random.Random) -> Episode:
    """An episode whose fault phase its set-up would seldom reach, made to reach it: the drafting
    mode, beams, a spill pool, preemption or a rotation the phase belongs to."""
    name = episode.fault_phase
    changes: dict[str, Any] = {}
    if "Dflash" in name:
        changes["mode"] = "dflash"
    elif name in ("AwaitMtpGate", "AwaitMtpBatch", "AwaitBatchedProposal", "AwaitKVerify", "AwaitProposal",
                  "AwaitCapacity", "AwaitMtpDecode"):
        changes["mode"] = rng.choice(("mtp1", "mtp2", "mtp3"))
    elif "Ngram" in name:
        changes["mode"] = "ngram"
    elif "Self" in name:
        changes["mode"] = "self_spec"
    if name in ("AwaitMtpGate", "AwaitMtpBatch", "AwaitBatchedProposal", "AwaitBatchedDflash", "AwaitDflashGate"):
        changes.update(max_batch_size=max(episode.max_batch_size, 4), can_batch_verify=True)
    if name in ("AwaitMixedReadback", "AwaitPrefillToken"):
        changes.update(max_prefill_tokens=4, mode="plain", max_batch_size=max(episode.max_batch_size, 3),
                       requests=tuple(replace(r, prompt_len=max(r.prompt_len, 9), arrive_tick=0)
                                      for r in episode.requests))
    if "Beam" in name:
        changes["max_prefill_tokens"] = 0
        changes["requests"] = tuple(replace(r, streaming=False, num_beams=2, cancel_at=None, min_tokens=0)
                                    for r in episode.requests) * 1
    if name in ("AwaitSwapInSlot", "AwaitRestore"):
        changes.update(spill=True, total_blocks=8, kv_exhaust_at=(2, 5), max_batch_size=max(episode.max_batch_size, 3))
        if name == "AwaitSwapInSlot":  # a sequence swapped out by preemption: unchunked prompts, which
            # reserve no room for their output (options.py's production chunks reserve it)
            changes.update(max_prefill_tokens=0, options=tuple(
                (k, v) for k, v in episode.options if k not in ("prefill_new_together", "max_batch_tokens")))
    if name.startswith("AwaitResume"):
        changes.update(spill=False, total_blocks=rng.choice((12, 24)), held_blocks=4, reclaimable=4,
                       kv_exhaust_at=(1, 3, 6), max_batch_size=max(episode.max_batch_size, 3))
    if name == "AwaitRotation":
        changes["rotation_tick"] = rng.randint(1, 6)
    if name == "AwaitAhead":  # kept tokens read alone: async scheduling, arrivals that need them settled
        changes.update(mode="plain", async_scheduling=True, max_batch_size=max(episode.max_batch_size, 3),
                       requests=tuple(replace(r, arrive_tick=rng.choice((0, 2, 4))) for r in episode.requests))
    if len(episode.requests) < 3 and name not in ("AwaitRotation",):
        extra = [replace(r, id=r.id + len(episode.requests)) for r in episode.requests]
        changes.setdefault("requests", episode.requests)
        changes["requests"] = tuple(changes["requests"]) + tuple(
            replace(r, id=r.id + len(episode.requests)) for r in changes["requests"][:len(extra)])
    episode = replace(episode, **changes)
    if episode.mode == "self_spec":  # no min_tokens there (see random_episode)
        episode = replace(episode, requests=tuple(replace(r, min_tokens=0) for r in episode.requests))
    return episode


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


_NOTED = frozenset((dc.GenerateBeamBatch, dc.DecodeVerifyBatched, dc.TruncateSequence, dc.AdapterIdFor, plans.Decode))
"""The effect types ``WalkObserver._note_features`` looks into."""


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
        self.effect_types: list[type] = []  # the type of every effect stepped, counted by ``count_effects``
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
            kinds = tuple(map(type, effects))
            self.monitor.on_effects(effects, kinds)
            self.effect_types.extend(kinds)
            if not _NOTED.isdisjoint(kinds):
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
        """Add the effects stepped so far to the coverage, one count per effect under its type's name."""
        coverage = self.coverage
        for kind, n in Counter(self.effect_types).items():
            coverage[kind.__name__] += n
        self.effect_types = []

    def performed(self, state) -> None:
        if self.lane is not None:  # the checks read the device: let it catch up with the batch
            self.lane.fence()
        self.monitor.on_state(state)
        if (state.swapped or state.preempted) and isinstance(state.waiting, AwaitPublishBlocks):
            if (len(state.active) + len(state.prefilling) + len(state.new_requests) >= state.config.max_batch_size
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


@attrs.frozen
class EpisodeResult:
    steps: int
    violation: Optional[Violation]
    violation_step: Optional[int]
    events: tuple


def hash_seed(episode: Episode) -> int:
    """A seed drawn from the episode itself (its requests' ids, lengths and budgets), so a replay
    file replays the same device."""
    h = 17
    for r in episode.requests:
        h = (h * 1_000_003 + r.id * 131 + r.prompt_len * 7 + r.max_tokens + len(r.tokens)) & 0xFFFFFFFF
    return h


def _comparable(episode: Episode) -> bool:
    """Whether an episode scheduled asynchronously must give its clients what its synchronous twin
    gives them (specs/async.md §16.6 rule 3): nothing in it may depend on when the host learns a
    token (a client's cancel) or on which device call a fault lands."""
    requests = episode.requests
    if any(r.deadline_ms is not None for r in requests) and (
            any(r.arrive_tick > 0 for r in requests) or len(requests) > episode.max_batch_size
            or episode.total_blocks < 1000 or episode.max_prefill_tokens):
        return False  # when a request starts depends on when others end: its deadline cuts it elsewhere
    return not (episode.fault_phase or episode.decode_fault_at or episode.kv_exhaust_at or episode.verify_fault_at
                or episode.rotation_tick) and all(r.cancel_at is None and r.host_cancel_tick is None
                                                  for r in requests)


def run_episode(episode: Episode, coverage: Counter, step_limit: int = 20000, keep_log: bool = False,
                outputs: Optional[list] = None) -> EpisodeResult:
    """Run one episode to its end on the interpreter's drive loop; the first broken invariant
    stops it. ``outputs`` collects every client output. An episode scheduled asynchronously whose
    outcome may not depend on timing runs its synchronous twin too: the same client outputs, unless
    a fault (a pool the rows computed ahead fill a little earlier, a kept decode failed) makes the
    comparison say nothing."""
    if outputs is None and episode.async_scheduling and _comparable(episode):
        outputs = []
    scripts = {r.id: r.script() for r in episode.requests}
    counts_acc = episode.mode.startswith(("mtp", "dflash"))
    config = episode.config()
    model = episode.model()
    device = SimDevice(scripts, total_blocks=episode.total_blocks, held_blocks=episode.held_blocks,
                       kv_exhaust_at=episode.kv_exhaust_at, decode_fault_at=episode.decode_fault_at,
                       verify_fault_at=episode.verify_fault_at, spill_corrupt_for=episode.spill_corrupt_for,
                       spill_missing_for=episode.spill_missing_for,
                       cancel_flags={r.id for r in episode.requests if r.streaming},
                       can_batch_verify=episode.can_batch_verify, count_accepted=counts_acc,
                       reclaimable=episode.reclaimable, prefix_cache=episode.prefix_cache, adapters=ADAPTERS,
                       adapter_of={r.id: r.adapter_slot for r in episode.requests},
                       wave_budget=config.prefill_new_together,
                       idle_fills=config.prefill_new_together and config.idle_prefill_fills_budget,
                       max_prefill_tokens=config.max_prefill_tokens, max_batch_tokens=config.max_batch_tokens,
                       short_proposals=hash_seed(episode) if episode.short_proposals else None,
                       capacities=episode.capacities,
                       late_drafts=hash_seed(episode) + 1 if episode.late_drafts else None,
                       keep_decodes=hash_seed(episode) + 2 if episode.async_scheduling else None)
    device.strict_drafts = counts_acc
    device.ring_slots = episode.ssm_ring
    device.dflash = episode.mode == "dflash"
    monitor = Monitor(episode.requests, device, counts_acc=counts_acc, config=config, model=model)
    watch = WalkObserver(monitor, coverage, step_limit, keep_log, episode)
    watch.outputs = outputs
    host = WalkHost(episode)
    device.on_tick = host.on_tick
    lane = DeferredLane() if episode.lane else None
    watch.lane = lane
    if episode.fault_phase:
        interpreter: Interpreter = FaultingInterpreter(device, host, config.eos_ids, observer=watch, watch=watch,
                                                       phase=episode.fault_phase, at=episode.fault_phase_at, lane=lane)
    else:
        interpreter = Interpreter(device, host, config.eos_ids, observer=watch, lane=lane)
    _count_episode(episode, coverage)
    if lane is not None:
        coverage["feature:lane"] += 1
    state = initial_state(config, model)
    violation = None
    try:
        interpreter.run(state, host.initial_events() + [ev.Boot()])
    except Violation as found:
        violation = found
    except BatchError as err:
        violation = Violation("batch_ends_in_one_query", str(err))
    except Exception as err:
        if getattr(device, "refused", None) is not None:  # the device refused a call's arguments
            violation = Violation("device_arguments", device.refused or "")
        elif watch.stepping is not None:  # step must never raise on an event its phase allows
            violation = Violation("step_raises", f"{type(err).__name__}: {err} on {watch.stepping!r}")
        else:  # a device refusal (double free, bad slot) is a scheduler bug too
            violation = Violation("device_refused", f"{type(err).__name__}: {err}")
    watch.count_effects()
    coverage["feature:answered_ahead"] += interpreter.answered_ahead
    if device.reclaimable < min(episode.reclaimable, episode.held_blocks):
        coverage["feature:reclaim"] += 1
    events = tuple(watch.log or ())
    if violation is None and outputs is not None and episode.async_scheduling and _comparable(episode):
        violation = _against_twin(episode, outputs, step_limit)
    if violation is None:
        return EpisodeResult(watch.steps, None, None, events)
    return EpisodeResult(watch.steps, violation, watch.steps, events)


def _against_twin(episode: Episode, outputs: list, step_limit: int) -> Optional[Violation]:
    """async equals sync (specs/async.md §16.6 rule 3): the client outputs of the synchronous twin."""
    twin: list = []
    if run_episode(replace(episode, async_scheduling=False), Counter(), step_limit, outputs=twin).violation:
        return None  # the twin's own violation is found when the walk draws it
    if any(isinstance(o, ErrorOut) for o in outputs + twin):
        return None
    mine, theirs = _by_request(outputs), _by_request(twin)  # (frames of different requests interleave otherwise)
    for rid in sorted(set(mine) | set(theirs)):
        got, want = mine.get(rid, []), theirs.get(rid, [])
        if got != want:
            at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
            return Violation("async_equals_sync", f"request {rid}'s frame {at} is "
                                                  f"{got[at] if at < len(got) else 'missing'}; the synchronous run's "
                                                  f"is {want[at] if at < len(want) else 'missing'}")
    return None


def _by_request(outputs: list) -> dict[int, list]:
    """Each request's client frames, in order."""
    frames: dict[int, list] = {}
    for o in outputs:
        rid = getattr(o, "request_id", None)
        if rid is not None:
            frames.setdefault(rid, []).append(o)
    return frames


FEATURES: dict[str, tuple[str, ...]] = {
    "mtp K=2": ("mode:mtp1",), "mtp K=3": ("mode:mtp2",), "mtp K=4": ("mode:mtp3",),
    "mtp batched": ("feature:mtp_batched",), "dflash serial": ("DecodeVerifyDflash",),
    "dflash batched": ("feature:dflash_batched",), "ngram": ("mode:ngram",), "self-spec": ("mode:self_spec",),
    "plain": ("mode:plain",), "beam single": ("feature:beam_single",), "beam grouped": ("feature:beam_grouped",),
    "policy slai": ("policy:slai",), "watchdog armed": ("feature:watchdog",),
    "watchdog rollback": ("feature:watchdog_rollback",),
    "guard content loop": ("guard:content_loop_watchdog",), "guard fuzzy repetition": ("guard:fuzzy_repetition",),
    "sampling": ("CopyLogitsToHost",), "min_tokens": ("feature:min_tokens",), "logprobs": ("feature:logprobs",),
    "prefix-cache hit": ("feature:prefix_hit",), "prefix-cache reclaim": ("feature:reclaim",),
    "adapters": ("feature:adapters",), "rotation": ("rotation_ack",), "context ceiling": ("feature:context_ceiling",),
    "spill": ("SaveSequenceState",), "spill swap-in": ("RestoreSequenceState",),
    "spill file fault": ("feature:spill_fault",), "kv exhaustion": ("fault:kv_exhausted",),
    "device fault": ("fault:fatal",), "cancel": ("fault:cancel",), "deadline": ("finish:timeout",),
    "full batch while preempted/swapped wait": ("feature:full_batch_while_waiting",),
    "rare: timeout with the deadline on the clock": ("rare:deadline_on_the_clock",),
    "rare: plain decode after a rejected verify crossed a block": ("rare:plain_after_rejected_cross",),
    "rare: a preempted sequence needing the whole pool": ("rare:requeue_needs_whole_pool",),
    "rare: cancel of a request without a cancel flag": ("rare:cancel_without_flag",),
    "late drafts, serial verify": ("feature:late_drafts_serial",),
    "late drafts, batched MTP": ("feature:late_drafts_mtp_batched",),
    "late drafts, batched DFlash": ("feature:late_drafts_dflash_batched",),
    "late proposal failed, its verify answers": ("feature:late_failure",),
    "device behind the host (a lane)": ("feature:lane",),
    "proposal answered ahead": ("feature:answered_ahead",),
    "decode answered ahead": ("feature:decode_ahead",),
    "kept tokens resolved by the next decode": ("feature:kept_resolved",),
    "kept tokens read alone": ("feature:kept_read_alone",),
    "row computed ahead for a sequence its EOS ended": ("feature:computed_ahead_dropped",),
    "decode answered ahead failed, its resolve answers": ("feature:ahead_failure",),
    "fault at a pipelined decode's launch, its kept tokens read first": ("feature:fault_brings_kept",),
    "deadline passed with a token on the device": ("feature:ahead_deadline_read",),
    "a steady batch ahead, in columns": ("feature:ahead_columns",),
}
FEATURES.update({f"fault in {name}": (f"fault_phase:{name}",) for name in FAULT_PHASES})
"""Every feature the walk must reach, with the coverage keys whose sum counts it."""


_LATE = {AwaitMtpBatch: "feature:late_drafts_mtp_batched", AwaitBatchedDflash: "feature:late_drafts_dflash_batched"}
"""The coverage key of late drafts arriving in a batched verify's answer, by the phase it answers."""


def _count_episode(episode: Episode, coverage: Counter) -> None:
    """The features an episode's set-up draws (counted once per episode)."""
    coverage[f"mode:{episode.mode}"] += 1
    coverage[f"policy:{episode.policy}"] += 1
    if episode.watchdog:
        coverage["feature:watchdog"] += 1
    if any(r.min_tokens for r in episode.requests):
        coverage["feature:min_tokens"] += 1


def feature_counts(coverage: dict) -> dict[str, int]:
    """How often the walk reached each feature of ``FEATURES``."""
    return {name: sum(coverage.get(key, 0) for key in keys) for name, keys in FEATURES.items()}


@attrs.frozen
class WalkReport:
    seed: int
    steps: int
    episodes: int
    seconds: float
    coverage: dict
    violation: Optional[dict]
    jobs: int = 1  # the processes that ran episodes (1: this one)
    cpu_seconds: float = 0.0  # their CPU time, episodes run past the end included

    @property
    def steps_per_second(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else 0.0

    @property
    def steps_per_cpu_second(self) -> float:
        return self.steps / self.cpu_seconds if self.cpu_seconds > 0 else 0.0


def episode_seed(seed: int, index: int) -> int:
    return (seed * 1_000_003 + index) & 0xFFFFFFFF


@attrs.frozen
class Outcome:
    """What one episode of a walk came to: its steps, its coverage counts and its violation (the
    invariant, the message and the step), if any."""

    index: int
    steps: int
    coverage: Counter
    violation: Optional[tuple[str, str, int]]


def run_indexed(seed: int, index: int) -> Outcome:
    """Draw and run episode ``index`` of the walk of ``seed``."""
    coverage: Counter = Counter()
    result = run_episode(random_episode(random.Random(episode_seed(seed, index))), coverage)
    found = result.violation
    violation = None if found is None else (found.invariant, found.message, result.violation_step or 0)
    return Outcome(index, result.steps, coverage, violation)


def usable_cpus() -> int:
    """The CPUs this process may run on."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)


def walk(seed: int, steps: Optional[int] = None, seconds: Optional[float] = None, progress=None,
         jobs: int = 1) -> WalkReport:
    """Run episodes until ``steps`` steps or ``seconds`` seconds; stop at the first violation.

    ``jobs`` > 1 runs episodes in that many forked processes (where the platform forks), each
    taking the next episode index as it frees up. Their outcomes are taken in episode order, so
    the report (steps, episodes, coverage, the violation) is the one a single process gives for
    the same ``steps``; outcomes past the end are dropped (specs/checker.md §11.5).

    The objects from before the walk are frozen (``gc.freeze``) until it ends, so no collection in
    this process or in a forked worker traverses them: a collection writes to every object it looks
    at, and in a worker each write to a page still shared with the parent copies that page."""
    coverage: Counter = Counter()
    total, episodes = 0, 0
    start, cpu_start = time.perf_counter(), _cpu_seconds()
    parallel = jobs > 1 and "fork" in multiprocessing.get_all_start_methods()
    source = _forked_outcomes(seed, jobs) if parallel else (run_indexed(seed, i) for i in itertools.count())
    violation = None
    froze = gc.get_freeze_count() == 0  # (a caller that froze its own objects keeps them frozen)
    if froze:
        gc.freeze()
    try:
        for outcome in source:
            coverage.update(outcome.coverage)
            total += outcome.steps
            episodes += 1
            if progress is not None:
                progress(outcome.steps)
            if outcome.violation is not None:
                violation = _violation_report(seed, outcome)
                break
            if steps is not None and total >= steps:
                break
            if seconds is not None and time.perf_counter() - start >= seconds:
                break
    finally:
        source.close()  # a forked source stops and reaps its workers
        if froze:
            gc.unfreeze()
    return WalkReport(seed, total, episodes, time.perf_counter() - start, dict(coverage), violation,
                      jobs if parallel else 1, _cpu_seconds() - cpu_start)


def _violation_report(seed: int, outcome: Outcome) -> dict:
    """The violation of ``outcome`` with its episode and the event log of a re-run (for the replay file)."""
    assert outcome.violation is not None
    eseed = episode_seed(seed, outcome.index)
    episode = random_episode(random.Random(eseed))
    replayed = run_episode(episode, Counter(), keep_log=True)
    invariant, message, step = outcome.violation
    return {"invariant": invariant, "message": message, "step": step, "episode_index": outcome.index,
            "episode_seed": eseed, "episode": episode.to_json(), "events": list(replayed.events)}


def _cpu_seconds() -> float:
    """CPU time of this process and of its reaped children."""
    if resource is None:
        return time.process_time()
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _worker(seed: int, next_index: Any, stop: Any, conn: Any) -> None:
    """A forked walker: runs the next free episode index until told to stop or until one breaks an
    invariant (the episodes after it do not count), sending each outcome down ``conn``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops the workers
    index = None
    try:
        while not stop.is_set():
            with next_index.get_lock():
                index = next_index.value
                next_index.value = index + 1
            outcome = run_indexed(seed, index)
            conn.send(outcome)
            if outcome.violation is not None:
                break
    except Exception as err:  # the parent raises it in its turn, naming the episode
        with contextlib.suppress(OSError):  # a parent that has gone has no use for it
            conn.send((index, f"episode {index}: {type(err).__name__}: {err}"))
    finally:
        conn.close()


def _forked_outcomes(seed: int, jobs: int):
    """The outcomes of ``jobs`` forked walkers, in episode order; closing the generator stops them.
    (``walk`` has frozen the parent's objects: specs/checker.md §11.5.)"""
    ctx = multiprocessing.get_context("fork")
    next_index, stop = ctx.Value("q", 0), ctx.Event()
    workers: list[Any] = []
    readers: list[Any] = []
    try:
        for _ in range(jobs):
            end, writer = ctx.Pipe(duplex=False)
            worker = ctx.Process(target=_worker, args=(seed, next_index, stop, writer), daemon=True)
            worker.start()
            writer.close()  # the worker's end: its closing is the reader's end of file
            workers.append(worker)
            readers.append(end)
        waiting: dict[int, Any] = {}  # episode index -> its outcome, or the error a worker met in it
        wanted = 0
        while True:
            while wanted in waiting:
                got = waiting.pop(wanted)
                if isinstance(got, tuple):
                    raise RuntimeError(f"seed {seed}: a checker worker failed: {got[1]}")
                yield got
                wanted += 1
            if not readers:
                raise RuntimeError(f"seed {seed}: the checker's workers stopped before episode {wanted} came back")
            for ready in multiprocessing.connection.wait(readers):
                reader: Any = ready
                try:
                    got = reader.recv()
                except EOFError:  # a worker that stopped: after a violation, or killed
                    worker = workers[readers.index(reader)]
                    worker.join()
                    if worker.exitcode != 0:
                        raise RuntimeError(f"seed {seed}: a checker worker died (exit code {worker.exitcode}) "
                                           f"before episode {wanted} came back") from None
                    workers.remove(worker)
                    readers.remove(reader)
                    reader.close()
                    continue
                waiting[got[0] if isinstance(got, tuple) else got.index] = got
    finally:
        stop.set()
        for worker in workers:
            worker.terminate()
        for worker in workers:
            worker.join()
        for reader in readers:
            reader.close()
