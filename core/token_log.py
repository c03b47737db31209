"""An append-only token list with O(1) amortised append that shares its storage between versions.

A sequence's output grows every step; copying a tuple of a thousand tokens per step per
sequence would make ``step`` linear in the output length, and a node per append would cost the
state tens of bytes per token. A ``TokenLog`` is a *view*: the first ``length`` entries of a
machine-integer array (``array('i')``, 4 bytes a token; ``'q'`` once a token needs more) that
versions of the same output share.

``extend`` appends to the shared array in place when this view reaches its end (the usual case:
the newest version of an output is the one that grows) and returns a longer view; every older
view still sees exactly its own prefix, since nothing before its end ever changes. A view that
does not reach the end (an older version extended a second time: a rollback, or the model
checker stepping twice from one state) copies its prefix into a fresh array first. So no value
that any version can observe ever changes, and ``step`` stays pure.

To every caller it is an immutable sequence of ints that behaves like the tuple of its tokens:
``len``, iteration, indexing and slicing, ``in``, ``index``, ``count``, ``+``, comparison and
hashing all go by the token contents (a ``TokenLog`` equals and hashes like the tuple of its
tokens).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator
from collections.abc import Sequence as AbcSequence
from itertools import islice
from typing import Any, Optional, overload


def _array(tokens: Iterable[int]) -> "array[int]":
    """An int32 array of ``tokens``, or int64 when one of them does not fit."""
    try:
        return array("i", tokens)
    except OverflowError:
        return array("q", tokens)


_new = object.__new__


class TokenLog(AbcSequence[int]):
    __slots__ = ("_buf", "_length")

    _buf: "array[int]"
    _length: int

    def __init__(self, tokens: Iterable[int] = ()) -> None:
        self._buf = _array(tokens)
        self._length = len(self._buf)

    def extend(self, tokens: Iterable[int]) -> "TokenLog":
        """A new log with ``tokens`` appended; this one is unchanged."""
        chunk = tokens if type(tokens) is tuple else tuple(tokens)
        if not chunk:
            return self
        buf = extended(self._buf, self._length, chunk)
        return view(buf, len(buf))

    def append(self, token: int) -> "TokenLog":
        """A new log with ``token`` appended; this one is unchanged."""
        return self.extend((token,))

    def parts(self) -> tuple["array[int]", int]:
        """The array this view reads and how many of its tokens it holds (``view``'s arguments)."""
        return self._buf, self._length

    @property
    def last(self) -> Optional[int]:
        """The newest token, or ``None`` for an empty log."""
        return self._buf[self._length - 1] if self._length else None

    def tokens(self) -> tuple[int, ...]:
        """All tokens, oldest first."""
        buf = self._buf
        return tuple(buf) if len(buf) == self._length else tuple(islice(buf, self._length))

    def nbytes(self) -> int:
        """Bytes of token storage this view's array holds (shared with the other versions)."""
        return self._buf.buffer_info()[1] * self._buf.itemsize

    # --- the sequence protocol, by contents ---------------------------------------------------

    def __len__(self) -> int:
        return self._length

    def __bool__(self) -> bool:
        return self._length > 0

    def __iter__(self) -> Iterator[int]:
        return islice(self._buf, self._length)

    def __reversed__(self) -> Iterator[int]:
        return reversed(self.tokens())

    def __contains__(self, token: object) -> bool:
        return token in self.tokens()

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[int, ...]: ...

    def __getitem__(self, index: int | slice) -> int | tuple[int, ...]:
        if isinstance(index, slice):
            start, stop, stride = index.indices(self._length)
            if stride == 1:
                return tuple(self._buf[start:stop]) if start < stop else ()
            return self.tokens()[index]
        length = self._length
        if index < 0:
            index += length
        if not 0 <= index < length:
            raise IndexError("TokenLog index out of range")
        return int(self._buf[index])

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


def extended(buf: "array[int]", length: int, chunk: tuple[int, ...]) -> "array[int]":
    """The array of the view (``buf``, ``length``) with ``chunk`` appended: ``buf`` itself, grown in
    place, when the view reaches its end; else (a later version grew it already) a fresh copy of
    the view's tokens, grown. The batched steps keep outputs as such (array, length) columns
    (``state.Settled``), so a steady row makes no new object."""
    if len(buf) != length:
        buf = buf[:length]
    try:
        buf.extend(chunk)
    except OverflowError:  # a token past int32 (the tokens before it went in already): int64 from here on
        buf = array("q", buf[:length])
        buf.extend(chunk)
    return buf


def view(buf: "array[int]", length: int) -> TokenLog:
    """The log of the first ``length`` tokens of ``buf`` (which is never changed below ``length``)."""
    log = _new(TokenLog)
    log._buf = buf
    log._length = length
    return log


def as_log(value: Iterable[int]) -> TokenLog:
    """Converter: a TokenLog as is, any iterable of ints as a fresh log."""
    return value if isinstance(value, TokenLog) else TokenLog(int(v) for v in value)
