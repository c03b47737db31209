"""The random walk of the model checker: random episodes of ``step`` on the simulated device with
invariants checked after every step; a seed replays any failure exactly (``replay``).

An episode is drawn from a seeded generator: a drafting mode, batch size, chunking, a spill pool,
a block pool, 1–6 requests with random scripts (EOS placement, budgets, draft errors, cancel
points, deadlines, late arrivals, blocking or streaming), scheduled faults (KV exhaustion, fatal
decode and verify errors, corrupted spill files), perhaps a LoRA rotation, and the inbox closing
at a random tick after the last arrival.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from typing import Any, Optional

import attrs

from fxsched.core.config import SCRIPTED_EOS as EOS
from fxsched.core import events as ev
from fxsched.core.config import ModelInfo, SchedulerConfig
from fxsched.core.request import Request
from fxsched.core.state import initial_state
from fxsched.effects.client import DoneOut, ErrorOut, ResponseOut, RotationAck
from fxsched.runtime.interpreter import BatchError, Host, Interpreter, Observer
from fxsched.runtime.check.invariants import Monitor, Violation, expected_output
from fxsched.runtime.devices.scripted import Script
from fxsched.runtime.devices.simulated import SimDevice

MODES = ("plain", "mtp1", "mtp2", "mtp3", "dflash", "ngram", "self_spec")
TICK_MS = 10.0


@attrs.frozen
class SimRequest:
    id: int
    prompt_len: int
    tokens: tuple[int, ...]
    max_tokens: int
    streaming: bool = True
    wrong_every: int = 0
    cancel_at: Optional[int] = None
    deadline_ms: Optional[float] = None
    arrive_tick: int = 0
    num_beams: int = 1

    def request(self) -> Request:
        prompt = (self.id,) + tuple(2 + (i % 7) for i in range(1, self.prompt_len))
        return Request(id=self.id, prompt=prompt, max_tokens=self.max_tokens, streaming=self.streaming,
                       deadline_ms=self.deadline_ms, num_beams=self.num_beams)

    def script(self) -> Script:
        beam = expected_output(self.tokens, self.max_tokens) if self.num_beams > 1 else ()
        return Script(self.prompt_len, self.tokens, self.wrong_every, beam, self.cancel_at)


@attrs.frozen
class Episode:
    mode: str
    max_batch_size: int
    max_prefill_tokens: int
    spill: bool
    total_blocks: int
    held_blocks: int
    requests: tuple[SimRequest, ...]
    kv_exhaust_at: tuple[int, ...] = ()
    decode_fault_at: tuple[int, ...] = ()
    verify_fault_at: tuple[int, ...] = ()
    spill_corrupt_for: tuple[int, ...] = ()
    can_batch_verify: bool = True
    rotation_tick: Optional[int] = None
    close_tick: int = 0

    def to_json(self) -> dict:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Episode":
        """The episode of a replay file. Files from before planted bugs left the checker carry an
        empty ``planted`` list, which is dropped; a file that planted a bug cannot be replayed."""
        data = dict(data)
        if data.pop("planted", None):
            raise ValueError("the episode plants bugs, which the checker no longer does "
                             "(planted bugs are source mutations run by the tests)")
        requests = tuple(SimRequest(**_lists_as_tuples(r)) for r in data.pop("requests"))
        return cls(requests=requests, **_lists_as_tuples(data))

    def config(self) -> SchedulerConfig:
        modes: dict[str, dict[str, Any]] = dict(
            plain={}, mtp1=dict(use_speculative=True, num_drafts=1), mtp2=dict(use_speculative=True, num_drafts=2),
            mtp3=dict(use_speculative=True, num_drafts=3), dflash=dict(use_speculative=True, dflash=True, num_drafts=5),
            ngram=dict(ngram_speculative=True), self_spec=dict(self_speculative=True, num_drafts=2))
        spec = modes[self.mode]
        return SchedulerConfig(max_batch_size=self.max_batch_size, max_prefill_tokens=self.max_prefill_tokens,
                               swap_space_gb=1.0 if self.spill else 0.0, **spec)

    def model(self) -> ModelInfo:
        return ModelInfo(total_blocks=self.total_blocks, has_proposer=self.mode.startswith(("mtp", "dflash")),
                         dflash_gamma=6 if self.mode == "dflash" else None,
                         has_self_speculative=self.mode == "self_spec",
                         supports_beam=any(r.num_beams > 1 for r in self.requests))


def _lists_as_tuples(data: dict[str, Any]) -> dict[str, Any]:
    """A record's fields from JSON: lists back to the tuples of the frozen records."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}


