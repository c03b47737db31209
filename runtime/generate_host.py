"""The clients of a generation run (``runtime/generate.py``): each request's result as it
arrives (``RequestResult``, with its text through ``TextStream``), the host that collects them
(``GenerateHost``), and the observers that tell it what the outputs alone do not say (which EOS id
ended a request, the logprob record of each token).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence as Seq

from fxsched.core import events as ev
from fxsched.core.request import Request
from fxsched.core.state import SchedulerState
from fxsched.effects.client import DoneOut, ErrorOut, ResponseOut, TokenOut, TokensOut
from fxsched.runtime.devices.torch import TorchDevice
from fxsched.runtime.devices.torch_sampling import RowLogprobs
from fxsched.runtime.interpreter import Host, Observer, RunError
from fxsched.runtime.text import IncrementalDetokenizer, StopMatcher, TextTokenizer, opens_thinking, think_count

# The scheduler's finish reasons in OpenAI's vocabulary; others pass through unchanged.
OPENAI_FINISH_REASONS = {"stop": "stop", "length": "length", "tool_calls": "tool_calls"}
INTERRUPTED = "interrupted"  # the finish reason of a request cut short by Ctrl-C


class GenerateError(ValueError):
    """Bad input to a generation run; the message names the input and what is wrong."""


# --- results ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class TextOptions:
    """Detokenized output for a run: the tokenizer, stop strings, and whether special tokens
    (EOS, ``<|im_end|>``, ...) are left out of the text (they are by default, as in vLLM)."""

    tokenizer: TextTokenizer
    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if any(not s for s in self.stop):
            raise GenerateError("--stop: a stop string must not be empty")


@dataclass
class RequestResult:
    """One request's outcome. ``tokens`` are the generated ids the client got (EOS included, cut
    after the token that completed a stop string); ``reason`` is the scheduler's finish reason and
    ``finish_reason`` the one a client sees."""

    id: int
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    reason: Optional[str] = None
    acc: int = 0
    cached_tokens: int = 0
    reported_cached: int = 0  # what the final frame told the client (Done(cached=...))
    error: Optional[str] = None
    text: Optional[str] = None  # with TextOptions: the detokenized output
    stop: Optional[str] = None  # the stop string that ended the request
    think_tokens: int = 0
    received: int = 0  # tokens the scheduler produced for it (past a stop string too)
    # with SamplingOptions.logprobs: one entry per token (None for the first, which never has a record)
    logprobs: Optional[list[Optional[dict[str, Any]]]] = None

    @property
    def finished(self) -> bool:
        return self.reason is not None or self.error is not None

    @property
    def finish_reason(self) -> Optional[str]:
        """"stop" (EOS or a stop string), "length", "tool_calls", "error", or the scheduler's own
        word where OpenAI has none ("timeout"); None while running."""
        if self.error is not None:
            return "error"
        if self.stop is not None:
            return "stop"
        if self.reason is None:
            return None
        return OPENAI_FINISH_REASONS.get(str(self.reason), str(self.reason))

    def render(self) -> str:
        toks = " ".join(str(t) for t in self.tokens)
        if self.error:
            return f"request {self.id}: {toks} (error: {self.error})"
        return f"request {self.id}: {toks} ({self.reason}, n={len(self.tokens)}, acc={self.acc})"

    def render_header(self, think: bool = False) -> str:
        """A one-line heading for the text of a request."""
        if self.error:
            return f"--- request {self.id} (error: {self.error}) ---"
        extra = f", think={self.think_tokens}" if think else ""
        stop = f", stop={self.stop!r}" if self.stop is not None else ""
        return f"--- request {self.id} ({self.finish_reason}{stop}, n={len(self.tokens)}, acc={self.acc}{extra}) ---"

    def to_json(self, index: int) -> dict[str, Any]:
        """The machine-readable record (``fxsched generate --json``)."""
        out: dict[str, Any] = {
            "index": index, "request_id": self.id,
            "prompt_token_ids": list(self.prompt), "num_prompt_tokens": len(self.prompt),
            "token_ids": list(self.tokens), "text": self.text,
            "finish_reason": self.finish_reason, "stop_reason": self.stop,
            "num_generated_tokens": len(self.tokens), "think_tokens": self.think_tokens,
            "accepted_draft_tokens": self.acc, "cached_prompt_tokens": self.cached_tokens,
        }
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        if self.error is not None:
            out["error"] = self.error
        return out


class TextStream:
    """One request's detokenizer and stop matcher."""

    def __init__(self, options: TextOptions):
        self.detok = IncrementalDetokenizer(options.tokenizer, options.skip_special_tokens)
        self.stops = StopMatcher(options.stop)
        self.parts: list[str] = []

    def push(self, token: int) -> tuple[str, Optional[str]]:
        match = self.stops.push(self.detok.push(token))
        if match.text:
            self.parts.append(match.text)
        return match.text, match.stop

    def flush(self) -> str:
        tail = self.stops.push(self.detok.flush()).text
        tail += self.stops.flush()
        if tail:
            self.parts.append(tail)
        return tail


