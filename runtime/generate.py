"""Generation on the real model: requests from prompts, the scheduler's interpreter driving a
``TorchDevice``, tokens (and, with a tokenizer, text) collected per request, and a summary.

``generate`` is the library entry point (the CLI, the benchmarks and the tests use it);
``fxsched.runtime.bench.generate`` measures it.

Speculation modes (``SPECS``) map onto the scheduler configuration as follows:

* ``none``: no speculation (plain decode, batched over the running sequences);
* ``mtp``: ``use_speculative``, MTP drafts (``num_drafts = 3``; the scheduler picks K = 2..4);
* ``dflash``: ``use_speculative`` + ``dflash``, ``num_drafts`` = the drafter's block size gamma;
* ``ngram``: ``ngram_speculative`` (prompt-lookup drafts proposed by the scheduler itself).

Greedy, every mode is lossless: the tokens equal those of ``none``, token for token. Sampling, every
mode is lossless in distribution: the speculative steps verify by rejection sampling
(specs/speculation.md §6.16), so the output follows the law of ``none`` (not its tokens).

Sampling (``SamplingOptions``, every spec). Each
request carries the run's ``temperature``, ``top_p``, ``top_k``, ``min_p`` and ``logprobs`` and its
own seed, ``seed`` + its index x ``REQUEST_SEED_STRIDE`` (2**20: requests' draws never share a
seed for outputs shorter than a million tokens); a pick draws with that seed + the output length (specs/scheduler.md §5.11), so a seeded run repeats token for token. The torch
device samples the rows (``TorchDevice.sample_rows``); with ``logprobs`` = k > 0 each generated
token gets its logprob record (the chosen token's logprob and the k most likely ids, from
``TorchDevice.last_sample``, matched to requests by ``LogprobWitness``) in
``RequestResult.logprobs``, one entry per token id; the first token's comes from its device row
(the scheduler's first pick carries no record, specs/scheduler.md §5.11), a speculative token's from
its verify row (``TorchDevice.last_verify``, specs/speculation.md §6.16). The defaults are greedy
and change nothing.

EOS. ``eos_ids`` (default: the model config's ``stop_ids``) go to the scheduler and the
interpreter; ``()`` never stops early (``--ignore-eos``). The scheduler appends the EOS to a
request's output but never streams it, so ``GenerateHost`` adds it from the final frame's count;
with several EOS ids it reads which one from the scheduler state and the answer of that step
(``EosWitness``).

Text (``TextOptions``, a tokenizer from ``fxsched.runtime.text``). Each request's tokens go
through an ``IncrementalDetokenizer`` and a ``StopMatcher`` as they stream; ``on_text(request
id, piece)`` gets every piece that is safe to show. When a stop string completes, the host keeps
the tokens up to the one that completed it, cuts the text before the stop string, reports
``finish_reason`` "stop", and posts a ``Cancel`` event so the scheduler ends the request: both
sinks finish a cancelled sequence at its next token (specs/scheduler.md §5.17, specs/speculation.md
§6.1). Tokens that reached the host after the stop string (the rest of a multi-token frame) are
dropped (``Summary.discarded_tokens`` counts them). Without a stop string the text is exactly
``decode(token_ids)``.

Ctrl-C (``KeyboardInterrupt``) during a run: every request not yet finished ends with reason
"interrupted", keeping the tokens (and text) it got so far, and is reported through
``on_finish`` like any other; the device is released, and ``GenerateInterrupted`` (a
``KeyboardInterrupt``) carries the ``GenerateResult`` of everything generated.

Prompt ids (``parse_prompt``) are written in ASCII digits only: ``1_0`` or ``٣`` is not a token id.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence as Seq

import attrs
import torch

from fxsched.core import events as ev
from fxsched.core.config import ModelInfo, SchedulerConfig
from fxsched.core.request import Request
from fxsched.core.state import initial_state
from fxsched.runtime.devices.device import Device
from fxsched.runtime.devices.lane import DeviceLane
from fxsched.runtime.interpreter import Interpreter
from fxsched.runtime.logs import ensure_configured
from fxsched.runtime.devices.torch import Drafter, TorchDevice
from fxsched.runtime.generate_host import (GenerateError, GenerateHost,
                                           LogprobWitness, Observers, RequestResult, TextOptions)
from fxsched.runtime.torch_model import HybridEngine, ModelConfig

SPECS = ("none", "mtp", "dflash", "ngram")
MTP_DRAFTS = 3


class GenerateInterrupted(KeyboardInterrupt):
    """Ctrl-C during ``generate``: ``result`` holds what was generated until then."""

    def __init__(self, result: "GenerateResult"):
        super().__init__("interrupted")
        self.result = result


REQUEST_SEED_STRIDE = 2**20  # request i of a run seeds its picks with seed + i * stride (+ output length)


@dataclass(frozen=True)
class SamplingOptions:
    """How every request of a run picks its tokens (see the module docstring). Out-of-range values
    raise ``GenerateError`` naming the option (``Request``'s own checks, one field at a time)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0
    logprobs: int = 0

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "top_k", "min_p"):
            value = getattr(self, name)
            try:
                Request(id=0, prompt=(0,), max_tokens=1, **{name: value})
            except ValueError as err:
                problem = str(err).split(": ", 1)[-1]
                raise GenerateError(f"--{name.replace('_', '-')} {value}: {problem}") from None
        if self.logprobs < 0:
            raise GenerateError(f"--logprobs {self.logprobs}: must be at least 0")

    @property
    def greedy(self) -> bool:
        """Every pick is the argmax and no logprob is asked for."""
        return self.temperature == 0 and self.logprobs == 0

    def request(self, index: int, prompt: Seq[int], max_tokens: int) -> Request:
        """The request of prompt ``index`` (0-based): id ``index + 1``, seed ``seed + index * REQUEST_SEED_STRIDE``."""
        try:
            return Request(id=index + 1, prompt=tuple(prompt), max_tokens=max_tokens, streaming=True,
                           temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                           seed=self.seed + index * REQUEST_SEED_STRIDE, top_logprobs=self.logprobs)
        except ValueError as err:
            raise GenerateError(str(err)) from None


