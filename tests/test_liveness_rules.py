"""Rules of progress and counting that a random walk seldom reaches, tested on hand-built states
(specs/scheduler.md §5.4 step 2, §5.8, §5.19 steps 4–5, speculation.md §6.1 step 4, watchdog.md
§7.5): the loop never waits on its inbox or shuts down while spilled or preempted work waits, a
swap-in or resume needs a free seat, the speculative sink counts min_tokens before the EOS, and a
rollback gives back the content count of the tokens it drops."""

from __future__ import annotations

import pytest

from fxsched.core.config import SCRIPTED_EOS as EOS
from fxsched.core.emit import spec_tokens
from fxsched.core.events import FreeBlocks
from fxsched.core.lifecycle import requeue_resume, swap_in
from fxsched.core.machine import step
from fxsched.core.phases import RequeueResume, Shutdown, SwapIn, TickStart
from fxsched.core.records import replace
from fxsched.core.sequence import Sequence
from fxsched.core.state import Preempted, PrefillEntry, Swapped, initial_state
from fxsched.core.tick import idle_check, tick_start
from fxsched.core.watchdog import roll_back
from fxsched.effects import device_calls as dc
from fxsched.effects.client import TokenOut, TokensOut
from factories import make_config, make_model, make_request


def _seq(seq_id: int = 1, output: tuple[int, ...] = (10,), **kw) -> Sequence:
    request = kw.pop("request", make_request(id=seq_id, prompt_len=5, max_tokens=20))
    return Sequence(seq_id=seq_id, request=request, slot=kw.pop("slot", 0), seq_len=request.prompt_len + len(output) - 1,
                    blocks=1, output=output, remaining=request.max_tokens - len(output), last_token=output[-1], **kw)


def _waiting(kind: str, closed: bool):
    config = make_config(swap_space_gb=1.0 if kind == "swapped" else 0.0)
    state = initial_state(config, make_model(total_blocks=100))
    seq = _seq()
    work = {"swapped": (Swapped(seq),)} if kind == "swapped" else {"preempted": (Preempted(seq, (1, 3, 3, 3, 3, 10)),)}
    return replace(state, closed=closed, **work)


@pytest.mark.parametrize("kind", ["swapped", "preempted"])
def test_the_loop_does_not_wait_for_input_while_work_waits(kind):
    out: list = []
    tick_start(_waiting(kind, closed=False), TickStart(), out)
    assert not any(isinstance(e, dc.WaitForInput) for e in out), "§5.4 step 2: nothing swapped or preempted"


@pytest.mark.parametrize("kind", ["swapped", "preempted"])
def test_a_closed_loop_does_not_shut_down_while_work_waits(kind):
    after = idle_check(_waiting(kind, closed=True), None, [])
    assert Shutdown() not in after.agenda, "§5.8: the loop ends only with nothing swapped or preempted"


@pytest.mark.parametrize("kind", ["swapped", "preempted"])
def test_a_waiting_sequence_comes_back_only_into_a_free_seat(kind):
    state = _waiting(kind, closed=False)
    full = tuple(_seq(seq_id=10 + i, slot=i) for i in range(state.config.max_batch_size))
    out: list = []
    task, rule = (SwapIn(), swap_in) if kind == "swapped" else (RequeueResume(), requeue_resume)
    rule(replace(state, active=full), task, out)
    assert out == [], "§5.19 steps 4-5: only while fewer than max_batch_size sequences are active"
    out = []
    prompt = PrefillEntry(99, make_request(id=99, prompt_len=40, max_tokens=4), slot=len(full) - 1, offset=8)
    rule(replace(state, active=full[1:], prefilling=(prompt,)), task, out)
    assert out == [], "a prompt still prefilling holds its seat (§5.19 steps 4-5)"
    out = []
    rule(replace(state, active=full[1:]), task, out)
    assert out, "with a seat free it goes on"


def test_a_requeued_sequence_comes_back_only_with_a_block_to_spare():
    """§5.19 step 5: the candidate needs its tokens' blocks (len // block_size + 1), and resume
    wants one more, for the token it decodes next: with exactly its blocks free it reclaims first."""
    state = _waiting("preempted", closed=False)  # 6 tokens in 16-token blocks: 1 block, want 2
    out: list = []
    asked = requeue_resume(state, RequeueResume(), out)
    assert isinstance(out[-1], dc.NumFreeBlocks)
    _, out = step(asked, FreeBlocks(1))
    assert not any(isinstance(e, dc.AllocSequence) for e in out) and isinstance(out[-1], dc.ReclaimPrefixBlocks)
    assert out[-1].n == 1
    _, out = step(asked, FreeBlocks(2))
    assert isinstance(out[-1], dc.AllocSequence)


@pytest.mark.parametrize("before", [1, 2, 3])
def test_the_speculative_sink_keeps_an_eos_below_min_tokens(before):
    """§6.1 step 4: EOS finishes only when the output held at least min_tokens tokens before it."""
    min_tokens = before + 1
    request = make_request(prompt_len=5, max_tokens=20, min_tokens=min_tokens)
    seq = _seq(output=tuple(range(10, 10 + before)), request=request)
    out: list = []
    after = spec_tokens(seq, (EOS, 30), make_config(), out)
    assert not after.finished and after.output.tokens()[-2:] == (EOS, 30)
    streamed = [t for e in out if isinstance(e, (TokenOut, TokensOut)) for t in getattr(e, "tokens", (getattr(e, "token", None),))]
    assert streamed == [30], "the EOS stays unstreamed, the next token goes out"
    at_min = spec_tokens(_seq(output=tuple(range(10, 10 + min_tokens)), request=request), (EOS,), make_config(), [])
    assert at_min.finished


def test_a_rollback_gives_back_the_content_count_of_what_it_drops():
    """watchdog.md §7.5: the rollback rewinds output, KV, budget and content count together."""
    seq = _seq(output=(11, 12, 41, 13, 14, 15, 16), content_count=7)
    after = roll_back(seq, 2, -1, make_model(), [])
    dropped = 7 - 3
    assert after.output.tokens() == (11, 12, 41)
    assert after.content_count == seq.content_count - dropped and after.remaining == seq.remaining + dropped
