"""The event log format and its codec (specs/event-log.md §9.1–9.3): records turned into log values
and back, the effect digests, and the header.

In short: JSON lines, one record per line, append-only. The first line is a header object (format
name, version, the ``SchedulerConfig`` and ``ModelInfo`` fields that ``initial_state`` needs, and
free ``meta``); every later line is a JSON array whose first element says what it is:

* ``["!", tag, ClassName, [field, ...]]`` defines a short tag the first time a class is written;
* ``[tag, field, ...]`` is one event fed to ``step``, its fields positional, trailing defaults left out;
* ``["=", effect, ...]`` is what that ``step`` returned: a client output (or rotation
  acknowledgement) in full as ``{tag: [fields]}``, any other effect as ``"tag.hash"``, a 32-bit
  BLAKE2b digest of the effect's canonical form (just ``"tag"`` for a class without fields);
* ``[".", events]`` ends a log that was closed.

Why JSON lines rather than a binary framing: a line is one ``write``, a crash leaves a readable
prefix that ends at the last newline, the file greps and diffs, and Python's ``json`` reads a line
faster than a hand-written decoder would. Compact where it counts: the per-step records are arrays
with one-letter tags and positional fields (a plain decode step at batch 1 is four short lines,
about 90 bytes), the class and field names are written once in the definitions, and device
effects are digests (their arguments follow from the events already in the log).

The codec is generic: any attrs record whose fields hold ``None``, booleans, numbers, strings,
enums, tuples and frozensets of those, or nested attrs records (an ``Arrival``'s ``Request``) is
written by walking its fields, and read back guided by the fields' type hints, so a new event class
needs no codec change. Reading checks every value against its field's type.

Invariant: the effect digests depend only on the effects (class names and field values), never on
the tags of the file, so a replay compares each effects record byte for byte (client outputs in
full, the other effects by digest).
"""

from __future__ import annotations

import enum
import hashlib
import importlib
import json
import sys
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence as Seq

import attrs

from fxsched.core import events as ev
from fxsched.core.config import ModelInfo, SchedulerConfig
from fxsched.effects.base import Effect
from fxsched.effects import client as client_effects
from fxsched.effects.client import ClientOutput, RotationAck

FORMAT = "fxsched-eventlog"
VERSION = 1
MAGIC = b'{"format":"fxsched-eventlog"'  # how every event log begins (the header's first key)
DEFINE, EFFECTS, END = "!", "=", "."
DIGEST_BYTES = 4
_SEPARATORS = (",", ":")
_RECORD_MODULES = ("fxsched.core.events", "fxsched.core.request", "fxsched.effects.client",
                   "fxsched.effects.device_calls", "fxsched.effects.lifecycle", "fxsched.effects.plans")


# the JSON scalars a field hint accepts: (test of the raw value, how an error names it); a bool is
# never taken for a number
_SCALARS: dict[Any, tuple[Callable[[Any], bool], str]] = {
    type(None): (lambda raw: raw is None, "null"),
    bool: (lambda raw: isinstance(raw, bool), "a boolean"),
    int: (lambda raw: isinstance(raw, int) and not isinstance(raw, bool), "an integer"),
    float: (lambda raw: isinstance(raw, (int, float)) and not isinstance(raw, bool), "a number"),
    str: (lambda raw: isinstance(raw, str), "a string"),
}


class EventLogError(ValueError):
    """An event log that cannot be written or read; the message names the file and the problem."""


# --- the codec ---------------------------------------------------------------------------------


# What the interpreter hands to the host: client outputs, rotation acknowledgements, and the
# batched ``StreamOut`` record (one per forward, split into per-request frames on delivery).
_CLIENT_TYPES: tuple[type, ...] = tuple(
    t for t in (ClientOutput, RotationAck, getattr(client_effects, "StreamOut", None)) if isinstance(t, type))


def _is_client(value: object) -> bool:
    return isinstance(value, _CLIENT_TYPES)


def client_frames(effects: Seq[Any]) -> list[Any]:
    """The frames a client receives from ``effects``, in order (a batched record split)."""
    frames: list[Any] = []
    for effect in effects:
        if _is_client(effect):
            split = getattr(effect, "split", None)
            frames.extend(split() if callable(split) else (effect,))
    return frames


def _init_fields(cls: type) -> tuple[attrs.Attribute, ...]:
    return tuple(f for f in attrs.fields(cls) if f.init)


def canonical(value: Any) -> Any:
    """The tag-free JSON form of a value, for digests: a record is ``[ClassName, field, ...]`` with
    every field, a tuple a list, a frozenset a sorted list, an enum its value."""
    if attrs.has(type(value)):
        return [type(value).__name__, *(canonical(getattr(value, f.name)) for f in _init_fields(type(value)))]
    if isinstance(value, enum.Enum):
        return canonical(value.value)
    if isinstance(value, (tuple, list)):
        return [canonical(v) for v in value]
    if isinstance(value, (frozenset, set)):
        return sorted((canonical(v) for v in value), key=repr)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def digest(effect: Any) -> str:
    """The hex digest of an effect's canonical form (``DIGEST_BYTES`` bytes)."""
    text = json.dumps(canonical(effect), separators=_SEPARATORS, ensure_ascii=False)
    return hashlib.blake2b(text.encode("utf-8"), digest_size=DIGEST_BYTES).hexdigest()