GREEDY = SamplingOptions()


# --- configuration ------------------------------------------------------------------------------


PREFILL_CHUNK = 2048  # the most tokens of one prompt a step prefills beside decoding sequences
PREFILL_BUDGET = 8192  # the most rows one prefill (or mixed) forward takes
SERVED_CPU_BATCH_TOKENS = 512  # the rows a server's step takes on a CPU (`served_config`)
SERVED_CPU_MIXED_FLOOR = 64  # on a CPU, the prompt rows a served step takes beside few decoding streams
SERVED_CPU_MIXED_PER_DECODE = 8  # ... and per decoding stream beside many (`served_config`)


def served_config(config: SchedulerConfig, device_type: str, max_batch_tokens: Optional[int] = None
                  ) -> SchedulerConfig:
    """What a server's scheduler bounds beyond `scheduler_setup`'s: running streams wait on one
    step's rows, never on a queue of prompts (specs/scheduler.md §5.13).

    - ``idle_prefill_fills_budget``: while nothing decodes, a prompt's chunk takes the whole budget.
    - The budget, as vLLM's ``--max-num-batched-tokens`` (``max_batch_tokens`` where given): prompt
      chunks and idle waves of at most this many rows. On a CPU a forward of a few dozen rows or
      more costs in proportion to its rows, so the bound is what running streams wait on while
      prompts prefill, and too small a bound starves the queue. Measured with vLLM's client (256-token
      prompts, 64 outputs, one core, Qwen3-0.6B's size; `fxsched bench serve`): at 32 rows, 32 clients'
      prompts waited 54 s for their first token (vLLM 4.9 s) and output fell to 0.4x vLLM's; at 512,
      TTFT p50 1.6 s and inter-token p99 0.86 s (vLLM 2.6 s); at 1024 and 2048 (vLLM's CPU server
      default) the stalls grow (p99 1.8 s, 3.5 s) for 2-6 % more output. A GPU takes thousands of rows
      at little cost: it keeps PREFILL_CHUNK, and idle waves of PREFILL_BUDGET.
    - On a CPU, the mixed-prefill bound (§5.13 C): beside d decoding streams a step takes at most
      max(SERVED_CPU_MIXED_FLOOR, SERVED_CPU_MIXED_PER_DECODE * d) prompt rows. A decode step of a
      few rows costs about what reading the weights costs, and each prompt row beside it adds a
      fixed share (about 1.1 ms on one AMX core at Qwen3-0.6B's size, against 110-130 ms for the
      decode rows): 64 rows keep a mixed step under twice a decode step, and 8 per stream keep the
      prompts of many streams fed (a stream of 64 outputs per 256-token prompt needs 4 a step).
      An explicit ``max_batch_tokens`` turns it off (the budget alone, as vLLM's flag)."""
    config = attrs.evolve(config, idle_prefill_fills_budget=True)
    if max_batch_tokens is None and device_type == "cpu":
        return attrs.evolve(config, max_batch_tokens=SERVED_CPU_BATCH_TOKENS, max_prefill_tokens=SERVED_CPU_BATCH_TOKENS,
                            mixed_prefill_floor=SERVED_CPU_MIXED_FLOOR,
                            mixed_prefill_per_decode=SERVED_CPU_MIXED_PER_DECODE)
    if max_batch_tokens is not None:
        return attrs.evolve(config, max_batch_tokens=max_batch_tokens, max_prefill_tokens=max_batch_tokens)
    return config


