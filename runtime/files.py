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


def read_text(path: str | Path, what: str, error: Callable[[str], Exception]) -> str:
    """The whole file at ``path`` as UTF-8 text."""
    with open_binary(path, what, error) as fh:
        try:
            data = fh.read()
        except OSError as err:
            raise error(f"{path}: cannot read it ({err.strerror or err})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise error(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
