"""Generation on the real model: requests from prompts, the scheduler's interpreter driving a
``TorchDevice``, tokens collected per request, and a summary of the run.

``generate`` is the library entry point (the CLI, the benchmarks and the tests use it);
``fxsched.runtime.bench.generate`` measures it.

Speculation modes (``SPECS``) map onto the scheduler configuration as follows:

* ``none``: no speculation (plain decode, batched over the running sequences);
* ``mtp``: ``use_speculative``, MTP drafts (``num_drafts = 3``; the scheduler picks K = 2..4);
* ``dflash``: ``use_speculative`` + ``dflash``, ``num_drafts`` = the drafter's block size gamma;
* ``ngram``: ``ngram_speculative`` (prompt-lookup drafts proposed by the scheduler itself).

Every mode is greedy and lossless: the tokens equal those of ``none``, token for token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence as Seq

import torch

from fxsched.core import events as ev
from fxsched.core.config import ModelInfo, SchedulerConfig
from fxsched.core.request import Request
from fxsched.core.state import initial_state
from fxsched.effects.client import DoneOut, ErrorOut, ResponseOut, TokenOut, TokensOut
from fxsched.runtime.devices.device import Device
from fxsched.runtime.interpreter import Host, Interpreter, RunError
from fxsched.runtime.logs import ensure_configured
from fxsched.runtime.devices.torch import Drafter, TorchDevice
from fxsched.runtime.torch_model import HybridEngine, ModelConfig

SPECS = ("none", "mtp", "dflash", "ngram")
MTP_DRAFTS = 3


class GenerateError(ValueError):
    """Bad input to a generation run; the message names the input and what is wrong."""


# --- configuration ------------------------------------------------------------------------------


def context_limit(cfg: ModelConfig) -> int:
    """The scheduler's ``max_seq_len``: the model's context less the widest verify (so the rows of
    a verify started just before the scheduler's limit still fit in the model's context)."""
    widest = max(cfg.dflash_gamma + 1, MTP_DRAFTS + 1) + 1
    return cfg.max_seq_len - widest


def max_prompt_len(cfg: ModelConfig) -> int:
    """The longest prompt that leaves room for at least one generated token."""
    return context_limit(cfg) - 2


def scheduler_setup(cfg: ModelConfig, spec: str, batch: int) -> tuple[SchedulerConfig, ModelInfo, Optional[str]]:
    """(scheduler config, model info, device proposer) for a speculation mode."""
    if spec not in SPECS:
        raise GenerateError(f"--spec {spec}: unknown speculation mode (choose from {', '.join(SPECS)})")
    if not 1 <= batch <= cfg.max_slots:
        raise GenerateError(f"--batch {batch}: must be between 1 and {cfg.max_slots} (the model's slots)")
    if spec == "mtp" and not cfg.mtp:
        raise GenerateError("--spec mtp: the model has no MTP head (config mtp = false)")
    if spec == "dflash" and cfg.dflash_gamma <= 0:
        raise GenerateError("--spec dflash: the model has no DFlash drafter (config dflash_gamma = 0)")
    common: dict[str, Any] = dict(eos_ids=(cfg.eos_id,), max_batch_size=batch, max_seq_len=context_limit(cfg),
                                  admission_watermark=cfg.max_seq_len)
    model: dict[str, Any] = dict(vocab=cfg.vocab_size, block_size=cfg.block_size, total_blocks=cfg.num_blocks)
    if spec == "mtp":
        return (SchedulerConfig(use_speculative=True, dflash=False, num_drafts=MTP_DRAFTS, **common),
                ModelInfo(has_proposer=True, **model), "mtp")
    if spec == "dflash":
        return (SchedulerConfig(use_speculative=True, dflash=True, num_drafts=cfg.dflash_gamma, **common),
                ModelInfo(has_proposer=True, dflash_gamma=cfg.dflash_gamma, **model), "dflash")
    if spec == "ngram":
        return SchedulerConfig(ngram_speculative=True, **common), ModelInfo(**model), None
    return SchedulerConfig(**common), ModelInfo(**model), None


# --- prompts -----------------------------------------------------------------------------------


def parse_prompt(text: str, source: str) -> list[int]:
    """Token ids separated by spaces or commas."""
    words = text.replace(",", " ").split()
    if not words:
        raise GenerateError(f"{source}: the prompt is empty")
    tokens = []
    for word in words:
        try:
            tokens.append(int(word))
        except ValueError:
            raise GenerateError(f"{source}: {word!r} is not a token id (expected integers)") from None
    return tokens


def check_prompt(tokens: Seq[int], cfg: ModelConfig, source: str) -> None:
    if not tokens:
        raise GenerateError(f"{source}: the prompt is empty")
    bad = [t for t in tokens if not 0 <= t < cfg.vocab_size]
    if bad:
        raise GenerateError(f"{source}: token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")
    if len(tokens) > max_prompt_len(cfg):
        raise GenerateError(f"{source}: the prompt of {len(tokens)} tokens is longer than the context "
                            f"(at most {max_prompt_len(cfg)} prompt tokens for this model)")


def expand_prompts(prompts: Seq[Seq[int]], batch: int) -> list[list[int]]:
    """At least ``batch`` requests: the prompts, repeated in order if there are fewer."""
    out = [list(p) for p in prompts]
    i = 0
    while len(out) < batch:
        out.append(list(prompts[i % len(prompts)]))
        i += 1
    return out


# --- the host --------------------------------------------------------------------------------


@dataclass
class RequestResult:
    id: int
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    reason: Optional[str] = None
    acc: int = 0
    cached_tokens: int = 0
    reported_cached: int = 0  # what the final frame told the client (Done(cached=...))
    error: Optional[str] = None

    def render(self) -> str:
        toks = " ".join(str(t) for t in self.tokens)
        if self.error:
            return f"request {self.id}: {toks} (error: {self.error})"
        return f"request {self.id}: {toks} ({self.reason}, n={len(self.tokens)}, acc={self.acc})"


class GenerateHost(Host):
    """Clients of one run: collects each request's tokens and final frame."""

    def __init__(self, requests: Seq[Request], eos_id: int, on_tokens: Callable[[int], None] = lambda n: None):
        super().__init__()
        self.results = {r.id: RequestResult(r.id, list(r.prompt)) for r in requests}
        self.eos_id = eos_id
        self.on_tokens = on_tokens
        self.finished: set[int] = set()

    def send(self, output) -> None:
        rid = getattr(output, "request_id", None)
        result = self.results.get(rid) if rid is not None else None
        if result is None:
            return
        if isinstance(output, TokenOut):
            result.tokens.append(output.token)
            self.on_tokens(1)
        elif isinstance(output, TokensOut):
            result.tokens.extend(output.tokens)
            self.on_tokens(len(output.tokens))
        elif isinstance(output, DoneOut):
            # EOS is appended to the output but never streamed
            if output.n == len(result.tokens) + 1:
                result.tokens.append(self.eos_id)
                self.on_tokens(1)
            result.reason, result.acc, result.reported_cached = output.reason, output.acc, output.cached
            self.finished.add(output.request_id)
        elif isinstance(output, ResponseOut):
            result.tokens = list(output.tokens)
            result.reason, result.acc, result.reported_cached = output.reason, output.acc, output.cached
            self.finished.add(output.request_id)
        elif isinstance(output, ErrorOut):
            result.error = output.message
            self.finished.add(output.request_id)

    def wait_for_input(self) -> list[ev.Event]:
        if len(self.finished) == len(self.results):
            return [ev.InboxClosed()]
        missing = sorted(set(self.results) - self.finished)
        raise RunError(f"the scheduler waits for input that can never come (requests without a final frame: {missing})")


