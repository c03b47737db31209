"""The model checker: invariants, the seeded random walk over random episodes, and replay files."""
