"""Reading and writing the files a user names on the command line, with bounds.

A file is read with ``read_user_bytes`` / ``read_user_text``: at most ``limit`` bytes are ever read
(one more tells that it is larger), so ``--prompt-ids-file /dev/zero`` or a 20 GB file is one
line, "larger than N bytes", within a second, not a process that grows until the kernel kills it.
Every problem is a ``UserFileError`` whose message starts with the option and the path.

``record_problem`` says why an output path (``--record FILE``) cannot be used: an existing file is
refused unless ``--force`` (a run never overwrites a log silently), and so are a missing folder,
a folder in place of the file, an unwritable folder.

No torch and no serve extra here: the CLI checks its files before it loads either.
"""

from __future__ import annotations

import os
from pathlib import Path

MAX_PROMPT_FILE_BYTES = 64 * 1024 * 1024  # --prompt-file, --prompt-ids-file


class UserFileError(ValueError):
    """A file on the command line that cannot be used (the message names the option and the path)."""


def _size(limit: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if limit >= scale and limit % scale == 0:
            return f"{limit // scale} {unit}"
    return f"{limit} bytes"


def read_user_bytes(path: str | Path, option: str, limit: int) -> bytes:
    """The bytes of the file at ``path``, at most ``limit`` of them (``UserFileError`` otherwise)."""
    where = f"{option} {path}"
    try:
        with open(path, "rb") as fh:
            data = fh.read(limit + 1)
    except FileNotFoundError:
        raise UserFileError(f"{where}: no such file") from None
    except IsADirectoryError:
        raise UserFileError(f"{where}: is a directory, not a file") from None
    except OSError as err:
        raise UserFileError(f"{where}: cannot read it ({err.strerror or err})") from None
    if len(data) > limit:
        raise UserFileError(f"{where}: larger than {_size(limit)}, the most this option reads")
    return data


def read_user_text(path: str | Path, option: str, limit: int) -> str:
    """The UTF-8 text of the file at ``path`` (bounded as ``read_user_bytes``)."""
    data = read_user_bytes(path, option, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserFileError(f"{option} {path}: not UTF-8 text ({err.reason} at byte {err.start})") from None


def record_problem(path_text: str, force: bool) -> str:
    """Why ``--record path_text`` cannot be written ('' when it can)."""
    if not path_text:
        return "the path is empty"
    path = Path(path_text)
    if path.is_dir():
        return "is a directory (give a file name)"
    if (path.exists() or path.is_symlink()) and not force:
        return "the file exists (give --force to overwrite it)"
    folder = path.parent
    if not folder.is_dir():
        return f"no such folder {str(folder)!r}"
    if not os.access(folder, os.W_OK):
        return f"the folder {str(folder)!r} is not writable"
    return ""
