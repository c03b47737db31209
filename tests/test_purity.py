"""Purity: ``step`` is deterministic, leaves its inputs untouched, and everything it handles is hashable."""

from __future__ import annotations

import ast
import copy
import sys
from pathlib import Path

import pytest

from fxsched.core import events as ev
from fxsched.core.machine import step
from fxsched.runtime.scenarios.runner import run_scenario
from fxsched.runtime.scenarios.loader import load_scenario

from factories import Driver, dflash_config, dflash_model, make_request

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["dflash_batched", "plain_decode"])
def test_a_scenario_run_twice_gives_identical_bytes(name):
    scenario = load_scenario(name)
    assert run_scenario(scenario) == run_scenario(scenario)


def _recorded_steps():
    """(state, event) pairs of a whole DFlash run, driven by the test script."""
    d = Driver(config=dflash_config(), model=dflash_model(),
               requests=[make_request(1, max_tokens=12), make_request(2, max_tokens=9)], boot=False)
    pairs = []
    event = ev.Boot()
    for _ in range(200):
        pairs.append((d.state, event))
        d.feed(event)
        if d.state.stopped:
            break
        if len(d.outputs()) and all(r in {o.request_id for o in d.outputs() if type(o).__name__ == "DoneOut"} for r in (1, 2)) \
                and type(d.query).__name__ == "WaitForInput":
            d.feed(ev.InboxClosed())
        event = d.script(d.query, d)
    assert d.state.stopped
    return pairs


def test_step_leaves_its_inputs_equal_to_a_deep_copy_taken_before():
    for state, event in _recorded_steps():
        state_before, event_before = copy.deepcopy(state), copy.deepcopy(event)
        step(state, event)
        assert state == state_before and event == event_before


def test_step_is_deterministic_for_the_same_state_and_event():
    for state, event in _recorded_steps()[:60]:
        assert step(state, event) == step(state, event)


def test_states_events_and_effects_are_hashable():
    for state, event in _recorded_steps():
        hash(state)
        hash(event)
        _, effects = step(state, event)
        for effect in effects:
            hash(effect)


ALLOWED_THIRD_PARTY = {"attrs", "attr"}


def _imports(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module


@pytest.mark.parametrize("folder", ["core", "effects"])
def test_core_and_effects_import_only_the_standard_library_attrs_and_each_other(folder):
    bad = []
    for path in sorted((ROOT / folder).glob("**/*.py")):
        for name in _imports(path):
            top = name.split(".")[0]
            if top in sys.stdlib_module_names or top in ALLOWED_THIRD_PARTY:
                continue
            if name.startswith(("fxsched.core", "fxsched.effects")):
                continue
            bad.append(f"{path.relative_to(ROOT)}: {name}")
    assert bad == []


@pytest.mark.parametrize("banned", ["time", "random", "logging", "datetime", "secrets", "os"])
def test_core_reads_no_clock_randomness_logging_or_environment(banned):
    users = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "core").glob("*.py"))
             if any(n.split(".")[0] == banned for n in _imports(p))]
    assert users == []


def _effect_classes():
    from fxsched.effects import (adapter_calls, batched_calls, call_base, client, ep_calls, forward_calls, lifecycle,
                                 loop_calls, plans, readback_calls, sequence_calls, speculation_calls, verify_calls)
    from fxsched.effects.base import Effect

    device_calls = (call_base, loop_calls, sequence_calls, adapter_calls, ep_calls, forward_calls, readback_calls,
                    verify_calls, speculation_calls, batched_calls)  # the modules behind the device_calls namespace
    for module in (*device_calls, lifecycle, plans, client):
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, Effect) and obj.__module__ == module.__name__:
                yield obj


def test_the_interpreter_has_a_case_for_every_effect_kind():
    import re

    source = (ROOT / "runtime" / "effect_handlers.py").read_text()  # the interpreter's cases
    abstract = {"DeviceCall", "SerialVerify", "Plan", "Lifecycle", "ClientOutput"}
    missing = [cls.__name__ for cls in _effect_classes()
               if cls.__name__ not in abstract and not re.search(rf"\b{cls.__name__}\b", source)
               and not any(base.__name__ in ("SerialVerify", "ClientOutput") for base in cls.__mro__[1:])]
    assert missing == []
