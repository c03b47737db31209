"""An append-only token list with O(1) append that shares its prefix between versions.

A sequence's output grows every step; copying a tuple of a thousand tokens per step per
sequence would make ``step`` linear in the output length. A ``TokenLog`` is a chain of chunks:
``extend`` makes a new head that points at the old log, so both versions stay valid and share
everything before the new chunk. To every caller it is an immutable sequence of ints that behaves
like the tuple of its tokens: ``len``, iteration, indexing and slicing, ``in``, ``index``,
``count``, ``+``, comparison and hashing all go by the token contents (a ``TokenLog`` equals and
hashes like the tuple of its tokens).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from collections.abc import Sequence as AbcSequence
from typing import Any, Optional, overload


class TokenLog(AbcSequence[int]):
    __slots__ = ("_prev", "_chunk", "_length")

    _prev: Optional["TokenLog"]
    _chunk: tuple[int, ...]
    _length: int

    def __init__(self, tokens: Iterable[int] = ()) -> None:
        chunk = tuple(tokens)
        self._prev = None
        self._chunk = chunk
        self._length = len(chunk)

    @classmethod
    def _link(cls, prev: "TokenLog", chunk: tuple[int, ...]) -> "TokenLog":
        log = object.__new__(cls)
        log._prev = prev
        log._chunk = chunk
        log._length = prev._length + len(chunk)
        return log

    def extend(self, tokens: Iterable[int]) -> "TokenLog":
        """A new log with ``tokens`` appended; this one is unchanged."""
        chunk = tokens if type(tokens) is tuple else tuple(tokens)
        if not chunk:
            return self
        if self._length == 0:
            return TokenLog(chunk)
        return TokenLog._link(self, chunk)

    def append(self, token: int) -> "TokenLog":
        """A new log with ``token`` appended; this one is unchanged."""
        return self.extend((token,))

    @property
    def last(self) -> Optional[int]:
        """The newest token, or ``None`` for an empty log."""
        node: Optional[TokenLog] = self
        while node is not None:
            if node._chunk:
                return node._chunk[-1]
            node = node._prev
        return None

    def tokens(self) -> tuple[int, ...]:
        """All tokens, oldest first (walks the chain iteratively)."""
        if self._prev is None:
            return self._chunk
        chunks = []
        node: Optional[TokenLog] = self
        while node is not None:
            chunks.append(node._chunk)
            node = node._prev
        return tuple(t for chunk in reversed(chunks) for t in chunk)

    # --- the sequence protocol, by contents ---------------------------------------------------

    def __len__(self) -> int:
        return self._length

    def __bool__(self) -> bool:
        return self._length > 0

    def __iter__(self) -> Iterator[int]:
        return iter(self.tokens())

    def __reversed__(self) -> Iterator[int]:
        return reversed(self.tokens())

    def __contains__(self, token: object) -> bool:
        return token in self.tokens()

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[int, ...]: ...

    def __getitem__(self, index: int | slice) -> int | tuple[int, ...]:
        return self.tokens()[index]

    def index(self, value: Any, start: int = 0, stop: int | None = None) -> int:
        return self.tokens().index(value, start, len(self) if stop is None else stop)

    def count(self, value: Any) -> int:
        return self.tokens().count(value)

    def __add__(self, other: Iterable[int]) -> tuple[int, ...]:
        if isinstance(other, (tuple, TokenLog)):
            return self.tokens() + tuple(other)
        return NotImplemented

    def __radd__(self, other: Iterable[int]) -> tuple[int, ...]:
        if isinstance(other, tuple):
            return other + self.tokens()
        return NotImplemented

    def __mul__(self, n: int) -> tuple[int, ...]:
        return self.tokens() * n

    __rmul__ = __mul__

    @staticmethod
    def _contents(other: object) -> Optional[tuple[int, ...]]:
        if isinstance(other, TokenLog):
            return other.tokens()
        if isinstance(other, tuple):
            return other
        return None

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenLog) and other._length != self._length:
            return False
        theirs = self._contents(other)
        if theirs is None:
            return NotImplemented
        return self.tokens() == theirs

    def __ne__(self, other: object) -> bool:
        result = self.__eq__(other)
        return result if result is NotImplemented else not result

    def __lt__(self, other: object) -> bool:
        theirs = self._contents(other)
        return NotImplemented if theirs is None else self.tokens() < theirs

    def __le__(self, other: object) -> bool:
        theirs = self._contents(other)
        return NotImplemented if theirs is None else self.tokens() <= theirs

    def __gt__(self, other: object) -> bool:
        theirs = self._contents(other)
        return NotImplemented if theirs is None else self.tokens() > theirs

    def __ge__(self, other: object) -> bool:
        theirs = self._contents(other)
        return NotImplemented if theirs is None else self.tokens() >= theirs

    def __hash__(self) -> int:
        return hash(self.tokens())

    def __repr__(self) -> str:
        return f"TokenLog({list(self.tokens())})"

    def __reduce__(self) -> tuple[type, tuple[tuple[int, ...]]]:
        return (TokenLog, (self.tokens(),))

    def __deepcopy__(self, memo: dict[int, Any]) -> "TokenLog":
        return self  # immutable

    def __copy__(self) -> "TokenLog":
        return self


def as_log(value: Iterable[int]) -> TokenLog:
    """Converter: a TokenLog as is, any iterable of ints as a fresh log."""
    return value if isinstance(value, TokenLog) else TokenLog(int(v) for v in value)
