"""A cancel ends a request in plain (non-speculative) decode at its next token (specs/scheduler.md
§5.17 step 1): the token is dropped, the final frame is ``Done(stop, n=<tokens streamed>)``, the
slot is released and the other rows go on. Checked at the level of ``step`` (plain and mixed
steps) and through ``generate`` on the torch model, where a stop string posts the ``Cancel``.

The step-level expectations are written out by hand from the script of tests/factories.py (first
token ``10 * request id``, each decode adds one); the generate test's reference is the same run
without a stop string.
"""

from __future__ import annotations

import pytest

from fxsched.core import events as ev
from fxsched.effects import device_calls as dc
from fxsched.effects import lifecycle as lc
from fxsched.effects import plans
from fxsched.effects.client import DoneOut, ResponseOut

from factories import Driver, make_config, make_request, of_type




def decode_once(d: Driver) -> tuple:
    """Answer the outstanding plain decode (every row: its last token + 1) and run to the next."""
    assert isinstance(d.query, plans.Decode)
    effects = d.answer()
    d.run_to_query(plans.Decode)
    return effects


# --- step level ---------------------------------------------------------------------------------


def test_a_cancel_during_plain_decode_ends_the_request_at_its_next_token():
    d = Driver(requests=[make_request(1, max_tokens=20), make_request(2, max_tokens=6)]).run_to_query(plans.Decode)
    decode_once(d)  # both rows stream one decoded token: 11 and 21
    assert isinstance(d.query, plans.Decode) and d.query.tokens == (11, 21)
    seq1 = next(s for s in d.state.active if s.request_id == 1)
    d.feed(ev.Cancel(1))  # the client goes away while the decode is on the device
    effects = d.feed(ev.TokensSampled((12, 22)))
    # request 1: the token of that decode is dropped; its final frame counts what it got
    assert d.streamed(1) == [10, 11]
    assert of_type(effects, DoneOut) == [DoneOut(1, "stop", 2, 0, 0, 0, None)]
    assert [e.seq for e in of_type(effects, lc.MarconiCheckpoint)] == [d.state.active[0].seq_id]
    release = of_type(effects, lc.ReleaseSeq)
    assert [(r.seq, r.slot, r.cache) for r in release] == [(seq1.seq_id, seq1.slot, True)]
    # request 2 streamed its token in the same step and runs on to its budget
    assert [s.request_id for s in d.state.active] == [2]
    d.finish()
    assert d.streamed(2) == [20, 21, 22, 23, 24, 25]
    assert d.outputs(DoneOut)[-1] == DoneOut(2, "length", 6, 0, 0, 0, None)


def test_a_cancel_between_steps_acts_at_the_next_plain_token_and_never_streams_again():
    d = Driver(requests=[make_request(1, max_tokens=20)]).run_to_query(plans.Decode)
    for _ in range(3):
        decode_once(d)
    assert d.streamed(1) == [10, 11, 12, 13]
    d.feed(ev.Cancel(1))
    d.finish()
    assert d.streamed(1) == [10, 11, 12, 13]
    assert d.outputs(DoneOut) == [DoneOut(1, "stop", 4, 0, 0, 0, None)]
    assert sum(isinstance(e, plans.Decode) for e in d.history) == 4  # 16 more without the cancel


def test_a_cancel_takes_the_plain_rows_of_a_mixed_step_too():
    """Request 2's prompt prefills in chunks while request 1 decodes: the mixed step's decode row
    goes through the plain sink, which sees the cancel."""
    config = make_config(max_prefill_tokens=4, max_batch_tokens=4)
    d = Driver(config=config, requests=[make_request(1, max_tokens=20)]).run_to_query(plans.Decode)
    d.feed(ev.Arrival(make_request(2, prompt_len=12, max_tokens=3)))
    d.run_to_query(dc.MixedForward)
    before = len(d.streamed(1))
    d.feed(ev.Cancel(1))
    d.run_to_query(dc.ArgmaxBatch)
    effects = d.answer()
    assert of_type(effects, DoneOut) == [DoneOut(1, "stop", before, 0, 0, 0, None)]
    d.finish()
    assert d.streamed(1) == list(range(10, 10 + before))
    assert d.streamed(2) == [20, 21, 22]


def test_a_cancel_for_a_blocking_request_is_not_taken():
    """Blocking clients carry no cancel flag (specs/scheduler.md §5.12): the request runs to its budget."""
    d = Driver(requests=[make_request(1, max_tokens=4, streaming=False)]).run_to_query(plans.Decode)
    d.feed(ev.Cancel(1))
    d.finish()
    [response] = [o for o in d.outputs() if getattr(o, "tokens", None) is not None]
    assert tuple(response.tokens) == (10, 11, 12, 13) and response.reason == "length"


def prompts_sent(d: Driver) -> set[int]:
    """The requests whose prompt reached the device, by the first prompt token (the request id)."""
    firsts: set[int] = set()
    for e in d.history:
        slices = list(getattr(e, "prefills", ()))
        if getattr(e, "prefill", None) is not None:
            slices.append(e.prefill)
        for piece in [getattr(e, "tokens", None) if isinstance(e, dc.Prefill) else None,
                      getattr(e, "prompt", None)] + [sl.prompt for sl in slices]:
            if piece:
                firsts.add(piece[0])
    return firsts


