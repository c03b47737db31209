"""Exception types of the torch model layer; every error names what was wrong and where."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable


class TorchModelError(Exception):
    """Base class of every error raised by fxsched.runtime.torch_model."""


class ConfigError(TorchModelError, ValueError):
    """A model config field is unknown or has a bad value; names source file, field and expectation."""

    def __init__(self, field: str, expected: str, got: object, source: str | None = None) -> None:
        self.field = field
        self.expected = expected
        self.got = got
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(f"{where}field '{field}': expected {expected}, got {got!r}")

    def with_source(self, source: str) -> "ConfigError":
        """The same error, attributed to `source` (a file path)."""
        return ConfigError(self.field, self.expected, self.got, source)


class WeightsError(TorchModelError, ValueError):
    """A weights file is missing, unreadable, or holds missing/extra/mis-shaped tensors."""


class SlotError(TorchModelError, ValueError):
    """An engine operation was called on a slot in the wrong state (free, busy, out of range...)."""


class OutOfBlocksError(TorchModelError, RuntimeError):
    """The KV block pool cannot satisfy an allocation; nothing was modified."""


class SpillError(TorchModelError, ValueError):
    """A spill file is missing, truncated, corrupted or incompatible; names the file and the defect."""

    def __init__(self, path: object, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"spill file {self.path}: {problem}")


class ModelDirError(TorchModelError, ValueError):
    """A Hugging Face checkpoint directory cannot be loaded; str is ONE line naming the file and the defect
    (missing directory or config.json, invalid JSON, unknown architecture, missing / unexpected /
    mis-shaped tensor, unreadable shard)."""

    def __init__(self, path: object, problem: str) -> None:
        self.path = str(path)
        self.problem = " ".join(str(problem).split())  # one line, whatever the cause's message held
        super().__init__(f"{self.path}: {self.problem}")


class AdapterError(TorchModelError, ValueError):
    """A LoRA adapter directory cannot be loaded into this model; str is ONE line naming the file and
    the defect (specs/lora.md §18.4: missing file, bad config field, rank above the pool's, a
    target the model lacks or fxsched cannot adapt, missing / unexpected / mis-shaped tensor)."""

    def __init__(self, path: object, problem: str) -> None:
        self.path = str(path)
        self.problem = " ".join(str(problem).split())
        super().__init__(f"{self.path}: {self.problem}")


def read_json_object(path: Path, error: Callable[[object, str], Exception]) -> dict[str, Any]:
    """The JSON object in file ``path``; a file that is not valid JSON, unreadable or not an object
    raises ``error(path, problem)`` (one line naming the file: ``ModelDirError``, ``AdapterError``)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise error(path, f"not valid JSON ({err.msg} at line {err.lineno} column {err.colno})") from None
    except (OSError, UnicodeDecodeError) as err:
        raise error(path, f"unreadable ({err.__class__.__name__}: {err})") from None
    if not isinstance(data, dict):
        raise error(path, f"expected a JSON object, got {type(data).__name__}")
    return data
