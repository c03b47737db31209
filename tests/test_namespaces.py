"""The record namespaces (``effects.device_calls`` as ``dc``, ``core.phases`` as ``ph``) are complete:
every public record or helper defined in one of their family modules is re-exported, so a record
added to a family is never missing from ``dc.X`` / ``ph.X`` (where the core, the interpreter and
the devices look it up), and the namespace defines nothing of its own."""

from __future__ import annotations

import importlib
import inspect

import pytest

NAMESPACES = {
    "fxsched.effects.device_calls": ("call_base", "loop_calls", "sequence_calls", "adapter_calls", "ep_calls",
                                     "forward_calls", "readback_calls", "verify_calls", "speculation_calls",
                                     "batched_calls"),
    "fxsched.core.phases": ("loop_phases", "flow_phases", "prefill_phases", "decode_phases", "spec_phases",
                            "memory_phases"),
}


def _defined(module) -> set[str]:
    return {name for name, value in vars(module).items()
            if not name.startswith("_") and (inspect.isclass(value) or inspect.isfunction(value))
            and value.__module__ == module.__name__}


@pytest.mark.parametrize("namespace", sorted(NAMESPACES))
def test_every_family_record_is_in_its_namespace(namespace):
    ns = importlib.import_module(namespace)
    package = namespace.rsplit(".", 1)[0]
    everything: set[str] = set()
    for family in NAMESPACES[namespace]:
        module = importlib.import_module(f"{package}.{family}")
        names = _defined(module)
        assert names, f"{family} defines nothing"
        missing = sorted(n for n in names if getattr(ns, n, None) is not getattr(module, n))
        assert not missing, f"{namespace} lacks {family}'s {missing}"
        everything |= names
    assert set(ns.__all__) == everything, sorted(set(ns.__all__) ^ everything)
    assert not _defined(ns), f"{namespace} defines {_defined(ns)} itself"


def test_no_other_module_holds_records_of_the_namespaces():
    """A family module the lists above do not name would escape the check: every module whose
    records subclass the namespaces' bases is one of the listed families."""
    import pkgutil

    from fxsched import core, effects
    from fxsched.effects.call_base import DeviceCall

    families = {f"fxsched.effects.{m}" for m in NAMESPACES["fxsched.effects.device_calls"]}
    for info in pkgutil.iter_modules(effects.__path__):
        module = importlib.import_module(f"fxsched.effects.{info.name}")
        calls = [v for v in vars(module).values() if inspect.isclass(v) and issubclass(v, DeviceCall)
                 and v.__module__ == module.__name__]
        assert not calls or module.__name__ in families, (module.__name__, calls)
    phase_families = {f"fxsched.core.{m}" for m in NAMESPACES["fxsched.core.phases"]}
    for info in pkgutil.iter_modules(core.__path__):
        if info.name.endswith("_phases"):
            assert f"fxsched.core.{info.name}" in phase_families, info.name
