"""The drive loop's side of ``fxsched serve``'s engine thread (runtime/serve/engine.py): ``ServeHost``,
the ``Host`` that ``Interpreter.run`` takes the clients' inputs from and hands their outputs to, and
``_Watch``, the observer whose readings the metrics take. ``ServeHost``'s

* ``wait_for_input()`` (the scheduler's ``WaitForInput`` when idle) blocks on the inbox and returns
  the events of what arrived, and ``take_inputs()`` (after every batch) takes what arrived while
  the batch ran, without blocking: that is continuous batching, a new request joins at the next
  tick. Every hand-over starts with a ``Clock`` event (milliseconds since the engine started,
  ``time.monotonic``). A submitted choice becomes an ``Arrival``, a client disconnect a ``Cancel``
  (the scheduler remembers a cancel of a request that is not running yet and applies it once it
  runs, core/machine.py; the sinks finish a cancelled sequence at its next token), ``close`` an
  ``InboxClosed`` (the scheduler finishes everything it holds, then stops);
* ``send()`` gets every client output: tokens go through the request's detokenizer and stop
  matcher exactly as in ``fxsched generate`` (``GenerateHost``: a completed stop string posts a
  ``Cancel``, the EOS the scheduler never streams is added from the final frame), and each frame
  becomes one ``ChoiceEvent`` handed to the request's sink (the HTTP layer's
  ``loop.call_soon_threadsafe``). Nothing in the HTTP layer decides scheduling.

Ids. Each choice of an HTTP request is one scheduler ``Request`` with a fresh integer id from a
counter (never reused), streaming (so a disconnect can cancel it), with the choice's sampling fields
(``ignore_eos`` as ``min_tokens`` = ``max_tokens``: EOS masked throughout).

Per-choice extras (specs/serve-fields.md §13.2–4), all on the engine thread when a choice is taken:
its penalties and ``logit_bias`` become a row processor under its id (``ServeHost.processors``,
read by the device at every pick, dropped with the final frame); ``prompt_logprobs`` are computed
by the device in a scratch slot and sent as the choice's first event; a choice with
``max_tokens`` 0 (echo alone) ends there without reaching the scheduler. Stop token ids end a
choice on the host like a stop string (a ``Cancel``), reported as its ``stop_reason``. A choice
with a grammar (structured output or a forced tool call, specs/serve.md §12.1, §12.4) gets a fresh
llguidance matcher in ``grammars`` (a ``GrammarBook``, dropped with the final frame too): the
device masks its rows when a forward's logits are stored, so the row processors see the masked
rows (a masked token stays at -inf whatever its penalty or bias).
"""

from __future__ import annotations

import queue
from typing import Any, Callable, Optional, Protocol, Sequence as Seq, Union

from fxsched.core import events as ev
from fxsched.core.config import SchedulerConfig
from fxsched.core.request import Request
from fxsched.core.state import SchedulerState
from fxsched.effects import device_calls as dc
from fxsched.effects.lifecycle import ReleaseReason, ReleaseSeq
from fxsched.runtime.devices.device import DeviceError
from fxsched.runtime.devices.grammar_mask import GrammarBook
from fxsched.runtime.devices.row_processors import Penalties, RowProcessors
from fxsched.runtime.devices.torch import TorchDevice
from fxsched.runtime.generate_host import GenerateHost, RequestResult, TextOptions, TextStream
from fxsched.runtime.interpreter import Host, Observer
from fxsched.runtime.serve.choices import _CANCEL_ALL, _CLOSE, ABORT, ChoiceEvent, _Cancel, _Choice, _Submit
from fxsched.runtime.text import TextTokenizer

DEFERRED_POLL_S = 0.05  # how often an idle engine looks again for a slot for choices waiting on one


_ALLOCS = (dc.AllocSequence, dc.AllocSequenceFor)
_PREEMPTIONS = frozenset((ReleaseReason.PREEMPT_REQUEUE, ReleaseReason.SPILL_OUT_SEQUENCE))


class _Watch(Observer):
    """Keeps the last scheduler state the loop performed (the metrics read it on ticks), and reads
    two things off each batch of effects for the metrics (specs/serve.md §12.8): a request's first
    sequence allocation (it is scheduled: its queue time ends) and a sequence released for memory
    (a preemption, requeued or spilled)."""

    def __init__(self, scheduled: Callable[[int], None] = lambda rid: None,
                 preempted: Callable[[], None] = lambda: None) -> None:
        self.state: Optional[SchedulerState] = None
        self._scheduled = scheduled
        self._preempted = preempted

    def stepped(self, event: ev.Event, state: SchedulerState, effects: Seq) -> None:
        self.state = state
        for effect in effects:
            kind = type(effect)
            if kind in _ALLOCS:
                if effect.session:  # a swap-in names session 0: not a first schedule
                    self._scheduled(effect.session)
            elif kind is ReleaseSeq and effect.reason in _PREEMPTIONS:
                self._preempted()


