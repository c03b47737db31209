"""The scenario runner: one deterministic run of a scenario on the recording device, printed as a
trace (specs/runner.md). Every run starts from a fresh device and a fresh scheduler, and every
run, finished or failed, removes its spill files (the device's private temporary folder).

A scenario that turns out impossible while it runs (a late arrival at a tick the run never
reaches: ticks pass only while requests are in flight) raises ``ScenarioError``; a run that
breaks down raises ``RunError``."""

from __future__ import annotations

from typing import Optional

import attrs
import structlog

from fxsched.core import events as ev
from fxsched.core.config import ModelInfo, SchedulerConfig
from fxsched.core.state import SchedulerState, initial_state
from fxsched.effects.client import TERMINAL_OUTPUTS, RotationAck, TokenOut, TokensOut
from fxsched.runtime.devices.recording import RecordingDevice
from fxsched.runtime.interpreter import Host, Interpreter, Observer, RunError
from fxsched.runtime.scenarios.loader import Scenario, ScenarioError

log = structlog.get_logger("fxsched.runner")


def scheduler_config(scenario: Scenario) -> SchedulerConfig:
    o = scenario.options
    return SchedulerConfig(
        max_batch_size=o.max_batch_size, use_speculative=o.use_speculative, dflash=o.dflash,
        num_drafts=o.num_drafts, max_prefill_tokens=o.max_prefill_tokens, max_batch_tokens=o.max_batch_tokens,
        self_speculative=o.self_speculative, ngram_speculative=o.ngram_speculative,
        ngram_history_without_pending_token=o.ngram_history_without_pending_token,
        swap_space_gb=o.swap_space_gb, policy="slai" if o.slai_policy else "fifo",
        loop_watchdog=o.loop_watchdog, boundary_tokens=o.boundary_tokens,
    )


def model_info(scenario: Scenario) -> ModelInfo:
    m = scenario.model
    return ModelInfo(
        vocab=m.vocab, block_size=m.block_size, total_blocks=m.total_blocks, has_ssm_layers=m.has_ssm_layers,
        ring_slots=m.ring_slots, has_proposer=m.has_proposer, dflash_gamma=m.dflash_gamma,
        has_self_speculative=m.has_self_speculative, supports_beam=m.supports_beam,
    )


class ScenarioHost(Host):
    """Clients, the inbox and the late arrivals of one scenario run."""

    def __init__(self, scenario: Scenario):
        super().__init__()
        self.scenario = scenario
        self.streams: dict[int, list[str]] = {}
        self.answers: dict[int, Optional[str]] = {}
        self.finished: set[int] = set()
        self.late: dict[int, list[ev.Event]] = {}
        self.rotation_ack: Optional[str] = None
        self.tick = 0
        for spec in scenario.requests:
            if spec.streaming:
                self.streams[spec.id] = []
            else:
                self.answers[spec.id] = None
            if spec.arrive_at_tick is not None:
                self.late.setdefault(spec.arrive_at_tick, []).append(ev.Arrival(spec.request()))

    def initial_events(self) -> list[ev.Event]:
        events: list[ev.Event] = [ev.Arrival(s.request()) for s in self.scenario.requests if s.arrive_at_tick is None]
        if self.scenario.options.lora_rotation:
            events.append(ev.RotationRequested(self.scenario.options.lora_rotation))
        return events

    def on_tick(self, tick: int) -> None:
        self.tick = tick
        self.inputs.extend(self.late.pop(tick, []))

    def send(self, output) -> None:
        if isinstance(output, RotationAck):
            self.rotation_ack = output.render()
            return
        rid = output.request_id
        if rid in self.finished:
            raise RunError(f"scenario {self.scenario.name}: request {rid} got {output!r} after its final frame")
        if isinstance(output, TERMINAL_OUTPUTS):
            self.finished.add(rid)
        if rid in self.streams:
            self.streams[rid].append(output.render())
        elif isinstance(output, (TokenOut, TokensOut)):
            raise RunError(f"scenario {self.scenario.name}: blocking request {rid} was sent a token")
        else:
            self.answers[rid] = output.render()

    def complete(self) -> bool:
        rotation_done = not self.scenario.options.lora_rotation or self.rotation_ack is not None
        return len(self.finished) == len(self.scenario.requests) and rotation_done and not self.late

    def wait_for_input(self) -> list[ev.Event]:
        if self.complete():
            return [ev.InboxClosed()]
        if self.late:  # ticks pass only while there is work: a later arrival can never come
            tick = min(self.late)
            ids = [s.id for s in self.scenario.requests if s.arrive_at_tick == tick]
            raise ScenarioError(f"scenario {self.scenario.name}: request {ids[0]} has arrive_at_tick = {tick}, but "
                                f"the run went idle after tick {self.tick} (ticks pass only while requests are "
                                f"in flight)")
        missing = [s.id for s in self.scenario.requests if s.id not in self.finished]
        raise RunError(f"scenario {self.scenario.name}: the scheduler waits for input that can never come "
                       f"(requests without a final frame: {missing})")

    def out_lines(self) -> list[str]:
        lines = []
        for spec in self.scenario.requests:
            if spec.streaming:
                lines.append(f"out s{spec.id}: " + " ".join(self.streams[spec.id]))
            else:
                lines.append(f"out s{spec.id}: " + (self.answers[spec.id] or "dropped"))
        return lines


