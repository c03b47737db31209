"""Opening the files a user names (scenarios, replay files, event logs): one wording for what can
go wrong before a file's contents are read.

Each function takes ``what`` (the kind of file, as the message names it: "scenario file") and
``error`` (the caller's exception class, a ``ValueError`` the CLI turns into one line and exit 2),
and raises ``error`` with a message that starts with the path.
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO, Callable


def open_binary(path: str | Path, what: str, error: Callable[[str], Exception]) -> BinaryIO:
    """The file at ``path`` opened for reading bytes."""
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise error(f"{path}: no such {what}") from None
    except IsADirectoryError:
        raise error(f"{path}: is a directory, not a {what}") from None
    except OSError as err:
        raise error(f"{path}: cannot read it ({err.strerror or err})") from None


MAX_TEXT_BYTES = 64 * 1024 * 1024  # the largest scenario or replay file read (a bound, not a size seen)


def read_text(path: str | Path, what: str, error: Callable[[str], Exception], limit: int = MAX_TEXT_BYTES) -> str:
    """The whole file at ``path`` as UTF-8 text; at most ``limit`` bytes are read (a larger file,
    or an endless one such as /dev/zero, is an error, not a process that grows)."""
    with open_binary(path, what, error) as fh:
        try:
            data = fh.read(limit + 1)
        except OSError as err:
            raise error(f"{path}: cannot read it ({err.strerror or err})") from None
    if len(data) > limit:
        raise error(f"{path}: larger than {limit >> 20} MiB, the most a {what} may be")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise error(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
