"""Forwards of fixed shape replayed as CUDA graphs: decodes and uniform verifies (specs/async.md §16.4).

A ``StaticForward`` owns the input tensors of one shape, B sequences of T rows each, and runs the
model over them in the shape-static form (no host attention plan, the block tables as wide as the
longest sequence, every row valid). A forward of b <= B sequences of T rows is copied in on the
device. The b sequences' tokens, positions, KV write rows, block tables and GDN slots fill the
first b entries. The other B - b entries are padding: their block tables name only the engine's
scratch block, their KV rows are written there, they read GDN slot 0's state (never written: off
the CPU a forward returns the GDN states and a commit writes them), and their outputs are dropped.
Slot 0's state must be finite even before a sequence sits there (the pool is not zeroed; the engine
zeroes slot 0 before it records): a padding row computed from garbage writes NaN K/V into the
scratch block, which the real rows' attention reads past their length at weight 0, and 0 x NaN is NaN.
On CUDA the forward over those inputs is captured once as a graph and each later forward of that
shape replays it. The outputs are copied out of the graph's buffers before they are returned,
because a verify's rows stay pending across other forwards until their commit, and every graph
writes its outputs into one shared memory pool.

How a forward is recorded and replayed is a ``Recorder``'s: ``CudaGraphRecorder`` captures a CUDA
graph (warm-ups on a side stream, then the capture into one memory pool shared by every graph). A
recorded forward is a contract: each replay reads the static inputs and the engine's state
tensors (``StaticForward.inputs``: KV cache, GDN states) as they are then, and everything else as
it was at capture -- so the forward must compute from those inputs alone, with no value taken on
the host and no table kept from an earlier call (specs/async.md §16.4). The tests hold every static
forward to it with a recorder that replays a trace made with real tensors, in which anything that
is not an input is a constant.

``ForwardGraphs`` holds one ``StaticForward`` per (bucket, T) and picks, for a batch, the smallest
bucket that holds it. A batch it cannot take runs eagerly, as does every forward when capture
fails: a prefill (its rows are committed and chunked), a ragged verify, a batch wider than the
last bucket, an in-place GDN decode (CPU), or a forward whose logits are limited to a few rows.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, Optional, Protocol, Sequence

import structlog
import torch

from .model import ForwardOutput, RowBatch
from .paged_kv import blocks_for

if TYPE_CHECKING:
    from .engine import HybridEngine

log = structlog.get_logger("fxsched.graphs")

WARMUP_RUNS = 2  # eager runs on a side stream before a capture (cuBLAS workspaces, the allocator)
ENV = "FXSCHED_CUDA_GRAPHS"  # "0": every forward eager on CUDA too (to compare)


def cuda_graphs_wanted(device: torch.device, asked: Optional[bool]) -> bool:
    """Whether an engine on ``device`` captures graphs: only on CUDA; ``asked`` None defers to the
    environment (FXSCHED_CUDA_GRAPHS, on unless "0")."""
    if device.type != "cuda":
        return False
    return os.environ.get(ENV, "1") != "0" if asked is None else asked


def buckets(max_slots: int) -> tuple[int, ...]:
    """The batch sizes graphs are captured for: 1, 2, 4, 8, then every multiple of 8, up to and
    including max_slots."""
    sizes = [b for b in (1, 2, 4) if b < max_slots] + list(range(8, max_slots, 8)) + [max_slots]
    return tuple(sorted(set(sizes)))


def _copied(value: Any) -> Any:
    """``value`` with every tensor in it (a ForwardOutput, its GDN rows, dicts, lists) cloned."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if is_dataclass(value) and not isinstance(value, type):
        return replace(value, **{f.name: _copied(getattr(value, f.name)) for f in fields(value) if f.init})
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copied(v) for v in value]
    return value


Replay = Callable[[], ForwardOutput]  # runs a recorded forward over its inputs as they are now


class Recorder(Protocol):
    """Records a static forward once and replays it (specs/async.md §16.4)."""

    def warm_up(self) -> ContextManager[Any]:
        """Where the warm-up runs before the recording go (a side stream for a CUDA graph)."""
        ...

    def record(self, run: Callable[[], ForwardOutput], inputs: Sequence[torch.Tensor]) -> Replay:
        """Record ``run`` over ``inputs`` (every tensor whose contents may change between replays)
        and return what replays it."""
        ...