class _Owner(Protocol):
    """What ``ServeHost`` uses of its owner, the ``ServeEngine`` (runtime/serve/engine.py), stated here
    so that this module need not import the engine's."""

    @property
    def config(self) -> SchedulerConfig: ...

    @property
    def tokenizer(self) -> TextTokenizer: ...

    @property
    def grammars(self) -> GrammarBook: ...

    @property
    def counts_accepted(self) -> bool: ...

    @property
    def _inbox(self) -> queue.SimpleQueue[Any]: ...

    @property
    def _device(self) -> Optional[TorchDevice]: ...

    def grammar_matcher(self, grammar: str) -> Any: ...

    def now_ms(self) -> float: ...

    def _idle(self) -> None: ...

    def _retry_adapter_ops(self) -> None: ...

    def _adapter_ops(self, items: list[Any]) -> list[Any]: ...

    def _place(self, name: str) -> Union[int, str, None]: ...

    def _drain_inbox(self) -> list[Any]: ...

    def _frame(self, choice: _Choice, n: int) -> None: ...

    def _cached_tokens(self, rid: int) -> int: ...

    def _finished(self, choice: _Choice, event: ChoiceEvent, completion_tokens: int) -> None: ...


class ServeHost(GenerateHost):
    """The clients of the server: choices come and go while the loop runs (see the module docstring)."""

    def __init__(self, owner: _Owner):
        super().__init__((), owner.config.eos_ids, on_text=self._piece)
        self.owner = owner
        self.choices: dict[int, _Choice] = {}
        self._pieces: list[str] = []
        self.deferred: list[_Choice] = []  # handed over, waiting for their adapter's pool slot
        self.closing = False  # the inbox closed while choices waited for a slot
        self.processors = RowProcessors()  # the device reads it at every pick
        self.stop_tokens: dict[int, int] = {}  # choice id -> the stop token id that ended it

    def _piece(self, request_id: int, piece: str) -> None:
        self._pieces.append(piece)

    # --- inputs --------------------------------------------------------------------------------

    def take_inputs(self) -> list[ev.Event]:
        # a stop string's cancel for a choice that ended in the same batch is dropped (it would be remembered)
        events = [e for e in Host.take_inputs(self) if not (isinstance(e, ev.Cancel) and e.request_id not in self.results)]
        events.extend(self._hand_over(block=False))
        return events

    def wait_for_input(self) -> list[ev.Event]:
        self.owner._idle()
        while True:
            events = self._hand_over(block=True)
            if events:
                return events

    def _hand_over(self, block: bool) -> list[ev.Event]:
        inbox = self.owner._inbox
        self.owner._retry_adapter_ops()
        if not block and not self.deferred and not self.closing and inbox.empty():
            return []  # the common case after a batch: nothing arrived
        events: list[Optional[ev.Event]] = []
        memo: dict[tuple[tuple[int, ...], int], tuple[Optional[dict[str, Any]], ...]] = {}
        if self.deferred:  # choices waiting for an adapter slot, in order (runtime/serve/lora.py)
            waiting, self.deferred = self.deferred, []
            events.extend(self._placed(c, memo) for c in waiting)
        items: list[Any] = []
        if block and not events:
            try:  # while choices wait for a slot, look again now and then (a finished request frees one)
                items.append(inbox.get(timeout=DEFERRED_POLL_S) if self.deferred else inbox.get())
            except queue.Empty:
                pass
        while True:
            try:
                items.append(inbox.get_nowait())
            except queue.Empty:
                break
        items = self.owner._adapter_ops(items)
        for item in items:
            if isinstance(item, _Submit):
                events.extend(self._placed(c, memo) for c in item.choices)
            elif isinstance(item, _Cancel):
                events.extend(self._cancel(rid) for rid in item.ids if self._cancellable(rid))
            elif item == _CANCEL_ALL:
                events.extend(self._cancel(rid) for rid in [*self.choices, *(c.id for c in self.deferred)]
                              if self._cancellable(rid))
            elif item == _CLOSE:
                self.closing = True
        if self.closing and not self.deferred:  # the inbox closes once no choice waits for a slot
            self.closing = False
            events.append(ev.InboxClosed())
        arrived = [e for e in events if e is not None]
        return [ev.Clock(self.owner.now_ms()), *arrived] if arrived else []

    def _placed(self, choice: _Choice, memo: dict[tuple[tuple[int, ...], int], tuple[Optional[dict[str, Any]], ...]]
                ) -> Optional[ev.Event]:
        """The ``Arrival`` of a handed-over choice once its adapter holds a pool slot (None: it ended,
        or it waits in ``deferred`` for a slot)."""
        name = choice.spec.adapter
        if name is not None:
            if choice.cancelled:  # cancelled while it waited: never scheduled
                self._refuse(choice, None)
                return None
            placed = self.owner._place(name)
            if placed is None:
                self.deferred.append(choice)
                return None
            if isinstance(placed, str):
                self._refuse(choice, placed)
                return None
            choice.adapter_slot = placed
        return self._register(choice, memo)

    def _register(self, choice: _Choice,
                  memo: Optional[dict[tuple[tuple[int, ...], int], tuple[Optional[dict[str, Any]], ...]]] = None
                  ) -> Optional[ev.Event]:
        """The ``Arrival`` of a submitted choice (None when it ends here); ``memo`` shares prompt
        logprobs among the choices of one request (n choices of a prompt: one forward)."""
        s = choice.spec
        try:
            request = Request(id=choice.id, prompt=s.prompt, max_tokens=max(s.max_tokens, 1), streaming=True,
                              temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p, seed=s.seed,
                              top_logprobs=s.top_logprobs, min_tokens=s.scheduler_min_tokens,
                              adapter_slot=choice.adapter_slot)
            matcher = self.owner.grammar_matcher(s.grammar) if s.grammar is not None else None
        except ValueError as err:  # the protocol checks every field first; this is a last guard
            self._refuse(choice, str(err))
            return None
        self.choices[choice.id] = choice
        self.results[choice.id] = RequestResult(choice.id, list(s.prompt))
        if s.prompt_logprobs is not None:
            key = (s.prompt, s.prompt_logprobs)
            try:
                records = memo[key] if memo is not None and key in memo else self._prompt_records(*key)
            except DeviceError as err:
                self._refuse(choice, f"prompt logprobs: {err}")
                return None
            if memo is not None:
                memo[key] = records
            choice.deliver(ChoiceEvent(choice.index, "", (), prompt_logprobs=records))
        if s.max_tokens == 0:  # echo alone: nothing to generate
            self.results[choice.id].reason = "length"
            self._final(choice, self.results[choice.id], "")
            return None
        if matcher is not None:  # structured output: the device masks this request's rows
            self.owner.grammars.add(choice.id, len(s.prompt), matcher)
        self.streams[choice.id] = TextStream(TextOptions(self.owner.tokenizer, s.stop, s.skip_special_tokens))
        if s.processed:
            self.processors.set(choice.id, len(s.prompt), [Penalties(s.presence_penalty, s.frequency_penalty,
                                                                     s.repetition_penalty, s.logit_bias)])
        return ev.Arrival(request)

    def _refuse(self, choice: _Choice, message: Optional[str]) -> None:
        """End a choice the scheduler never took: with ``message`` as its error (None: aborted)."""
        self.choices[choice.id] = choice
        self.results[choice.id] = RequestResult(choice.id, list(choice.spec.prompt), error=message)
        self._final(choice, self.results[choice.id], "")

    def _prompt_records(self, prompt: Seq[int], width: int) -> tuple[Optional[dict[str, Any]], ...]:
        """vLLM's prompt logprobs: None for the first token, then each token's record and rank."""
        device = self.owner._device
        if device is None:
            raise DeviceError("the engine has no device")
        records, ranks = device.prompt_logprobs(prompt, width)
        return (None,) + tuple({"token_id": r.token, "logprob": r.logprob, "rank": rank,
                                "top_logprobs": [{"token_id": t, "logprob": lp} for t, lp in r.top]}
                               for r, rank in zip(records, ranks, strict=True))

    def _take(self, result: RequestResult, tokens: Seq[int]) -> None:
        """``GenerateHost._take``, with the choice's stop token ids (the token ends the choice: kept
        in its ids, its text shown only with ``include_stop_str_in_output``) and a stop string kept
        in the text with ``include_stop_str_in_output``."""
        choice = self.choices.get(result.id)
        spec = choice.spec if choice is not None else None
        stop_ids = spec.stop_token_ids if spec is not None else ()
        cut = next((i for i, t in enumerate(tokens) if t in stop_ids), None) if result.stop is None else None
        had_stop = result.stop is not None
        super()._take(result, tokens if cut is None else tokens[:cut])
        if spec is not None and spec.include_stop and not had_stop and result.stop:
            self._pieces.append(result.stop)
            self.streams[result.id].parts.append(result.stop)
        if cut is None or result.stop is not None:
            if cut is not None:
                result.received += len(tokens) - cut
            return
        token = tokens[cut]
        result.received += len(tokens) - cut
        result.tokens.append(token)
        if self.logprobs is not None:
            result.logprobs = (result.logprobs or []) + [self.logprobs.take(result.id, token)]
        stream = self.streams.get(result.id)
        if stream is not None and spec is not None and spec.include_stop:
            piece, _ = stream.push(token)
            if piece:
                self._pieces.append(piece)
        result.stop = ""
        self.stop_tokens[result.id] = token
        self.inputs.append(ev.Cancel(result.id))

    def _cancellable(self, rid: int) -> bool:
        choice = self.choices.get(rid) or next((c for c in self.deferred if c.id == rid), None)
        return choice is not None and not choice.cancelled

    def _cancel(self, rid: int) -> Optional[ev.Event]:
        choice = self.choices.get(rid)
        if choice is None:  # waiting for an adapter slot: it ends at the next look
            for waiting in self.deferred:
                if waiting.id == rid:
                    waiting.cancelled = True
            return None
        choice.cancelled = True
        return ev.Cancel(rid)

    # --- outputs -------------------------------------------------------------------------------

    def send(self, output) -> None:
        rid = getattr(output, "request_id", None)
        result = self.results.get(rid) if rid is not None else None
        choice = self.choices.get(rid) if rid is not None else None
        if result is None or choice is None:
            return
        before = len(result.tokens)
        super().send(output)
        text = "".join(self._pieces)
        self._pieces.clear()
        tokens = tuple(result.tokens[before:])
        if rid in self.finished:
            self._final(choice, result, text, before)
            return
        if not tokens and not text:
            return
        self.owner._frame(choice, len(tokens))
        choice.deliver(ChoiceEvent(choice.index, text, tokens, self._records(choice, result, before)))

    def _records(self, choice: _Choice, result: RequestResult, before: int
                 ) -> Optional[tuple[Optional[dict[str, Any]], ...]]:
        if not choice.spec.top_logprobs:
            return None
        records = result.logprobs or []
        got = tuple(records[before:])
        return got + (None,) * (len(result.tokens) - before - len(got))

    def _final(self, choice: _Choice, result: RequestResult, text: str, before: Optional[int] = None) -> None:
        before = len(result.tokens) if before is None else before
        tokens = tuple(result.tokens[before:])
        reason = "error" if result.error is not None else (result.finish_reason or "stop")
        if choice.cancelled and reason not in ("length", "error") and result.stop is None:
            reason = ABORT
        self.owner._frame(choice, len(tokens))
        cached = self.owner._cached_tokens(choice.id)
        stop_reason: Union[str, int, None] = self.stop_tokens.get(choice.id, result.stop or None)
        self._forget(choice.id)
        event = ChoiceEvent(choice.index, text, tokens, self._records(choice, result, before), reason, result.error,
                            len(result.tokens), cached, stop_reason=stop_reason,
                            accepted_tokens=result.acc if self.owner.counts_accepted else None)
        self.owner._finished(choice, event, len(result.tokens))
        choice.deliver(event)

    def _forget(self, rid: int) -> None:
        self.owner.grammars.drop(rid)
        self.results.pop(rid, None)
        self.streams.pop(rid, None)
        self.choices.pop(rid, None)
        self.finished.discard(rid)
        self.processors.drop(rid)
        self.stop_tokens.pop(rid, None)
        if self.logprobs is not None:
            self.logprobs.pending.pop(rid, None)

    def fail_pending(self, message: str) -> None:
        """The engine gave up: every choice still in the inbox or waiting for a slot ends with ``message``."""
        waiting, self.deferred = self.deferred, []
        for choice in waiting:
            self._refuse(choice, message)
        for item in self.owner._drain_inbox():
            if isinstance(item, _Submit):
                for choice in item.choices:
                    result = RequestResult(choice.id, list(choice.spec.prompt), error=message)
                    self.choices[choice.id] = choice
                    self.results[choice.id] = result
                    self._final(choice, result, "")

    def fail_all(self, message: str) -> None:
        """Every choice the scheduler took ends with ``message`` (the drive loop failed)."""
        for rid in list(self.choices):
            result = self.results.get(rid)
            if result is None:
                continue
            result.error = message
            self._final(self.choices[rid], result, "")
        self._pieces.clear()
        self.inputs.clear()
