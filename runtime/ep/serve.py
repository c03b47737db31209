"""``fxsched serve --ep-ranks N``: the server's engine on expert-parallel ranks.

``ep_serving`` starts the cluster for the whole life of the server (the workers load the same model,
or their shares of a MoE checkpoint's experts, as for ``generate``: runtime/ep/generate.py) and
yields the ``wrap_device`` the ``ServeEngine`` puts around its ``TorchDevice``. The workers mirror
one leader device from its first command, so a scheduler life that ends in a fault cannot be
followed by a fresh one on the same group: the second ``wrap`` raises, the engine thread stops, and
the server answers 503 (``/health`` too) until it is restarted. Leaving the context stops the
workers (the shutdown word, then join / terminate) and the forkserver that launched them.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

from fxsched.runtime.ep import DEFAULT_TIMEOUT_S
from fxsched.runtime.ep.experts import WeightsReport
from fxsched.runtime.ep.generate import bind_experts, group_options
from fxsched.runtime.ep.run import EpCluster, stop_launcher
from fxsched.runtime.ep.worker import DEFAULT_OPTIONS, WorkerOptions
from fxsched.runtime.interpreter import RunError
from fxsched.runtime.logs import ensure_configured
from fxsched.runtime.torch_model import HybridEngine


@contextlib.contextmanager
def ep_serving(engine: HybridEngine, ep_ranks: int, weights: Optional[str] = None, model_dir: Optional[str] = None,
               timeout_s: float = DEFAULT_TIMEOUT_S, options: WorkerOptions = DEFAULT_OPTIONS,
               on_weights: Optional[Callable[[WeightsReport], None]] = None) -> Iterator[Callable[[Any], Any]]:
    """The ``wrap_device`` of a server whose engine runs on ``ep_ranks`` ranks (module docstring);
    ``EpRunError`` (a RunError) when the group cannot start."""
    ensure_configured()
    options, shards = group_options(engine, ep_ranks, weights, model_dir, options)
    try:
        with EpCluster(ep_ranks, timeout_s, options=options) as cluster:
            group, _ = bind_experts(cluster, shards, engine, options, on_weights)
            leaders: list[Any] = []

            def wrap(device: Any) -> Any:
                if leaders:
                    raise RunError(f"EP: the scheduler stopped ({leaders[0].failure or 'a fault'}) and the "
                                   f"{ep_ranks}-rank group cannot start a new one; restart the server")
                leader = cluster.wrap(device)
                if group is not None:
                    leader.experts = group
                    group.leader = leader
                leaders.append(leader)
                return leader

            try:
                yield wrap
            finally:
                if group is not None:
                    group.unbind()
    finally:
        stop_launcher()
