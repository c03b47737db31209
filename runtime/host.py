"""The drive loop's two parties besides the device: the ``Host`` (clients and the request inbox) and
an ``Observer`` that watches the loop (specs/runner.md §4.1, §4.3). ``runtime/interpreter.py``
takes one of each.
"""

from __future__ import annotations

from typing import Sequence as Seq

from fxsched.core import events as ev
from fxsched.core.state import SchedulerState


class Host:
    """The world outside the device: clients and the request inbox.

    ``inputs`` collects input events that arise while a batch runs (late arrivals, clock
    readings, rotation requests); the interpreter takes them after the batch. ``send`` gets every
    client output and rotation acknowledgement; ``wait_for_input`` answers a blocking wait with
    the events that arrived (none by default). Subclasses override what they need.
    """

    def __init__(self) -> None:
        self.inputs: list[ev.Event] = []

    def take_inputs(self) -> list[ev.Event]:
        """The input events posted since the last call, in order (the caller reads it, never adds
        to it: with none posted it is the host's own empty list)."""
        taken = self.inputs
        if taken:
            self.inputs = []
        return taken

    def send(self, output) -> None:
        pass

    def wait_for_input(self) -> list[ev.Event]:
        return []


class Observer:
    """Watches the drive loop; every method is a no-op here, subclasses override what they need.

    For each event: ``before_step(event)``, then ``stepped(event, state, effects)`` with what
    ``step`` returned (before any effect is carried out), then ``performed(state)`` once the batch
    has been carried out. ``output`` gets every client output (and rotation acknowledgement) when
    the host does.
    """

    def before_step(self, event: ev.Event) -> None:
        pass

    def stepped(self, event: ev.Event, state: SchedulerState, effects: Seq) -> None:
        pass

    def performed(self, state: SchedulerState) -> None:
        pass

    def output(self, output) -> None:
        pass

