"""N-gram drafting with the pending last token in its history (specs/speculation.md §6.14).

A step-level test feeds hand-made answers and checks which draft the scheduler verifies with and
without ``ngram_history_without_pending_token``; a torch test runs the real model on a prompt
whose greedy continuation cycles, and checks drafts get accepted and every token equals the
engine's own greedy generation.
"""

from __future__ import annotations

import attrs
import pytest

from fxsched.core import events as ev
from fxsched.core.ngram import propose_ngram
from fxsched.effects import device_calls as dc

from factories import Driver, Script, make_config, make_request

PROMPT = (1, 5, 6, 7, 5, 6)


class CycleScript(Script):
    """The first token is 7, the decode after it answers 5: the output continues the 5 6 7 cycle."""

    def __init__(self) -> None:
        super().__init__()
        self.argmax = [7, 5]

    def __call__(self, effect, driver):
        if isinstance(effect, dc.ArgmaxOnDevice):
            return ev.TokenSampled(self.argmax.pop(0))
        return super().__call__(effect, driver)


def first_verify(**options) -> Driver:
    request = attrs.evolve(make_request(1, max_tokens=8), prompt=PROMPT)
    d = Driver(config=make_config(ngram_speculative=True, **options), requests=[request], script=CycleScript())
    return d.run_to_query(dc.DecodeVerifyGraphed)


def test_the_proposal_continues_after_the_pending_token():
    d = first_verify()
    (seq,) = d.state.active
    kv = PROMPT + (7,)  # the first token was fed by the decode; 5 is pending
    assert seq.last_token == 5 and seq.output.tokens() == (7, 5)
    assert propose_ngram(kv + (5,)) == 6
    assert d.query.tokens == (5, 6)  # [L, draft]: the draft guesses the token after L


def test_the_option_leaves_the_pending_token_out_and_the_draft_repeats_it():
    d = first_verify(ngram_history_without_pending_token=True)
    assert propose_ngram(PROMPT + (7,)) == 5
    assert d.query.tokens == (5, 5)


def test_an_accepted_draft_streams_the_draft_and_the_bonus_row():
    d = first_verify()
    d.feed(ev.VerifyRows((6, 7)))
    (seq,) = d.state.active
    assert seq.output.tokens() == (7, 5, 6, 7)
    assert seq.seq_len == len(PROMPT) + 3  # 7, 5 and the accepted 6 are in the KV; 7 is pending
    assert d.state.drafts[seq.seq_id] == (propose_ngram(seq.kv_tokens() + (seq.last_token,)),) == (5,)


# --- the real model ------------------------------------------------------------------------------


CYCLING_PROMPT = [3] * 10  # the default model's greedy continuation falls into a 5-token cycle
MAX_TOKENS = 60


def run_ngram(without_pending: bool):
    torch = pytest.importorskip("torch")
    from fxsched.core.state import initial_state
    from fxsched.core.request import Request
    from fxsched.runtime.devices.torch import TorchDevice
    from fxsched.runtime.generate import GenerateHost, scheduler_setup
    from fxsched.runtime.interpreter import Interpreter
    from fxsched.runtime.torch_model import HybridEngine, default_config

    engine = HybridEngine(default_config())
    config, model, _ = scheduler_setup(engine.cfg, "ngram", 1)
    config = attrs.evolve(config, ngram_history_without_pending_token=without_pending)
    requests = [Request(id=1, prompt=tuple(CYCLING_PROMPT), max_tokens=MAX_TOKENS)]
    device = TorchDevice(engine, strict=True)
    host = GenerateHost(requests, engine.cfg.eos_id)
    try:
        with torch.no_grad():
            Interpreter(device, host, config.eos_ids).run(initial_state(config, model),
                                                          [ev.Arrival(requests[0]), ev.Boot()])
    finally:
        device.release_all()
        device.close()
    return host.results[1].tokens, device.stats


@pytest.fixture(scope="module")
def greedy_reference() -> list[int]:
    pytest.importorskip("torch")
    from fxsched.runtime.torch_model import HybridEngine, default_config

    return HybridEngine(default_config()).greedy_generate(CYCLING_PROMPT, MAX_TOKENS)


@pytest.mark.usefixtures("one_torch_thread")
def test_torch_ngram_accepts_drafts_and_stays_lossless(greedy_reference):
    tokens, stats = run_ngram(without_pending=False)
    assert tokens == greedy_reference
    assert stats.verifies > 0 and stats.accepted_drafts > 0
    old_tokens, old_stats = run_ngram(without_pending=True)
    assert old_tokens == greedy_reference
    # leaving the pending token out drafts the token already known: far fewer accepts
    assert stats.accepted_drafts > 4 * max(old_stats.accepted_drafts, 1)
