"""An append-only token list with O(1) append that shares its prefix between versions.

A sequence's output grows every step; copying a tuple of a thousand tokens per step per
sequence would make ``step`` linear in the output length. A ``TokenLog`` is a chain of chunks:
``extend`` makes a new head that points at the old log, so both versions stay valid and share
everything before the new chunk. It is a tuple ``(prev, chunk, length)`` underneath (immutable,
cheap to build); equality and hashing go by the token contents.
"""

from __future__ import annotations

from typing import Iterable, Optional

_EMPTY_CHUNK: tuple[int, ...] = ()


class TokenLog(tuple):
    __slots__ = ()

    def __new__(cls, tokens: Iterable[int] = ()):
        chunk = tuple(tokens)
        return tuple.__new__(cls, (None, chunk, len(chunk)))

    @classmethod
    def _link(cls, prev: "TokenLog", chunk: tuple[int, ...]) -> "TokenLog":
        return tuple.__new__(cls, (prev, chunk, tuple.__getitem__(prev, 2) + len(chunk)))

    def extend(self, tokens: tuple[int, ...]) -> "TokenLog":
        """A new log with ``tokens`` appended; this one is unchanged."""
        if not tokens:
            return self
        if tuple.__getitem__(self, 2) == 0:
            return TokenLog(tokens)
        return TokenLog._link(self, tokens if type(tokens) is tuple else tuple(tokens))

    def append(self, token: int) -> "TokenLog":
        return self.extend((token,))

    def __len__(self) -> int:
        return tuple.__getitem__(self, 2)

    def __bool__(self) -> bool:
        return tuple.__getitem__(self, 2) > 0

    @property
    def last(self) -> Optional[int]:
        node = self
        while node is not None:
            chunk = tuple.__getitem__(node, 1)
            if chunk:
                return chunk[-1]
            node = tuple.__getitem__(node, 0)
        return None

    def tokens(self) -> tuple[int, ...]:
        """All tokens, oldest first (walks the chain iteratively)."""
        chunks = []
        node = self
        while node is not None:
            chunks.append(tuple.__getitem__(node, 1))
            node = tuple.__getitem__(node, 0)
        if len(chunks) == 1:
            return chunks[0]
        return tuple(t for chunk in reversed(chunks) for t in chunk)

    def __iter__(self):
        return iter(self.tokens())

    def __getitem__(self, index):
        return self.tokens()[index]

    def __eq__(self, other) -> bool:
        if isinstance(other, TokenLog):
            return len(self) == len(other) and self.tokens() == other.tokens()
        if isinstance(other, tuple):
            return self.tokens() == other
        return NotImplemented

    def __ne__(self, other) -> bool:
        result = self.__eq__(other)
        return result if result is NotImplemented else not result

    def __hash__(self) -> int:
        return hash(self.tokens())

    def __repr__(self) -> str:
        return f"TokenLog({list(self.tokens())})"

    def __reduce__(self):
        return (TokenLog, (self.tokens(),))

    def __deepcopy__(self, memo) -> "TokenLog":
        return self  # immutable

    def __copy__(self) -> "TokenLog":
        return self


def as_log(value) -> TokenLog:
    """Converter: a TokenLog as is, any iterable of ints as a fresh log."""
    return value if isinstance(value, TokenLog) else TokenLog(int(v) for v in value)