def _tag_name(n: int) -> str:
    """The n-th short tag: a..z, A..Z, then two characters, and so on."""
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    out = letters[n % len(letters)]
    n //= len(letters)
    while n:
        n -= 1
        out = letters[n % len(letters)] + out
        n //= len(letters)
    return out


class Encoder:
    """Turns records into log values, assigning a tag to each class on first use. ``pending``
    holds the definition records the caller must write before the record that used them."""

    def __init__(self) -> None:
        self.tags: dict[type, str] = {}
        self.pending: list[list[Any]] = []

    def tag(self, cls: type) -> str:
        tag = self.tags.get(cls)
        if tag is None:
            tag = self.tags[cls] = _tag_name(len(self.tags))
            self.pending.append([DEFINE, tag, cls.__name__, [f.name for f in _init_fields(cls)]])
        return tag

    def fields(self, record: Any) -> list[Any]:
        """A record's fields, positional, with the trailing ones equal to their defaults left out."""
        fields = _init_fields(type(record))
        values = [getattr(record, f.name) for f in fields]
        end = len(values)
        while end and _is_default(fields[end - 1], values[end - 1]):
            end -= 1
        return [self.value(v) for v in values[:end]]

    def record(self, record: Any) -> list[Any]:
        """A top-level record: ``[tag, field, ...]``."""
        return [self.tag(type(record)), *self.fields(record)]

    def value(self, value: Any) -> Any:
        if attrs.has(type(value)):
            return {self.tag(type(value)): self.fields(value)}
        if isinstance(value, enum.Enum):
            return self.value(value.value)
        if isinstance(value, (tuple, list)):
            return [self.value(v) for v in value]
        if isinstance(value, frozenset):
            return sorted((self.value(v) for v in value), key=repr)
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise EventLogError(f"cannot record a value of type {type(value).__name__} ({value!r:.60})")

    def effects(self, effects: Seq[Any]) -> list[Any]:
        """The effects record of one step: client outputs in full, the rest as ``tag.digest``."""
        out: list[Any] = [EFFECTS]
        for effect in effects:
            if _is_client(effect):
                out.append(self.value(effect))
            elif _init_fields(type(effect)):
                out.append(f"{self.tag(type(effect))}.{digest(effect)}")
            else:  # a record without fields: its class says everything
                out.append(self.tag(type(effect)))
        return out


def _is_default(f: attrs.Attribute, value: Any) -> bool:
    default = f.default
    if default is attrs.NOTHING or isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        return False
    return type(value) is type(default) and value == default


def _dumps(record: Any) -> str:
    return json.dumps(record, separators=_SEPARATORS, ensure_ascii=False)


def record_classes() -> dict[str, type]:
    """Every record class a log may name, by class name: the attrs classes of the event, request
    and effect modules, and any subclass of ``Event`` or ``Effect`` defined elsewhere."""
    found: dict[str, type] = {}
    for name in _RECORD_MODULES:
        module = importlib.import_module(name)
        for value in vars(module).values():
            if isinstance(value, type) and attrs.has(value):
                found.setdefault(value.__name__, value)
    stack: list[type] = [ev.Event, Effect]
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        home = sys.modules.get(cls.__module__)
        if attrs.has(cls) and getattr(home, cls.__qualname__, None) is cls:  # not a class attrs replaced
            found.setdefault(cls.__name__, cls)
    return found


class _Bad(Exception):
    """A value that does not fit its field (turned into an ``EventLogError`` with the line)."""


