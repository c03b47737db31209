"""Sparse mixture-of-experts feed-forward (Qwen3-Next / Qwen3.5-MoE style), plain torch, and the
expert shards of an expert-parallel run.

Per token x: router logits r = x W_router^T [E]; p = softmax(r) in fp32; the top-k experts by p
(ties broken by torch.topk, as transformers) get weights p_top, renormalised to sum 1 when
cfg.norm_topk_prob; the output is sum_e p_e * SwiGLU_e(x) over the chosen experts, plus, with a
shared expert, sigmoid(x W_shared_gate^T) * SwiGLU_shared(x).

Weights (canonical names, see weights.py) under `prefix` (e.g. "layers.3.moe"): router [E, D],
gate_proj / up_proj [E, I, D], down_proj [E, D, I] (experts stacked on dim 0 so an expert-parallel
runtime can slice them), and when cfg.shared_expert_intermediate_size > 0: shared.gate_proj,
shared.up_proj, shared.down_proj and shared_gate [1, D].

The routed sum (`routed_sum`, specs/expert-parallel.md §10.7) has no host logic: no read back,
no data-dependent shape (no unique / nonzero / boolean mask / tolist), so it adds no host
synchronisation to a step and runs on the meta device. The N * k (token, slot) assignments are
grouped by expert on the device (stable argsort of the expert ids; each expert's group end by a
binary search of the sorted ids), the tokens gathered in that order, and each projection is one
grouped GEMM (`torch._grouped_mm`) over the stacked weights; the weighted rows go back with
index_add_, each token's terms in increasing expert order (as transformers' eager experts). A
bf16 CPU forward with at most GEMV_MAX_ASSIGNMENTS assignments takes the per-assignment C kernel
instead (cpu_gemv.moe_gemv_bf16), which is faster on one-row groups. Experts outside a shard's
range get id `count` and contribute zeros (torch.where, not a mask). Rows are independent: a
token's output depends only on that token, so padded rows never affect valid ones.

The shared expert (`shared_expert`) is fused: `fuse_shared_experts` (called by HybridModel) stores
its gate_proj, up_proj and the shared_gate row as consecutive rows of one matrix, so one product
projects a token onto all three.

Expert shards (specs/expert-parallel.md §10.2). With `expert_shard=(rank, world)` the loader
(hf_checkpoint.py) keeps only rank's contiguous range of each MoE layer's experts
(`expert_bounds`): an `ExpertShard` holds those rows of gate/up/down, and the weights dict holds,
under the three stacked names, `ShardedExperts` placeholders -- tensors of the full [E, ...] shape
and dtype that own no memory and refuse every operation -- so `param_shapes` stays the one list
of names and shapes. `sparse_moe` sees a placeholder and hands the layer to the shard's bound
`ExpertCombine` (runtime/ep/experts.py), which returns the routed sum over all ranks' experts;
routing and the shared expert stay here, on the rank that runs the forward. A placeholder whose
shard has no combine bound raises `ExpertShardError` (a sharded model never computes with a
part of its experts silently). Invariant: a rank's routed sum is `routed_sum` restricted to its
range, so the sum over ranks is the single-rank routed sum up to the order of the additions
(exactly equal when every token has at most two experts: a + b == b + a and x + 0 == x).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch
import torch.nn.functional as F

from fxsched.kernels import cpu_gemv

from .config import ModelConfig
from .ops import linear, swiglu_mlp
from .weights import param_shapes

if TYPE_CHECKING:
    from .lora_rows import LoraRows

EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")  # the stacked [E, ...] tensors of a MoE layer
_STACKED_SUFFIXES = tuple(f".moe.{part}" for part in EXPERT_PARTS)


class ExpertShardError(RuntimeError):
    """A sharded expert tensor was used as a whole, or a shard has no expert-parallel group."""


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool,
          logits: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of tokens x [N, D]: (weights [N, k] in x's dtype, expert ids [N, k]); `logits`:
    the router's logits [N, E] when the caller computed them (an adapted router)."""
    probs = torch.softmax((linear(x, router) if logits is None else logits).float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), experts


# Assignments (token, slot pairs) up to which a bf16 CPU forward takes the per-assignment C kernel
# (cpu_gemv.moe_gemv_bf16: each assignment streams its expert's rows once) rather than the grouped
# GEMM, whose CPU bf16 form runs oneDNN per group at about half the kernel's speed on one-row groups.
# Past this, tokens share experts often enough that reading each expert once wins (measured on a
# Qwen3-Next-like layer, see specs/expert-parallel.md §10.7).
GEMV_MAX_ASSIGNMENTS = 1024