def random_episode(rng: random.Random) -> Episode:
    mode = rng.choice(MODES)
    n = rng.randint(1, 6) if rng.random() < 0.8 else rng.randint(7, 12)
    requests = []
    last_arrival = 0
    for i in range(n):
        length = rng.randint(1, 14)
        tokens = [rng.randint(2, 40) for _ in range(length)]
        if rng.random() < 0.3:  # repeated content, so n-gram proposals happen
            tokens = (tokens[:3] * 6)[:length]
        if rng.random() < 0.75:
            tokens.append(EOS)
        arrive = rng.choice([0, 0, 0, rng.randint(1, 8)])
        last_arrival = max(last_arrival, arrive)
        streaming = rng.random() < 0.8
        requests.append(SimRequest(
            id=i + 1, prompt_len=rng.randint(1, 40), tokens=tuple(tokens), max_tokens=rng.randint(1, 18),
            streaming=streaming, wrong_every=rng.choice([0, 0, 2, 3, 4, 5]),
            cancel_at=rng.randint(1, 10) if streaming and rng.random() < 0.15 else None,
            deadline_ms=(arrive * TICK_MS + rng.randint(20, 200)) if rng.random() < 0.1 else None,
            arrive_tick=arrive,
            num_beams=rng.choice([2, 3]) if not streaming and rng.random() < 0.3 else 1,
        ))
    spill = rng.random() < 0.3
    return Episode(
        mode=mode, max_batch_size=rng.choice([1, 2, 3, 4, 8, 12]), max_prefill_tokens=rng.choice([0, 0, 4, 8, 16]),
        spill=spill, total_blocks=rng.choice([6, 8, 12, 24, 1000]), held_blocks=rng.choice([0, 0, 1]),
        requests=tuple(requests),
        kv_exhaust_at=tuple(sorted(rng.sample(range(30), rng.randint(0, 2)))),
        decode_fault_at=tuple(sorted(rng.sample(range(40), 1))) if rng.random() < 0.1 else (),
        verify_fault_at=tuple(sorted(rng.sample(range(30), 1))) if rng.random() < 0.1 else (),
        spill_corrupt_for=(rng.randint(1, n),) if spill and rng.random() < 0.3 else (),
        can_batch_verify=rng.random() < 0.85,
        rotation_tick=rng.randint(1, 10) if rng.random() < 0.15 else None,
        close_tick=last_arrival + rng.randint(0, 6),
    )


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
        self.closed = False

    def initial_events(self) -> list:
        return [ev.Arrival(r.request()) for r in self.episode.requests if r.arrive_tick == 0]

    def on_tick(self, tick: int) -> None:
        self.inputs.append(ev.Clock(tick * TICK_MS))
        self.inputs.extend(self.pending.pop(tick, []))
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


class MonitorObserver(Observer):
    """The invariants on the drive loop: the monitor sees every batch before it is carried out,
    the device after it, and every client output; cancels are told to it as they are fed."""

    def __init__(self, monitor: Monitor):
        self.monitor = monitor

    def before_step(self, event) -> None:
        if isinstance(event, ev.Cancel):
            self.monitor.cancelled.add(event.request_id)

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

    def __init__(self, monitor: Monitor, coverage: Counter, step_limit: int, keep_log: bool):
        super().__init__(monitor)
        self.coverage = coverage
        self.step_limit = step_limit
        self.log: Optional[list[str]] = [] if keep_log else None
        self.steps = 0
        self.stepping: Optional[ev.Event] = None  # the event ``step`` is working on

    def before_step(self, event) -> None:
        self.stepping = event
        if self.log is not None:
            self.log.append(repr(event))
        if isinstance(event, ev.DeviceFault):
            self.coverage["fault:kv_exhausted" if event.kv_exhausted else "fault:fatal"] += 1
        elif isinstance(event, ev.Cancel):
            self.coverage["fault:cancel"] += 1
        super().before_step(event)

    def stepped(self, event, state, effects) -> None:
        self.stepping = None
        self.steps += 1
        super().stepped(event, state, effects)
        for effect in effects:
            self.coverage[type(effect).__name__] += 1

    def performed(self, state) -> None:
        super().performed(state)
        if state.stopped:
            self.monitor.at_end(state)
        elif self.steps >= self.step_limit:
            raise Violation("step_limit", f"the episode did not end within {self.step_limit} steps")

    def output(self, output) -> None:
        if isinstance(output, RotationAck):
            self.coverage["rotation_ack"] += 1
            return
        super().output(output)
        if isinstance(output, (DoneOut, ResponseOut)):
            self.coverage[f"finish:{output.reason}"] += 1
        elif isinstance(output, ErrorOut):
            self.coverage["finish:error"] += 1


