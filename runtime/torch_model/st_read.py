"""Whole tensors of a safetensors file read with plain file reads, not through a memory map.

safetensors' own reader maps the file and builds each tensor from the mapped pages: those pages
count in the process's resident memory while the handle is open, so loading a checkpoint peaks at
about twice its size (the mapped file plus the engine's own copies; 2.6 GB for a 1.3 GB model). Here
a tensor is read with one ``readinto`` into the tensor that will hold it: the file's pages stay in
the page cache, outside the process, and the peak is the weights themselves.

The format (safetensors' specification): an 8-byte little-endian header length, a JSON header
mapping each tensor name to its dtype, shape and [begin, end) byte offsets into the data that
follows the header. Tensors of a dtype not listed here return None and the caller uses the mapped
reader.
"""

from __future__ import annotations

import ctypes
import functools
import json
import struct
from pathlib import Path

import torch

__all__ = ["read_whole"]

_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


@functools.lru_cache(maxsize=64)
def _header(path: Path, mtime_ns: int) -> tuple[int, dict[str, dict[str, object]]]:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return 8 + length, header


def read_whole(path: Path, name: str) -> torch.Tensor | None:
    """Tensor `name` of the safetensors file `path`, read into fresh CPU memory, or None when this
    reader does not take it (an unknown dtype, an entry that does not describe its bytes). Raises
    OSError or ValueError for an unreadable file (the caller reports those)."""
    base, header = _header(path, path.stat().st_mtime_ns)
    entry = header.get(name)
    if not isinstance(entry, dict):
        return None
    dtype = _DTYPES.get(str(entry.get("dtype")))
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if dtype is None or not isinstance(shape, list) or not isinstance(offsets, list) or len(offsets) != 2:
        return None
    out = torch.empty([int(s) for s in shape], dtype=dtype)
    begin, end = int(offsets[0]), int(offsets[1])
    if end - begin != out.numel() * out.element_size():
        return None
    if out.numel() == 0:
        return out
    view = memoryview((ctypes.c_char * (end - begin)).from_address(out.data_ptr())).cast("B")
    with open(path, "rb", buffering=0) as f:
        f.seek(base + begin)
        got = 0
        while got < len(view):
            n = f.readinto(view[got:])
            if not n:
                raise ValueError(f"tensor '{name}' runs past the end of the file")
            got += n
    return out
