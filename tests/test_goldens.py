"""Golden tests: every scenario the project supports prints its golden trace byte for byte."""

from __future__ import annotations

from pathlib import Path

import pytest

from fxsched.runtime.scenarios.runner import run_scenario
from fxsched.runtime.scenarios.loader import load_scenario, scenario_names, specs_dir

GOLDENS = specs_dir() / "goldens"
SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "goldens"
SUPPORTED = sorted(p.stem for p in GOLDENS.glob("*.trace"))


def test_the_three_foundation_scenarios_have_goldens():
    assert {"dflash_batched", "dflash", "plain_decode"} <= set(SUPPORTED)


@pytest.mark.parametrize("name", SUPPORTED)
def test_golden_trace_is_reproduced_byte_for_byte(name):
    assert run_scenario(load_scenario(name)) == (GOLDENS / f"{name}.trace").read_text()


@pytest.mark.parametrize("name", SUPPORTED)
def test_project_golden_equals_the_reference(name):
    reference = SHARED / f"{name}.trace"
    if not reference.exists():
        pytest.skip(f"no reference trace at {reference}")
    assert (GOLDENS / f"{name}.trace").read_bytes() == reference.read_bytes()


def test_every_declared_scenario_has_a_golden():
    assert set(scenario_names()) == set(SUPPORTED)


def test_every_scenario_of_the_reference_set_is_declared():
    if not SHARED.exists():
        pytest.skip(f"no reference traces at {SHARED}")
    assert {p.stem for p in SHARED.glob("*.trace")} == set(scenario_names())