@attrs.frozen
class EpisodeResult:
    steps: int
    violation: Optional[Violation]
    violation_step: Optional[int]
    events: tuple


def run_episode(episode: Episode, coverage: Counter, step_limit: int = 20000, keep_log: bool = False) -> EpisodeResult:
    """Run one episode to its end on the interpreter's drive loop; the first broken invariant
    stops it."""
    scripts = {r.id: r.script() for r in episode.requests}
    counts_acc = episode.mode.startswith(("mtp", "dflash"))
    device = SimDevice(scripts, total_blocks=episode.total_blocks, held_blocks=episode.held_blocks,
                       kv_exhaust_at=episode.kv_exhaust_at, decode_fault_at=episode.decode_fault_at,
                       verify_fault_at=episode.verify_fault_at, spill_corrupt_for=episode.spill_corrupt_for,
                       cancel_flags={r.id for r in episode.requests if r.streaming},
                       can_batch_verify=episode.can_batch_verify, count_accepted=counts_acc)
    watch = WalkObserver(Monitor(episode.requests, device, counts_acc=counts_acc), coverage, step_limit, keep_log)
    host = WalkHost(episode)
    device.on_tick = host.on_tick
    config = episode.config()
    interpreter = Interpreter(device, host, config.eos_ids, observer=watch)
    state = initial_state(config, episode.model())
    violation = None
    try:
        interpreter.run(state, host.initial_events() + [ev.Boot()])
    except Violation as found:
        violation = found
    except BatchError as err:
        violation = Violation("batch_ends_in_one_query", str(err))
    except Exception as err:
        if watch.stepping is not None:  # step must never raise on an event its phase allows
            violation = Violation("step_raises", f"{type(err).__name__}: {err} on {watch.stepping!r}")
        else:  # a device refusal (double free, bad slot) is a scheduler bug too
            violation = Violation("device_refused", f"{type(err).__name__}: {err}")
    events = tuple(watch.log or ())
    if violation is None:
        return EpisodeResult(watch.steps, None, None, events)
    return EpisodeResult(watch.steps, violation, watch.steps, events)


@attrs.frozen
class WalkReport:
    seed: int
    steps: int
    episodes: int
    seconds: float
    coverage: dict
    violation: Optional[dict]

    @property
    def steps_per_second(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else 0.0


def episode_seed(seed: int, index: int) -> int:
    return (seed * 1_000_003 + index) & 0xFFFFFFFF


def walk(seed: int, steps: Optional[int] = None, seconds: Optional[float] = None, progress=None) -> WalkReport:
    """Run episodes until ``steps`` steps or ``seconds`` seconds; stop at the first violation."""
    coverage: Counter = Counter()
    total, index = 0, 0
    start = time.perf_counter()
    while True:
        if steps is not None and total >= steps:
            break
        if seconds is not None and time.perf_counter() - start >= seconds:
            break
        eseed = episode_seed(seed, index)
        episode = random_episode(random.Random(eseed))
        result = run_episode(episode, coverage)
        total += result.steps
        if progress is not None:
            progress(result.steps)
        if result.violation is not None:
            replayed = run_episode(episode, Counter(), keep_log=True)
            violation = {
                "invariant": result.violation.invariant, "message": result.violation.message,
                "step": result.violation_step, "episode_index": index, "episode_seed": eseed,
                "episode": episode.to_json(), "events": list(replayed.events),
            }
            return WalkReport(seed, total, index + 1, time.perf_counter() - start, dict(coverage), violation)
        index += 1
    return WalkReport(seed, total, index, time.perf_counter() - start, dict(coverage), None)