def context_limit(cfg: ModelConfig) -> int:
    """The scheduler's ``max_seq_len``: the model's context less the widest verify (so the rows of
    a verify started just before the scheduler's limit still fit in the model's context)."""
    widest = max(cfg.dflash_gamma + 1, MTP_DRAFTS + 1) + 1
    return cfg.max_seq_len - widest


def max_prompt_len(cfg: ModelConfig) -> int:
    """The longest prompt that leaves room for at least one generated token."""
    return context_limit(cfg) - 2


def model_eos_ids(cfg: ModelConfig) -> tuple[int, ...]:
    """The model config's end-of-sequence ids (``eos_id`` first)."""
    return tuple(getattr(cfg, "stop_ids", (cfg.eos_id,)))


def scheduler_setup(cfg: ModelConfig, spec: str, batch: int, eos_ids: Optional[Seq[int]] = None
                    ) -> tuple[SchedulerConfig, ModelInfo, Optional[str]]:
    """(scheduler config, model info, device proposer) for a speculation mode; ``eos_ids`` default
    to the model's (``()``: no EOS). A server bounds what its streams wait on besides (`served_config`)."""
    if spec not in SPECS:
        raise GenerateError(f"--spec {spec}: unknown speculation mode (choose from {', '.join(SPECS)})")
    if not 1 <= batch <= cfg.max_slots:
        raise GenerateError(f"--batch {batch}: must be between 1 and {cfg.max_slots} (the model's slots)")
    if spec == "mtp" and not (cfg.mtp or cfg.mtp_layers == 1):
        raise GenerateError("--spec mtp: the model has no MTP head (config mtp = false, and no one-layer "
                            "checkpoint MTP module)")
    if spec == "dflash" and cfg.dflash_gamma <= 0:
        raise GenerateError("--spec dflash: the model has no DFlash drafter (config dflash_gamma = 0, "
                            "no --draft-model)")
    eos = model_eos_ids(cfg) if eos_ids is None else tuple(eos_ids)
    # prompts are chunked (PREFILL_CHUNK tokens a step) and those that arrive together are prefilled
    # together in one forward of at most PREFILL_BUDGET rows (specs/scheduler.md §5.10, §5.13)
    common: dict[str, Any] = dict(eos_ids=eos, max_batch_size=batch, max_seq_len=context_limit(cfg),
                                  admission_watermark=cfg.max_seq_len, max_prefill_tokens=PREFILL_CHUNK,
                                  max_batch_tokens=PREFILL_BUDGET, prefill_new_together=True,
                                  mixed_adapters=True)
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


_TOKEN_ID = re.compile(r"-?[0-9]{1,18}")


