"""A Hugging Face checkpoint directory's files: its JSON files read (`_read_json`) and its
safetensors shards opened (`_Shards`: the tensors by name, listed by the index or found as
*.safetensors files, read lazily and checked finite); a defect is a ModelDirError naming the file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from .errors import ModelDirError, read_json_object
from .st_read import read_whole

INDEX_FILE = "model.safetensors.index.json"


def _read_json(path: Path, required: bool) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise ModelDirError(path, "missing (a checkpoint directory needs config.json)")
        return None
    return read_json_object(path, ModelDirError)


@dataclass
class _Shards:
    """The checkpoint's tensors by name (lazily read), and which file holds each."""

    root: Path
    files: dict[str, Path]  # tensor name -> shard path
    handles: dict[Path, Any] = field(default_factory=dict)
    listing: Path | None = None  # the file that lists the tensors (index), for "missing" errors

    @property
    def names(self) -> list[str]:
        return list(self.files)

    @classmethod
    def open(cls, root: Path) -> "_Shards":
        index_path = root / INDEX_FILE
        index = _read_json(index_path, required=False)
        weight_map: dict[str, str] = {}
        if index is not None:
            weight_map = index.get("weight_map")  # type: ignore[assignment]  # checked just below
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ModelDirError(index_path, "field 'weight_map': expected an object of tensor name -> shard file")
            paths = sorted({root / v for v in weight_map.values()})
            for p in paths:
                if not p.is_file():
                    raise ModelDirError(p, f"missing shard (listed in {INDEX_FILE})")
        else:
            paths = sorted(root.glob("*.safetensors"))
            if not paths:
                raise ModelDirError(root, "no *.safetensors weight files")
        shards = cls(root, {}, listing=index_path if index is not None else
                     (paths[0] if len(paths) == 1 else root))
        for p in paths:
            try:
                handle = safe_open(str(p), framework="pt")
                keys = list(handle.keys())
            except (SafetensorError, OSError, ValueError, RuntimeError) as err:
                raise ModelDirError(p, f"unreadable safetensors shard ({err})") from None
            shards.handles[p] = handle
            for k in keys:
                if k in shards.files:
                    raise ModelDirError(p, f"tensor '{k}' also stored in {shards.files[k].name}")
                shards.files[k] = p
        for name, shard in weight_map.items():
            if name not in shards.files:
                raise ModelDirError(root / shard, f"missing tensor '{name}' (listed in {INDEX_FILE})")
        return shards

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.handles[self.files[name]].get_slice(name).get_shape())

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor `name`, or with rows=(first, count) only those rows of its first dimension."""
        try:
            handle = self.handles[self.files[name]]
            whole = read_whole(self.files[name], name) if rows is None else None  # no mapped pages held
            if whole is not None:
                tensor = whole
            elif rows is None:
                tensor = handle.get_tensor(name)
            else:
                tensor = handle.get_slice(name)[rows[0]:rows[0] + rows[1]]
        except (SafetensorError, OSError, ValueError, RuntimeError) as err:
            raise ModelDirError(self.files[name], f"tensor '{name}' unreadable ({err})") from None
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):  # silent garbage otherwise
            raise ModelDirError(self.files[name], f"tensor '{name}' holds NaN or infinite values")
        return tensor