def test_a_cancel_while_the_request_waits_ends_it_at_the_next_tick_without_a_seat():
    """One seat, taken by request 1: request 2 waits; its client goes away. At the next tick start
    its stream gets ``Done(stop, n=0)`` and it is never admitted or prefilled (specs/scheduler.md
    §5.4 step 1); request 1 is not disturbed and the loop ends when it does."""
    config = make_config(max_batch_size=1)
    d = Driver(config=config, requests=[make_request(1, max_tokens=6)]).run_to_query(plans.Decode)
    d.feed(ev.Arrival(make_request(2, max_tokens=6)))
    decode_once(d)
    assert [r.id for r in d.state.pending] == [2]
    d.feed(ev.Cancel(2))
    assert d.outputs(DoneOut) == []  # an input event only records itself
    decode_once(d)
    assert d.outputs(DoneOut) == [DoneOut(2, "stop", 0, 0, 0, 0, None)]
    assert d.state.pending == () and d.state.cancels == frozenset()
    d.finish()
    assert d.streamed(2) == [] and prompts_sent(d) == {1}
    assert d.streamed(1) == [10, 11, 12, 13, 14, 15]
    assert d.outputs(DoneOut) == [DoneOut(2, "stop", 0, 0, 0, 0, None), DoneOut(1, "length", 6, 0, 0, 0, None)]


def test_a_cancel_for_a_waiting_blocking_request_answers_it_empty_without_a_seat():
    config = make_config(max_batch_size=1)
    d = Driver(config=config, requests=[make_request(1, max_tokens=3)]).run_to_query(plans.Decode)
    d.feed(ev.Arrival(make_request(2, max_tokens=3, streaming=False)))
    d.feed(ev.Cancel(2))
    d.finish()
    assert d.outputs(ResponseOut) == [ResponseOut(2, (), "stop")]
    assert prompts_sent(d) == {1} and d.streamed(1) == [10, 11, 12]


def test_a_waiting_request_admission_would_refuse_gets_its_error_even_when_cancelled():
    """A prompt as long as the context waits behind a full batch and is cancelled before admission:
    the refusal is the request's own, so its client gets the same ``Error`` it would have had at
    admission, not ``Done(stop)`` (specs/scheduler.md §5.4 step 1, §5.5 step 2)."""
    from fxsched.effects.client import ErrorOut
    config = make_config(max_batch_size=1, max_seq_len=32)
    d = Driver(config=config, requests=[make_request(1, max_tokens=4)]).run_to_query(plans.Decode)
    d.feed(ev.Arrival(make_request(2, prompt_len=32, max_tokens=4)))
    decode_once(d)
    d.feed(ev.Cancel(2))
    d.finish()
    assert [e.request_id for e in d.outputs(ErrorOut)] == [2] and not [o for o in d.outputs(DoneOut) if o.request_id == 2]
    assert "context holds 32" in d.outputs(ErrorOut)[0].message and prompts_sent(d) == {1}


# --- through generate on the torch model ------------------------------------------------------------


@pytest.mark.usefixtures("one_torch_thread")
def test_a_stop_string_stops_a_plain_run_early_on_the_torch_model(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("tokenizers")
    from support.tiny_tokenizer import write_tiny_tokenizer

    from fxsched.runtime.generate import TextOptions, generate
    from fxsched.runtime.text import load_tokenizer
    from fxsched.runtime.torch_model import HybridEngine, default_config

    cfg = default_config()
    tok = load_tokenizer(write_tiny_tokenizer(tmp_path, vocab_size=cfg.vocab_size).path)
    assert tok is not None
    prompt, budget = [1, 2, 3], 40
    full = generate(HybridEngine(cfg), [prompt], budget, spec="none", eos_ids=(), text=TextOptions(tok))
    [whole] = full.results
    assert len(whole.tokens) == budget and full.summary.target_forwards == budget  # 1 prefill + 39 decodes
    text = whole.text or ""
    start = next(i for i in range(5, len(text) - 2) if text.find(text[i:i + 2]) == i and text[i:i + 2].strip()
                 and "\ufffd" not in text[i:i + 2])
    stop = text[start:start + 2]

    run = generate(HybridEngine(cfg), [prompt], budget, spec="none", eos_ids=(), text=TextOptions(tok, stop=(stop,)))
    [r] = run.results
    assert r.finish_reason == "stop" and r.stop == stop and r.text == text[:start]
    assert r.tokens == whole.tokens[:len(r.tokens)] and len(r.tokens) < budget
    # the scheduler stopped at the token after the one that completed the stop string: one more
    # decode ran (its token dropped by the plain sink), none after it, nothing reached the host
    assert run.summary.target_forwards == len(r.tokens) + 1 < budget
    assert run.summary.discarded_tokens == 0 and r.received == len(r.tokens)