# --- the host --------------------------------------------------------------------------------


def _answer_tokens(event: Optional[ev.Event]) -> tuple[int, ...]:
    if isinstance(event, ev.TokenSampled):
        return (event.token,)
    if isinstance(event, ev.TokensSampled):
        return event.tokens
    if isinstance(event, ev.VerifyRows):
        return event.rows
    return ()


class EosWitness(Observer):
    """Which EOS id ended a request, for runs with several EOS ids (the final frame only counts it).

    While the host handles a batch, ``before`` is the scheduler state before the step and
    ``event`` the answer it stepped on. A sequence that finished in an earlier step still shows its
    EOS as its last output token in ``before``; one that finished in this step took it from the
    answer: the answer's only EOS id, else the row of the sequence when the waiting record names
    the rows (a batched decode), else the answer's first EOS id.
    """

    def __init__(self, eos_ids: Seq[int]):
        self.eos_ids = tuple(eos_ids)
        self.eos = frozenset(eos_ids)
        self.before: Optional[SchedulerState] = None
        self.event: Optional[ev.Event] = None

    def before_step(self, event: ev.Event) -> None:
        self.event = event

    def performed(self, state: SchedulerState) -> None:
        self.before = state

    def eos_of(self, request_id: int) -> int:
        before = self.before
        seq = None
        if before is not None:
            seq = next((s for s in before.active if s.request.id == request_id), None)
        if seq is not None and seq.finished and seq.output.last in self.eos:
            return int(seq.output.last)
        tokens = _answer_tokens(self.event)
        found = list(dict.fromkeys(t for t in tokens if t in self.eos))
        if len(found) > 1 and seq is not None and before is not None:
            rows = getattr(before.waiting, "seq_ids", None)
            if rows is not None and len(rows) == len(tokens) and seq.seq_id in rows:
                token = tokens[list(rows).index(seq.seq_id)]
                if token in self.eos:
                    return token
        return found[0] if found else self.eos_ids[0]


class LogprobWitness(Observer):
    """Logprob records for the tokens of a run with ``logprobs`` (``TorchDevice.last_sample``,
    ``TorchDevice.last_verify``).

    A sampled readback is the query that ends a batch; once the batch is carried out, the state's
    waiting record names its rows (``seq_ids`` of a decode or a mixed step, ``seq_id`` of a first
    token, with its ``request`` for a whole prefill), in the order of the sample's rows. A row the
    scheduler picked without a record (a first token: specs/scheduler.md §5.11) gets one from the
    device's row (``TorchDevice.row_record``). A rejection-sampled verify (specs/speculation.md
    §6.16) gives each sequence the records of the tokens it emits, in order. Records wait in order
    under their request until the host takes that request's tokens (``take``)."""

    def __init__(self, device: TorchDevice):
        self.device = device
        self._seen: Optional[object] = None
        self._seen_verify: Optional[object] = None
        self.pending: dict[int, deque[RowLogprobs]] = {}

    def _requests(self, state: SchedulerState) -> dict[int, Request]:
        request_of = {s.seq_id: s.request for s in state.active}
        request_of.update((e.seq_id, e.request) for e in state.prefilling)
        return request_of

    def performed(self, state: SchedulerState) -> None:
        verified = self.device.last_verify
        if verified is not None and verified is not self._seen_verify:
            self._seen_verify = verified
            request_of = self._requests(state)
            for vid, records in verified:
                if vid in request_of:
                    self.pending.setdefault(request_of[vid].id, deque()).extend(records)
        sample = self.device.last_sample
        if sample is None or sample is self._seen:
            return
        self._seen = sample
        waiting = state.waiting
        rows = getattr(waiting, "seq_ids", None)
        if rows is None:
            seq_id = getattr(waiting, "seq_id", None)
            rows = () if seq_id is None else (seq_id,)
        if len(rows) != len(sample.logprobs):
            return
        request_of = self._requests(state)
        request = getattr(waiting, "request", None)
        if request is not None and rows:
            request_of[rows[0]] = request
        for r, (sid, record, token) in enumerate(zip(rows, sample.logprobs, sample.tokens, strict=True)):
            req = request_of.get(sid)
            if req is None:
                continue
            if record is None and req.top_logprobs > 0:
                record = self.device.row_record(self.device.last_sample_row + r, token, req.top_logprobs)
            if record is not None:
                self.pending.setdefault(req.id, deque()).append(record)

    def take(self, request_id: int, token: int) -> Optional[dict[str, Any]]:
        """The record of ``request_id``'s next token ``token``, in the ``--json`` form; None if none."""
        queue = self.pending.get(request_id)
        record = queue.popleft() if queue else None
        if queue is not None and not queue:
            del self.pending[request_id]
        if record is None or record.token != token:
            return None
        return {"token_id": record.token, "logprob": record.logprob,
                "top_logprobs": [{"token_id": t, "logprob": lp} for t, lp in record.top]}


