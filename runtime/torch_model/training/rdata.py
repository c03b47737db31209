"""A reader of R's serialization format, as far as a data package's character vectors need it.

R packages ship their data sets as a lazy-load database: `data/Rdata.rdx` (a gzip-compressed
serialized index: variable name -> (offset, length) into `Rdata.rdb`) and `data/Rdata.rdb` (each
object a 4-byte big-endian length, then its serialization, zlib-, bzip2- or xz-compressed). A
serialization is "X\\n" (XDR, big-endian), a version header, then one item: a 32-bit flags word
(type in the low byte, "has attributes" bit 9, "has tag" bit 10, a reference index above bit 8 for
type 255) followed by the type's payload. This reads the types a data frame or a vector of strings
uses (NULL, symbols, pairlists, character, string, list, integer, logical and double vectors, and
references to symbols); anything else raises RDataError naming the type.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import struct
import zlib
from typing import Any


class RDataError(ValueError):
    """A file that is not the R serialization this reader understands."""


NIL, SYMBOL, PAIRLIST, CHARS, LOGICAL, INTEGER, DOUBLE, STRINGS, LIST = 254, 1, 2, 9, 10, 13, 14, 16, 19
ENVIRONMENTS = (241, 242, 253)  # base, empty and global environment markers
REFERENCE = 255
HAS_ATTRIBUTES, HAS_TAG = 1 << 9, 1 << 10


class _Reader:
    def __init__(self, data: bytes, source: str) -> None:
        self.data, self.pos, self.source = data, 0, source
        self.refs: list[Any] = []

    def int32(self) -> int:
        if self.pos + 4 > len(self.data):
            raise RDataError(f"{self.source}: truncated at byte {self.pos}")
        (value,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return int(value)

    def numbers(self, fmt: str, size: int) -> list[Any]:
        n = self.int32()
        if self.pos + n * size > len(self.data):
            raise RDataError(f"{self.source}: truncated vector of {n} at byte {self.pos}")
        out = list(struct.unpack_from(f">{n}{fmt}", self.data, self.pos))
        self.pos += n * size
        return out

    def item(self) -> Any:
        flags = self.int32()
        kind = flags & 0xFF
        if kind == NIL or kind in ENVIRONMENTS:
            return None
        if kind == REFERENCE:
            return self.refs[(flags >> 8) - 1]
        if kind == SYMBOL:
            name = self.item()
            self.refs.append(name)
            return name
        if kind == CHARS:
            n = self.int32()
            if n == -1:  # NA_character_
                return None
            text = self.data[self.pos:self.pos + n].decode("utf-8", errors="replace")
            self.pos += n
            return text
        if kind == PAIRLIST:  # attributes, tag, head, tail: a dict of tag -> value
            if flags & HAS_ATTRIBUTES:
                self.item()
            tag = self.item() if flags & HAS_TAG else None
            out = {tag: self.item()}
            tail = self.item()
            if isinstance(tail, dict):
                out.update(tail)
            return out
        if kind in (STRINGS, LIST):
            values = [self.item() for _ in range(self.int32())]
            return self._with_names(values, flags)
        if kind in (INTEGER, LOGICAL):
            return self._with_names(self.numbers("i", 4), flags)
        if kind == DOUBLE:
            return self._with_names(self.numbers("d", 8), flags)
        raise RDataError(f"{self.source}: R object type {kind} is not supported (at byte {self.pos - 4})")

    def _with_names(self, values: list[Any], flags: int) -> Any:
        if not flags & HAS_ATTRIBUTES:
            return values
        attributes = self.item()
        names = attributes.get("names") if isinstance(attributes, dict) else None
        return dict(zip(names, values, strict=True)) if isinstance(names, list) else values

    def top(self) -> Any:
        if self.data[:2] != b"X\n":
            raise RDataError(f"{self.source}: not an XDR R serialization (starts {self.data[:2]!r})")
        self.pos = 2
        version = self.int32()
        self.int32(), self.int32()  # the writer's R version, the oldest reader's
        if version == 3:
            length = self.int32()  # then the native encoding's name
            self.pos += length
        elif version != 2:
            raise RDataError(f"{self.source}: serialization version {version} (2 or 3 expected)")
        return self.item()


def unserialize(data: bytes, source: str = "<bytes>") -> Any:
    """The object of one uncompressed serialization: vectors as lists (dicts when named), pairlists as dicts."""
    return _Reader(data, source).top()


def _inflate(raw: bytes, source: str) -> bytes:
    if len(raw) < 5:
        raise RDataError(f"{source}: an object of {len(raw)} bytes")
    body = raw[4:]
    try:
        if body[:1] == b"Z":  # xz
            return lzma.decompress(body[1:])
        if body[:1] == b"2":  # bzip2
            return bz2.decompress(body[1:])
        if body[:1] == b"0":  # stored
            return body[1:]
        return zlib.decompress(body)
    except (lzma.LZMAError, OSError, zlib.error) as err:
        raise RDataError(f"{source}: cannot decompress an object ({err})") from None


def lazy_load_db(rdx: bytes, rdb: bytes, source: str = "Rdata") -> dict[str, Any]:
    """Every variable of a lazy-load database (the bytes of its .rdx index and .rdb file), by name."""
    try:
        index_bytes = gzip.decompress(rdx) if rdx[:2] == b"\x1f\x8b" else _inflate(rdx, f"{source}.rdx")
    except OSError as err:
        raise RDataError(f"{source}.rdx: cannot decompress ({err})") from None
    index = unserialize(index_bytes, f"{source}.rdx")
    variables = index.get("variables") if isinstance(index, dict) else None
    if not isinstance(variables, dict):
        raise RDataError(f"{source}.rdx: no variables index")
    out: dict[str, Any] = {}
    for var, where in variables.items():
        offset, length = (int(x) for x in where)
        where_text = f"{source}.rdb:{var}"
        out[var] = unserialize(_inflate(rdb[offset:offset + length], where_text), where_text)
    return out
