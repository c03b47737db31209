"""The ``fxsched`` command line: ``main`` and the commands of each sub-command."""

from fxsched.runtime.cli.app import main

__all__ = ["main"]
