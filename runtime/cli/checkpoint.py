"""A model directory's first look, before torch is imported (specs/serve.md §12.12).

``fxsched generate --model DIR`` and ``fxsched serve DIR`` load torch (seconds) before the
loader reads the checkpoint, so a directory that is not one would be reported only then. These
checks run first, on the files alone, in the order the loader needs them: ``config.json`` (present,
a JSON object, at most ``MAX_CONFIG_BYTES``), then, where the command speaks text, the tokenizer
(``tokenizer.json`` in the model directory or ``--tokenizer DIR``). Each problem is one line naming
the option and the file, the loader's wording (``DIR/config.json: missing (a checkpoint directory
needs config.json)``).

No torch, no tokenizers, no serve extra here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from fxsched.runtime.cli.bounds import UserFileError, read_user_text

MAX_CONFIG_BYTES = 16 * 1024 * 1024
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
GENERATION_CONFIG_FILE = "generation_config.json"


class CheckpointProblem(ValueError):
    """A model directory the command cannot use; the message is one line naming the file."""


def read_json_object(path: Path, option: str, required: bool = True, why: str = "") -> Optional[dict[str, Any]]:
    """The JSON object in ``path`` (None when it is absent and not ``required``; ``why`` says, in a
    missing file's message, what needs it)."""
    if not path.exists():
        if required:
            raise CheckpointProblem(f"{option}: {path}: missing" + (f" ({why})" if why else ""))
        return None
    if not path.is_file():
        raise CheckpointProblem(f"{option}: {path}: not a file")
    try:
        text = read_user_text(path, option, MAX_CONFIG_BYTES)
    except UserFileError as err:
        raise CheckpointProblem(str(err)) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise CheckpointProblem(f"{option}: {path}: not valid JSON ({err.msg} at line {err.lineno} column "
                                f"{err.colno})") from None
    except RecursionError:
        raise CheckpointProblem(f"{option}: {path}: not valid JSON (nested too deeply)") from None
    if not isinstance(data, dict):
        raise CheckpointProblem(f"{option}: {path}: expected a JSON object, got {type(data).__name__}")
    return data


def check_checkpoint(directory: str, label: str) -> dict[str, Any]:
    """``config.json`` of the checkpoint ``directory`` (``label``, e.g. ``--model DIR``, names it in
    errors), read and checked."""
    root = Path(directory)
    if not root.is_dir():
        raise CheckpointProblem(f"{label}: no such directory")
    config = read_json_object(root / CONFIG_FILE, label, why=f"a checkpoint directory needs {CONFIG_FILE}")
    assert config is not None
    return config


def has_tokenizer(directory: str) -> bool:
    """Whether ``directory`` holds ``tokenizer.json`` (its contents are the tokenizer loader's to check)."""
    return (Path(directory) / TOKENIZER_FILE).is_file()
