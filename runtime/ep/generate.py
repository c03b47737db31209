"""``generate`` with expert-parallel ranks: the leader's ``TorchDevice`` wrapped in
``EpLeaderDevice``; what the workers hold depends on the model.

* A sharded MoE model (the engine was loaded with ``expert_shard=(0, N)``): each worker loads its
  own range of every MoE layer's experts from ``model_dir`` (``experts.ExpertShardSpec``), reports
  its weight bytes, and computes its experts' part of every MoE layer call the leader's forwards
  make (``experts.ExpertGroup``, bound to the engine's shards for the run and unbound after it).
  The weights report (``WeightsReport``: expert and other bytes per rank) is logged
  (``ep_weights``) and handed to ``on_weights`` before the first forward.
* Any other model: each worker runs an ``EngineReplica`` of the same model (the seeded random
  model, the ``weights`` file, or the ``model_dir`` checkpoint) and the same forwards.

``generate_ep`` takes ``generate``'s arguments (plus the EP ones) and returns a
``GenerateResult`` (an ``EpGenerateResult``), so a caller switches with one line. A failed group
raises ``EpRunError``; when the run itself still finished (the requests in flight failed with the
group's error) the error carries that result, the tokens generated until the failure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence as Seq

import attrs
import structlog

from fxsched.runtime.ep.experts import ExpertGroup, ExpertShardSpec, WeightsReport, weights_report
from fxsched.runtime.ep.replica import EngineReplicaSpec
from fxsched.runtime.ep.run import DEFAULT_TIMEOUT_S, EpCluster, EpRunError
from fxsched.runtime.ep.worker import DEFAULT_OPTIONS, WorkerOptions
from fxsched.runtime.generate import GenerateResult, generate
from fxsched.runtime.interpreter import RunError
from fxsched.runtime.logs import ensure_configured
from fxsched.runtime.devices.torch import Drafter, TorchDevice
from fxsched.runtime.torch_model import HybridEngine
from fxsched.runtime.torch_model.moe import ExpertShard, expert_shards, weight_bytes

log = structlog.get_logger("fxsched.ep")


@dataclass
class EpGenerateResult(GenerateResult):
    """A ``GenerateResult`` plus what the EP group saw: the ticks, the workers' reports, and for a
    sharded model the weights per rank and rank 0's expert-call figures (``ExpertGroup.stats``)."""

    leader_ticks: list = field(default_factory=list)
    worker_reports: dict = field(default_factory=dict)
    weights: Optional[WeightsReport] = None
    experts: dict = field(default_factory=dict)


def _sharded(engine: HybridEngine, ep_ranks: int, model_dir) -> list[ExpertShard]:
    """The engine's expert shards, checked to be rank 0's of ``ep_ranks`` (none: not sharded)."""
    shards = expert_shards(engine.model.w)
    if not shards:
        return []
    bad = [s.prefix for s in shards if (s.rank, s.world) != (0, ep_ranks)]
    if bad:
        s = shards[0]
        raise ValueError(f"generate_ep: the engine holds expert shard {s.rank} of {s.world}, not 0 of "
                         f"{ep_ranks} (load it with expert_shard=(0, {ep_ranks}))")
    if model_dir is None:
        raise ValueError("generate_ep: the engine holds expert shard 0 only; give model_dir, the checkpoint "
                         "the workers load their experts from")
    return shards


