"""The random walk of the model checker: random episodes of ``step`` on the simulated device with
invariants checked after every step; a seed replays any failure exactly (``replay``).

An episode is drawn by ``draws.random_episode`` (runtime/check/draws.py).

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

from fxsched.core import events as ev
from fxsched.core.machine import step
from fxsched.core.records import replace
from fxsched.core.state import initial_state
from fxsched.effects.client import DoneOut, ErrorOut, ResponseOut, TokenOut, TokensOut
from fxsched.runtime.interpreter import BatchError, Interpreter
from fxsched.runtime.check.episode import ADAPTERS, FAULT_PHASES, Episode
from fxsched.runtime.check.invariants import Monitor, Violation
from fxsched.runtime.check.draws import hash_seed, random_episode
from fxsched.runtime.check.observers import FaultingInterpreter, WalkObserver, walk_host
from fxsched.runtime.devices.lane import DeferredLane
from fxsched.runtime.devices.simulated import SimDevice

try:
    import resource
except ImportError:  # not on Windows, where the walk runs in one process
    resource = None  # type: ignore[assignment]

@attrs.frozen
class EpisodeResult:
    steps: int
    violation: Optional[Violation]
    violation_step: Optional[int]
    events: tuple


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
                       mixed_bound=(config.mixed_prefill_floor, config.mixed_prefill_per_decode),
                       max_prefill_tokens=config.max_prefill_tokens, max_batch_tokens=config.max_batch_tokens,
                       short_proposals=hash_seed(episode) if episode.short_proposals else None,
                       capacities=episode.capacities,
                       late_drafts=hash_seed(episode) + 1 if episode.late_drafts else None,
                       keep_decodes=hash_seed(episode) + 2 if episode.async_scheduling else None,
                       ahead_failures=episode.ahead_failures,
                       requests={r.id: r.request() for r in episode.requests})
    device.strict_drafts = counts_acc
    device.ring_slots = episode.ssm_ring
    device.dflash = episode.mode == "dflash"
    monitor = Monitor(episode.requests, device, counts_acc=counts_acc, config=config, model=model)
    watch = WalkObserver(monitor, coverage, step_limit, keep_log, episode)
    watch.outputs = outputs
    host = walk_host(episode)
    device.on_tick = host.on_tick
    lane = DeferredLane() if episode.lane else None
    watch.lane = lane
    if episode.fault_phase:
        interpreter: Interpreter = FaultingInterpreter(device, host, config.eos_ids, observer=watch, watch=watch,
                                                       phase=episode.fault_phase, at=episode.fault_phase_at, lane=lane)
    else:
        interpreter = Interpreter(device, host, config.eos_ids, observer=watch, lane=lane)
    if episode.twice:
        interpreter.stepper = _twice
        coverage["feature:stepped_twice"] += 1
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
    coverage["feature:mixed_prefill_bound"] += device.bounded_steps
    if device.reclaimable < min(episode.reclaimable, episode.held_blocks):
        coverage["feature:reclaim"] += 1
    events = tuple(watch.log or ())
    if violation is None and outputs is not None and episode.async_scheduling and _comparable(episode):
        violation = _against_twin(episode, outputs, step_limit)
    if violation is None:
        return EpisodeResult(watch.steps, None, None, events)
    return EpisodeResult(watch.steps, violation, watch.steps, events)


def _twice(state, event):
    """step is pure (specs/checker.md §11.2): the event stepped twice on the same state gives equal
    states and equal effects; a step that changed its input state (or a record it shares with
    others), or anything else it reads, gives the second call something else. The loop goes
    on from the second result, so a change the first call made to shared data that the second does
    not show still meets the other invariants later."""
    first = step(state, event)
    second = step(state, event)
    if first[1] != second[1]:
        at = next((i for i, (a, b) in enumerate(zip(first[1], second[1], strict=False)) if a != b),
                  min(len(first[1]), len(second[1])))
        raise Violation("step_pure", f"{event!r} stepped twice on one state: effect {at} differs "
                                     f"({first[1][at] if at < len(first[1]) else 'none'} then "
                                     f"{second[1][at] if at < len(second[1]) else 'none'})")
    if first[0] != second[0]:
        raise Violation("step_pure", f"{event!r} stepped twice on one state gave two different states")
    return second


def _against_twin(episode: Episode, outputs: list, step_limit: int) -> Optional[Violation]:
    """async equals sync (specs/async.md §16.6 rule 3): the client outputs of the synchronous twin."""
    twin: list = []
    if run_episode(replace(episode, async_scheduling=False), Counter(), step_limit, outputs=twin).violation:
        return None  # the twin's own violation is found when the walk draws it
    if any(isinstance(o, ErrorOut) for o in outputs + twin):
        return None
    mine, theirs = _by_request(outputs), _by_request(twin)  # (frames of different requests interleave otherwise)
    if episode.mode != "plain":  # what the clients read, framing aside
        mine, theirs = ({rid: _client_view(frames) for rid, frames in side.items()} for side in (mine, theirs))
    for rid in sorted(set(mine) | set(theirs)):
        got, want = mine.get(rid, []), theirs.get(rid, [])
        if got != want:
            at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
            return Violation("async_equals_sync", f"request {rid}'s frame {at} is "
                                                  f"{got[at] if at < len(got) else 'missing'}; the synchronous run's "
                                                  f"is {want[at] if at < len(want) else 'missing'}")
    return None


def _client_view(frames: list) -> list:
    """What a client reads from its frames, framing aside: each token with its logprob count, then
    the final frame less its accepted-draft count. A speculative run groups its tokens by step, and
    which ticks speculate differs with when the host reads a token (a tick that would speculate
    reads the kept tokens first); the tokens, finish reason and logprobs may not."""
    view: list = []
    for o in frames:
        if isinstance(o, TokenOut):
            view.append((o.token, o.logprobs))
        elif isinstance(o, TokensOut):
            view.extend((t, o.logprobs) for t in o.tokens)
        elif isinstance(o, (DoneOut, ResponseOut)):
            view.append(attrs.evolve(o, acc=0))
        else:
            view.append(o)
    return view


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
    "swap-out of a victim short of the last active": ("feature:swap_out_not_last",),
    "rare: timeout with the deadline on the clock": ("rare:deadline_on_the_clock",),
    "rare: plain decode after a rejected verify crossed a block": ("rare:plain_after_rejected_cross",),
    "rare: a preempted sequence needing the whole pool": ("rare:requeue_needs_whole_pool",),
    "rare: cancel of a request without a cancel flag": ("rare:cancel_without_flag",),
    "late drafts, serial verify": ("feature:late_drafts_serial",),
    "late drafts, batched MTP": ("feature:late_drafts_mtp_batched",),
    "late drafts, batched DFlash": ("feature:late_drafts_dflash_batched",),
    "late proposal failed, its verify answers": ("feature:late_failure",),
    "device behind the host (a lane)": ("feature:lane",), "every event stepped twice": ("feature:stepped_twice",),
    "proposal answered ahead": ("feature:answered_ahead",),
    "decode answered ahead": ("feature:decode_ahead",),
    "kept tokens resolved by the next decode": ("feature:kept_resolved",),
    "kept tokens read alone": ("feature:kept_read_alone",),
    "row computed ahead for a sequence its EOS ended": ("feature:computed_ahead_dropped",),
    "decode answered ahead failed, its resolve answers": ("feature:ahead_failure",),
    "fault at a pipelined decode's launch, its kept tokens read first": ("feature:fault_brings_kept",),
    "deadline passed with a token on the device": ("feature:ahead_deadline_read",),
    "a steady batch ahead, in columns": ("feature:ahead_columns",),
    "prompt rows held by the mixed-prefill bound": ("feature:mixed_prefill_bound",),
}
FEATURES.update({f"fault in {name}": (f"fault_phase:{name}",) for name in FAULT_PHASES})
"""Every feature the walk must reach, with the coverage keys whose sum counts it."""


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
