"""``generate`` with expert-parallel ranks: the leader's ``TorchDevice`` wrapped in
``EpLeaderDevice``, each worker running an ``EngineReplica`` of the same model.

``generate_ep`` takes ``generate``'s arguments (plus the EP ones) and returns a
``GenerateResult`` (an ``EpGenerateResult``), so a caller switches with one line.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence as Seq

import torch

from fxsched.core import events as ev
from fxsched.core.request import Request
from fxsched.core.state import initial_state
from fxsched.runtime.ep_replica import EngineReplicaSpec
from fxsched.runtime.ep_run import DEFAULT_TIMEOUT_S, EpCluster, EpRunError
from fxsched.runtime.ep_worker import WorkerOptions
from fxsched.runtime.generate import (
    GenerateError,
    GenerateHost,
    GenerateResult,
    Summary,
    check_prompt,
    scheduler_setup,
)
from fxsched.runtime.interpreter import Interpreter, RunError
from fxsched.runtime.logs import ensure_configured
from fxsched.runtime.torch_device import Drafter, TorchDevice
from fxsched.runtime.torch_model import HybridEngine


@dataclass
class EpGenerateResult(GenerateResult):
    """A ``GenerateResult`` plus what the EP group saw."""

    leader_ticks: list = field(default_factory=list)
    worker_reports: dict = field(default_factory=dict)


def generate_ep(engine: HybridEngine, prompts: Seq[Seq[int]], max_tokens: int, spec: str = "none",
                batch: Optional[int] = None, drafter: Optional[Drafter] = None, strict: bool = False,
                progress: Optional[Callable[[int], None]] = None, *, ep_ranks: int = 2,
                weights: Optional[str] = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                options: WorkerOptions = WorkerOptions()) -> EpGenerateResult:
    """``generate.generate`` on ``ep_ranks`` ranks. ``weights`` is the file ``engine`` was loaded
    from (None: the seeded random model), so the workers build the same model. Raises
    ``EpRunError`` (a RunError) if the group fails, never waiting longer than ``timeout_s``."""
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
    replica = EngineReplicaSpec(cfg.to_dict(), weights, engine.device.type)
    with EpCluster(ep_ranks, timeout_s, options=_with_replica(options, replica)) as cluster:
        device = TorchDevice(engine, proposer=proposer, drafter=drafter, strict=strict)
        leader = cluster.wrap(device)
        host = GenerateHost(requests, cfg.eos_id, progress or (lambda n: None))
        interpreter = Interpreter(leader, host, config.eos_ids)
        start = time.perf_counter()
        try:
            with torch.no_grad():
                interpreter.run(initial_state(config, model), [ev.Arrival(r) for r in requests] + [ev.Boot()])
            device.streams.synchronize_all()
            leader.stop_workers()
        except RunError as err:
            if leader.failure is not None:
                raise EpRunError(str(err) if leader.failure in str(err) else f"{err} (EP: {leader.failure})") from err
            raise
        finally:
            device.close()
        seconds = time.perf_counter() - start
        if leader.failure is not None:
            raise EpRunError(leader.failure)
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
    return EpGenerateResult(results, summary, device, list(leader.tick_snapshots), dict(leader.worker_reports))


def _with_replica(options: WorkerOptions, replica: EngineReplicaSpec) -> WorkerOptions:
    import attrs

    return attrs.evolve(options, replica=replica)
