"""The engine thread of ``fxsched serve``: one drive loop (``Interpreter.run``) that owns the
scheduler state, fed by the HTTP layer through a thread-safe inbox.

Threads. The HTTP layer (the asyncio loop) only calls ``submit``, ``cancel``, ``close`` and
``abort_all``; each puts one item on the inbox (``queue.SimpleQueue``) and returns. The engine
thread is the only one that touches the scheduler state, the ``TorchDevice`` and the engine; it
runs ``Interpreter.run`` with a ``ServeHost``, whose

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

Backpressure. ``submit`` refuses (``Overloaded``) when the choices accepted but not yet started
(no token or final frame yet) plus the new ones would exceed ``max_waiting``, and (``Draining``)
once ``close`` was called.

Faults. A ``DeviceError`` answering a query is the scheduler's to handle (its fault scope fails the
requests concerned: an ``ErrorOut``, a 500 for them). Any exception out of ``Interpreter.run``
(``RunError``, a ``PhaseError``, an engine bug) fails every choice the scheduler had taken (a final
``ChoiceEvent`` with ``error``), frees every engine slot, and the loop starts again on a fresh
``TorchDevice`` and a fresh ``initial_state``; choices still in the inbox are untouched. After
``MAX_BARREN_FAULTS`` faults in a row with no choice served in between (a fault at every start),
the engine stops instead: the inbox's choices fail, ``alive`` turns false (the HTTP layer then
answers 503). With
``record``, each scheduler life writes its own event log (``FILE``, then ``FILE.1``... after a
restart: a log replays from ``initial_state``).

Invariant: every submitted choice gets exactly one final ``ChoiceEvent`` (finish reason or error),
unless the process dies; after it, the scheduler holds nothing of that choice.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence as Seq, Union

import attrs
import structlog
import torch

from fxsched.core import events as ev
from fxsched.core.request import Request
from fxsched.core.state import SchedulerState, initial_state
from fxsched.effects import device_calls as dc
from fxsched.effects.lifecycle import ReleaseReason, ReleaseSeq
from fxsched.runtime.devices.device import Device, DeviceError
from fxsched.runtime.devices.grammar_mask import GrammarBook
from fxsched.runtime.devices.row_processors import Penalties, RowProcessors
from fxsched.runtime.devices.torch import Drafter, TorchDevice
from fxsched.runtime.generate import SPECS, scheduler_setup, served_config
from fxsched.runtime.generate_host import (GenerateHost, LogprobWitness, Observers, RequestResult, TextOptions,
                                           TextStream)
from fxsched.runtime.interpreter import Host, Interpreter, Observer
from fxsched.runtime.logs import ensure_configured
from fxsched.runtime.serve.lora import AdapterBook, AdapterOp, AdapterRefused, ServedAdapter
from fxsched.runtime.serve.metrics import ServeMetrics
from fxsched.runtime.serve.protocol import ChoiceSpec
from fxsched.runtime.text import TextTokenizer
from fxsched.runtime.torch_model import HybridEngine

log = structlog.get_logger("fxsched.serve.engine")

ABORT = "abort"  # the finish reason of a choice cancelled by its client or by the drain timeout
MAX_BARREN_FAULTS = 5  # faults in a row, with no choice finished in between, before the engine gives up
RESTART_BACKOFF = 0.05  # seconds before the second restart in a row (doubling, at most 2 s)
RECENT = 4096  # final records kept for inspection (``ServeEngine.recent``)
ADAPTER_OP_TIMEOUT = 60.0  # seconds a LoRA load or unload may wait for the engine thread
DEFERRED_POLL_S = 0.05  # how often an idle engine looks again for a slot for choices waiting on one


class Overloaded(Exception):
    """The waiting queue is full (HTTP 429)."""


class Draining(Exception):
    """The server is shutting down and takes no new requests (HTTP 503)."""


@dataclass(frozen=True)
class ChoiceEvent:
    """What one client frame of a choice brought: its new text (safe to show), the token ids and
    (with logprobs) their records; a final event has ``finish_reason`` ("stop", "length", "abort",
    "error"), ``error`` for a failed choice, and the choice's totals."""

    index: int
    text: str
    tokens: tuple[int, ...]
    logprobs: Optional[tuple[Optional[dict[str, Any]], ...]] = None
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    prompt_logprobs: Optional[tuple[Optional[dict[str, Any]], ...]] = None  # the first event, when asked
    stop_reason: Union[str, int, None] = None  # the stop string or stop token id that ended the choice
    accepted_tokens: Optional[int] = None  # final event, with speculation: drafted tokens the target accepted

    @property
    def final(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _Choice:
    """A submitted choice, as the engine thread tracks it."""

    id: int
    index: int
    spec: ChoiceSpec
    sink: Callable[[ChoiceEvent], None]
    submitted: float
    scheduled: Optional[float] = None  # when the scheduler first allocated its sequence
    first_token: Optional[float] = None
    last_frame: Optional[float] = None
    started: bool = False
    cancelled: bool = False
    adapter_slot: int = -1  # the LoRA pool slot of the adapter its request names (-1: the base model)

    def deliver(self, event: ChoiceEvent) -> None:
        try:
            self.sink(event)
        except RuntimeError:  # the HTTP loop is closed (the server is going away): nobody listens
            pass


@dataclass(frozen=True)
class FinalRecord:
    """A finished choice, kept in ``ServeEngine.recent`` (tests and debugging)."""

    request_id: int
    finish_reason: str
    completion_tokens: int
    cancelled: bool
    error: Optional[str] = None
    accepted_tokens: Optional[int] = None  # with speculation: drafted tokens the target accepted


@dataclass(frozen=True)
class _Submit:
    choices: tuple[_Choice, ...]


@dataclass(frozen=True)
class _Cancel:
    ids: tuple[int, ...]


_CLOSE = "close"
_CANCEL_ALL = "cancel-all"


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


class ServeHost(GenerateHost):
    """The clients of the server: choices come and go while the loop runs (see the module docstring)."""

    def __init__(self, owner: "ServeEngine"):
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


class ServeEngine:
    """The engine of one server: the scheduler configuration, the inbox and the engine thread.

    ``engine`` and ``tokenizer`` are the model; ``spec`` one of ``SPECS``; ``max_batch`` caps the
    sequences running at once (default: the model's slots), ``max_batch_tokens`` the rows of one
    forward (default: the scheduler's budget); ``drafter`` replaces the model's
    drafter; ``wrap_device`` puts a layer between the interpreter and the device (tests inject
    faults with it); ``record`` writes the event log (``fxsched.runtime.eventlog``).
    """

    def __init__(self, engine: HybridEngine, tokenizer: TextTokenizer, spec: str = "none",
                 max_batch: Optional[int] = None, max_waiting: int = 1024, drafter: Optional[Drafter] = None,
                 wrap_device: Optional[Callable[[TorchDevice], Device]] = None,
                 metrics: Optional[ServeMetrics] = None, record: Optional[str | Path] = None,
                 record_meta: Optional[dict[str, Any]] = None, eos_ids: Optional[Seq[int]] = None,
                 max_batch_tokens: Optional[int] = None, late_drafts: bool = True,
                 async_scheduling: Optional[bool] = None):
        ensure_configured()
        cfg = engine.cfg
        self.engine = engine
        self.tokenizer = tokenizer
        self.spec = spec
        self.speculative = spec != SPECS[0]
        # the modes whose verifies count into a sequence's ``acc`` (n-gram steps never do, core/ngram.py):
        # their final events carry ``accepted_tokens``
        self.counts_accepted = spec in ("mtp", "dflash")
        self.max_batch = max_batch if max_batch is not None else cfg.max_slots
        eos = tuple(eos_ids) if eos_ids is not None else (tokenizer.eos_ids or None)
        self.config, self.model_info, self.proposer = scheduler_setup(cfg, spec, self.max_batch, eos)
        # streams wait on one step's rows, never a queue of prompts (specs/scheduler.md §5.13):
        # --max-num-batched-tokens N, or the device's served budget, as vLLM's
        self.config = served_config(self.config, engine.device.type, max_batch_tokens)
        self.max_waiting = max_waiting
        self.drafter = drafter
        self.wrap_device = wrap_device
        self.late_drafts = late_drafts  # specs/async.md §16.3; off under expert parallelism
        # plain decodes answered ahead (specs/async.md §16.6): on CUDA unless told, never under EP
        if async_scheduling is None:
            async_scheduling = engine.device.type == "cuda"
        self.async_scheduling = async_scheduling and wrap_device is None
        if self.async_scheduling:
            self.config = attrs.evolve(self.config, async_scheduling=True)
        self.metrics = metrics if metrics is not None else ServeMetrics(spec, cfg.num_blocks, cfg.max_slots)
        self.record = Path(record) if record is not None else None
        self.record_meta = record_meta or {}
        self.recent: deque[FinalRecord] = deque(maxlen=RECENT)
        self.faults: list[str] = []
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._waiting = 0
        self._live = 0
        self._closed = False
        self._t0 = time.monotonic()
        self._thread: Optional[threading.Thread] = None
        self._device: Optional[TorchDevice] = None
        self._watch = _Watch(self._scheduled, lambda: self.metrics.preemptions.inc())  # the child name_model binds
        self._last_tick: Optional[float] = None
        self._idled = False
        self._served = 0  # choices finished without an error
        self.gave_up = False
        self.grammars = GrammarBook(self.config.eos_ids or ())  # engine thread only
        self._ll_tokenizer: Any = None
        self.host = ServeHost(self)
        # LoRA adapters served by name (runtime/serve/lora.py, specs/lora.md §18.7)
        self.adapters = AdapterBook(engine.lora.max_loras if engine.lora is not None else 0)
        self._retry_ops: list[AdapterOp] = []

    @property
    def grammar_tokenizer(self) -> Any:
        """llguidance's view of the tokenizer (built on first use; runtime/serve/structured.py)."""
        if self._ll_tokenizer is None:
            from fxsched.runtime.serve.structured import grammar_tokenizer

            self._ll_tokenizer = grammar_tokenizer(self.tokenizer, self.engine.cfg.vocab_size,
                                                   tuple(self.config.eos_ids or ()))
        return self._ll_tokenizer

    def grammar_matcher(self, grammar: str) -> Any:
        """A fresh matcher of a checked grammar; ``ValueError`` if it cannot be made."""
        from fxsched.runtime.serve.structured import matcher

        try:
            return matcher(self.grammar_tokenizer, grammar)
        except Exception as err:  # the library's own failure: this choice fails, the engine goes on
            raise ValueError(f"grammar: {type(err).__name__}: {err}") from None

    # --- the HTTP side (any thread) -------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._main, name="fxsched-engine", daemon=True)
            self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def live(self) -> int:
        """Choices submitted and not finished."""
        with self._lock:
            return self._live

    @property
    def waiting(self) -> int:
        """Choices submitted that have not started (no token or final frame yet)."""
        with self._lock:
            return self._waiting

    def submit(self, specs: Seq[ChoiceSpec], sink: Callable[[ChoiceEvent], None]) -> list[int]:
        """Queue the choices of one request (choice i reports ``index`` i to ``sink``); their ids.
        Raises ``Draining`` after ``close`` and ``Overloaded`` when the waiting queue is full."""
        with self._lock:
            if self.gave_up or not self.alive:
                raise Draining("the engine is not running (it stopped after repeated faults)" if self.gave_up
                               else "the engine is not running")
            if self._closed:
                raise Draining("the server is shutting down")
            if self._waiting + len(specs) > self.max_waiting:
                raise Overloaded(f"the waiting queue is full ({self._waiting} choices waiting, at most "
                                 f"{self.max_waiting}); retry later")
            self.adapters.acquire([spec.adapter for spec in specs])  # AdapterGone: unloaded since
            self._waiting += len(specs)
            self._live += len(specs)
            ids = [next(self._ids) for _ in specs]
        now = time.perf_counter()
        self._inbox.put(_Submit(tuple(_Choice(rid, i, spec, sink, now) for i, (rid, spec)
                                      in enumerate(zip(ids, specs, strict=True)))))
        return ids

    def cancel(self, ids: Seq[int]) -> None:
        """The clients of these choices went away (finished ones are ignored)."""
        if ids:
            self._inbox.put(_Cancel(tuple(ids)))

    def abort_all(self) -> None:
        """Cancel every choice the engine holds (the drain timeout); each still gets its final event."""
        self._inbox.put(_CANCEL_ALL)

    def close(self) -> None:
        """Take no new requests; the scheduler finishes what it has, then the engine thread ends."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._inbox.put(_CLOSE)

    def stop(self, timeout: Optional[float] = None) -> bool:
        """``close`` and wait for the engine thread; whether it ended."""
        self.close()
        if self._thread is not None:
            self._thread.join(timeout)
        return not self.alive

    def _drain_inbox(self) -> list[Any]:
        with self._lock:  # submit checks ``alive`` under the lock: nothing new arrives once the thread ends
            self._closed = True
        items = []
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                return items

    def now_ms(self) -> float:
        return (time.monotonic() - self._t0) * 1000.0

    # --- the engine thread ----------------------------------------------------------------------

    def _main(self) -> None:
        try:
            self._lives()
        except BaseException as err:  # a bug outside the drive loop: nobody must wait for an answer forever
            message = " ".join(f"{type(err).__name__}: {err}".split())
            log.error("engine_thread_failed", error=message)
            self.gave_up = True
            self.host.fail_all(f"engine stopped: {message}")
            self.host.fail_pending(f"engine stopped: {message}")
            raise

    def _lives(self) -> None:
        life = failures = 0
        with torch.no_grad():
            while True:
                served = self._served
                if self._life(life):
                    break
                life += 1
                failures = 0 if self._served > served else failures + 1
                if failures >= MAX_BARREN_FAULTS:
                    log.error("engine_gave_up", faults=failures, last=self.faults[-1])
                    self.gave_up = True
                    self.host.fail_pending(f"engine stopped after {failures} faults in a row: {self.faults[-1]}")
                    break
                time.sleep(min(RESTART_BACKOFF * 2 ** (failures - 1), 2.0) if failures else 0.0)
        log.info("engine_stopped", lives=life + 1)

    def _life(self, life: int) -> bool:
        """One scheduler life; True when it ended as asked (closed), False after a fault."""
        device = TorchDevice(self.engine, proposer=self.proposer, drafter=self.drafter, on_tick=self._tick,
                             grammars=self.grammars, late_drafts=self.late_drafts,
                             decode_ahead=self.async_scheduling)
        device.row_processors = self.host.processors
        self._device = device
        self.metrics.reset_speculation()
        self.host.logprobs = LogprobWitness(device)
        recorder = self._recorder(life)
        interpreter = Interpreter(self.wrap_device(device) if self.wrap_device else device, self.host,
                                  self.config.eos_ids,
                                  observer=Observers(recorder, self.host.witness, self.host.logprobs, self._watch))
        if self._closed:
            self._inbox.put(_CLOSE)  # a restart after a fault while draining: the new scheduler must close too
        try:
            interpreter.run(initial_state(self.config, self.model_info), [ev.Boot()])
            device.streams.synchronize_all()
            return True
        except Exception as err:
            message = " ".join(f"{type(err).__name__}: {err}".split())
            log.error("engine_fault", error=message, life=life)
            self.faults.append(message)
            self.metrics.faults.inc()
            self.host.fail_all(f"engine fault: {message}")
            return False
        finally:
            if recorder is not None:
                recorder.close()
            self._release(device)
            self._refresh()

    def _recorder(self, life: int):
        if self.record is None:
            return None
        from fxsched.runtime.eventlog import EventLogError, EventRecorder

        path = self.record if life == 0 else self.record.with_name(f"{self.record.stem}.{life}{self.record.suffix}")
        meta = {"command": "serve", "spec": self.spec, "life": life, **self.record_meta}
        try:
            return EventRecorder(path, self.config, self.model_info, meta)
        except EventLogError as err:  # the CLI checked the path; serving goes on without the log
            log.error("record_failed", error=str(err))
            return None

    def _release(self, device: TorchDevice) -> None:
        """Free every sequence of the device; if the device cannot, every allocated engine slot."""
        try:
            device.release_all()
        except Exception as err:
            log.warning("release_failed", error=str(err))
            for slot in range(self.engine.cfg.max_slots):
                if self.engine.is_allocated(slot):
                    self.engine.free(slot)
        device.close()

    def _cached_tokens(self, rid: int) -> int:
        device = self._device
        if device is None:
            return 0
        return device.cached_tokens(rid)

    # --- metrics (engine thread) ----------------------------------------------------------------

    def _tick(self, tick: int) -> None:
        now = time.perf_counter()
        if self._last_tick is not None and not self._idled:
            self.metrics.step.observe(now - self._last_tick)
        self._last_tick, self._idled = now, False
        self._refresh()

    def _idle(self) -> None:
        self._idled = True
        self._refresh()

    def _refresh(self) -> None:
        m = self.metrics
        if self._watch.state is not None:
            m.scheduler(self._watch.state)
        e = self.engine
        free, evictable = e.num_free_blocks(), e.num_evictable_blocks()
        m.device(e.cfg.num_blocks - free - evictable, e.num_cached_blocks(), e.cfg.max_slots - len(e.free_slots()))
        if self._device is not None:
            m.speculation(self._device.stats.verifies, self._device.stats.kept_rows)
            m.positions(self._device.stats.drafts_at, self._device.stats.accepted_at)
        if self.adapters.enabled:
            m.lora(self.adapters)

    # --- LoRA adapters (runtime/serve/lora.py) -------------------------------------------------

    def load_adapter(self, name: str, path: str, base_model_name: Optional[str] = None,
                     timeout: float = ADAPTER_OP_TIMEOUT) -> ServedAdapter:
        """Load the PEFT adapter in ``path`` into a free pool slot and serve it as ``name`` (any thread;
        blocks until the engine thread has loaded it). ``AdapterRefused`` names the adapter and why."""
        adapter = self.adapters.reserve(name, path, base_model_name)
        op = self._adapter_op(AdapterOp("load", adapter), timeout)
        if op.error is not None:
            raise AdapterRefused(400, f"The lora adapter '{name}' cannot be loaded: {op.error}", name, op.error)
        return adapter

    def unload_adapter(self, name: str, timeout: float = ADAPTER_OP_TIMEOUT) -> ServedAdapter:
        """Stop serving adapter ``name`` and empty its slot (refused while requests use it)."""
        adapter = self.adapters.begin_unload(name)
        op = self._adapter_op(AdapterOp("unload", adapter), timeout)
        if op.error is not None:
            raise AdapterRefused(500, f"The lora adapter '{name}' could not be unloaded: {op.error}")
        return adapter

    def _adapter_op(self, op: AdapterOp, timeout: float) -> AdapterOp:
        """Run ``op`` at once (before the engine thread starts), else on the engine thread."""
        if self._thread is None:
            op.run(self.engine, self.adapters)
            if op.retry:  # no sequence runs before the engine starts
                op.error = "a sequence still runs with its adapter"
            return op
        self._inbox.put(op)
        deadline = time.monotonic() + timeout
        while not op.done.wait(0.05):
            if not self.alive or time.monotonic() > deadline:
                if op.kind == "load":
                    self.adapters.abort(op.adapter)
                raise AdapterRefused(503, f"The lora adapter '{op.adapter.name}': the engine did not carry out "
                                          f"the {op.kind} (it is not running, or busy past {timeout:g} s)")
        return op

    def _adapter_ops(self, items: list[Any]) -> list[Any]:
        """Carry out the adapter ops among the inbox's ``items`` (engine thread); the other items."""
        ops = [item for item in items if isinstance(item, AdapterOp)]
        if not ops:
            return items
        for op in ops:
            op.run(self.engine, self.adapters)
            if op.retry:
                self._retry_ops.append(op)
        self._refresh()
        return [item for item in items if not isinstance(item, AdapterOp)]

    def _place(self, name: str) -> Union[int, str, None]:
        """The pool slot adapter ``name`` runs in, loading it on demand (engine thread; see
        runtime/serve/lora.py): a free slot, else the least recently used idle adapter's (evicted);
        None when every slot's adapter has requests in flight; a string: why it cannot be loaded."""
        from fxsched.runtime.torch_model.errors import AdapterError, SlotError

        book = self.adapters
        slot = book.slot_for(name)
        if slot is not None:
            return slot
        adapter = book.get(name)
        if adapter is None:  # cannot happen while the choice holds it (unloads of adapters in use are refused)
            return f"The lora adapter '{name}' is no longer served"
        slot = book.free_slot()
        if slot is None:
            for victim, victim_slot in book.idle():
                try:
                    self.engine.unload_adapter(victim_slot)
                except SlotError:  # a finished request's sequence not yet freed: another, or later
                    continue
                book.evicted(victim)
                log.info("lora_evicted", name=victim, slot=victim_slot, for_adapter=name)
                slot = victim_slot
                break
            else:
                return None
        try:
            self.engine.load_adapter(slot, Path(adapter.path))
        except AdapterError as err:  # its files changed since it was listed
            return f"The lora adapter '{name}' cannot be loaded: {err}"
        book.placed(name, slot)
        log.info("lora_loaded", name=name, slot=slot, path=adapter.path, on_demand=True)
        return slot

    def _retry_adapter_ops(self) -> None:
        """Unloads that found a finished request's sequence still bound, tried again."""
        if self._retry_ops:
            ops, self._retry_ops = self._retry_ops, []
            self._adapter_ops(list(ops))

    def _scheduled(self, rid: int) -> None:
        """The scheduler allocated request ``rid``'s sequence (its first allocation ends its queue time)."""
        choice = self.host.choices.get(rid)
        if choice is not None and choice.scheduled is None:
            choice.scheduled = time.perf_counter()
            if choice.spec.adapter is not None:
                self.adapters.scheduled(choice.spec.adapter)

    def _frame(self, choice: _Choice, n: int) -> None:
        """A frame of ``n`` tokens reached the client (specs/serve.md §12.8: tokens are counted as
        they come; the prompt, and its prefix cache hits, with the first token)."""
        now = time.perf_counter()
        if n:
            m = self.metrics
            if choice.first_token is None:
                choice.first_token = now
                m.first_token(now - choice.submitted, len(choice.spec.prompt), self._cached_tokens(choice.id))
            else:
                assert choice.last_frame is not None
                m.itl.observe(now - choice.last_frame)
            m.generation_tokens.inc(n)
            choice.last_frame = now
        if not choice.started:
            choice.started = True
            with self._lock:
                self._waiting -= 1

    def _finished(self, choice: _Choice, event: ChoiceEvent, completion_tokens: int) -> None:
        m = self.metrics
        if event.error is not None:
            m.failed.inc()
        elif choice.first_token is not None and choice.last_frame is not None:  # a choice never started counts nowhere
            first, last = choice.first_token, choice.last_frame
            scheduled = choice.scheduled if choice.scheduled is not None else first
            m.finished(event.finish_reason or "", time.perf_counter() - choice.submitted, scheduled - choice.submitted,
                       first - scheduled, last - first, last - scheduled)
        self.recent.append(FinalRecord(choice.id, event.finish_reason or "", completion_tokens, choice.cancelled,
                                       event.error, event.accepted_tokens))
        if event.error is None:
            self._served += 1
        if choice.spec.adapter is not None:
            self.adapters.release(choice.spec.adapter, choice.scheduled is not None)
        with self._lock:
            self._live -= 1


@dataclass(frozen=True)
class EngineSnapshot:
    """Counts of the engine's holdings (tests read them once the server is idle)."""

    slots_used: int
    blocks_used: int
    live: int


def snapshot(engine: ServeEngine) -> EngineSnapshot:
    """Slots and KV blocks held by sequences right now (read from any thread: plain counters)."""
    e = engine.engine
    used = e.cfg.num_blocks - e.num_free_blocks() - e.num_evictable_blocks()
    return EngineSnapshot(e.cfg.max_slots - len(e.free_slots()), used, engine.live)
