"""Benchmarks: the step benchmark, the generate benchmark and its prompts."""
