"""The batched sinks decide every row exactly as the per-row sinks do.

A plain decode without watchdogs or snapshots goes through ``decode._decoded_batch`` (one pass, one
``MarconiCheckpoints``, one ``StreamOut``) instead of ``emit.plain_token`` row by row; a batched
DFlash verify settles its common rows inline instead of through ``emit.settle_tokens``. The inline
copies are the hot path, so they are checked here against the per-row sinks on random rows: cancel
flags, EOS, budgets, the context ceiling, streaming or not, logprob records.
"""

from __future__ import annotations

import attrs

from hypothesis import given, settings, strategies as st

from fxsched.core import decode, dflash
from fxsched.core import events as ev
from fxsched.core.config import ModelInfo, SchedulerConfig
from fxsched.core.emit import plain_token, settle_tokens
from fxsched.core.phases import AwaitBatchedDflash
from fxsched.core.request import Request
from fxsched.core.rows import grow
from fxsched.core.sequence import Sequence
from fxsched.core.state import NO_DRAFTS, DraftTable, Settled, hot_row, initial_state, kept_facts
from fxsched.effects.base import expand_batched
from fxsched.effects.client import ClientOutput

EOS = 63
BLOCK = 4


@st.composite
def rows(draw, n_max: int = 6, cancels: bool = True):
    n = draw(st.integers(1, n_max))
    out = []
    for i in range(n):
        prompt_len = draw(st.integers(1, 12))
        generated = draw(st.integers(1, 12))
        seq_len = prompt_len + generated - 1
        top = draw(st.sampled_from([0, 0, 3]))
        request = Request(id=i + 1, prompt=tuple(range(1, prompt_len + 1)), max_tokens=64,
                          streaming=draw(st.booleans()), top_logprobs=top)
        out.append(Sequence(
            seq_id=10 + i, request=request, slot=i, seq_len=seq_len, blocks=seq_len // BLOCK + 1,
            output=tuple(draw(st.lists(st.integers(0, 70), min_size=generated, max_size=generated))),
            remaining=draw(st.integers(1, 6)), last_token=5, cancel_requested=cancels and draw(st.booleans()),
            finished=False, logprob_records=draw(st.sampled_from([0, 0, 2])),
            content_count=draw(st.integers(0, 30)), acc=draw(st.integers(0, 5))))
    return out


def _state(seqs, max_seq_len, drafts=None, **config):
    cfg = SchedulerConfig(eos_ids=(EOS,), max_seq_len=max_seq_len, **config)
    state = initial_state(cfg, ModelInfo(block_size=BLOCK, has_proposer=True, dflash_gamma=6))
    return attrs.evolve(state, active=tuple(seqs), drafts=drafts or NO_DRAFTS)


def _frames(effects):
    return [e for e in expand_batched(effects) if isinstance(e, ClientOutput)]


def _kept(state, seqs):
    """``state`` with the columns of a batched step over its very records, so a batched step reads
    their ``RowFacts``."""
    state = attrs.evolve(state, settled=Settled(state.rows, *zip(*map(hot_row, seqs), strict=True)))
    assert kept_facts(state) is not None
    return state


def _check_plain_decode(seqs, data, kept: bool):
    tokens = tuple(data.draw(st.lists(st.sampled_from([7, 8, EOS]), min_size=len(seqs), max_size=len(seqs))))
    sampled = st.sampled_from([0, 3]) if data.draw(st.booleans(), label="logprobs") else st.just(0)
    logprobs = tuple(data.draw(st.lists(sampled, min_size=len(seqs), max_size=len(seqs))))
    state = _state(seqs, data.draw(st.integers(3, 26), label="max_seq_len"))
    if kept:
        state = _kept(state, seqs)
    out: list = []
    after = decode._decoded_batch(state, tuple(s.seq_id for s in seqs), ev.TokensSampled(tokens, logprobs), out)
    want: list = []
    expected = [plain_token(grow(s, s.seq_len + 1, BLOCK), t, state.config, want, lp, state.model)
                for s, t, lp in zip(seqs, tokens, logprobs, strict=True)]
    assert list(after.active) == expected
    # the same checkpoints in row order, and the same frames in row order (the two kinds go to the
    # device and to the clients, so only the order within each kind is observable)
    got = expand_batched(out)
    assert [e for e in got if not isinstance(e, ClientOutput)] == [e for e in want if not isinstance(e, ClientOutput)]
    assert _frames(got) == _frames(want)


