"""The interpreter's drive loop: ``run`` is ``feed`` repeated, the observer sees every step and
every client output, and a batch that does not end in exactly one query is refused."""

from __future__ import annotations

import pytest

from fxsched.core import events as ev
from fxsched.effects import device_calls as dc
from fxsched.effects import lifecycle as lc
from fxsched.effects.client import ClientOutput, RotationAck
from fxsched.runtime.interpreter import BatchError, Observer, check_batch
from fxsched.runtime.scenarios.loader import load_scenario
from fxsched.runtime.scenarios.runner import RunResult, prepare_scenario, run_scenario


class Recorder(Observer):
    def __init__(self):
        self.calls: list[str] = []
        self.outputs: list = []

    def before_step(self, event):
        self.calls.append("before")

    def stepped(self, event, state, effects):
        self.calls.append("stepped")

    def performed(self, state):
        self.calls.append("performed")

    def output(self, output):
        self.outputs.append(output)


def _setup(name: str, observer=None):
    scenario = load_scenario(name)
    setup = prepare_scenario(scenario, observer=observer)
    return scenario, setup.host, setup.device, setup.interpreter, setup.state


@pytest.mark.parametrize("name", ["dflash_batched", "cancel_mid_stream", "lora_rotation_at_quiescence"])
def test_feeding_event_by_event_gives_the_run_trace(name):
    scenario, host, device, interpreter, state = _setup(name)
    queue = host.initial_events() + [ev.Boot()]
    while queue and not state.stopped:
        state, follow = interpreter.feed(state, queue.pop(0))
        queue.extend(follow)
    assert state.stopped
    assert RunResult(scenario, device.lines, host, interpreter.steps).trace() == run_scenario(scenario)


def test_the_observer_sees_each_step_in_order_and_every_output():
    watch = Recorder()
    _, host, _, interpreter, state = _setup("lora_rotation_at_quiescence", watch)
    interpreter.run(state, host.initial_events() + [ev.Boot()])
    assert watch.calls == ["before", "stepped", "performed"] * interpreter.steps
    assert any(isinstance(o, RotationAck) for o in watch.outputs)
    assert sum(isinstance(o, ClientOutput) for o in watch.outputs) == sum(
        len(lines) for lines in host.streams.values()) + sum(1 for a in host.answers.values() if a is not None)


def test_a_batch_ends_in_its_only_query_or_in_the_teardown():
    check_batch(ev.Clock(10.0), (), stopped=False)  # an input event's batch is empty
    check_batch(ev.Boot(), (dc.PollInnerq(), dc.NumFreeBlocks()), stopped=False)
    check_batch(ev.InputReady(), (dc.PollInnerq(), lc.Teardown()), stopped=True)


@pytest.mark.parametrize("effects, stopped, words", [
    ((dc.NumFreeBlocks(), dc.CreateStream()), False, "holds 2 queries (NumFreeBlocks, CreateStream)"),
    ((dc.NumFreeBlocks(), dc.PollInnerq()), False, "has its query NumFreeBlocks at position 1 of 2, not last"),
    ((dc.PollInnerq(),), False, "ends in PollInnerq with no query and the loop has not stopped"),
    ((dc.PollInnerq(), lc.Teardown()), False, "ends in Teardown with no query and the loop has not stopped"),
    ((lc.Teardown(), dc.PollInnerq()), True, "ends in PollInnerq with no query"),
])
def test_any_other_batch_is_a_clear_error(effects, stopped, words):
    with pytest.raises(BatchError) as info:
        check_batch(ev.InputReady(), effects, stopped)
    message = str(info.value)
    assert message.startswith(f"step(InputReady) returned a batch of {len(effects)} effects that {words};")
    assert message.endswith("a batch must end in exactly one query or in the teardown")