def _show(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass
class _Definition:
    cls: type
    names: tuple[str, ...]  # the fields as the file lists them


class Decoder:
    """Reads log values back into records, checking each against its field's type hint."""

    def __init__(self, classes: Optional[dict[str, type]] = None):
        self.classes = classes if classes is not None else record_classes()
        self.defs: dict[str, _Definition] = {}
        self._hints: dict[type, dict[str, Any]] = {}

    def define(self, record: list[Any]) -> None:
        if len(record) != 4 or not all(isinstance(x, str) for x in record[1:3]) or not isinstance(record[3], list) \
                or not all(isinstance(x, str) for x in record[3]):
            raise _Bad(f"a definition is [\"!\", tag, class name, [field names]], got {_show(record)}")
        _, tag, name, names = record
        if tag in (DEFINE, EFFECTS, END) or tag in self.defs:
            raise _Bad(f"tag {tag!r} is defined twice" if tag in self.defs else f"tag {tag!r} is reserved")
        cls = self.classes.get(name)
        if cls is None:
            raise _Bad(f"unknown record class {name!r} (not an event, request or effect of this fxsched)")
        known = {f.name for f in _init_fields(cls)}
        extra = [n for n in names if n not in known]
        if extra:
            raise _Bad(f"{name} has no field {extra[0]!r} in this fxsched (the log was written by another version)")
        self.defs[tag] = _Definition(cls, tuple(names))

    def definition(self, tag: Any) -> _Definition:
        if not isinstance(tag, str) or tag not in self.defs:
            raise _Bad(f"unknown tag {_show(tag)}")
        return self.defs[tag]

    def hints(self, cls: type) -> dict[str, Any]:
        hints = self._hints.get(cls)
        if hints is None:
            try:
                hints = typing.get_type_hints(cls)
            except Exception:  # noqa: BLE001 - an annotation that does not resolve: its values go unchecked
                hints = {}
            self._hints[cls] = hints
        return hints

    def build(self, tag: Any, values: Any) -> Any:
        """The record of ``tag`` from its positional field values."""
        d = self.definition(tag)
        name = d.cls.__name__
        if not isinstance(values, list):
            raise _Bad(f"{name}: expected a list of fields, got {_show(values)}")
        if len(values) > len(d.names):
            raise _Bad(f"{name}: {len(values)} fields, the log defines {len(d.names)}")
        hints = self.hints(d.cls)
        kwargs = {}
        for field_name, raw in zip(d.names, values, strict=False):  # trailing defaults are left out
            try:
                kwargs[field_name] = self.value(raw, hints.get(field_name, Any))
            except _Bad as err:
                raise _Bad(f"{name}.{field_name}: {err}") from None
        try:
            return d.cls(**kwargs)
        except (TypeError, ValueError) as err:
            raise _Bad(f"{name}: {' '.join(str(err).split())}") from None

    def value(self, raw: Any, hint: Any) -> Any:
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if hint is Any or hint is object:
            return self._untyped(raw)
        if origin is typing.Union or origin is types.UnionType:
            for arm in args:
                try:
                    return self.value(raw, arm)
                except _Bad:
                    continue
            raise _Bad(f"expected {_words(hint)}, got {_show(raw)}")
        scalar = _SCALARS.get(hint)
        if scalar is not None:
            fits, words = scalar
            if fits(raw):
                return raw
            raise _Bad(f"expected {words}, got {_show(raw)}")
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            try:
                return hint(raw)
            except ValueError:
                raise _Bad(f"expected one of {[m.value for m in hint]}, got {_show(raw)}") from None
        if origin in (tuple, frozenset, list) or hint in (tuple, frozenset, list):
            if not isinstance(raw, list):
                raise _Bad(f"expected a list, got {_show(raw)}")
            if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
                if len(raw) != len(args):
                    raise _Bad(f"expected a list of {len(args)}, got {_show(raw)}")
                return tuple(self.value(r, a) for r, a in zip(raw, args, strict=True))
            item = args[0] if args else Any
            items = [self.value(r, item) for r in raw]
            return frozenset(items) if (origin or hint) is frozenset else tuple(items)
        if isinstance(hint, type) and attrs.has(hint):
            record = self._instance(raw)
            if not isinstance(record, hint):
                raise _Bad(f"expected a {hint.__name__}, got a {type(record).__name__}")
            return record
        return self._untyped(raw)

    def _instance(self, raw: Any) -> Any:
        if not (isinstance(raw, dict) and len(raw) == 1):
            raise _Bad(f"expected a record {{tag: [fields]}}, got {_show(raw)}")
        ((tag, values),) = raw.items()
        return self.build(tag, values)

    def _untyped(self, raw: Any) -> Any:
        if isinstance(raw, dict):
            return self._instance(raw)
        if isinstance(raw, list):
            return tuple(self._untyped(r) for r in raw)
        return raw


def _words(hint: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", type(None): "null"}
    args = typing.get_args(hint)
    if args:
        return " or ".join(names.get(a, getattr(a, "__name__", str(a))) for a in args)
    return names.get(hint, getattr(hint, "__name__", str(hint)))


# --- the header --------------------------------------------------------------------------------


def _settings(record: Any) -> dict[str, Any]:
    return {f.name: canonical(getattr(record, f.name)) for f in _init_fields(type(record))}


def header(config: SchedulerConfig, model: ModelInfo, meta: Optional[dict] = None) -> dict[str, Any]:
    """The first record of a log (see the module docstring)."""
    return {"format": FORMAT, "version": VERSION, "config": _settings(config), "model": _settings(model),
            "meta": dict(meta or {})}


def _settings_from(cls: type, raw: Any, decoder: Decoder, what: str) -> Any:
    if not isinstance(raw, dict):
        raise _Bad(f"header field {what!r} expects an object, got {_show(raw)}")
    fields = {f.name for f in _init_fields(cls)}
    unknown = sorted(set(raw) - fields)
    if unknown:
        raise _Bad(f"header {what} has field {unknown[0]!r}, which {cls.__name__} of this fxsched does not know")
    hints = decoder.hints(cls)
    kwargs = {}
    for name, value in raw.items():
        try:
            kwargs[name] = decoder.value(value, hints.get(name, Any))
        except _Bad as err:
            raise _Bad(f"header {what}.{name}: {err}") from None
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        raise _Bad(f"header {what}: {' '.join(str(err).split())}") from None

