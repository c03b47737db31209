"""The errors that stop a run: ``RunError`` (the run cannot go on) and ``BatchError`` (``step``
returned a batch that breaks the one-query rule) (specs/runner.md §4.7).
"""

from __future__ import annotations


class RunError(Exception):
    """The run cannot go on (a wait that can never be satisfied, a fatal device error)."""


class BatchError(RunError):
    """A batch of effects from ``step`` that does not end in exactly one query (or the teardown)."""