@settings(max_examples=300, deadline=None)
@given(rows(), st.data())
def test_a_batched_plain_decode_equals_the_per_row_sink(seqs, data):
    _check_plain_decode(seqs, data, kept=False)


@settings(max_examples=300, deadline=None)
@given(st.one_of(rows(n_max=8, cancels=False), rows(n_max=8)), st.data())
def test_a_batched_plain_decode_from_kept_columns_equals_the_per_row_sink(seqs, data):
    """The same from columns kept over the records: with no row cancelled and no logprob sampled,
    who checkpoints and streams comes from the ``RowFacts`` (less the rows that take EOS)."""
    _check_plain_decode(seqs, data, kept=True)


def _check_batched_verify(seqs, data, kept: bool):
    k = 6
    drafts = tuple(tuple(data.draw(st.lists(st.sampled_from([7, 8, EOS]), min_size=k - 1, max_size=k - 1)))
                   for _ in seqs)
    verify_rows: list[int] = []
    for d in drafts:  # a random accepted prefix, then a row the drafts do not continue
        accepted = data.draw(st.integers(0, k - 1))
        verify_rows.extend(d[:accepted] + (9,) + (9,) * (k - 1 - accepted))
    held = DraftTable(zip((s.seq_id for s in seqs), drafts, strict=True))
    state = _state(seqs, data.draw(st.integers(8, 32), label="max_seq_len"), held, use_speculative=True, dflash=True,
                   num_drafts=k - 1)
    if kept:
        state = _kept(state, seqs)
    waiting = AwaitBatchedDflash(tuple(s.seq_id for s in seqs), drafts, tuple(s.seq_len for s in seqs), k, k - 1)
    out: list = []
    after = dflash.batched_verified(state, waiting, ev.VerifyRows(tuple(verify_rows)), out)
    frames: list = []
    for i, s in enumerate(seqs):
        row = verify_rows[i * k:(i + 1) * k]
        na = 0
        while na < k - 1 and drafts[i][na] == row[na]:
            na += 1
        fields = {"seq_len": s.seq_len + na + 1, "blocks": max(s.blocks, (s.seq_len + k) // BLOCK + 1),
                  "acc": s.acc + na}
        want, sent = settle_tokens(s, tuple(row[:na + 1]), state.config, fields)
        got = next(a for a in after.active if a.seq_id == s.seq_id)
        assert got.__dict__ == want.__dict__
        if sent:
            k_lp = s.request.top_logprobs if s.logprob_records else 0
            frames.append((s.request.id, sent, k_lp))
    got_frames = [(f.request_id, (f.token,) if hasattr(f, "token") else f.tokens, f.logprobs) for f in _frames(out)]
    assert got_frames == frames
    assert not any(s.seq_id in after.drafts for s in seqs)  # the verify consumed every row's drafts


@settings(max_examples=300, deadline=None)
@given(rows(), st.data())
def test_a_batched_dflash_verify_settles_every_row_as_the_speculative_sink(seqs, data):
    _check_batched_verify(seqs, data, kept=False)


@settings(max_examples=300, deadline=None)
@given(st.one_of(rows(n_max=8, cancels=False), rows(n_max=8)), st.data())
def test_a_batched_dflash_verify_from_kept_columns_settles_every_row_as_the_speculative_sink(seqs, data):
    """The same from columns kept over the records: with no row cancelled, the verify reads which
    rows stream, their request ids and record sizes from the ``RowFacts``, and a row that leaves the
    common way (EOS, budget, the context ceiling) is settled by the sink; with one cancelled, every
    row's record is read."""
    _check_batched_verify(seqs, data, kept=True)
