"""Counting host synchronisations of torch code run on the CPU.

On a GPU, a host synchronisation is any call that makes the host wait for the device: reading a
value back (`item`, `tolist`, `cpu`, `numpy`, a tensor's truth value or int/float value), an
operation whose output shape depends on the data (`nonzero`, `unique`, `masked_select`, indexing
or assigning with a boolean mask), or a blocking host-to-device copy (`torch.tensor(data,
device=...)`, `as_tensor(..., device=...)`, `.to(device)` / `.cuda()` without `non_blocking=True`).
On the CPU nothing waits, but the same calls are made, so counting them on the CPU tells how many
synchronisations the code would make on a GPU. `SyncCounter` patches those entry points for the
duration of a `with` block and counts the calls made from Python (torch's own C++ calls do not go
through them), by kind.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import torch

READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")
SHAPES = ("nonzero", "unique", "masked_select")


def _is_bool_index(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _has_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if "device" in kwargs and kwargs["device"] is not None:
        return True
    return any(isinstance(a, (torch.device, str)) for a in args)


class SyncCounter:
    """`with SyncCounter() as c: ...` then `c.counts` (a Counter by kind) and `c.total`;
    `c.window()` starts a new count and returns the previous one."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._saved: list[tuple[Any, str, Any]] = []

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def window(self) -> Counter[str]:
        done, self.counts = self.counts, Counter()
        return done

    def _patch(self, owner: Any, name: str, wrapper: Callable[..., Any]) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, wrapper)

    def __enter__(self) -> "SyncCounter":
        counts = lambda: self.counts  # noqa: E731 -- the current window, read at call time
        for name in READS + SHAPES:
            original = getattr(torch.Tensor, name)

            def read(t: torch.Tensor, *a: Any, _o: Any = original, _n: str = name, **k: Any) -> Any:
                counts()[_n] += 1
                return _o(t, *a, **k)
            self._patch(torch.Tensor, name, read)
        for name in SHAPES:
            original = getattr(torch, name)

            def shaped(*a: Any, _o: Any = original, _n: str = name, **k: Any) -> Any:
                counts()[_n] += 1
                return _o(*a, **k)
            self._patch(torch, name, shaped)
        get, put = torch.Tensor.__getitem__, torch.Tensor.__setitem__

        def getitem(t: torch.Tensor, index: Any) -> Any:
            if _is_bool_index(index):
                counts()["bool_index"] += 1
            return get(t, index)

        def setitem(t: torch.Tensor, index: Any, value: Any) -> Any:
            if _is_bool_index(index):
                counts()["bool_index"] += 1
            return put(t, index, value)
        self._patch(torch.Tensor, "__getitem__", getitem)
        self._patch(torch.Tensor, "__setitem__", setitem)
        for name in ("tensor", "as_tensor"):
            original = getattr(torch, name)

            def made(*a: Any, _o: Any = original, **k: Any) -> Any:
                if k.get("device") is not None:
                    counts()["blocking_copy"] += 1
                return _o(*a, **k)
            self._patch(torch, name, made)
        to = torch.Tensor.to

        def moved(t: torch.Tensor, *a: Any, **k: Any) -> Any:
            if _has_device(a, k) and not k.get("non_blocking", False):
                counts()["blocking_copy"] += 1
            return to(t, *a, **k)
        self._patch(torch.Tensor, "to", moved)
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()
