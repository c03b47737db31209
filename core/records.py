"""Fast copies of the hot records (sequences, the scheduler state).

``attrs.evolve`` re-runs every converter and validator of every field and costs several
microseconds per call; ``step`` rebuilds sequences many times per tick, so the hot records are
dict-backed frozen attrs classes copied directly:

- ``replace(record, **changes)`` runs the converter and validator of each *changed* field (looked
  up once per class), so a copy keeps every conversion the constructor would make
  (``replace(seq, output=[1, 2])`` stores a ``TokenLog``). The result equals ``attrs.evolve``'s.
- ``with_fields(record, changes)`` is the hot path's copy: it takes final values as they are.
  Its callers pass only values their converters would leave unchanged (tuples, token logs); a
  test runs every reference scenario and the random walk with a checking ``with_fields`` to keep
  that true.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any, Callable, TypeVar

import attrs

T = TypeVar("T")

_Check = tuple[str, Callable[[Any], Any] | None, Callable[[Any, Any, Any], Any] | None, Any]
_CHECKS: dict[type, tuple[_Check, ...] | None] = {}
_UNSEEN: Any = object()


def field_checks(cls: type) -> tuple[_Check, ...] | None:
    """(name, converter, validator, attribute) of each field of ``cls`` that converts or validates;
    ``None`` for slotted records, which ``replace`` builds anew (``slotted_plan``)."""
    if cls in _CHECKS:
        return _CHECKS[cls]
    found: tuple[_Check, ...] | None = None
    if "__slots__" not in cls.__dict__:
        found = tuple((a.name, a.converter, a.validator, a) for a in attrs.fields(cls)
                      if a.converter is not None or a.validator is not None)
    _CHECKS[cls] = found
    return found


_Plan = tuple[Callable[[Any], tuple[Any, ...]], dict[str, int]]
_PLANS: dict[type, _Plan | None] = {}


def slotted_plan(cls: type) -> _Plan | None:
    """How ``replace`` copies a slotted record of ``cls``: a getter of its fields' values in
    ``__init__``'s order and the position of each init argument (by its alias), so the copy is
    ``cls(*values)``: the call ``attrs.evolve`` makes, with its arguments by keyword, without
    evolve's walk over the fields. ``None`` (evolve it) for a class whose ``__init__`` is not attrs'
    own or leaves a field out or takes one by keyword only."""
    if cls in _PLANS:
        return _PLANS[cls]
    fields = attrs.fields(cls)
    code = getattr(cls.__dict__.get("__init__"), "__code__", None)
    plan: _Plan | None = None
    if (fields and code is not None and code.co_filename.startswith("<attrs generated")
            and all(a.init and not a.kw_only for a in fields)):
        names = tuple(a.name for a in fields)
        getter: Callable[[Any], Any] = attrgetter(*names) if len(names) > 1 else _one_field(names[0])
        plan = (getter, {a.alias: i for i, a in enumerate(fields)})
    _PLANS[cls] = plan
    return plan


def _one_field(name: str) -> Callable[[Any], tuple[Any, ...]]:
    """The getter of a record of one field: its value in a tuple (``attrgetter`` of one name gives the
    value itself)."""
    get = attrgetter(name)

    def getter(record: Any) -> tuple[Any, ...]:
        return (get(record),)

    return getter


_new = object.__new__
_set = object.__setattr__  # sets a frozen record's ``__dict__`` (a fresh dict, never shared)


def with_fields(record: T, changes: dict[str, Any]) -> T:
    """A copy of ``record`` with ``changes`` (final values) applied; ``record`` is left as it was."""
    new = _new(type(record))
    fields = record.__dict__.copy()  # a dict copy is one memcpy; filling an empty dict is slower
    fields.update(changes)
    _set(new, "__dict__", fields)
    return new


def copy_fields(record: T) -> tuple[T, dict[str, Any]]:
    """A fresh copy of ``record`` and its field dict, which the caller fills with final values
    before the copy is seen anywhere (the hot loops' form of ``with_fields``)."""
    new = _new(type(record))
    fields = record.__dict__.copy()
    _set(new, "__dict__", fields)
    return new, fields


def replace(record: T, **changes: Any) -> T:
    """A copy of ``record`` with ``changes`` converted, validated and applied."""
    cls = type(record)
    renamed = getattr(cls, "_renamed", None)  # a record whose init names differ from its fields
    if renamed is not None:
        changes = renamed(changes)
    checks = _CHECKS.get(cls, _UNSEEN)
    if checks is _UNSEEN:
        checks = field_checks(cls)
    if checks is None:  # a slotted record: built by its ``__init__``, as ``attrs.evolve`` builds it
        plan = _PLANS.get(cls, _UNSEEN)
        if plan is _UNSEEN:
            plan = slotted_plan(cls)
        if plan is None or not changes.keys() <= plan[1].keys():
            return attrs.evolve(record, **changes)  # type: ignore[misc]
        getter, index = plan
        values = list(getter(record))
        for name, value in changes.items():
            values[index[name]] = value
        return cls(*values)
    new = object.__new__(cls)
    if checks:
        for name, converter, validator, attribute in checks:
            if name in changes:
                value = changes[name]
                if converter is not None:
                    value = changes[name] = converter(value)
                if validator is not None:
                    validator(new, attribute, value)
    fields = record.__dict__.copy()
    fields.update(changes)
    _set(new, "__dict__", fields)
    return new
