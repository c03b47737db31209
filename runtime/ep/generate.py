"""``generate`` with expert-parallel ranks: the leader's ``TorchDevice`` wrapped in
``EpLeaderDevice``, each worker running an ``EngineReplica`` of the same model.

``generate_ep`` takes ``generate``'s arguments (plus the EP ones) and returns a
``GenerateResult`` (an ``EpGenerateResult``), so a caller switches with one line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence as Seq

from fxsched.runtime.ep.replica import EngineReplicaSpec
from fxsched.runtime.ep.run import DEFAULT_TIMEOUT_S, EpCluster, EpRunError
from fxsched.runtime.ep.worker import DEFAULT_OPTIONS, WorkerOptions
from fxsched.runtime.generate import GenerateResult, generate
from fxsched.runtime.interpreter import RunError
from fxsched.runtime.logs import ensure_configured
from fxsched.runtime.devices.torch import Drafter, TorchDevice
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
                options: WorkerOptions = DEFAULT_OPTIONS, **generate_options) -> EpGenerateResult:
    """``generate.generate`` on ``ep_ranks`` ranks. ``weights`` is the file ``engine`` was loaded
    from (None: the seeded random model), so the workers build the same model; the other keyword
    options (``eos_ids``, ``text``, ``on_text``, ``on_finish``) go to ``generate``. Raises
    ``EpRunError`` (a RunError) if the group fails, never waiting longer than ``timeout_s``."""
    ensure_configured()
    replica = EngineReplicaSpec(engine.cfg.to_dict(), weights, engine.device.type)
    with EpCluster(ep_ranks, timeout_s, options=_with_replica(options, replica)) as cluster:
        leaders: list = []

        def wrap(device: TorchDevice):
            leaders.append(cluster.wrap(device))
            return leaders[-1]

        try:
            result = generate(engine, prompts, max_tokens, spec, batch, drafter, strict, progress, wrap_device=wrap,
                              **generate_options)
            if leaders:
                leaders[0].stop_workers()
        except RunError as err:
            failure = leaders[0].failure if leaders else None
            if failure is not None:
                raise EpRunError(str(err) if failure in str(err) else f"{err} (EP: {failure})") from err
            raise
        leader = leaders[0]
        if leader.failure is not None:
            raise EpRunError(leader.failure)
    return EpGenerateResult(result.results, result.summary, result.device, list(leader.tick_snapshots),
                            dict(leader.worker_reports))


def _with_replica(options: WorkerOptions, replica: EngineReplicaSpec) -> WorkerOptions:
    import attrs

    return attrs.evolve(options, replica=replica)