# --- the run ---------------------------------------------------------------------------------


@dataclass
class Summary:
    spec: str
    device: str
    batch: int
    requests: int
    prompt_tokens: int
    generated_tokens: int
    seconds: float
    target_forwards: int
    verifies: int
    accepted_drafts: int
    mean_accepted_length: Optional[float]
    cached_prompt_tokens: int
    steps: int

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def forwards_per_token(self) -> float:
        return self.target_forwards / self.generated_tokens if self.generated_tokens else 0.0

    def line(self) -> str:
        mal = "-" if self.mean_accepted_length is None else f"{self.mean_accepted_length:.2f}"
        return (f"summary: spec={self.spec} device={self.device} batch={self.batch} requests={self.requests} "
                f"tokens={self.generated_tokens} time={self.seconds:.3f}s tokens/s={self.tokens_per_s:.1f} "
                f"target_forwards={self.target_forwards} forwards/token={self.forwards_per_token:.3f} "
                f"verifies={self.verifies} mean_accepted_len={mal} cached_prompt_tokens={self.cached_prompt_tokens}")


@dataclass
class GenerateResult:
    results: list[RequestResult]
    summary: Summary
    device: TorchDevice

    @property
    def outputs(self) -> list[list[int]]:
        return [r.tokens for r in self.results]


