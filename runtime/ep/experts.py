"""Expert parallelism's data plane: a sharded MoE layer's routed sum, computed by every rank.

Who holds what (specs/expert-parallel.md §10.2). Rank 0 (the leader) loads the checkpoint with
``expert_shard=(0, N)``: every dense part (embeddings, attention, GDN, norms, routers, shared experts,
LM head, drafters) and its own range of each MoE layer's experts. Worker r loads nothing but its
range (``load_expert_shards``), so the experts, almost all of a sparse model's weights, are split N
ways and nothing is held twice.

One layer call (§10.3). The leader runs every forward the scheduler asks for (prefill, chunk,
decode, verify, batched verify, MTP and DFlash drafting) exactly as on one rank; the routing comes
from its router. In a MoE layer, ``sparse_moe`` hands its shard to ``ExpertGroup.combine``, which on
the EP group (the one the command stream uses; gloo on CPU, NCCL on CUDA):

1. broadcasts an EXPERTS header (protocol kind 12: layer id, rows N, top-k, hidden size, dtype);
2. broadcasts one payload [N, D + 2k] in the activations' dtype: the rows, their routing weights,
   and the expert ids bit-cast to an integer of the dtype's width (``pack``; a copy never
   changes bits, so nothing is rounded on the way);
3. adds its own experts' part of the routed sum (``ExpertShard.local_sum``) while the workers
   add theirs (``ExpertServer.serve``);
4. reduces the N partial sums [N, D] to rank 0 (SUM), the layer's routed sum; the shared expert
   is then added by ``sparse_moe`` on rank 0 alone, never twice.

Every rank computes the same ``routed_sum`` restricted to its experts, on the same bits, so the
result is the single-rank one up to the order of the additions of the ranks' parts (exact when
each token has at most two experts; within fp32 rounding otherwise).

Failures. A collective that raises (a worker died: its sockets close at once; a worker stalled:
the group's timeout, the leader's ``--ep-timeout``) becomes the leader's ``failure`` with the
message of ``TorchLeaderLink.failure`` (``EP worker 1 died (its process exited with code -9)``),
and the forward raises ``DeviceError`` with it: the interpreter fails the requests in flight and
the run ends. From then on, and after the shutdown word, ``combine`` raises at once and sends
nothing. A worker whose own computation fails still takes part in the reduce (with zeros) and
reports the error at the next SYNC, which the leader sends before any answer is read.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any, Optional

import attrs
import structlog

from fxsched.runtime.devices.device import DeviceError
from fxsched.runtime.ep.link import LinkError, TorchLeaderLink
from fxsched.runtime.ep.protocol import Kind, Message

if TYPE_CHECKING:
    import torch

    from fxsched.runtime.ep.leader import EpLeaderDevice
    from fxsched.runtime.torch_model.moe import ExpertShard

log = structlog.get_logger("fxsched.ep")

WIRE_DTYPES = ("float32", "bfloat16", "float16")  # header code i: the activations' dtype
ID_DTYPES = {"float32": "int32", "bfloat16": "int16", "float16": "int16"}  # expert ids, bit-cast
MIB = 1024 * 1024


def _wire_code(dtype: "torch.dtype") -> int:
    name = str(dtype).removeprefix("torch.")
    if name not in WIRE_DTYPES:
        raise DeviceError(f"expert parallelism: activations of dtype {name} cannot go on the wire")
    return WIRE_DTYPES.index(name)


def pack(flat: "torch.Tensor", weights: "torch.Tensor", experts: "torch.Tensor", num_experts: int) -> "torch.Tensor":
    """[N, D + 2k] in flat's dtype: rows, routing weights, expert ids (of num_experts) bit-cast
    (see ``unpack``)."""
    import torch

    ids = getattr(torch, ID_DTYPES[str(flat.dtype).removeprefix("torch.")])
    if num_experts - 1 > torch.iinfo(ids).max:
        raise DeviceError(f"expert parallelism: {num_experts} expert ids do not fit {ids} ({flat.dtype} activations)")
    return torch.cat([flat, weights.to(flat.dtype), experts.to(ids).view(flat.dtype)], dim=-1)


def unpack(payload: "torch.Tensor", hidden: int, k: int) -> tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]:
    """(rows [N, D], weights [N, k], expert ids [N, k] int64) of a ``pack`` payload."""
    import torch

    ids = getattr(torch, ID_DTYPES[str(payload.dtype).removeprefix("torch.")])
    return (payload[:, :hidden].contiguous(), payload[:, hidden:hidden + k].contiguous(),
            payload[:, hidden + k:].contiguous().view(ids).to(torch.int64))


def layer_table(shards: list["ExpertShard"]) -> list[list[Any]]:
    """[prefix, first expert, count, experts per layer] of each shard (what a rank reports)."""
    return [[s.prefix, s.first, s.count, s.num_experts] for s in shards]


# --- rank 0 ---------------------------------------------------------------------------------------


class ExpertGroup:
    """Rank 0's end of the data plane; the ``moe.ExpertCombine`` bound to its shards during a run.

    Figures: ``calls`` (layer calls; ``by_layer`` per layer prefix), ``rows`` (rows sent),
    ``collective_s`` (seconds in the broadcasts and the reduce, which includes waiting for the
    slowest worker), ``compute_s`` (rank 0's own experts)."""

    def __init__(self, link: TorchLeaderLink):
        self.link = link
        self.leader: Optional["EpLeaderDevice"] = None
        self.failure: Optional[str] = None
        self.calls = 0
        self.rows = 0
        self.collective_s = 0.0
        self.compute_s = 0.0
        self.by_layer: dict[str, int] = {}  # layer prefix -> calls
        self._bound: list["ExpertShard"] = []

    def bind(self, shards: list["ExpertShard"]) -> None:
        for shard in shards:
            shard.combine = self
        self._bound = list(shards)

    def unbind(self) -> None:
        """The shards forget this group: a later forward on them raises instead of using it."""
        for shard in self._bound:
            if shard.combine is self:
                shard.combine = None
        self._bound = []

    def stats(self) -> dict[str, Any]:
        return {"calls": self.calls, "rows": self.rows, "collective_s": self.collective_s,
                "compute_s": self.compute_s, "by_layer": dict(self.by_layer)}

    def _check_open(self) -> None:
        failure = self.failure or (self.leader.failure if self.leader is not None else None)
        if failure is not None:
            raise DeviceError(failure)
        if self.leader is not None and self.leader.shut_down:
            raise DeviceError("EP: an expert call after the shutdown word (the workers are gone)")

    def _fail(self, message: str, err: BaseException) -> DeviceError:
        if self.failure is None:
            self.failure = message
        if self.leader is not None:
            self.leader._fail(message)
        else:
            log.info("ep_group_failed", message=message)
        return DeviceError(message)

    def combine(self, shard: "ExpertShard", flat: "torch.Tensor", weights: "torch.Tensor",
                experts: "torch.Tensor") -> "torch.Tensor":
        """The routed sum of tokens flat [N, D] over every rank's experts (see the module docstring)."""
        import torch.distributed as dist

        self._check_open()
        n, k = experts.shape
        if n == 0:
            return shard.local_sum(flat, weights, experts)
        hidden = int(flat.shape[-1])
        comm, group = self.link.comm_device, self.link.group
        header = Message(Kind.EXPERTS, shard.layer, n, (k, hidden, _wire_code(flat.dtype)))
        start = time.perf_counter()
        payload = pack(flat, weights, experts, shard.num_experts).to(comm)
        try:
            self.link.send(header)
            dist.broadcast(payload, src=0, group=group)
            sent = time.perf_counter()
            partial = shard.local_sum(flat, weights, experts)
            computed = time.perf_counter()
            total = partial.to(comm)
            dist.reduce(total, dst=0, op=dist.ReduceOp.SUM, group=group)
        except LinkError as err:
            raise self._fail(str(err), err) from err
        except RuntimeError as err:
            raise self._fail(str(self.link.failure(err)), err) from err
        done = time.perf_counter()
        self.calls += 1
        self.rows += n
        self.by_layer[shard.prefix] = self.by_layer.get(shard.prefix, 0) + 1
        self.collective_s += (sent - start) + (done - computed)
        self.compute_s += computed - sent
        return total.to(flat.device)


# --- workers --------------------------------------------------------------------------------------


class ExpertServer:
    """A worker's experts: its shard of every MoE layer, serving the leader's layer calls."""

    def __init__(self, rank: int, world: int, shards: list["ExpertShard"], device: str = "cpu"):
        self.rank = rank
        self.world = world
        self.device = device
        self.by_layer = {s.layer: s for s in shards}
        self.shards = shards
        self.group: Any = None
        self.comm_device = "cpu"
        self.calls = 0
        self.rows = 0
        self.compute_s = 0.0

    def attach(self, group: Any, comm_device: str) -> None:
        self.group = group
        self.comm_device = comm_device

    def weights_report(self) -> dict[str, Any]:
        return {"rank": self.rank, "expert_bytes": sum(s.nbytes for s in self.shards), "other_bytes": 0,
                "layers": layer_table(self.shards), "error": None}

    def serve(self, message: Message) -> Optional[str]:
        """Take part in one layer call (header ``message``); the error of the local computation,
        if any (the collectives are done regardless; their own failures raise RuntimeError)."""
        import torch
        import torch.distributed as dist

        if self.group is None:
            raise RuntimeError("expert server not attached to a process group")
        layer, n = message.a, message.b
        k, hidden, code = message.payload
        dtype = getattr(torch, WIRE_DTYPES[code])
        payload = torch.empty((n, hidden + 2 * k), dtype=dtype, device=self.comm_device)
        dist.broadcast(payload, src=0, group=self.group)
        error = None
        start = time.perf_counter()
        try:
            shard = self.by_layer[layer]
            partial = shard.local_sum(*unpack(payload.to(self.device), hidden, k)).to(self.comm_device)
        except Exception as err:  # noqa: BLE001 -- reported at the next SYNC; the reduce must still happen
            error = f"expert call for layer {layer}: {type(err).__name__}: {err}"
            partial = torch.zeros((n, hidden), dtype=dtype, device=self.comm_device)
        self.compute_s += time.perf_counter() - start
        dist.reduce(partial, dst=0, op=dist.ReduceOp.SUM, group=self.group)
        self.calls += 1
        self.rows += n
        return error

    def stats(self) -> dict[str, Any]:
        return {"calls": self.calls, "rows": self.rows, "compute_s": self.compute_s}


@attrs.frozen
class ExpertShardSpec:
    """Builds a worker's ``ExpertServer`` in its process (picklable: a process argument): rank r of
    world loads its experts from ``model_dir`` itself, in the leader's dtype."""

    model_dir: str
    dtype: Optional[str] = None
    device: str = "cpu"
    threads: int = 1

    def __call__(self, rank: int, world: int) -> ExpertServer:
        import torch

        from fxsched.runtime.torch_model.hf_checkpoint import load_expert_shards

        if self.device == "cpu":
            torch.set_num_threads(self.threads)
        _, shards = load_expert_shards(self.model_dir, rank, world, device=self.device, dtype=self.dtype)
        return ExpertServer(rank, world, shards, self.device)


# --- the per-rank weights report ------------------------------------------------------------------


@attrs.frozen
class WeightsReport:
    """Weight bytes per rank: ``ranks[r] = (expert bytes, other bytes)``."""

    ranks: tuple[tuple[int, int], ...]

    def to_json(self) -> list[dict[str, int]]:
        return [{"rank": r, "expert_bytes": e, "other_bytes": o} for r, (e, o) in enumerate(self.ranks)]

    def line(self) -> str:
        """One line: each rank's total and its split, in MiB."""
        parts = []
        for r, (e, o) in enumerate(self.ranks):
            split = f"experts {e / MIB:.3f}" + (f" + other {o / MIB:.3f}" if o else "")
            parts.append(f"rank {r} {(e + o) / MIB:.3f} MiB ({split})")
        return f"EP weights per rank: {', '.join(parts)}"


def weights_report(leader_shards: list["ExpertShard"], leader_bytes: tuple[int, int],
                   posts: dict[int, bytes]) -> WeightsReport:
    """Check the workers' posted reports against the leader's shards (every rank holds its
    expected range of the same layers) and sum them up; RuntimeError naming the first mismatch."""
    from fxsched.runtime.torch_model.moe import expert_bounds

    world = len(posts) + 1
    ranks = [leader_bytes]
    for rank in range(1, world):
        report = json.loads(posts[rank])
        if report.get("error"):
            raise RuntimeError(f"EP worker {rank} could not load its experts: {report['error']}")
        want = [[s.prefix, *expert_bounds(s.num_experts, world)[rank], s.num_experts] for s in leader_shards]
        if report["layers"] != want:
            raise RuntimeError(f"EP worker {rank} holds experts {report['layers']}, expected {want}")
        ranks.append((int(report["expert_bytes"]), int(report["other_bytes"])))
    return WeightsReport(tuple(ranks))


__all__ = ["ExpertGroup", "ExpertServer", "ExpertShardSpec", "WeightsReport", "layer_table", "weights_report"]
