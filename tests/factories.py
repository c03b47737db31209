"""Factories and a driver for unit tests of ``step``: build a state, feed events, assert effects.

``Driver`` answers queries with a small scripted model so a test can run the engine to the
phase it wants and then feed a hand-built answer.
"""

from __future__ import annotations

from typing import Callable, Optional

from fxsched.core import events as ev
from fxsched.core.config import ModelInfo, SchedulerConfig
from fxsched.core.machine import step
from fxsched.core.request import Request
from fxsched.core.state import SchedulerState, initial_state
from fxsched.effects import device_calls as dc
from fxsched.effects import lifecycle as lc
from fxsched.effects import plans
from fxsched.effects.base import Effect, expand_batched


def make_config(**kw) -> SchedulerConfig:
    return SchedulerConfig(**kw)


def make_model(**kw) -> ModelInfo:
    return ModelInfo(**kw)


def make_request(id: int = 1, prompt_len: int = 5, max_tokens: int = 8, **kw) -> Request:
    return Request(id=id, prompt=(id,) + tuple(3 for _ in range(prompt_len - 1)), max_tokens=max_tokens, **kw)


def dflash_config(**kw) -> SchedulerConfig:
    return make_config(use_speculative=True, dflash=True, num_drafts=5, **kw)


def dflash_model(**kw) -> ModelInfo:
    return make_model(has_proposer=True, dflash_gamma=6, **kw)


class Script:
    """Default answers: slots count up, first tokens are ``10 * request id``, decodes add one,
    drafts are the next tokens, verifies accept everything."""

    def __init__(self):
        self.next_slot = 0

    def __call__(self, effect, driver: "Driver"):
        match effect:
            case dc.CreateStream():
                return ev.StreamCreated(1)
            case dc.CreateEvent():
                return ev.EventCreated(2)
            case dc.WaitForInput():
                return ev.InputReady()
            case dc.NumFreeBlocks():
                return ev.FreeBlocks(100)
            case dc.AdapterIdFor(slots=slots):
                return ev.AdapterIds((0,) * len(slots))
            case dc.AllocSequence() | dc.AllocSequenceFor():
                self.next_slot += 1
                return ev.SlotAllocated(self.next_slot - 1)
            case dc.ArgmaxOnDevice():
                seq = driver.last_prefilled
                return ev.TokenSampled(10 * seq if seq else 7)
            case (dc.Prefill() | dc.PrefillChunk() | dc.MixedForward() | dc.MixedForwardBatch()
                  | dc.PrefillBatchChunk() | dc.DecodeCall() | dc.DecodeDraft()):
                return ev.ForwardDone()
            case dc.ArgmaxBatch(n=n):
                return ev.TokensSampled((7,) * n)
            case dc.CopyLogitsToHost(picks=picks):
                return ev.TokensSampled((7,) * len(picks), tuple(p.top_logprobs for p in picks))
            case plans.Decode(tokens=tokens):
                return ev.TokensSampled(tuple(t + 1 for t in tokens))
            case dc.SlotDraftCapacity(slots=slots):
                return ev.DraftCapacity((8,) * len(slots))
            case dc.CanBatchVerify():
                return ev.BatchVerifyAllowed(True)
            case dc.ProposeMulti(token=t, n=n):
                return ev.Drafts(tuple(t + 1 + j for j in range(n)))
            case dc.ProposeBatched(tokens=tokens, n=n):
                return ev.BatchedDrafts(tuple(tuple(t + 1 + j for j in range(n)) for t in tokens))
            case dc.SerialVerify(tokens=tokens):
                return ev.VerifyRows(tuple(tokens[1:]) + (tokens[-1] + 1,))
            case dc.DecodeVerifyBatched(tokens=tokens, ks=ks):
                rows: list[int] = []
                off = 0
                for k in ks:
                    mine = tokens[off:off + k]
                    rows.extend(mine[1:] + (mine[-1] + 1,))
                    off += k
                return ev.VerifyRows(tuple(rows))
            case lc.LoraRotate():
                return ev.LoraApplied()
            case dc.GenerateBeamBatch(prompts=prompts):
                return ev.BeamHypotheses(tuple((10, 63) for _ in prompts))
        raise AssertionError(f"the test script has no answer for {effect!r}")


class Driver:
    """Holds a state; feeds events; answers queries with ``script`` unless a test intervenes."""

    def __init__(self, config: Optional[SchedulerConfig] = None, model: Optional[ModelInfo] = None,
                 requests=(), script: Optional[Callable] = None, boot: bool = True):
        self.state: SchedulerState = initial_state(config or make_config(), model or make_model())
        self.script = script or Script()
        self.effects: tuple = ()
        self.history: list = []
        self.last_prefilled: Optional[int] = None
        self._query: Optional[Effect] = None
        for r in requests:
            self.feed(ev.Arrival(r))
        if boot:
            self.feed(ev.Boot())

    def feed(self, event) -> tuple:
        self.state, self.effects = step(self.state, event)
        self.history.extend(self.effects)
        if self.effects:
            self._query = self.effects[-1]
        for e in self.effects:
            if isinstance(e, dc.Prefill):
                self.last_prefilled = e.tokens[0]
            elif isinstance(e, dc.PrefillChunk):
                self.last_prefilled = e.prompt[0]
        return self.effects

    @property
    def query(self):
        """The outstanding query (the last effect of the last batch that had effects)."""
        return self._query

    def answer(self):
        """Answer the outstanding query with the script."""
        return self.feed(self.script(self.query, self))

    def run_until(self, predicate: Callable[["Driver"], bool], limit: int = 500) -> "Driver":
        """Answer queries until ``predicate(self)`` holds (checked before each answer)."""
        for _ in range(limit):
            if predicate(self):
                return self
            if self.state.stopped:
                raise AssertionError("the loop stopped before the predicate held")
            self.answer()
        raise AssertionError("predicate never held")

    def run_to_query(self, query_type: type, limit: int = 500) -> "Driver":
        return self.run_until(lambda d: isinstance(d.query, query_type), limit)

    def finish(self, limit: int = 5000) -> "Driver":
        """Answer until every request has its final frame, then close the inbox and shut down."""
        for _ in range(limit):
            if self.state.stopped:
                return self
            if isinstance(self.query, dc.WaitForInput):
                self.feed(ev.InboxClosed())
            self.answer()
        raise AssertionError("the run did not finish")

    def streamed(self, request_id: int) -> list[int]:
        """The tokens streamed to ``request_id`` so far, in order."""
        from fxsched.effects.client import TokenOut, TokensOut

        tokens: list[int] = []
        for out in self.outputs():
            if out.request_id != request_id:
                continue
            if isinstance(out, TokenOut):
                tokens.append(out.token)
            elif isinstance(out, TokensOut):
                tokens.extend(out.tokens)
        return tokens

    def outputs(self, kind: type = object) -> list:
        from fxsched.effects.client import ClientOutput

        return [e for e in expand_batched(self.history) if isinstance(e, ClientOutput) and isinstance(e, kind)]


def of_type(effects, kind: type) -> list:
    return [e for e in expand_batched(effects) if isinstance(e, kind)]
