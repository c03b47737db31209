"""Base record of every effect.

An effect is a description, never a callback: two runs that make the same decisions produce equal
effect lists. ``QUERY`` marks effects whose answer ``step`` needs before it can decide anything
else; their answer comes back as an event.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import attrs


@attrs.frozen
class Effect:
    """A frozen, hashable record of something the core wants done."""

    QUERY: ClassVar[bool] = False


def expand_batched(effects: Iterable[Effect]) -> list[Effect]:
    """``effects`` with each batched record (one that has ``split``: ``StreamOut``,
    ``MarconiCheckpoints``) replaced by the per-request or per-sequence records it stands for."""
    out: list[Effect] = []
    for effect in effects:
        split = getattr(effect, "split", None)
        if split is None:
            out.append(effect)
        else:
            out.extend(split())
    return out


def is_query(effect: Effect) -> bool:
    """True when the interpreter must answer ``effect`` with an event."""
    return effect.QUERY


def int_tuple(value: Iterable[int]) -> tuple[int, ...]:
    """Converter: any iterable of ints becomes a tuple (records stay hashable).

    A tuple is taken as is: records are rebuilt on every step, and re-converting long tuples
    (a sequence's output) would make each step linear in the output length.
    """
    if type(value) is tuple:
        return value
    return tuple(int(v) for v in value)


def int_tuples(value: Iterable[Iterable[int]]) -> tuple[tuple[int, ...], ...]:
    """Converter: an iterable of iterables of ints becomes a tuple of ``int_tuple``s."""
    return tuple(int_tuple(x) for x in value)


def int_pairs(value: Iterable[Iterable[int]]) -> tuple[tuple[int, int], ...]:
    """Converter: an iterable of ``(a, b)`` pairs becomes a tuple of int pairs."""
    return tuple((int(a), int(b)) for a, b in value)


# --- quick constructors ------------------------------------------------------------------------------


def quick_inits(namespace: dict[str, Any]) -> None:
    """Give every frozen, slotted attrs record class defined in the module ``namespace`` a quicker
    ``__init__`` with the same signature and the same result.

    A frozen attrs ``__init__`` sets each field through a bound ``object.__setattr__`` it makes per
    call; ``step`` builds several effects, events and waiting records per batch, and that is a
    fair part of a small step's cost. The quick one sets each field through its slot's own
    descriptor, after the field's converter. Classes with a validator, a pre- or post-init hook, a
    field left out of ``__init__`` or a default factory keep attrs' own (tests/test_quick_inits.py
    compares the two on every class)."""
    module = namespace["__name__"]
    for cls in list(namespace.values()):
        if isinstance(cls, type) and cls.__module__ == module and attrs.has(cls):
            init = _quick_init(cls)
            if init is not None:
                init.__qualname__ = f"{cls.__qualname__}.__init__"
                init.__doc__ = cls.__init__.__doc__
                init.__annotations__ = dict(cls.__init__.__annotations__)
                cls.__init__ = init  # type: ignore[method-assign]


def _slot(cls: type, name: str) -> Any:
    """The descriptor of slot ``name`` (on ``cls`` or the base that declares it), or ``None``."""
    for klass in cls.__mro__:
        if name in klass.__dict__.get("__slots__", ()):
            return klass.__dict__[name]
    return None


def _quick_init(cls: type) -> Any:
    """The quick ``__init__`` of ``cls``, or ``None`` where attrs' own must stay."""
    if "__slots__" not in cls.__dict__ or getattr(cls, "__attrs_post_init__", None) is not None \
            or getattr(cls, "__attrs_pre_init__", None) is not None:
        return None
    fields = attrs.fields(cls)
    namespace: dict[str, Any] = {}
    positional: list[str] = []
    keywords: list[str] = []
    body: list[str] = []
    for i, field in enumerate(fields):
        setter = _slot(cls, field.name)
        if (setter is None or field.validator is not None or not field.init or field.alias is None
                or isinstance(field.default, attrs.Factory)):  # type: ignore[arg-type]
            return None
        param = field.alias
        if field.default is attrs.NOTHING:
            spec = param
        else:
            namespace[f"_default{i}"] = field.default
            spec = f"{param}=_default{i}"
        (keywords if field.kw_only else positional).append(spec)
        namespace[f"_set{i}"] = setter.__set__
        if field.converter is not None:
            if not callable(field.converter) or isinstance(field.converter, attrs.Converter):
                return None
            namespace[f"_convert{i}"] = field.converter
            body.append(f"    _set{i}(self, _convert{i}({param}))")
        else:
            body.append(f"    _set{i}(self, {param})")
    params = ", ".join(["self", *positional, *(["*", *keywords] if keywords else [])])
    source = f"def __init__({params}):\n" + ("\n".join(body) if body else "    pass") + "\n"
    exec(compile(source, f"<quick init of {cls.__module__}.{cls.__qualname__}>", "exec"), namespace)
    return namespace["__init__"]
