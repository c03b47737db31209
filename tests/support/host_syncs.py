"""Counting host synchronisations of torch code run on the CPU (specs/async.md §16.1).

On a GPU the host waits for the device at every call that needs the device's data or that copies
host memory the host may change as soon as the call returns. On the CPU nothing waits, but the same
Python calls are made, so counting them on the CPU tells how many times the code would make a GPU's
host wait. `SyncCounter` patches those entry points for the duration of a `with` block and counts
the calls made from Python (torch's own C++ calls do not go through them), by kind:

* a read (the kind is the method's name): `item`, `tolist`, `cpu`, `numpy`, a tensor's truth value
  (`__bool__`) or int / float value (`__int__`, `__float__`);
* a data-dependent shape: `nonzero`, `unique`, `masked_select` (method or function), and
  `bool_index`: indexing or assigning with a boolean mask tensor (the host must learn how many
  elements were selected);
* `blocking_copy`: a host-to-device copy the host waits for, which is
    - `torch.tensor(data, device=...)` and `torch.as_tensor(data, device=...)`;
    - `.to(device)` (a device or a string among its arguments) and `.cuda()` without
      `non_blocking=True`;
    - `copy_(src)` without `non_blocking=True` whose `src` is host-made (below): the device copies
      from pageable host memory while the host waits;
    - assigning a host-made tensor into a tensor (`x[i] = host`), which is such a `copy_`;
* `list_index`: indexing or index-assigning with a Python list, with a tuple holding a list or a
  tuple (`x[:, [0, 2]]`; a plain tuple of ints, `x[1, 2]`, is basic indexing and copies nothing),
  or with a host-made tensor: torch turns the index into a tensor on the host and copies it to the
  indexed tensor's device, a blocking copy;
* `synchronize`: a wait for a stream or an event: `torch.cuda.synchronize`,
  `torch.cuda.Stream.synchronize`, `torch.cuda.Event.synchronize`, `torch.accelerator.synchronize`,
  and the runtime's CPU stand-ins for the CUDA stream and event (`runtime/devices/streams.py`'s
  `CpuStream.synchronize`, `CpuEvent.synchronize`), which a CPU device calls where a CUDA device
  calls the real ones. Each is counted before it runs, so a CUDA call counts on a build without
  CUDA too (where it then raises). Calls that make a *stream* wait (`Stream.wait_event`,
  `wait_stream`, `Event.wait`) do not block the host and are not counted. torch's generic
  `torch.Stream` / `torch.Event` cannot be patched (immutable types): the runtime does not use them.

*Host-made* tensors are those `torch.tensor`, `torch.as_tensor` and `torch.from_numpy` make without
a device, and their views, until they are moved with `.to(device, ...)`: on the CPU `.to` returns
the same tensor, which from then on stands for the device copy (`runtime/torch_model/transfers.py`
moves a packed host buffer so). A device tensor made on the device (`torch.zeros(..., device=...)`)
is never host-made. What is not counted: a host-made tensor used on the host (a CPU generator's
draws), a copy from a host-made tensor with `non_blocking=True` (the runtime pins such buffers on
CUDA, so the copy is queued and the host goes on), and device-to-device copies.
"""

from __future__ import annotations

import weakref
from collections import Counter
from typing import Any, Callable

import torch

from fxsched.runtime.devices.streams import CpuEvent, CpuStream

READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")
SHAPES = ("nonzero", "unique", "masked_select")
KINDS = READS + SHAPES + ("bool_index", "blocking_copy", "list_index", "synchronize")


def _index_items(index: Any) -> tuple[Any, ...]:
    return index if isinstance(index, tuple) else (index,)


def _is_bool_index(index: Any) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in _index_items(index))


def _has_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if "device" in kwargs and kwargs["device"] is not None:
        return True
    return any(isinstance(a, (torch.device, str)) for a in args)


