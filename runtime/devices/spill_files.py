"""Spill files: a sequence's saved state on disk, with a header and a checksum.

Layout: one header line ``FXSPILL 1 <sha256 of the body> <body length>`` then a JSON body. A
missing, truncated or altered file is a ``SpillError`` naming the file and what is wrong. The error
names the file by its own name (``seq-3.spill``), never by the private temporary folder it lives
in, so a trace that records the error is the same on every run.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Optional

MAGIC = "FXSPILL"
VERSION = 1


class SpillError(Exception):
    pass


class SpillFiles:
    """Spill files in a private temporary directory, one per sequence id."""

    def __init__(self, root: Optional[Path] = None):
        self._root = root
        self._owned = root is None

    @property
    def root(self) -> Path:
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="fxsched-spill-"))
            # removed by close(), or when these files are collected or the process exits unclosed
            self._cleanup = weakref.finalize(self, shutil.rmtree, self._root, True)
        return self._root

    def path_for(self, seq: int) -> Path:
        return self.root / f"seq-{seq}.spill"

    def write(self, seq: int, state: dict) -> Path:
        body = json.dumps(state, sort_keys=True).encode()
        digest = hashlib.sha256(body).hexdigest()
        path = self.path_for(seq)
        path.write_bytes(f"{MAGIC} {VERSION} {digest} {len(body)}\n".encode() + body)
        return path

    def read(self, seq: int) -> dict:
        """The saved state of ``seq``; the file is removed once read and checked."""
        path = self.path_for(seq)
        name = path.name  # what an error names: the same on every run (see the module docstring)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise SpillError(f"spill file {name} is missing") from None
        head, _, body = raw.partition(b"\n")
        parts = head.decode(errors="replace").split()
        if len(parts) != 4 or parts[0] != MAGIC:
            raise SpillError(f"spill file {name} has no {MAGIC} header")
        if parts[1] != str(VERSION):
            raise SpillError(f"spill file {name} has version {parts[1]}, expected {VERSION}")
        if not parts[3].isdigit() or int(parts[3]) != len(body):
            raise SpillError(f"spill file {name} is truncated ({len(body)} of {parts[3]} bytes)")
        if hashlib.sha256(body).hexdigest() != parts[2]:
            raise SpillError(f"spill file {name} is corrupted (checksum mismatch)")
        path.unlink()
        return json.loads(body)

    def close(self) -> None:
        if self._owned and self._root is not None:
            self._cleanup()
            self._root = None
