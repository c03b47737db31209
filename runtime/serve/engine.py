"""The engine thread of ``fxsched serve``: one drive loop (``Interpreter.run``) that owns the
scheduler state, fed by the HTTP layer through a thread-safe inbox.

Threads. The HTTP layer (the asyncio loop) only calls ``submit``, ``cancel``, ``close`` and
``abort_all``; each puts one item on the inbox (``queue.SimpleQueue``) and returns. The engine
thread is the only one that touches the scheduler state, the ``TorchDevice`` and the engine; it
runs ``Interpreter.run`` with a ``ServeHost`` (runtime/serve/serve_host.py), which turns the
inbox's items into the scheduler's events and its client outputs into each choice's
``ChoiceEvent`` (runtime/serve/choices.py). Its LoRA adapter methods are runtime/serve/engine_adapters.py's.

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
from typing import Any, Callable, Optional, Sequence as Seq

import attrs
import structlog
import torch

from fxsched.core import events as ev
from fxsched.core.state import initial_state
from fxsched.runtime.devices.device import Device
from fxsched.runtime.devices.grammar_mask import GrammarBook
from fxsched.runtime.devices.torch import Drafter, TorchDevice
from fxsched.runtime.generate import SPECS, scheduler_setup, served_config
from fxsched.runtime.generate_host import LogprobWitness, Observers
from fxsched.runtime.interpreter import Interpreter
from fxsched.runtime.logs import ensure_configured
from fxsched.runtime.serve.choices import _CANCEL_ALL, _CLOSE, ChoiceEvent, FinalRecord, _Cancel, _Choice, _Submit
from fxsched.runtime.serve.engine_adapters import EngineAdapters
from fxsched.runtime.serve.lora import AdapterBook, AdapterOp
from fxsched.runtime.serve.metrics import ServeMetrics
from fxsched.runtime.serve.protocol import ChoiceSpec
from fxsched.runtime.serve.serve_host import ServeHost, _Watch
from fxsched.runtime.text import TextTokenizer
from fxsched.runtime.torch_model import HybridEngine

log = structlog.get_logger("fxsched.serve.engine")

MAX_BARREN_FAULTS = 5  # faults in a row, with no choice finished in between, before the engine gives up
RESTART_BACKOFF = 0.05  # seconds before the second restart in a row (doubling, at most 2 s)
RECENT = 4096  # final records kept for inspection (``ServeEngine.recent``)


class Overloaded(Exception):
    """The waiting queue is full (HTTP 429)."""


class Draining(Exception):
    """The server is shutting down and takes no new requests (HTTP 503)."""


class ServeEngine(EngineAdapters):
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
