"""CUDA-graph replay emulated on the CPU: a recorder (runtime/torch_model/graphs.py's `Recorder`) that
records a static forward as a trace made with real tensors (torch.fx's `make_fx`) and replays the
trace instead of running the forward.

The trace keeps what a CUDA graph keeps:
  * the tensors the recorder is told of (`StaticForward.inputs`: the static input buffers, the KV
    and GDN caches) are the trace's placeholders, read afresh, and written in place, at every
    replay, as a graph reads and writes the same addresses each time;
  * every other tensor the forward read is a constant of the trace, with the value it had at
    capture: a graph replays the address, and nothing the forward recorded recomputes it (a table
    kept by an earlier call, a tensor a later capture frees and reuses);
  * every value the forward computed on the host from host data is frozen (the capture's Python
    runs once); a value read back from a traced tensor (`.item()`, `.tolist()`, a branch on a
    tensor) fails the recording, as a host sync fails a CUDA capture.
A forward that keeps the recording contract (specs/async.md §16.4) replays equal to its eager run;
one that breaks it replays the capture's values.
"""

from __future__ import annotations

import contextlib
from dataclasses import fields, is_dataclass, replace
from typing import Any, Callable, ContextManager, Sequence

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fxsched.runtime.torch_model.model import ForwardOutput


def _flatten(value: Any, out: list[torch.Tensor]) -> Any:
    """``value`` with each tensor replaced by its index in ``out`` (appended), for ``_rebuild``."""
    if isinstance(value, torch.Tensor):
        out.append(value)
        return _Slot(len(out) - 1)
    if is_dataclass(value) and not isinstance(value, type):
        return replace(value, **{f.name: _flatten(getattr(value, f.name), out) for f in fields(value) if f.init})
    if isinstance(value, dict):
        return {k: _flatten(v, out) for k, v in value.items()}
    if isinstance(value, list):
        return [_flatten(v, out) for v in value]
    return value


def _rebuild(shape: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """The structure ``_flatten`` gave, its slots filled from ``tensors``."""
    if isinstance(shape, _Slot):
        return tensors[shape.index]
    if is_dataclass(shape) and not isinstance(shape, type):
        return replace(shape, **{f.name: _rebuild(getattr(shape, f.name), tensors) for f in fields(shape) if f.init})
    if isinstance(shape, dict):
        return {k: _rebuild(v, tensors) for k, v in shape.items()}
    if isinstance(shape, list):
        return [_rebuild(v, tensors) for v in shape]
    return shape


class _Slot:
    def __init__(self, index: int) -> None:
        self.index = index


class TraceReplayRecorder:
    """Records each static forward as a real-tensor trace; `recorded` counts the recordings and
    `replays` the replays."""

    def __init__(self) -> None:
        self.recorded = 0
        self.replays = 0

    def warm_up(self) -> ContextManager[Any]:
        return contextlib.nullcontext()

    def record(self, run: Callable[[], ForwardOutput], inputs: Sequence[torch.Tensor]) -> Callable[[], ForwardOutput]:
        shapes: list[Any] = []

        def traced(*placeholders: torch.Tensor) -> list[torch.Tensor]:
            # make_fx hands the real input tensors themselves to the function: the forward, which
            # reads them through the engine, reads the placeholders
            flat: list[torch.Tensor] = []
            shapes.append(_flatten(run(), flat))
            return flat

        graph = make_fx(traced, tracing_mode="real")(*inputs)
        self.recorded += 1
        shape = shapes[-1]
        held = list(inputs)

        def replay() -> ForwardOutput:
            self.replays += 1
            out: ForwardOutput = _rebuild(shape, graph(*held))
            return out
        return replay
