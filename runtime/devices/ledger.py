"""The simulated device's ledgers (specs/checker.md §11.8): one account per resource the rule book
pairs an acquire with a release, kept per key, so that a second acquire of a held key, a release
of a key not held, and whatever is still held when the run ends are named where they happen.

An account maps a key (a slot number, a sequence id) to its holder (the sequence in the slot, the
adapter slot a sequence took, the request whose state a spill file keeps). The simulated device
calls ``acquire`` and ``release`` where its calls take and give back the resource, and turns an
answer other than ``None`` into a refusal of that call; the checker reads ``open`` at the end of
the run. The device's other accounts (kept tokens, pending proposals, the snapshot ring, the
stash) are checked where they are used (the layers of runtime/devices/simulated.py).
"""

from __future__ import annotations

from typing import Hashable, Optional

SLOT = "slot"  # device slot -> the sequence in it (alloc_sequence .. free_sequence, moved by compaction)
ADAPTER = "adapter"  # sequence -> the adapter slot it acquired (acquire_adapter_slot .. free_sequence)
SPILL = "spill file"  # sequence -> the request whose state it saved (save_sequence_state .. restore)
KINDS = (SLOT, ADAPTER, SPILL)

_ABSENT = object()


class Ledger:
    """Acquire/release accounts, one per kind in ``KINDS``; each method answers what was wrong
    (``None``: nothing)."""

    __slots__ = ("accounts",)

    def __init__(self) -> None:
        self.accounts: dict[str, dict[Hashable, object]] = {kind: {} for kind in KINDS}

    def acquire(self, kind: str, key: Hashable, holder: object) -> Optional[str]:
        account = self.accounts[kind]
        held = account.get(key, _ABSENT)
        if held is not _ABSENT:
            return f"{kind} {key} acquired for {holder} while {held} holds it"
        account[key] = holder
        return None

    def release(self, kind: str, key: Hashable) -> Optional[str]:
        if self.accounts[kind].pop(key, _ABSENT) is _ABSENT:
            return f"{kind} {key} released, but nothing holds it (never acquired, or released twice)"
        return None

    def holder(self, kind: str, key: Hashable) -> object:
        """Who holds ``key`` (``None``: nobody)."""
        return self.accounts[kind].get(key)

    def open(self) -> dict[str, dict[Hashable, object]]:
        """What is still held, per kind (kinds with nothing held left out)."""
        return {kind: dict(account) for kind, account in self.accounts.items() if account}
