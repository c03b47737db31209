"""``Violation``: what every check of the model checker raises (specs/checker.md §11.2)."""

from __future__ import annotations


class Violation(Exception):
    """An invariant does not hold; ``invariant`` names it."""

    def __init__(self, invariant: str, message: str):
        super().__init__(f"{invariant}: {message}")
        self.invariant = invariant
        self.message = message