class CudaGraphRecorder:
    """Captures each forward as a CUDA graph in one shared memory pool; a replay returns the graph's
    own output tensors (the next replay overwrites them: the caller copies them out)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    @contextlib.contextmanager
    def warm_up(self) -> Iterator[None]:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            yield
        torch.cuda.current_stream(self.device).wait_stream(side)

    def record(self, run: Callable[[], ForwardOutput], inputs: Sequence[torch.Tensor]) -> Replay:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = run()

        def replay() -> ForwardOutput:
            graph.replay()
            return out
        return replay


class StaticForward:
    """The inputs of one forward shape, the forward over them, and (once recorded) its replay."""

    def __init__(self, engine: "HybridEngine", b: int, t: int, scratch_block: int,
                 capture_layers: tuple[int, ...]) -> None:
        cfg, dev = engine.cfg, engine.device
        self.engine, self.b, self.t, self.capture_layers = engine, b, t, capture_layers
        nb = blocks_for(cfg.max_seq_len, cfg.block_size)
        rows = torch.arange(t, device=dev)
        self.tokens = torch.zeros(b, t, dtype=torch.long, device=dev)
        self.positions = rows.repeat(b, 1)
        self.write_index = (scratch_block * cfg.block_size + rows % cfg.block_size).repeat(b)
        self.block_tables = torch.full((b, nb), scratch_block, dtype=torch.long, device=dev)
        self.slots = torch.zeros(b, dtype=torch.long, device=dev)
        self.padding = (self.positions.clone(), self.write_index.clone(), self.block_tables.clone())
        self.batch = RowBatch(self.tokens, self.positions, torch.ones(b, t, dtype=torch.bool, device=dev),
                              self.write_index, self.block_tables, self.slots, uniform=True)
        self.replay: Optional[Replay] = None  # once recorded

    def load(self, batch: RowBatch) -> None:
        """Copy a prepared batch (n <= b sequences of t rows) into the inputs; the rest is padding.
        Device-to-device copies only: nothing here waits for the device."""
        n, t = batch.tokens.shape
        positions, write_index, tables = self.padding
        self.tokens[:n].copy_(batch.tokens)
        self.tokens[n:].zero_()
        self.positions.copy_(positions)
        self.positions[:n].copy_(batch.positions)
        self.write_index.copy_(write_index)
        self.write_index[:n * t].copy_(batch.write_index)
        self.block_tables.copy_(tables)
        self.block_tables[:n, :batch.block_tables.shape[1]].copy_(batch.block_tables)
        self.slots.zero_()
        self.slots[:n].copy_(batch.slots)

    def run(self) -> ForwardOutput:
        """The forward over the inputs as they are, eagerly: what a recorder records and replays."""
        engine = self.engine
        return engine.model.forward(self.batch, engine.kv, engine.gdn, capture_layers=self.capture_layers)

    def inputs(self) -> list[torch.Tensor]:
        """Every tensor the forward reads whose contents change between forwards: the static inputs,
        then the engine's KV cache and GDN state cache (read and written in place)."""
        engine = self.engine
        return [self.tokens, self.positions, self.write_index, self.block_tables, self.slots,
                *engine.kv.k, *engine.kv.v, *engine.gdn.recurrent, *engine.gdn.conv]

    def capture(self, recorder: Recorder) -> None:
        """Warm up (WARMUP_RUNS eager runs), then record the forward over the inputs as loaded."""
        with recorder.warm_up():
            for _ in range(WARMUP_RUNS):
                self.run()
        self.replay = recorder.record(self.run, self.inputs())

    def forward(self, batch: RowBatch) -> ForwardOutput:
        """The forward of ``batch``: replayed when recorded (its first n sequences' outputs copied
        out of the recording's buffers), else run on the static inputs."""
        self.load(batch)
        n = batch.tokens.shape[0]
        if self.replay is None:
            return _first(self.run(), n)  # fresh tensors: nothing else writes them
        return _copied(_first(self.replay(), n))


def _first(out: ForwardOutput, n: int) -> ForwardOutput:
    """The outputs of the first n sequences (views)."""
    rows = [replace(r, states=r.states[:n], windows=r.windows[:n]) for r in out.gdn_rows]
    return ForwardOutput(out.hidden[:n], out.logits[:n], rows, {i: h[:n] for i, h in out.layer_hidden.items()})


@dataclass
class GraphStats:
    """How the forwards that asked went: replayed or run on static inputs, or run eagerly."""

    static: int = 0
    eager: int = 0


class ForwardGraphs:
    """One ``StaticForward`` per (bucket, rows), each recorded by ``recorder`` when one is given
    (a CUDA graph: ``CudaGraphRecorder``), else run eagerly over its static inputs."""

    def __init__(self, engine: "HybridEngine", sizes: Sequence[int], rows: Sequence[int], scratch_block: int,
                 capture_layers: tuple[int, ...] = (), recorder: Optional[Recorder] = None) -> None:
        self.sizes = tuple(sorted(set(sizes)))
        self.rows = tuple(sorted(set(rows)))
        self.stats = GraphStats()
        self.forwards = {(b, t): StaticForward(engine, b, t, scratch_block, capture_layers)
                         for t in self.rows for b in self.sizes}
        self.captured = False
        if recorder is not None:
            # the widest first: a CUDA graphs' shared pool is sized by the first capture
            for key in sorted(self.forwards, key=lambda k: -k[0] * k[1]):
                self.forwards[key].capture(recorder)
            self.captured = True
            log.info("cuda_graphs_captured", graphs=len(self.forwards), sizes=self.sizes, rows=self.rows)

    def find(self, batch: RowBatch) -> Optional[StaticForward]:
        """The static forward that takes ``batch``, or None (it runs eagerly)."""
        if (not batch.uniform or batch.gdn_in_place or batch.gdn_keep_rows is not None
                or batch.logit_rows is not None or batch.lora is not None):
            return None  # (an adapted batch runs eagerly: its rows' slots are not a static input)
        n, t = batch.tokens.shape
        size = next((b for b in self.sizes if b >= n), None)
        return None if size is None else self.forwards.get((size, t))

    def forward(self, batch: RowBatch) -> Optional[ForwardOutput]:
        """``batch``'s forward through its static form, or None when none takes it."""
        static = self.find(batch)
        if static is None:
            self.stats.eager += 1
            return None
        self.stats.static += 1
        return static.forward(batch)
