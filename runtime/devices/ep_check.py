"""The simulated device's reading of the EP command words (specs/expert-parallel.md): the words a
leader broadcasts are parsed as a worker parses them (``runtime/ep/protocol.py``), and every
forward they announce for a slot must be what the next forward on that slot runs there: for a
prefill the same chunk start, chunk length and prompt, for a decode the same token, for a verify
the same input tokens. A worker writes what the words say into its copy of the slot (the mirror),
so wrong words leave it holding another chunk than the leader's KV. The words that report a result
are read too: a verify's accept count is kept in ``accepted`` for the device to hold against what
that verify accepted, and the release word is checked by the device against the slot it freed.
The shutdown word is the last: no word follows it.
"""

from __future__ import annotations

from typing import Optional, Union

from fxsched.runtime.ep.protocol import (Accept, CommandParser, Decode, Kind, Prefill, ProtocolError, Release,
                                         Shutdown, Verify)

Announced = Union[Prefill, Decode, Verify]


class EpWordCheck:
    """Parses the words as they are sent and keeps, per slot, the forward they announced last;
    ``take`` hands a forward that runs on some slots the announcements it must match."""

    def __init__(self) -> None:
        self.parser = CommandParser()
        self.number = 0
        self.announced: dict[int, Announced] = {}  # slot -> the forward announced for it, not run yet
        self.accepted: Optional[Accept] = None  # the accept count just parsed, until the device reads it
        self.shut = False  # the shutdown word came

    def feed(self, kind: Kind, a: int = 0, b: int = 0, payload=()) -> Optional[str]:
        """One broadcast; a message that breaks the protocol is the error returned. (An announcement
        may replace one whose forward never ran: its sequence failed, finished or left the step.)
        The parser reads the message's fields as a worker reads the message (``feed_fields``: the
        simulated device sends a word per call, hot in the model checker)."""
        self.number += 1
        if self.shut:
            return f"EP word {self.number} ({kind.name}) after the shutdown word"
        try:
            command = self.parser.feed_fields(kind, a, b, tuple(payload), self.number)
        except ProtocolError as err:
            return str(err)
        if command is None:
            return None
        if isinstance(command, (Prefill, Decode, Verify)):
            self.announced[command.slot] = command
        elif isinstance(command, Release):
            self.announced.pop(command.slot, None)
        elif isinstance(command, Accept):
            self.accepted = command
        elif isinstance(command, Shutdown):
            self.shut = True
        return None

    def take(self, call: str, runs: tuple[Announced, ...]) -> Optional[str]:
        """A forward that carries out ``runs``: for each slot it runs on, what the words announced
        for that slot (if anything) must be what it runs there (None: all match)."""
        announced = self.announced
        for run in runs:
            said = announced.pop(run.slot, None)
            if said is not None and said != run:
                return f"the EP words announced {said!r} for slot {run.slot}, but {call} runs {run!r}"
        return None
