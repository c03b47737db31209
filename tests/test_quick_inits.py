"""The quick constructors of the record classes (``effects.base.quick_inits``): every effect,
event and waiting record built through one gives what attrs' own ``__init__`` of the same fields
gives, with the same signature; a class that validates keeps attrs' own."""

from __future__ import annotations

import inspect

import attrs
import pytest

from fxsched.core import decode_phases, events, flow_phases, loop_phases, memory_phases, prefill_phases, spec_phases
from fxsched.effects import (adapter_calls, batched_calls, call_base, client, ep_calls, forward_calls, lifecycle,
                             loop_calls, plans, readback_calls, sequence_calls, speculation_calls, verify_calls)
from fxsched.effects.base import int_pairs, int_tuple, int_tuples
from fxsched.effects.device_calls import host_picks, prefill_slices

DEVICE_CALLS = (call_base, loop_calls, sequence_calls, adapter_calls, ep_calls, forward_calls, readback_calls,
                verify_calls, speculation_calls, batched_calls)  # the modules behind the device_calls namespace
PHASES = (loop_phases, flow_phases, prefill_phases, decode_phases, spec_phases, memory_phases)  # behind core.phases
MODULES = (*DEVICE_CALLS, client, lifecycle, plans, events, *PHASES)
RECORDS = sorted((cls for module in MODULES for cls in vars(module).values()
                  if isinstance(cls, type) and cls.__module__ == module.__name__ and attrs.has(cls)),
                 key=lambda cls: f"{cls.__module__}.{cls.__qualname__}")
QUICK = [cls for cls in RECORDS if cls.__init__.__code__.co_filename.startswith("<quick init")]
ARGUMENTS = {int_tuple: [3, 4], int_tuples: [[1, 2], (3,)], int_pairs: [[1, 2], (3, 4)],
             host_picks: [object(), object()], prefill_slices: [object()]}
"""An argument each converter converts (a list becomes a tuple); any other field gets a fresh object."""


def attrs_twin(cls: type) -> type:
    """A class attrs builds from the same field specs: the reference ``__init__``."""
    specs = {f.name: attrs.field(default=f.default, converter=f.converter, kw_only=f.kw_only, alias=f.alias,
                                 type=f.type)
             for f in attrs.fields(cls)}
    return attrs.make_class(f"Twin{cls.__name__}", specs, frozen=True, slots=True)


def test_most_records_are_quick() -> None:
    assert len(QUICK) >= 150, f"only {len(QUICK)} of {len(RECORDS)} record classes have a quick __init__"


@pytest.mark.parametrize("cls", QUICK, ids=lambda cls: cls.__qualname__)
def test_quick_init_matches_attrs(cls: type) -> None:
    twin = attrs_twin(cls)
    assert inspect.signature(vars(cls)["__init__"]) == inspect.signature(vars(twin)["__init__"])
    fields = attrs.fields(cls)
    given = {f.alias: ARGUMENTS[f.converter] if f.converter is not None else object() for f in fields}
    positional = [given[f.alias] for f in fields if not f.kw_only]
    keywords = {f.alias: given[f.alias] for f in fields if f.kw_only}
    mine, reference = cls(*positional, **keywords), twin(*positional, **keywords)
    for f in fields:
        value = getattr(mine, f.name)
        assert value == getattr(reference, f.name)
        if f.converter is None:
            assert value is given[f.alias]
        elif f.converter in ARGUMENTS:
            assert type(value) is tuple and value != given[f.alias]  # converted: a list became a tuple
    # the defaults are attrs' own too
    required = [f for f in fields if f.default is attrs.NOTHING]
    if len(required) < len(fields) and not any(f.kw_only for f in required):
        args = [given[f.alias] for f in required]
        assert attrs.astuple(cls(*args), recurse=False) == attrs.astuple(twin(*args), recurse=False)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        setattr(mine, fields[0].name if fields else "x", 1)


def test_a_validating_record_keeps_attrs_init() -> None:
    assert lifecycle.ReleaseSeq not in QUICK
    with pytest.raises(ValueError):
        lifecycle.ReleaseSeq(1, 0, False, "not a reason")  # type: ignore[arg-type]