def routed_sum(flat: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_w: torch.Tensor,
               up_w: torch.Tensor, down_w: torch.Tensor, first: int = 0) -> torch.Tensor:
    """sum_e p_e * SwiGLU_e(x) over the chosen experts e in [first, first + len(gate_w)) for tokens
    flat [N, D] routed to `experts` [N, k] with `weights` [N, k]; gate_w/up_w/down_w hold those
    experts' rows (expert first + j at row j). Experts outside the range add nothing.

    No host synchronisation and no data-dependent shape (see the module docstring): the N * k
    assignments are grouped by expert on the device and each projection is one grouped GEMM
    (`_grouped`), or, for a few assignments of a bf16 CPU forward, one per-assignment kernel call
    (`_per_assignment`)."""
    n, k = experts.shape
    count = gate_w.shape[0]
    local = (experts - first).reshape(-1)
    outside = (local < 0) | (local >= count)
    local = torch.where(outside, torch.full_like(local, count), local)  # `count`: no expert of ours
    if (flat.dtype == torch.bfloat16 and flat.device.type == "cpu" and n * k <= GEMV_MAX_ASSIGNMENTS
            and not torch.compiler.is_compiling() and cpu_gemv.ready()):
        return _per_assignment(flat, weights, local, gate_w, up_w, down_w)
    return _grouped(flat, weights, local, gate_w, up_w, down_w)


def _per_assignment(flat: torch.Tensor, weights: torch.Tensor, local: torch.Tensor, gate_w: torch.Tensor,
                    up_w: torch.Tensor, down_w: torch.Tensor) -> torch.Tensor:
    """routed_sum by one product per assignment (local [N * k] expert rows, `count` for none:
    the kernel gives zero rows there)."""
    n, k = weights.shape
    h = flat.repeat_interleave(k, dim=0)  # assignment a = token a // k, slot a % k
    act = F.silu(cpu_gemv.moe_gemv_bf16(h, gate_w, local)) * cpu_gemv.moe_gemv_bf16(h, up_w, local)
    y = cpu_gemv.moe_gemv_bf16(act, down_w, local).view(n, k, -1)
    out = torch.zeros_like(flat)
    for slot in range(k):  # slot order: each token's terms are added one by one, as index_add_ does
        out += y[:, slot] * weights[:, slot, None]
    return out


def _grouped(flat: torch.Tensor, weights: torch.Tensor, local: torch.Tensor, gate_w: torch.Tensor,
             up_w: torch.Tensor, down_w: torch.Tensor) -> torch.Tensor:
    """routed_sum by grouped GEMMs: the assignments sorted by expert (stable: within an expert in
    token order), the end offset of each expert's group found by a binary search of the sorted ids,
    the tokens gathered in that order, one grouped GEMM per projection, the weighted rows added back
    with index_add_ (in expert order for each token). Assignments to no expert of ours (id `count`)
    sort last, past the last offset: the GEMMs leave those rows undefined and they are replaced by
    zeros before the scatter."""
    k = weights.shape[1]
    count = gate_w.shape[0]
    order = torch.argsort(local, stable=True)
    ids = local.index_select(0, order)
    bounds = torch.arange(1, count + 1, device=local.device, dtype=local.dtype)
    offs = torch.searchsorted(ids, bounds, out_int32=True)  # end of expert j's rows: #ids <= j
    token = torch.div(order, k, rounding_mode="floor")
    h = flat.index_select(0, token)
    g = torch._grouped_mm(h, gate_w.transpose(-2, -1), offs=offs)
    u = torch._grouped_mm(h, up_w.transpose(-2, -1), offs=offs)
    y = torch._grouped_mm(F.silu(g) * u, down_w.transpose(-2, -1), offs=offs)
    p = weights.reshape(-1).index_select(0, order)[:, None]
    y = torch.where((ids < count)[:, None], y * p, torch.zeros((), dtype=y.dtype, device=y.device))
    return torch.zeros_like(flat).index_add_(0, token, y)


def expert_bounds(num_experts: int, world: int) -> list[tuple[int, int]]:
    """(first expert, count) of each rank: contiguous ranges, the first num_experts % world ranks
    one expert more (rank r holds experts first .. first + count - 1)."""
    if world < 1 or num_experts < world:
        raise ValueError(f"{world} expert-parallel ranks for {num_experts} experts per layer "
                         f"(every rank needs at least one expert)")
    base, extra = divmod(num_experts, world)
    bounds, first = [], 0
    for rank in range(world):
        count = base + (1 if rank < extra else 0)
        bounds.append((first, count))
        first += count
    return bounds