def generate(engine: HybridEngine, prompts: Seq[Seq[int]], max_tokens: int, spec: str = "none",
             batch: Optional[int] = None, drafter: Optional[Drafter] = None, strict: bool = False,
             progress: Optional[Callable[[int], None]] = None,
             wrap_device: Optional[Callable[[TorchDevice], Device]] = None) -> GenerateResult:
    """Generate up to ``max_tokens`` greedy tokens for each prompt through the scheduler.

    ``batch`` caps the sequences running at once (default: every prompt, up to the model's
    slots). ``drafter`` replaces the model's drafter. ``progress(n)`` is called as tokens arrive.
    ``wrap_device`` may put a layer between the interpreter and the device (expert parallelism). Raises ``GenerateError`` for bad input and ``RunError`` if the run cannot finish.
    """
    ensure_configured()
    cfg = engine.cfg
    if not prompts:
        raise GenerateError("no prompts")
    if max_tokens < 1:
        raise GenerateError(f"--max-tokens {max_tokens}: must be at least 1")
    for i, p in enumerate(prompts):
        check_prompt(p, cfg, f"prompt {i + 1}")
    batch = batch if batch is not None else min(len(prompts), cfg.max_slots)
    config, model, proposer = scheduler_setup(cfg, spec, batch)
    requests = [Request(id=i + 1, prompt=tuple(p), max_tokens=max_tokens, streaming=True)
                for i, p in enumerate(prompts)]
    device = TorchDevice(engine, proposer=proposer, drafter=drafter, strict=strict)
    host = GenerateHost(requests, cfg.eos_id, progress or (lambda n: None))
    interpreter = Interpreter(wrap_device(device) if wrap_device else device, host, config.eos_ids)
    start = time.perf_counter()
    try:
        with torch.no_grad():
            interpreter.run(initial_state(config, model), [ev.Arrival(r) for r in requests] + [ev.Boot()])
        device.streams.synchronize_all()
    finally:
        device.release_all()
        device.close()
    seconds = time.perf_counter() - start
    results = [host.results[r.id] for r in requests]
    for r in results:
        r.cached_tokens = device.cached_tokens(r.id)
    stats = device.stats
    summary = Summary(
        spec=spec, device=str(engine.device), batch=batch, requests=len(requests),
        prompt_tokens=sum(len(p) for p in prompts), generated_tokens=sum(len(r.tokens) for r in results),
        seconds=seconds, target_forwards=stats.forwards, verifies=stats.verifies,
        accepted_drafts=stats.accepted_drafts, mean_accepted_length=stats.mean_accepted_length,
        cached_prompt_tokens=stats.cached_prompt_tokens, steps=interpreter.steps,
    )
    return GenerateResult(results, summary, device)