class _HostMade:
    """The host-made tensors alive now (by identity: a tensor's `==` is elementwise), and those of
    them moved to the device since."""

    def __init__(self) -> None:
        self._made: dict[int, weakref.ref[torch.Tensor]] = {}
        self._moved: dict[int, weakref.ref[torch.Tensor]] = {}

    @staticmethod
    def _holds(table: dict[int, weakref.ref[torch.Tensor]], t: torch.Tensor) -> bool:
        ref = table.get(id(t))
        return ref is not None and ref() is t

    @staticmethod
    def _add(table: dict[int, weakref.ref[torch.Tensor]], t: torch.Tensor) -> None:
        key = id(t)

        def forget(_ref: weakref.ref[torch.Tensor]) -> None:  # the tensor is gone: its id may be reused
            table.pop(key, None)
        table[key] = weakref.ref(t, forget)

    def made(self, t: Any) -> None:
        if isinstance(t, torch.Tensor):
            self._add(self._made, t)

    def moved(self, t: Any) -> None:
        if isinstance(t, torch.Tensor):
            self._add(self._moved, t)

    def __call__(self, t: Any) -> bool:
        """Whether `t` is a host-made tensor (or a view of one) not moved to the device."""
        if not isinstance(t, torch.Tensor):
            return False
        roots = (t,) if t._base is None else (t, t._base)
        return (any(self._holds(self._made, r) for r in roots)
                and not any(self._holds(self._moved, r) for r in roots))


class SyncCounter:
    """`with SyncCounter() as c: ...` then `c.counts` (a Counter by kind, see the module docstring)
    and `c.total`; `c.window()` starts a new count and returns the previous one."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._saved: list[tuple[Any, str, Any]] = []
        self._host = _HostMade()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def window(self) -> Counter[str]:
        done, self.counts = self.counts, Counter()
        return done

    def _patch(self, owner: Any, name: str, wrapper: Callable[..., Any]) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, wrapper)

    def _is_list_index(self, index: Any) -> bool:
        if isinstance(index, list):
            return True
        items = _index_items(index)
        return any(isinstance(i, (list, tuple)) for i in items) or any(self._host(i) for i in items)

    def __enter__(self) -> "SyncCounter":
        counts = lambda: self.counts  # noqa: E731 -- the current window, read at call time
        host = self._host
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
            elif self._is_list_index(index):
                counts()["list_index"] += 1
            return get(t, index)

        def setitem(t: torch.Tensor, index: Any, value: Any) -> Any:
            if _is_bool_index(index):
                counts()["bool_index"] += 1
            elif self._is_list_index(index):
                counts()["list_index"] += 1
            if host(value):
                counts()["blocking_copy"] += 1
            return put(t, index, value)
        self._patch(torch.Tensor, "__getitem__", getitem)
        self._patch(torch.Tensor, "__setitem__", setitem)
        for name in ("tensor", "as_tensor"):
            original = getattr(torch, name)

            def made(*a: Any, _o: Any = original, **k: Any) -> Any:
                if k.get("device") is not None:
                    counts()["blocking_copy"] += 1
                    return _o(*a, **k)
                out = _o(*a, **k)
                host.made(out)
                return out
            self._patch(torch, name, made)
        from_numpy = torch.from_numpy

        def from_host(*a: Any, **k: Any) -> Any:
            out = from_numpy(*a, **k)
            host.made(out)
            return out
        self._patch(torch, "from_numpy", from_host)
        to, cuda, copy = torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.copy_

        def moved(t: torch.Tensor, *a: Any, **k: Any) -> Any:
            if not _has_device(a, k):
                return to(t, *a, **k)
            if not k.get("non_blocking", False):
                counts()["blocking_copy"] += 1
            out = to(t, *a, **k)
            host.moved(out)
            return out

        def to_cuda(t: torch.Tensor, *a: Any, **k: Any) -> Any:
            if not k.get("non_blocking", False):
                counts()["blocking_copy"] += 1
            return cuda(t, *a, **k)

        def copied(t: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> Any:
            if host(src) and not non_blocking:
                counts()["blocking_copy"] += 1
            return copy(t, src, non_blocking)
        self._patch(torch.Tensor, "to", moved)
        self._patch(torch.Tensor, "cuda", to_cuda)
        self._patch(torch.Tensor, "copy_", copied)
        waits: list[tuple[Any, str]] = [(torch.cuda, "synchronize"), (torch.cuda.Stream, "synchronize"),
                                        (torch.cuda.Event, "synchronize"), (CpuStream, "synchronize"),
                                        (CpuEvent, "synchronize")]
        if hasattr(torch, "accelerator"):
            waits.append((torch.accelerator, "synchronize"))
        for owner, name in waits:
            original = getattr(owner, name)

            def wait(*a: Any, _o: Any = original, **k: Any) -> Any:
                counts()["synchronize"] += 1
                return _o(*a, **k)
            self._patch(owner, name, wait)
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()
