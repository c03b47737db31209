"""Scenarios: the loader of specs/scenarios/*.toml and the runner that prints their traces."""
