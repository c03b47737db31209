"""Speculative decoding: depth choice, the n-gram proposer, accounting, and the lossless property
over the recording device for every drafting mode."""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from fxsched.core.mtp_batch import batch_depths, batch_order, chunk_by_rows, dcut_depths
from fxsched.core.ngram import propose_ngram
from fxsched.runtime.check.invariants import expected_output
from fxsched.runtime.devices.recording import DeviceConfig
from fxsched.runtime.scenarios.runner import execute_scenario
from fxsched.runtime.scenarios.loader import RequestSpec, RunOptions, Scenario

EOS = 63


# --- depth choice ------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, drafts, depths", [
    (3, 3, [4, 4, 3]),
    (2, 3, [4, 3]),
    (1, 3, [4]),
    (2, 2, [3, 3]),
    (4, 2, [3, 3, 3, 2]),
])
def test_dcut_with_unmeasured_confidences_cuts_the_last_sequences_first(n, drafts, depths):
    assert dcut_depths([()] * n, drafts) == depths


def test_dcut_keeps_depth_where_the_proposer_is_confident():
    assert dcut_depths([(), ()], 3) == [4, 3]
    assert dcut_depths([(0.0, 0.0, 0.0), (0.9, 0.9, 0.9)], 3) == [3, 4]


def test_one_draft_or_a_wide_batch_gets_no_dcut():
    assert batch_depths(2, 1) == [2, 2]
    assert batch_depths(9, 3) == [4] * 9


def test_batch_order_by_depth_below_eight_and_by_slot_from_eight():
    assert batch_order([(3, 0, 0), (4, 1, 1)]) == [(4, 1, 1), (3, 0, 0)]
    wide = [(4 if i % 2 else 3, 8 - i, i) for i in range(8)]
    assert [e[1] for e in batch_order(wide)] == sorted(e[1] for e in wide)


def test_chunks_respect_the_row_budget_and_the_sequence_cap():
    assert chunk_by_rows([4] * 40) == [(0, 32), (32, 40)]
    assert chunk_by_rows([100, 100, 50]) == [(0, 1), (1, 3)]


# --- the n-gram proposer -----------------------------------------------------------------------------


def test_ngram_proposes_after_the_earliest_match_of_the_longest_suffix():
    history = [1, 3, 4, 5, 6, 7, 8, 2, 3, 4, 5, 6, 7, 8, 2, 8, 2]
    assert propose_ngram(history) == 3
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3]) == 9


def test_ngram_proposes_nothing_for_short_or_unmatched_histories():
    assert propose_ngram([1, 2]) is None
    assert propose_ngram([1, 2, 3, 4, 5]) is None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=0, max_size=40))
def test_an_ngram_proposal_continues_an_earlier_occurrence_of_a_suffix(history):
    proposal = propose_ngram(history)
    if proposal is None:
        for n in range(2, min(16, len(history) - 1) + 1):
            suffix = history[-n:]
            assert all(history[s:s + n] != suffix for s in range(len(history) - n))
        return
    found = False
    for n in range(2, min(16, len(history) - 1) + 1):
        for s in range(len(history) - n):
            if history[s:s + n] == history[-n:] and history[s + n] == proposal:
                found = True
    assert found


# --- lossless over the recording device ------------------------------------------------------------------

MODES = {
    "mtp_k2": (dict(has_proposer=True), dict(use_speculative=True, num_drafts=1)),
    "mtp_k3": (dict(has_proposer=True), dict(use_speculative=True, num_drafts=2)),
    "mtp_k4": (dict(has_proposer=True), dict(use_speculative=True, num_drafts=3)),
    "dflash": (dict(has_proposer=True, dflash_gamma=6), dict(use_speculative=True, dflash=True, num_drafts=5)),
    "ngram": ({}, dict(ngram_speculative=True)),
    "self_spec": (dict(has_self_speculative=True), dict(self_speculative=True, num_drafts=2)),
}

VERIFY_LINE = re.compile(r"^(decode_verify_graphed(?:_k[34])?|decode_and_verify_fused|decode_verify_dflash)"
                         r"\(tokens=\[([^\]]*)\], s(\d+)@\d+:len=\d+\) -> \[([^\]]*)\]$")