def parse_prompt(text: str, source: str) -> list[int]:
    """Token ids separated by spaces or commas, in ASCII digits (``1_0`` and ``٣`` are refused)."""
    words = text.replace(",", " ").split()
    if not words:
        raise GenerateError(f"{source}: the prompt is empty")
    tokens = []
    for word in words:
        if not _TOKEN_ID.fullmatch(word):
            raise GenerateError(f"{source}: {word!r} is not a token id (expected integers in ASCII digits)")
        tokens.append(int(word))
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
    discarded_tokens: int = 0  # received after a stop string, before the Cancel took effect
    acceptance_by_position: tuple[float, ...] = ()  # share of verified drafts kept, by draft position
    host_s: Optional[float] = None  # with a device lane: the host's working time (wall less its waits)
    hidden_s: Optional[float] = None  # with a device lane: the part of host_s that ran beside device work

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def forwards_per_token(self) -> float:
        return self.target_forwards / self.generated_tokens if self.generated_tokens else 0.0

    def line(self) -> str:
        mal = "-" if self.mean_accepted_length is None else f"{self.mean_accepted_length:.2f}"
        discarded = f" discarded_tokens={self.discarded_tokens}" if self.discarded_tokens else ""
        return (f"summary: spec={self.spec} device={self.device} batch={self.batch} requests={self.requests} "
                f"tokens={self.generated_tokens} time={self.seconds:.3f}s tokens/s={self.tokens_per_s:.1f} "
                f"target_forwards={self.target_forwards} forwards/token={self.forwards_per_token:.3f} "
                f"verifies={self.verifies} mean_accepted_len={mal} cached_prompt_tokens={self.cached_prompt_tokens}"
                f"{discarded}{self._lane_figures()}")

    def _lane_figures(self) -> str:
        if self.host_s is None or self.hidden_s is None:
            return ""
        share = 100 * self.hidden_s / self.host_s if self.host_s > 0 else 0.0
        return f" overlap: host_s={self.host_s:.3f} hidden_host_s={self.hidden_s:.3f} ({share:.0f}%)"

    def to_json(self) -> dict[str, Any]:
        """The final record of ``fxsched generate --json``."""
        return {
            "summary": True, "spec": self.spec, "device": self.device, "batch": self.batch,
            "requests": self.requests, "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens, "discarded_tokens": self.discarded_tokens,
            "seconds": self.seconds, "tokens_per_s": self.tokens_per_s,
            "target_forwards": self.target_forwards, "forwards_per_token": self.forwards_per_token,
            "verifies": self.verifies, "accepted_drafts": self.accepted_drafts,
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_by_position": list(self.acceptance_by_position),
            "cached_prompt_tokens": self.cached_prompt_tokens, "steps": self.steps,
            "overlap": self.host_s is not None, "host_s": self.host_s, "hidden_host_s": self.hidden_s,
        }


@dataclass
class GenerateResult:
    results: list[RequestResult]
    summary: Summary
    device: TorchDevice

    @property
    def outputs(self) -> list[list[int]]:
        return [r.tokens for r in self.results]


def _recorder(record: Optional[str | Path], config: SchedulerConfig, model: ModelInfo, spec: str, max_tokens: int,
              sampling: SamplingOptions, meta: Optional[dict[str, Any]]):
    """The run's ``EventRecorder`` (None without ``record``); an unwritable path is a ``GenerateError``."""
    if record is None:
        return None
    from fxsched.runtime.eventlog import EventRecorder
    from fxsched.runtime.eventlog_codec import EventLogError

    header_meta = {"command": "generate", "spec": spec, "max_tokens": max_tokens,
                   "sampling": {k: getattr(sampling, k) for k in ("temperature", "top_p", "top_k", "min_p", "seed",
                                                                 "logprobs")},
                   **(meta or {})}
    try:
        return EventRecorder(record, config, model, header_meta)
    except EventLogError as err:
        raise GenerateError(f"--record {err}") from None