class Observers(Observer):
    """Several observers, called in order."""

    def __init__(self, *observers: Optional[Observer]):
        self.observers = [o for o in observers if o is not None]

    def before_step(self, event: ev.Event) -> None:
        for o in self.observers:
            o.before_step(event)

    def stepped(self, event: ev.Event, state: SchedulerState, effects: Seq) -> None:
        for o in self.observers:
            o.stepped(event, state, effects)

    def performed(self, state: SchedulerState) -> None:
        for o in self.observers:
            o.performed(state)

    def output(self, output) -> None:
        for o in self.observers:
            o.output(output)


class GenerateHost(Host):
    """Clients of one run: collects each request's tokens, text and final frame.

    ``eos`` is the EOS id, or the tuple of them; ``on_text(request id, piece)`` and
    ``on_finish(result)`` are called as text is ready and as requests end.
    """

    def __init__(self, requests: Seq[Request], eos: int | Seq[int] = (),
                 on_tokens: Callable[[int], None] = lambda n: None, text: Optional[TextOptions] = None,
                 on_text: Optional[Callable[[int, str], None]] = None,
                 on_finish: Optional[Callable[[RequestResult], None]] = None):
        super().__init__()
        self.results = {r.id: RequestResult(r.id, list(r.prompt)) for r in requests}
        self.eos_ids: tuple[int, ...] = (eos,) if isinstance(eos, int) else tuple(eos)
        self.on_tokens = on_tokens
        self.on_text = on_text or (lambda rid, piece: None)
        self.on_finish = on_finish or (lambda result: None)
        self.text = text
        self.streams = {r.id: TextStream(text) for r in requests} if text is not None else {}
        self.witness: Optional[EosWitness] = EosWitness(self.eos_ids) if len(self.eos_ids) > 1 else None
        self.logprobs: Optional[LogprobWitness] = None  # set by ``generate`` for a run with logprobs
        self.finished: set[int] = set()

    @property
    def eos_id(self) -> Optional[int]:
        return self.eos_ids[0] if self.eos_ids else None

    def _take(self, result: RequestResult, tokens: Seq[int]) -> None:
        result.received += len(tokens)
        self.on_tokens(len(tokens))
        for token in tokens:
            if result.stop is not None:
                return
            result.tokens.append(token)
            if self.logprobs is not None:
                if result.logprobs is None:
                    result.logprobs = []
                result.logprobs.append(self.logprobs.take(result.id, token))
            stream = self.streams.get(result.id)
            if stream is None:
                continue
            piece, stop = stream.push(token)
            if piece:
                self.on_text(result.id, piece)
            if stop is not None:
                result.stop = stop
                self.inputs.append(ev.Cancel(result.id))

    def _finish(self, result: RequestResult) -> None:
        self.finished.add(result.id)
        stream = self.streams.get(result.id)
        if stream is not None:
            tail = stream.flush()
            if tail:
                self.on_text(result.id, tail)
            result.text = "".join(stream.parts)
            think_ids = stream.detok.tokenizer.think_ids
            result.think_tokens = think_count(result.tokens, think_ids, opens_thinking(result.prompt, think_ids))
        self.on_finish(result)

    def send(self, output) -> None:
        rid = getattr(output, "request_id", None)
        result = self.results.get(rid) if rid is not None else None
        if rid is None or result is None or result.id in self.finished:
            return
        if isinstance(output, TokenOut):
            self._take(result, (output.token,))
        elif isinstance(output, TokensOut):
            self._take(result, output.tokens)
        elif isinstance(output, DoneOut):
            # EOS is appended to the output but never streamed
            if output.n == result.received + 1 and self.eos_ids:
                self._take(result, (self.witness.eos_of(rid) if self.witness else self.eos_ids[0],))
            result.reason, result.acc, result.reported_cached = output.reason, output.acc, output.cached
            self._finish(result)
        elif isinstance(output, ResponseOut):
            self._take(result, output.tokens[result.received:])
            result.reason, result.acc, result.reported_cached = output.reason, output.acc, output.cached
            self._finish(result)
        elif isinstance(output, ErrorOut):
            result.error = output.message
            self._finish(result)

    def interrupt(self) -> None:
        """Ctrl-C: every request still running ends as ``INTERRUPTED`` with what it has."""
        for result in self.results.values():
            if result.id not in self.finished:
                result.reason = INTERRUPTED
                self._finish(result)

    def take_inputs(self) -> list[ev.Event]:
        # a cancel for a request that ended in the same batch would only be remembered
        return [e for e in super().take_inputs()
                if not (isinstance(e, ev.Cancel) and e.request_id in self.finished)]

    def wait_for_input(self) -> list[ev.Event]:
        if len(self.finished) == len(self.results):
            return [ev.InboxClosed()]
        missing = sorted(set(self.results) - self.finished)
        raise RunError(f"the scheduler waits for input that can never come (requests without a final frame: {missing})")