def moe_prefixes(cfg: ModelConfig) -> list[str]:
    """The MoE layers of the model ("layers.i.moe", "mtp.layers.j.moe") in param_shapes order;
    a layer's position in this list is its id on the expert-parallel wire."""
    return [name[: -len(".router")] for name in param_shapes(cfg) if name.endswith(".moe.router")]


class ExpertCombine(Protocol):
    """Computes a sharded MoE layer's routed sum over every rank's experts (runtime/ep/experts.py)."""

    def combine(self, shard: "ExpertShard", flat: torch.Tensor, weights: torch.Tensor,
                experts: torch.Tensor) -> torch.Tensor: ...


@dataclass(eq=False)
class ExpertShard:
    """One rank's experts of one MoE layer: experts first .. first + count - 1 of num_experts.

    gate_proj / up_proj [count, I, D], down_proj [count, D, I]; `layer` is the layer's id
    (its index in `moe_prefixes`); `combine` is bound by the expert-parallel runtime while a run
    is up (None otherwise)."""

    prefix: str
    layer: int
    first: int
    num_experts: int
    rank: int
    world: int
    gate_proj: torch.Tensor
    up_proj: torch.Tensor
    down_proj: torch.Tensor
    combine: Optional[ExpertCombine] = field(default=None, repr=False)

    @property
    def count(self) -> int:
        return int(self.gate_proj.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.gate_proj.shape[-1])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.gate_proj, self.up_proj, self.down_proj))

    def local_sum(self, flat: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """This shard's part of the routed sum of tokens flat [N, D] (zeros for the other experts)."""
        return routed_sum(flat, weights, experts, self.gate_proj, self.up_proj, self.down_proj, self.first)

    def placeholders(self) -> dict[str, "ShardedExperts"]:
        """The three stacked names of the layer -> placeholders of their full shapes."""
        e = self.num_experts
        return {f"{self.prefix}.{part}": ShardedExperts(self, part, (e, *getattr(self, part).shape[1:]))
                for part in EXPERT_PARTS}


class ShardedExperts(torch.Tensor):
    """Stands for the stacked tensor `shard.prefix`.`part` [E, ...] of which this rank holds only
    `shard`'s rows: the full shape, dtype and device, no storage; any operation on it raises
    ExpertShardError (only `sparse_moe` knows what it is)."""

    shard: ExpertShard
    part: str

    @staticmethod
    def __new__(cls, shard: ExpertShard, part: str, shape: tuple[int, ...]) -> "ShardedExperts":
        local = getattr(shard, part)
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=local.dtype, device=local.device,
                                                requires_grad=False)
        t.shard = shard
        t.part = part
        return t

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        shard = next((a.shard for a in args if isinstance(a, ShardedExperts)), None)
        where = f"{shard.prefix} (experts {shard.first}..{shard.first + shard.count - 1} of {shard.num_experts} " \
                f"on rank {shard.rank} of {shard.world})" if shard is not None else "a sharded expert tensor"
        raise ExpertShardError(f"{where}: {func} on the whole stacked tensor, of which this rank holds a shard")

    def __repr__(self, *, tensor_contents: Any = None) -> Any:  # type: ignore[override]  # the default computes
        return (f"ShardedExperts({self.shard.prefix}.{self.part}, shape={list(self.shape)}, "
                f"experts {self.shard.first}..{self.shard.first + self.shard.count - 1})")


def expert_shards(weights: dict[str, torch.Tensor]) -> list[ExpertShard]:
    """The distinct shards behind the ShardedExperts placeholders of `weights`, in layer order."""
    seen: dict[int, ExpertShard] = {}
    for t in weights.values():
        if isinstance(t, ShardedExperts):
            seen.setdefault(id(t.shard), t.shard)
    return sorted(seen.values(), key=lambda s: s.layer)