def generate(engine: HybridEngine, prompts: Seq[Seq[int]], max_tokens: int, spec: str = "none",
             batch: Optional[int] = None, drafter: Optional[Drafter] = None, strict: bool = False,
             progress: Optional[Callable[[int], None]] = None,
             wrap_device: Optional[Callable[[TorchDevice], Device]] = None, *,
             eos_ids: Optional[Seq[int]] = None, text: Optional[TextOptions] = None,
             on_text: Optional[Callable[[int, str], None]] = None,
             on_finish: Optional[Callable[[RequestResult], None]] = None,
             sampling: SamplingOptions = GREEDY, record: Optional[str | Path] = None,
             record_meta: Optional[dict[str, Any]] = None, late_drafts: bool = True,
             overlap: bool = False, async_scheduling: Optional[bool] = None,
             adapter_slots: Optional[Seq[int]] = None) -> GenerateResult:
    """Generate up to ``max_tokens`` tokens for each prompt through the scheduler (greedy unless
    ``sampling`` says otherwise; see the module docstring).

    ``batch`` caps the sequences running at once (default: every prompt, up to the model's
    slots). ``drafter`` replaces the model's drafter. ``progress(n)`` is called as tokens arrive.
    ``wrap_device`` may put a layer between the interpreter and the device (expert parallelism).
    ``eos_ids``: the ids that end a request (default the model's; ``()`` for none). ``text``
    detokenizes and applies stop strings; ``on_text(request id, piece)`` streams that text and
    ``on_finish(result)`` is called as each request ends (request ids are 1, 2, ... in prompt
    order). ``late_drafts``: proposals keep their drafts on the device until the verify that
    consumes them reads everything back at once (specs/async.md §16.3; expert parallelism turns it
    off: its words carry every input). ``overlap``: carry the device's effects out on a device lane
    (``DeviceLane``, specs/async.md §16.5), so the host's work runs beside the forwards (not with
    ``wrap_device``). ``async_scheduling``: plain decodes answered ahead, the host one tick ahead of
    the device (specs/async.md §16.6; None: on for a CUDA engine, off on the CPU and under
    ``wrap_device``). ``adapter_slots``: the LoRA pool slot each prompt's request runs with (-1: the
    base model; default: every request on the base model), adapters the caller loaded into
    ``engine``'s pool (specs/lora.md §18.7). ``record``: write the run's event log there (``fxsched.runtime.eventlog``; replay it
    with ``fxsched replay``), with ``record_meta`` in its header; the file is created only once the
    input has been checked. Raises ``GenerateError`` for bad input (an unwritable ``record`` path
    too) and ``RunError`` if the run cannot finish.
    """
    ensure_configured()
    cfg = engine.cfg
    if not prompts:
        raise GenerateError("no prompts")
    if max_tokens < 1:
        raise GenerateError(f"--max-tokens {max_tokens}: must be at least 1")
    for i, p in enumerate(prompts):
        check_prompt(p, cfg, f"prompt {i + 1}")
    if overlap and wrap_device is not None:
        raise GenerateError("--overlap: the device lane does not run under expert parallelism")
    batch = batch if batch is not None else min(len(prompts), cfg.max_slots)
    config, model, proposer = scheduler_setup(cfg, spec, batch, eos_ids)
    if async_scheduling is None:  # (a wrapped device, expert parallelism's leader, keeps no decode)
        async_scheduling = engine.device.type == "cuda" and wrap_device is None
    if async_scheduling:
        config = attrs.evolve(config, async_scheduling=True)
    if sampling.logprobs > cfg.vocab_size:
        raise GenerateError(f"--logprobs {sampling.logprobs}: must be at most the vocabulary size {cfg.vocab_size}")
    requests = [sampling.request(i, p, max_tokens) for i, p in enumerate(prompts)]
    if adapter_slots is not None:
        if len(adapter_slots) != len(prompts):
            raise GenerateError(f"{len(adapter_slots)} adapter slots for {len(prompts)} prompts")
        requests = [attrs.evolve(r, adapter_slot=slot) for r, slot in zip(requests, adapter_slots, strict=True)]
    recorder = _recorder(record, config, model, spec, max_tokens, sampling, record_meta)
    try:
        device = TorchDevice(engine, proposer=proposer, drafter=drafter, strict=strict,
                             late_drafts=late_drafts, decode_ahead=async_scheduling)
    except BaseException:
        if recorder is not None:
            recorder.close()
        raise
    host = GenerateHost(requests, config.eos_ids, progress or (lambda n: None), text, on_text, on_finish)
    if sampling.logprobs:
        host.logprobs = LogprobWitness(device)
    lane = DeviceLane(torch.no_grad) if overlap else None
    interpreter = Interpreter(wrap_device(device) if wrap_device else device, host, config.eos_ids,
                              observer=Observers(recorder, host.witness, host.logprobs), lane=lane)
    start = time.perf_counter()
    interrupted = False
    try:
        with torch.no_grad():
            interpreter.run(initial_state(config, model), [ev.Arrival(r) for r in requests] + [ev.Boot()])
        device.streams.synchronize_all()
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if recorder is not None:
            recorder.close()
        if lane is not None:
            lane.fence()  # nothing of the device is touched here while the lane still runs
            lane.close()
        try:
            device.release_all()
            device.close()
        except Exception:
            if not interrupted:  # after Ctrl-C the device may be mid-call; the results still count
                raise
    seconds = time.perf_counter() - start
    if interrupted:
        host.interrupt()
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
        discarded_tokens=sum(r.received - len(r.tokens) for r in results),
        acceptance_by_position=stats.acceptance_by_position,
        host_s=None if lane is None else seconds - lane.waited_s,
        hidden_s=None if lane is None else lane.hidden_s,
    )
    if interrupted:
        raise GenerateInterrupted(GenerateResult(results, summary, device))
    return GenerateResult(results, summary, device)