def generate_ep(engine: HybridEngine, prompts: Seq[Seq[int]], max_tokens: int, spec: str = "none",
                batch: Optional[int] = None, drafter: Optional[Drafter] = None, strict: bool = False,
                progress: Optional[Callable[[int], None]] = None, *, ep_ranks: int = 2,
                weights: Optional[str] = None, model_dir: Optional[str] = None,
                timeout_s: float = DEFAULT_TIMEOUT_S, options: WorkerOptions = DEFAULT_OPTIONS,
                on_weights: Optional[Callable[[WeightsReport], None]] = None,
                **generate_options) -> EpGenerateResult:
    """``generate.generate`` on ``ep_ranks`` ranks (see the module docstring). ``weights`` is the
    file ``engine`` was loaded from, ``model_dir`` the checkpoint directory (None for both: the
    seeded random model), so the workers build the same model or their shards of it; the other
    keyword options (``eos_ids``, ``text``, ``on_text``, ``on_finish``, ``sampling``) go to
    ``generate``. Raises ``EpRunError`` (a RunError) if the group fails, never waiting longer than
    ``timeout_s`` on a worker (``options.startup_timeout_s`` while they load)."""
    ensure_configured()
    options, shards = group_options(engine, ep_ranks, weights, model_dir, options)
    with EpCluster(ep_ranks, timeout_s, options=options) as cluster:
        group, report = bind_experts(cluster, shards, engine, options, on_weights)
        leaders: list = []

        def wrap(device: TorchDevice):
            leaders.append(cluster.wrap(device))
            if group is not None:
                leaders[-1].experts = group
                group.leader = leaders[-1]
            return leaders[-1]

        try:
            result = generate(engine, prompts, max_tokens, spec, batch, drafter, strict, progress, wrap_device=wrap,
                              late_drafts=False, **generate_options)
            if leaders:
                leaders[0].stop_workers()
        except RunError as err:
            failure = leaders[0].failure if leaders else None
            if failure is not None and not isinstance(err, EpRunError):
                raise EpRunError(str(err) if failure in str(err) else f"{err} (EP: {failure})") from err
            raise
        finally:
            if group is not None:
                group.unbind()
        leader = leaders[0]
        out = EpGenerateResult(result.results, result.summary, result.device, list(leader.tick_snapshots),
                               dict(leader.worker_reports), report, group.stats() if group is not None else {})
        if leader.failure is not None:
            raise EpRunError(leader.failure, result=out)
    return out


def group_options(engine: HybridEngine, ep_ranks: int, weights: Optional[str], model_dir,
                  options: WorkerOptions = DEFAULT_OPTIONS) -> tuple[WorkerOptions, list[ExpertShard]]:
    """The workers' options for ``engine`` (see the module docstring) and its expert shards
    (none: every worker runs a replica)."""
    shards = _sharded(engine, ep_ranks, model_dir)
    device = engine.device.type
    if shards:
        return attrs.evolve(options, replica=None,
                            experts=ExpertShardSpec(str(model_dir), engine.cfg.dtype, device)), shards
    return attrs.evolve(options, replica=EngineReplicaSpec(
        engine.cfg.to_dict(), weights, device, model_dir=str(model_dir) if model_dir is not None else None)), shards


def bind_experts(cluster: EpCluster, shards: list[ExpertShard], engine: HybridEngine, options: WorkerOptions,
                 on_weights: Optional[Callable[[WeightsReport], None]] = None
                 ) -> tuple[Optional[ExpertGroup], Optional[WeightsReport]]:
    """For a sharded model (``cluster`` up): the workers' weights report, handed to ``on_weights``,
    and the expert group bound to the engine's shards (unbind it after the run); (None, None) else."""
    if not shards:
        return None, None
    report = _weights(cluster, shards, engine, options.startup_timeout_s)
    log.info("ep_weights", ranks=report.to_json())
    if on_weights is not None:
        on_weights(report)
    group = ExpertGroup(cluster.link)  # type: ignore[arg-type]  # the cluster is up
    group.bind(shards)
    return group, report


def _weights(cluster: EpCluster, shards: list[ExpertShard], engine: HybridEngine, timeout_s: float) -> WeightsReport:
    """Every worker's weights report (they have loaded their experts), checked against rank 0's."""
    assert cluster.link is not None
    try:
        posts = cluster.link.collect("weights", timeout_s)
        return weights_report(shards, weight_bytes(engine.model.w), posts)
    except RuntimeError as err:  # LinkError among them
        raise EpRunError(str(err)) from err