BATCH_LINE = re.compile(r'^decode_verify_batched\(tokens=\[([^\]]*)\], ks=\[([^\]]*)\], seqs=\[([^\]]*)\].* -> \[([^\]]*)\]$')


def _ints(text):
    return [int(x) for x in text.split(",") if x.strip()]


def accepted_drafts_in_trace(lines) -> dict[int, int]:
    """Accepted drafts per session, counted from the device's own lines (independently of the scheduler)."""
    acc: dict[int, int] = {}
    for line in lines:
        m = VERIFY_LINE.match(line)
        if m:
            tokens, outputs = _ints(m.group(2)), _ints(m.group(4))
            groups = [(int(m.group(3)), tokens, outputs)]
        else:
            m = BATCH_LINE.match(line)
            if not m:
                continue
            tokens, ks, outputs = _ints(m.group(1)), _ints(m.group(2)), _ints(m.group(4))
            sessions = [int(s) for s in re.findall(r'"s(\d+)@', m.group(3))]
            groups, off = [], 0
            for session, k in zip(sessions, ks, strict=True):
                groups.append((session, tokens[off:off + k], outputs[off:off + k]))
                off += k
        for session, toks, outs in groups:
            na = 0
            while na < len(toks) - 1 and toks[na + 1] == outs[na]:
                na += 1
            acc[session] = acc.get(session, 0) + na
    return acc


requests_strategy = st.lists(
    st.tuples(
        st.integers(2, 20),                                   # prompt length
        st.lists(st.integers(0, 62), min_size=1, max_size=24),  # scripted tokens
        st.booleans(),                                        # ends with EOS
        st.integers(1, 30),                                   # max tokens
        st.integers(0, 6),                                    # draft_wrong_every
    ),
    min_size=1, max_size=3,
)


@pytest.mark.parametrize("mode", sorted(MODES))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=requests_strategy)
def test_lossless_speculation_never_changes_greedy_output(mode, specs):
    model, options = MODES[mode]
    requests = []
    for index, (plen, toks, eos, max_tokens, wrong) in enumerate(specs):
        tokens = tuple(toks) + ((EOS,) if eos else ())
        requests.append(RequestSpec(id=index + 1, prompt_len=plen, tokens=tokens, max_tokens=max_tokens,
                                    draft_wrong_every=wrong))
    scenario = Scenario(f"lossless_{mode}", DeviceConfig(**model), RunOptions(**options), tuple(requests))
    result = execute_scenario(scenario)
    trace_acc = accepted_drafts_in_trace(result.lines)
    for spec in requests:
        want = list(expected_output(spec.tokens, spec.max_tokens))
        frames = result.host.streams[spec.id]
        streamed = [int(t[1:]) for f in frames[:-1] for t in f.split()]
        done = frames[-1]
        assert streamed == [t for t in want if t != EOS], (mode, spec)
        assert f"n={len(want)}," in done
        acc = int(re.search(r"acc=(\d+)", done).group(1))
        if mode in ("ngram", "self_spec"):
            assert acc == 0
        else:
            assert acc == min(trace_acc.get(spec.id, 0), len(want) - 1)


def test_reported_acc_never_exceeds_the_tokens_after_the_first():
    from fxsched.core.retire import reported_acc

    assert reported_acc(15, 17) == 15
    assert reported_acc(3, 2) == 1
    assert reported_acc(0, 0) == 0


def _reference_ngram(history, max_match=16):
    """The proposal by brute force: every suffix length, every earlier start."""
    best, proposal = 0, None
    for n in range(2, min(max_match, len(history) - 1) + 1):
        for s in range(len(history) - n):
            if history[s:s + n] == history[-n:]:
                if n > best:
                    best, proposal = n, history[s + n]
                break
    return proposal if len(history) >= 3 else None


@settings(max_examples=400, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=0, max_size=60) | st.lists(st.integers(-2**40, 2**40), max_size=12))
def test_the_ngram_search_equals_the_brute_force_one(history):
    assert propose_ngram(history) == _reference_ngram(history)


def test_the_ngram_search_ignores_matches_across_token_boundaries():
    # 256 = bytes 00 01 00 00 and 1 = 01 00 00 00: a byte-level match one byte off is no token match
    assert propose_ngram([0, 256, 0, 9, 1, 0, 0, 1, 0]) == _reference_ngram([0, 256, 0, 9, 1, 0, 0, 1, 0])