def weight_bytes(weights: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(expert bytes, other bytes) that `weights` holds on this rank: a shard counts its own rows, a
    tensor stored under two names (tied embeddings) counts once."""
    experts = sum(s.nbytes for s in expert_shards(weights))
    other, seen = 0, set()
    for name, t in weights.items():
        if isinstance(t, ShardedExperts):
            continue
        key = (t.device, t.data_ptr())
        if key in seen:
            continue
        seen.add(key)
        size = t.numel() * t.element_size()
        if name.endswith(_STACKED_SUFFIXES):
            experts += size
        else:
            other += size
    return experts, other


def sparse_moe(x: torch.Tensor, w: dict[str, torch.Tensor], prefix: str, cfg: ModelConfig,
               lora: "Optional[LoraRows]" = None) -> torch.Tensor:
    """MoE feed-forward of x [..., D] with the weights under `prefix`; returns [..., D]. `lora`: the
    batch's adapters of the router and the shared expert (specs/lora.md §18.3: routed experts take none)."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    router = w[f"{prefix}.router"]
    logits = None if lora is None else lora.add(f"{prefix}.router", flat, linear(flat, router))
    weights, experts = route(flat, router, cfg.num_experts_per_tok, cfg.norm_topk_prob, logits)
    gate_w, up_w, down_w = w[f"{prefix}.gate_proj"], w[f"{prefix}.up_proj"], w[f"{prefix}.down_proj"]
    if isinstance(gate_w, ShardedExperts):
        shard = gate_w.shard
        if shard.combine is None:
            raise ExpertShardError(f"{prefix}: this rank holds experts {shard.first}..{shard.first + shard.count - 1} "
                                   f"of {shard.num_experts} only (expert shard {shard.rank} of {shard.world}) and "
                                   f"no expert-parallel group is bound to combine them")
        out = shard.combine.combine(shard, flat, weights, experts)
    else:
        out = routed_sum(flat, weights, experts, gate_w, up_w, down_w)
    if cfg.shared_expert_intermediate_size:
        out = out + shared_expert(flat, w, prefix, lora)
    return out.reshape(shape)


def _shared_parts(w: dict[str, torch.Tensor], prefix: str) -> tuple[torch.Tensor, ...]:
    return tuple(w[f"{prefix}.{name}"] for name in ("shared.gate_proj", "shared.up_proj", "shared_gate"))


def fused_shared(w: dict[str, torch.Tensor], prefix: str) -> Optional[torch.Tensor]:
    """The [2S + 1, D] matrix whose rows are the layer's shared gate_proj, up_proj and shared_gate
    when the three are consecutive views of it (`fuse_shared_experts`), else None."""
    gate, up, sgate = _shared_parts(w, prefix)
    base = gate._base
    if base is None or up._base is not base or sgate._base is not base or base.dim() != 2:
        return None
    s, d = gate.shape
    at = base.storage_offset()
    if (base.shape[0] != 2 * s + 1 or not base.is_contiguous() or gate.storage_offset() != at
            or up.storage_offset() != at + s * d or sgate.storage_offset() != at + 2 * s * d):
        return None
    return base


def fuse_shared_experts(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """`weights` with each MoE layer's shared gate_proj [S, D], up_proj [S, D] and shared_gate
    [1, D] stored as consecutive rows of one [2S + 1, D] tensor (the dict keeps its names and
    shapes: the three entries become views of it), so `shared_expert` projects a token onto all
    three with one product. One copy at load; the separate tensors are released with the caller's
    dict."""
    if not cfg.shared_expert_intermediate_size:
        return weights
    out = dict(weights)
    for prefix in moe_prefixes(cfg):
        if fused_shared(out, prefix) is not None:
            continue
        parts = _shared_parts(out, prefix)
        fused = torch.cat(parts, dim=0)
        s = parts[0].shape[0]
        out[f"{prefix}.shared.gate_proj"], out[f"{prefix}.shared.up_proj"], out[f"{prefix}.shared_gate"] = (
            fused[:s], fused[s:2 * s], fused[2 * s:])
    return out


def shared_expert(flat: torch.Tensor, w: dict[str, torch.Tensor], prefix: str,
                  lora: "Optional[LoraRows]" = None) -> torch.Tensor:
    """sigmoid(x W_shared_gate^T) * SwiGLU_shared(x) for tokens flat [N, D]: with the fused layout
    one product gives the gate, up and shared-gate columns, then one the down projection (four
    products otherwise)."""
    fused = fused_shared(w, prefix)
    if fused is None:
        sgate = linear(flat, w[f"{prefix}.shared_gate"])
        if lora is not None:
            sgate = lora.add(f"{prefix}.shared_gate", flat, sgate)
        return torch.sigmoid(sgate) * swiglu_mlp(flat, w, f"{prefix}.shared", lora)
    s = (fused.shape[0] - 1) // 2
    proj = linear(flat, fused)
    gate, up, sgate = proj[:, :s], proj[:, s:2 * s], proj[:, 2 * s:]
    if lora is not None:  # each part's adapter on its columns of the fused product
        gate = lora.add(f"{prefix}.shared.gate_proj", flat, gate)
        up = lora.add(f"{prefix}.shared.up_proj", flat, up)
        sgate = lora.add(f"{prefix}.shared_gate", flat, sgate)
    act = F.silu(gate) * up
    down = linear(act, w[f"{prefix}.shared.down_proj"])
    if lora is not None:
        down = lora.add(f"{prefix}.shared.down_proj", act, down)
    return torch.sigmoid(sgate) * down
