"""Expert parallelism: the EP command stream as torch.distributed collectives.

Rank 0 runs the scheduler on its device wrapped in ``EpLeaderDevice``; ranks 1.. run
``run_worker``: they mirror every slot from the stream and, with a model replica, run the same
forwards. The modules:

* ``ep_protocol`` — words, message kinds, the wire format, the command parser;
* ``ep_mirror`` — the slots as the stream describes them (snapshots, digests);
* ``ep_link`` — broadcast and acks over torch.distributed (and an in-process loopback);
* ``ep_leader`` — ``EpLeaderDevice``;
* ``ep_worker`` — ``EpWorker`` and the worker process ``run_worker``;
* ``ep_replica`` — ``EngineReplica``, a worker's copy of the torch model;
* ``ep_run`` — ``EpCluster``, ``run_scenario_ep``; ``ep_generate`` — ``generate_ep``;
* ``cli_ep`` — ``--ep-ranks`` for the CLI.
"""

from fxsched.runtime.ep_leader import EpLeaderDevice
from fxsched.runtime.ep_link import LinkError
from fxsched.runtime.ep_mirror import EpMirror
from fxsched.runtime.ep_run import (
    EpCluster,
    EpRunError,
    EpRunResult,
    execute_scenario_ep,
    execute_scenario_loopback,
    run_on_cluster,
    run_scenario_ep,
)
from fxsched.runtime.ep_worker import EpWorker, WorkerOptions, run_worker

__all__ = ["EpCluster", "EpLeaderDevice", "EpMirror", "EpRunError", "EpRunResult", "EpWorker", "LinkError",
           "WorkerOptions", "execute_scenario_ep", "execute_scenario_loopback", "run_on_cluster", "run_scenario_ep",
           "run_worker"]
