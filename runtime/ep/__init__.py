"""Expert parallelism: the EP command stream, its leader device, worker processes and cluster runs."""

DEFAULT_TIMEOUT_S = 30.0  # seconds the leader waits on a worker (``--ep-timeout``)
