"""Spill file format for one sequence's state, with integrity checks.

Layout (little endian):
    magic b"FXSPILL\\0" | u32 version | u32 header_len | header (UTF-8 JSON) |
    payload (safetensors bytes) | sha256 of everything before it (32 bytes)
The header holds the caller's metadata, the payload length and every tensor's shape.

Invariant: `read_spill` returns exactly what `write_spill` was given, or raises SpillError naming
the file and the defect (missing, truncated, bad magic/version, checksum mismatch, bad shapes).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from .errors import SpillError

MAGIC = b"FXSPILL\x00"
VERSION = 1
_PREFIX = struct.Struct("<8sII")  # magic, version, header_len
_DIGEST_LEN = 32


def write_spill(path: str | Path, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Write meta (JSON-able) and tensors to `path` atomically (temp file + rename)."""
    path = Path(path)
    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    payload = save_safetensors(cpu) if cpu else b""
    header = json.dumps({"meta": meta, "payload_len": len(payload),
                         "tensors": {n: list(t.shape) for n, t in cpu.items()}}, sort_keys=True).encode()
    body = _PREFIX.pack(MAGIC, VERSION, len(header)) + header + payload
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as handle:
            handle.write(body + hashlib.sha256(body).digest())
        os.replace(tmp, path)
    except OSError as err:
        raise SpillError(path, f"cannot write ({err})") from None


def read_spill(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Read and verify a spill file; return (meta, tensors on CPU)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise SpillError(path, "file not found") from None
    except OSError as err:
        raise SpillError(path, f"cannot read ({err})") from None
    if len(data) < _PREFIX.size + _DIGEST_LEN:
        raise SpillError(path, f"truncated: {len(data)} bytes is shorter than the fixed header and checksum")
    magic, version, header_len = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise SpillError(path, f"bad magic {magic!r}, expected {MAGIC!r} (not a spill file)")
    if version != VERSION:
        raise SpillError(path, f"unsupported version {version}, expected {VERSION}")
    header_end = _PREFIX.size + header_len
    if header_end + _DIGEST_LEN > len(data):
        raise SpillError(path, f"truncated: header of {header_len} bytes does not fit in {len(data)} bytes")
    try:
        header = json.loads(data[_PREFIX.size:header_end].decode())
        payload_len = int(header["payload_len"])
        shapes = {n: list(s) for n, s in header["tensors"].items()}
        meta = header["meta"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise SpillError(path, f"corrupted header ({err.__class__.__name__}: {err})") from None
    expected_len = header_end + payload_len + _DIGEST_LEN
    if len(data) < expected_len:
        raise SpillError(path, f"truncated: {len(data)} bytes, header announces {expected_len}")
    if len(data) > expected_len:
        raise SpillError(path, f"corrupted: {len(data) - expected_len} unexpected trailing bytes")
    body, digest = data[:-_DIGEST_LEN], data[-_DIGEST_LEN:]
    if hashlib.sha256(body).digest() != digest:
        raise SpillError(path, "checksum mismatch (file corrupted)")
    try:
        tensors = load_safetensors(body[header_end:]) if payload_len else {}
    except Exception as err:  # safetensors raises several types for bad payloads
        raise SpillError(path, f"corrupted payload ({err})") from None
    if {n: list(t.shape) for n, t in tensors.items()} != shapes:
        raise SpillError(path, "tensor names/shapes in payload do not match the header")
    return meta, tensors
