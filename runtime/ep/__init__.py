"""Expert parallelism: the EP command stream, its leader device, worker processes and cluster runs."""
