"""The EP protocol without processes: wire format, parser, mirror, and every scenario through an
in-process loopback group (traces, per-tick mirrors, the recording device's own sequences)."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from fxsched.effects.ep_words import PREFILL_CMD, RELEASE_CMD, SHUTDOWN_CMD
from fxsched.runtime.ep.leader import EpLeaderDevice
from fxsched.runtime.ep.link import LoopbackLink
from fxsched.runtime.ep.mirror import EpMirror, MirrorError
from fxsched.runtime.ep.protocol import (
    HEADER_LEN,
    Accept,
    CommandParser,
    Decode,
    Forward,
    Kind,
    Message,
    Move,
    Prefill,
    ProtocolError,
    Release,
    Restore,
    Rows,
    SetLength,
    Shutdown,
    Verify,
    decode_header,
    encode,
    pack_rows,
    unpack_rows,
)
from fxsched.runtime.ep.run import EpRunError, _run_wrapped, execute_scenario_loopback
from fxsched.runtime.ep.worker import EpWorker
from fxsched.runtime.scenarios.runner import run_scenario
from fxsched.runtime.scenarios.loader import load_scenario, scenario_names

ALL = scenario_names()


# --- wire format ---------------------------------------------------------------------------------


@given(st.sampled_from(list(Kind)), st.integers(0, 2**32), st.integers(0, 2**32),
       st.lists(st.integers(0, 2**40), max_size=40), st.integers(1, 10**6))
def test_a_message_survives_the_wire(kind, a, b, payload, number):
    message = Message(kind, a, b, payload, number)
    header, tail = encode(message)
    assert len(header) == HEADER_LEN
    got, n = decode_header(header)
    assert n == (len(tail) if tail is not None else 0)
    if tail is not None:
        got = Message(got.kind, got.a, got.b, tail, got.number)
    assert got == message


@given(st.lists(st.tuples(st.integers(0, 15), st.integers(0, 500), st.lists(st.integers(0, 63), max_size=9)),
                min_size=1, max_size=6))
def test_row_groups_survive_packing(groups):
    rows = [Rows(*g) for g in groups]
    assert list(unpack_rows(tuple(pack_rows(rows)))) == rows


def test_a_header_of_unknown_kind_is_a_protocol_error():
    with pytest.raises(ProtocolError, match="unknown kind 99"):
        decode_header([99, 1] + [0] * (HEADER_LEN - 2))


# --- parser ---------------------------------------------------------------------------------------


def _feed(messages):
    parser = CommandParser()
    return [c for c in (parser.feed(m) for m in messages) if c is not None]


def _preamble(slot, chunk, start, prompt):
    return [Message(Kind.CMD_FOR_SEQ, slot, PREFILL_CMD), Message(Kind.CMD, 0, chunk), Message(Kind.CMD, 0, start),
            Message(Kind.CMD, 0, len(prompt)), Message(Kind.TOKENS, 0, 0, prompt), Message(Kind.VISION, len(prompt))]


def test_words_make_commands():
    prompt = (1, 2, 3, 4, 5)
    messages = _preamble(0, 5, 0, prompt) + [
        Message(Kind.CMD_FOR_SEQ, 0, 10),
        Message(Kind.CMD_FOR_SEQ, 0, 0xFFFFFFF3), Message(Kind.CMD, 0, 11), Message(Kind.CMD, 0, 12),
        Message(Kind.CMD, 0, 13),
        Message(Kind.PENDING_ROWS, 0, 0, pack_rows([Rows(1, 4, (7,))])),  # may come between verify and accept
        Message(Kind.CMD, 0, 1),
        Message(Kind.CMD_FOR_SEQ, 0, RELEASE_CMD),
        Message(Kind.CMD_FOR_SEQ, 0, SHUTDOWN_CMD),
    ]
    assert _feed(messages) == [Prefill(0, 0, 5, prompt), Decode(0, 10), Verify(0, (11, 12, 13)),
                               Forward((Rows(1, 4, (7,)),), False), Accept(0, 1), Release(0), Shutdown()]


@pytest.mark.parametrize("messages, needle", [
    ([Message(Kind.CMD, 0, 5)], "outside any command"),
    ([Message(Kind.CMD_FOR_SEQ, 0, 0xFFFFFFF7)], "reserved word 0xfffffff7"),
    ([Message(Kind.TOKENS, 0, 0, (1, 2))], "tokens outside a prefill"),
    ([Message(Kind.CMD_FOR_SEQ, 0, 0xFFFFFFF2), Message(Kind.CMD_FOR_SEQ, 1, 7)], "is incomplete"),
    (_preamble(0, 5, 0, (1, 2, 3, 4, 5))[:4] + [Message(Kind.TOKENS, 0, 0, (1, 2))], "announced 5 tokens, got 2"),
])
def test_words_that_do_not_fit_are_protocol_errors(messages, needle):
    with pytest.raises(ProtocolError, match=needle):
        _feed(messages)


def test_the_shutdown_word_ends_even_a_command_cut_short():
    messages = _preamble(0, 5, 0, (1, 2, 3, 4, 5))[:3] + [Message(Kind.CMD_FOR_SEQ, 0, SHUTDOWN_CMD)]
    assert _feed(messages) == [Shutdown()]


def test_an_accept_count_belongs_only_to_the_verify_just_announced():
    messages = [Message(Kind.CMD_FOR_SEQ, 0, 0xFFFFFFF2), Message(Kind.CMD, 0, 4), Message(Kind.CMD, 0, 5),
                Message(Kind.CMD_FOR_SEQ, 0, RELEASE_CMD),  # the verify's sequence failed: no accept
                Message(Kind.CMD, 0, 1)]
    with pytest.raises(ProtocolError, match="outside any command"):
        _feed(messages)


# --- mirror ---------------------------------------------------------------------------------------


def test_the_mirror_follows_prefill_decode_verify_accept_and_release():
    m = EpMirror()
    m.apply(Prefill(2, 0, 3, (1, 2, 3, 4)))
    m.apply(Prefill(2, 3, 1, (1, 2, 3, 4)))
    m.apply(Decode(2, 9))
    m.apply(Verify(2, (10, 11, 12, 13)))
    assert m.tokens(2) == [1, 2, 3, 4, 9, 10, 11, 12, 13]
    m.apply(Accept(2, 1))  # keeps na + 1 = 2 of the 4 rows
    assert m.snapshot() == ((2, (1, 2, 3, 4, 9, 10, 11)),)
    m.apply(Move(2, 0))
    m.apply(SetLength(0, 5))
    assert m.snapshot() == ((0, (1, 2, 3, 4, 9)),)
    m.apply(Release(0))
    m.apply(Restore(1, (5, 6)))
    assert m.snapshot() == ((1, (5, 6)),)


@pytest.mark.parametrize("command, needle", [
    (Forward((Rows(0, 9, (1,)),), True), "rows from position 9 but it holds 3"),
    (SetLength(0, 4), "would grow it"),
    (Accept(0, 1), "without an announced verify"),
])
def test_the_mirror_refuses_what_cannot_happen(command, needle):
    m = EpMirror()
    m.apply(Prefill(0, 0, 3, (1, 2, 3)))
    with pytest.raises(MirrorError, match=needle):
        m.apply(command)


# --- every scenario through the loopback group -------------------------------------------------------


class _Truth:
    """Wraps a recording device: at every tick, its live sequences as (slot, tokens)."""

    def __init__(self, device):
        self.ticks = []
        live: set = set()
        alloc, alloc_for, free, on_tick = (device.alloc_sequence, device.alloc_sequence_for, device.free_sequence,
                                           device.on_tick)

        def take(seq, slot):
            live.add(seq)
            return slot

        device.alloc_sequence = lambda seq, session: take(seq, alloc(seq, session))
        device.alloc_sequence_for = lambda seq, session, budget: take(seq, alloc_for(seq, session, budget))
        device.free_sequence = lambda seq: (live.discard(seq), free(seq))[1]

        def tick(n):
            seqs = [s for s in device.sequences.values() if s.seq_id in live and s.tokens]
            self.ticks.append((n, tuple(sorted((s.slot, tuple(s.tokens)) for s in seqs))))
            on_tick(n)

        device.on_tick = tick


@pytest.mark.parametrize("name", ALL)
def test_every_scenario_keeps_its_trace_and_every_mirror_agrees_at_every_tick(name):
    link = LoopbackLink(lambda lk: [EpWorker(r, lk.poster(r)) for r in (1, 2)])
    truths = []

    def leader(device):
        truths.append(_Truth(device))
        return EpLeaderDevice(device, link, 5.0)

    result = _run_wrapped(load_scenario(name), leader)
    assert result.trace == run_scenario(load_scenario(name))
    assert result.leader_ticks == truths[0].ticks  # the stream describes the device's sequences
    for worker in link.workers:
        assert worker.error is None and worker.stopped
        assert worker.ticks == result.leader_ticks


def test_the_words_alone_would_lose_the_batched_decodes():
    """Why kinds 5-9 exist: plain_decode decodes in batches that no word announces."""
    words_only, parser, at_ticks = EpMirror(), CommandParser(), []

    class WordsOnly(LoopbackLink):
        def send(self, message):
            if message.kind == Kind.TICK:
                at_ticks.append(words_only.snapshot())
            if message.kind in (Kind.CMD_FOR_SEQ, Kind.CMD, Kind.TOKENS, Kind.VISION):
                command = parser.feed(message)
                if command is not None:
                    words_only.apply(command)

    link = WordsOnly(lambda lk: [])
    leaders = []
    _run_wrapped(load_scenario("plain_decode"), lambda d: leaders.append(EpLeaderDevice(d, link, 5.0)) or leaders[0])
    tick, full = leaders[0].tick_snapshots[2]
    assert tick == 3
    assert [len(t) for _, t in full] == [7, 7, 9, 8]  # the prompts and two batched decodes
    assert [len(t) for _, t in at_ticks[2]] == [5, 5, 7, 6]  # the words saw the prompts only


class _DivergingWorker(EpWorker):
    """Drops every batched decode: its mirror falls behind the leader's."""

    def handle(self, message):
        if message.kind == Kind.ROWS:
            self.messages += 1
            return True
        return super().handle(message)


def test_a_worker_whose_mirror_diverges_fails_the_requests_with_its_reason():
    link = LoopbackLink(lambda lk: [_DivergingWorker(1, lk.poster(1))])
    with pytest.raises(EpRunError, match="EP worker 1 failed: mirror differs from the leader's at tick 2") as info:
        _run_wrapped(load_scenario("plain_decode"), lambda d: EpLeaderDevice(d, link, 5.0))
    assert "out s1: T10 T11 Error(EP worker 1 failed: mirror differs" in info.value.trace  # the decode in flight


def test_loopback_helper_runs_a_scenario():
    result, workers = execute_scenario_loopback("verify_k3", workers=1)
    assert result.trace == run_scenario(load_scenario("verify_k3"))
    assert workers[0].ticks == result.leader_ticks