@attrs.frozen
class RunResult:
    """What one run produced: the recorded lines and what each client received."""

    scenario: Scenario
    lines: list
    host: ScenarioHost
    steps: int

    def trace(self) -> str:
        lines = [f"# scenario {self.scenario.name}"] + self.lines
        if self.scenario.options.lora_rotation:
            lines.append(f"rotation ack: {self.host.rotation_ack or 'dropped'}")
        lines += self.host.out_lines()
        return "\n".join(lines) + "\n"


@attrs.frozen
class ScenarioSetup:
    """A scenario ready to run: its host, recording device, interpreter and unbooted state."""

    host: ScenarioHost
    device: RecordingDevice
    interpreter: Interpreter
    state: SchedulerState

    def first_events(self) -> list[ev.Event]:
        return self.host.initial_events() + [ev.Boot()]


def prepare_scenario(scenario: Scenario, wrap_device=None, observer: Optional[Observer] = None) -> ScenarioSetup:
    """A fresh recording device, host and scheduler for ``scenario``; ``wrap_device`` may put a
    layer (expert-parallel broadcast) between the interpreter and the device, ``observer`` watches
    the drive loop."""
    host = ScenarioHost(scenario)
    device = RecordingDevice(scenario.model, {s.id: s.script() for s in scenario.requests},
                             cancel_flags={s.id for s in scenario.requests if s.streaming})
    device.on_tick = host.on_tick
    config = scheduler_config(scenario)
    interpreter = Interpreter(wrap_device(device) if wrap_device else device, host, config.eos_ids,
                              observer=observer)
    return ScenarioSetup(host, device, interpreter, initial_state(config, model_info(scenario)))


def execute_scenario(scenario: Scenario, wrap_device=None) -> RunResult:
    """Run ``scenario`` on a fresh recording device and a fresh scheduler (``prepare_scenario``)."""
    setup = prepare_scenario(scenario, wrap_device)
    host, device, interpreter, state = setup.host, setup.device, setup.interpreter, setup.state
    try:
        interpreter.run(state, host.initial_events() + [ev.Boot()])
    except (RunError, ScenarioError):
        raise
    except Exception as err:  # a fault of the run names the scenario
        raise RunError(f"scenario {scenario.name}: {type(err).__name__}: {err}") from err
    finally:  # a run that stopped before its teardown leaves no spill file behind
        device.spill.close()
    log.info("scenario_done", scenario=scenario.name, steps=interpreter.steps, lines=len(device.lines))
    return RunResult(scenario, device.lines, host, interpreter.steps)


def run_scenario(scenario: Scenario) -> str:
    """Run ``scenario`` and return its trace text (final newline included)."""
    return execute_scenario(scenario).trace()
