"""The episodes of the model checker's walk (specs/checker.md §11.1): the records a seed draws
(``Episode`` and its requests, ``SimRequest``) and the constants the draws share."""

from __future__ import annotations

import random
from typing import Any, Optional

import attrs

from fxsched.core.config import ModelInfo, SchedulerConfig
from fxsched.core.faults import Halt
from fxsched.core.request import Request
from fxsched.core.table import ANSWERS
from fxsched.runtime.check.invariants import expected_output
from fxsched.runtime.devices.script_rules import Script

MODES = ("plain", "mtp1", "mtp2", "mtp3", "dflash", "ngram", "self_spec")
TICK_MS = 10.0
BOUNDARY = 41  # the watchdog episodes' boundary token: outside the random scripts' 2 .. 40
ADAPTERS = {-1: 0, 1: 1, 2: 1}  # adapter slot -> id on the simulated device; slot 3 is unknown
FAULT_PHASES = tuple(sorted(t.__name__ for t, phase in ANSWERS.items() if not isinstance(phase.fault, Halt)))
"""The waiting phases a ``DeviceFault`` may answer without halting the loop (specs/faults.md §8.3)."""


_PROMPT_BODY = tuple(2 + (i % 7) for i in range(1, 8))
"""A request's prompt after its id: token i is 2 + (i mod 7), i = 1, 2, ..."""


@attrs.frozen
class SimRequest:
    id: int
    prompt_len: int
    tokens: tuple[int, ...]
    max_tokens: int
    streaming: bool = True
    wrong_every: int = 0
    cancel_at: Optional[int] = None
    deadline_ms: Optional[float] = None
    arrive_tick: int = 0
    num_beams: int = 1
    min_tokens: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    top_logprobs: int = 0
    adapter_slot: int = -1
    host_cancel_tick: Optional[int] = None  # the client cancels at this tick (whatever the request is doing)

    def request(self) -> Request:
        n = self.prompt_len - 1
        prompt = (self.id,) + (_PROMPT_BODY * (n // len(_PROMPT_BODY) + 1))[:n]
        return Request(id=self.id, prompt=prompt, max_tokens=self.max_tokens, streaming=self.streaming,
                       deadline_ms=self.deadline_ms, num_beams=self.num_beams, min_tokens=self.min_tokens,
                       temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                       top_logprobs=self.top_logprobs, adapter_slot=self.adapter_slot)

    def script(self) -> Script:
        beam = expected_output(self.tokens, self.max_tokens) if self.num_beams > 1 else ()
        return Script(self.prompt_len, self.tokens, self.wrong_every, beam, self.cancel_at)


@attrs.frozen
class Episode:
    mode: str
    max_batch_size: int
    max_prefill_tokens: int
    spill: bool
    total_blocks: int
    held_blocks: int
    requests: tuple[SimRequest, ...]
    kv_exhaust_at: tuple[int, ...] = ()
    decode_fault_at: tuple[int, ...] = ()
    verify_fault_at: tuple[int, ...] = ()
    spill_corrupt_for: tuple[int, ...] = ()
    can_batch_verify: bool = True
    rotation_tick: Optional[int] = None
    close_tick: int = 0
    policy: str = "fifo"
    slai_deadline_ms: float = 1_000_000.0
    watchdog: bool = False
    max_seq_len: int = 4096
    prefix_cache: bool = False
    reclaimable: int = 0
    spill_missing_for: tuple[int, ...] = ()
    fault_phase: str = ""
    fault_phase_at: int = 0
    short_proposals: bool = False
    late_drafts: bool = False  # the device answers proposals late now and then (specs/async.md §16.3)
    lane: bool = False  # the device's effects run behind the host, on a deferred lane (specs/async.md §16.5)
    async_scheduling: bool = False  # plain decodes answered ahead now and then (specs/async.md §16.6)
    # the chance that a decode answered ahead fails afterwards (None: sim_decodes.AHEAD_FAILURE_CHANCE)
    ahead_failures: Optional[float] = None
    capacities: tuple[int, ...] = ()
    ssm_ring: int = 0  # > 0: the model has SSM layers and a snapshot ring of this many slots
    admission_watermark: int = 4096  # the KV reservation's horizon (small: prompts admitted on their own blocks)
    aim: str = ""  # the rare state an aimed episode was drawn for (runtime/check/aimed.py), "" for none
    twice: bool = False  # every event stepped twice on the same state, the results compared (step is pure)
    # other SchedulerConfig fields, (name, value) sorted by name (runtime/check/options.py)
    options: tuple[tuple[str, Any], ...] = ()

    def to_json(self) -> dict:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Episode":
        """The episode of a replay file. Files from before planted bugs left the checker carry an
        empty ``planted`` list, which is dropped; a file that planted a bug cannot be replayed."""
        data = dict(data)
        if data.pop("planted", None):
            raise ValueError("the episode plants bugs, which the checker no longer does "
                             "(planted bugs are source mutations run by the tests)")
        requests = tuple(SimRequest(**_lists_as_tuples(r)) for r in data.pop("requests"))
        options = tuple((name, tuple(v) if isinstance(v, list) else v) for name, v in data.pop("options", ()))
        return cls(requests=requests, options=options, **_lists_as_tuples(data))

    def config(self) -> SchedulerConfig:
        modes: dict[str, dict[str, Any]] = dict(
            plain={}, mtp1=dict(use_speculative=True, num_drafts=1), mtp2=dict(use_speculative=True, num_drafts=2),
            mtp3=dict(use_speculative=True, num_drafts=3), dflash=dict(use_speculative=True, dflash=True, num_drafts=5),
            ngram=dict(ngram_speculative=True), self_spec=dict(self_speculative=True, num_drafts=2))
        spec = modes[self.mode]
        return SchedulerConfig(max_batch_size=self.max_batch_size, max_prefill_tokens=self.max_prefill_tokens,
                               swap_space_gb=1.0 if self.spill else 0.0, policy=self.policy,
                               slai_deadline_ms=self.slai_deadline_ms, loop_watchdog=self.watchdog,
                               boundary_tokens=(BOUNDARY,) if self.watchdog else (), max_seq_len=self.max_seq_len,
                               admission_watermark=self.admission_watermark,
                               async_scheduling=self.async_scheduling, **spec, **dict(self.options))

    def model(self) -> ModelInfo:
        return ModelInfo(total_blocks=self.total_blocks, has_proposer=self.mode.startswith(("mtp", "dflash")),
                         dflash_gamma=6 if self.mode == "dflash" else None,
                         has_self_speculative=self.mode == "self_spec",
                         has_ssm_layers=self.ssm_ring > 0, ring_slots=self.ssm_ring,
                         supports_beam=any(r.num_beams > 1 for r in self.requests))


def _lists_as_tuples(data: dict[str, Any]) -> dict[str, Any]:
    """A record's fields from JSON: lists back to the tuples of the frozen records."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}


def _randints(rng: random.Random, low: int, high: int, n: int) -> list[int]:
    """``n`` draws of ``rng.randint(low, high)``, the very numbers it gives, without its two Python
    frames per draw (``randint(a, b)`` is ``a + _randbelow(b - a + 1)``; a script token is most of
    the draws of an episode)."""
    below, width = rng._randbelow, high - low + 1  # type: ignore[attr-defined]
    return [low + below(width) for _ in range(n)]


