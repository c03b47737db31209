"""The value records behave as their types promise: a ``TokenLog`` is a sequence of tokens for
every operation a caller can use, ``replace`` keeps conversions and validation, and the hot path's
``with_fields`` is only ever given final values."""

from __future__ import annotations

import sys

import attrs
import pytest
from hypothesis import given, strategies as st

from fxsched.core import records
from fxsched.core.records import replace, with_fields
from fxsched.core.request import Request
from fxsched.core.sequence import Sequence
from fxsched.core.token_log import TokenLog
from fxsched.runtime.check.walk import walk
from fxsched.runtime.scenarios.loader import load_scenario, scenario_names
from fxsched.runtime.scenarios.runner import run_scenario

tokens = st.lists(st.integers(0, 70), max_size=12)
chunks = st.lists(tokens, max_size=5)


def build(parts: list[list[int]]) -> TokenLog:
    log = TokenLog()
    for part in parts:
        log = log.extend(tuple(part))
    return log


@given(chunks, st.integers(-15, 15), st.integers(-15, 15), st.integers(0, 70), tokens)
def test_a_token_log_behaves_like_the_tuple_of_its_tokens(parts, i, j, token, other):
    log, plain = build(parts), tuple(t for part in parts for t in part)
    assert len(log) == len(plain) and bool(log) == bool(plain)
    assert list(log) == list(plain) and list(reversed(log)) == list(reversed(plain))
    assert log == plain and plain == log and hash(log) == hash(plain) and not (log != plain)
    assert (token in log) == (token in plain) and log.count(token) == plain.count(token)
    assert log[i:j] == plain[i:j] and log[::2] == plain[::2]
    if -len(plain) <= i < len(plain):
        assert log[i] == plain[i]
    else:
        with pytest.raises(IndexError):
            log[i]
    if token in plain:
        assert log.index(token) == plain.index(token)
    else:
        with pytest.raises(ValueError):
            log.index(token)
    assert log + tuple(other) == plain + tuple(other) and tuple(other) + log == tuple(other) + plain
    assert log * 2 == plain * 2
    assert (log < tuple(other)) == (plain < tuple(other)) and (log >= tuple(other)) == (plain >= tuple(other))
    assert log.last == (plain[-1] if plain else None) and log.tokens() == plain
    assert log.append(token) == plain + (token,) and log == plain  # the old version is unchanged


def test_a_token_past_int32_after_small_ones_goes_in_once():
    log = TokenLog((1,))
    longer = log.extend((2, 2**40, 3))
    assert longer.tokens() == (1, 2, 2**40, 3) and log.tokens() == (1,)
    assert longer.extend((4,)) == (1, 2, 2**40, 3, 4)


def test_the_reported_leaks_are_gone():
    assert 5 in TokenLog((5,))
    assert TokenLog((1, 2)) + (3,) == (1, 2, 3)


def _sequence() -> Sequence:
    return Sequence(seq_id=1, request=Request(1, (1, 2), 4), slot=0, seq_len=2, blocks=1, output=(3,),
                    remaining=3, last_token=3)


def test_replace_converts_like_the_constructor():
    seq = replace(_sequence(), output=[3, 4], remaining=2)
    assert isinstance(seq.output, TokenLog) and seq.output == (3, 4) and seq.remaining == 2
    assert hash(seq) == hash(attrs.evolve(_sequence(), output=(3, 4), remaining=2))
    assert seq == attrs.evolve(_sequence(), output=(3, 4), remaining=2)


def test_replace_validates_slotted_records():
    with pytest.raises(ValueError, match="prompt is empty"):
        replace(Request(1, (1,), 4), prompt=())


@pytest.fixture
def checking_with_fields(monkeypatch):
    """Every core module's ``with_fields`` replaced by one that fails on a value its converter
    would change."""
    original = records.with_fields
    bad = []

    def checked(record, changes):
        if attrs.has(type(record)):
            names = {a.name for a in attrs.fields(type(record))}
            bad.extend((type(record).__name__, name, "not a field") for name in changes if name not in names)
        checks = records.field_checks(type(record)) or ()
        for name, converter, _, _ in checks:
            if name in changes and converter is not None:
                value = changes[name]
                converted = converter(value)
                if converted is not value and type(converted) is not type(value):
                    bad.append((type(record).__name__, name, type(value).__name__))
        return original(record, changes)

    for name, module in list(sys.modules.items()):
        if name.startswith("fxsched.core") and getattr(module, "with_fields", None) is original:
            monkeypatch.setattr(module, "with_fields", checked)
    return bad


def test_with_fields_gets_only_final_values(checking_with_fields):
    for name in scenario_names():
        run_scenario(load_scenario(name))
    report = walk(3, steps=4000)
    assert report.violation is None
    assert checking_with_fields == []


def test_the_with_fields_check_can_fail(checking_with_fields):
    import fxsched.core.emit as emit

    emit.with_fields(_sequence(), {"output": [1, 2]})
    assert checking_with_fields == [("Sequence", "output", "list")]


def test_with_fields_copies_without_touching_the_original():
    seq = _sequence()
    new = with_fields(seq, {"remaining": 1})
    assert new.remaining == 1 and seq.remaining == 3
