"""Projection weights packed at load, on a bf16 CPU model (cpu-kernels.md §15.2): in tile order, which
the AMX kernel (kernels/cpu_amx.py) and the AVX512-BF16 kernel (kernels/cpu_pairs.py) both read.

`pack_for_cpu` replaces every projection matrix that only `ops.linear` reads by its tile-order
packing, where one of the two kernels is ready (`packing_ready`); `ops.linear` and `ops.embed_rows` take packed and plain
weights alike, and `weights.check_weights` checks a packed weight by the matrix it holds. Left as
they are: norms, convolutions and biases (not products), 3-D expert stacks (the MoE kernels read
them), the fused shared-expert rows (views of one matrix, moe.fuse_shared_experts), and every
weight of a float32 model or one on another device. A tied embedding (the same tensor as
`lm_head`) is packed once and both names take it. An attention block's q/k/v(/gate) and a dense
MLP's gate/up are packed into one buffer each, their names views of it (fused.pack_fused: the
forward's fused products, specs/cpu-kernels.md §15.10).
"""

from __future__ import annotations

import torch

from fxsched.kernels import cpu_amx, cpu_pairs

from .config import ModelConfig
from .fused import fusion_groups, pack_fused
from .moe import fused_shared, moe_prefixes

__all__ = ["LINEAR_WEIGHTS", "pack_for_cpu", "packing_ready"]

# The last name component of every weight that only `linear` reads (weights.py's canonical names).
LINEAR_WEIGHTS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "g_proj", "a_proj", "b_proj", "gate_proj",
                            "up_proj", "down_proj", "in_proj", "fc", "ctx_proj", "lm_head", "router"})
_SHARED_PARTS = ("shared.gate_proj", "shared.up_proj", "shared_gate")


def packing_ready() -> bool:
    """Whether a kernel that reads packed weights is ready on this host: AMX's, else AVX512-BF16's."""
    return cpu_amx.ready() or cpu_pairs.ready()


def pack_for_cpu(weights: dict[str, torch.Tensor], cfg: ModelConfig,
                 consume: bool = False) -> dict[str, torch.Tensor]:
    """`weights` with its projection matrices packed (see the module docstring); `weights` itself
    when nothing is to be packed.

    consume: pack `weights` in place, entry by entry, so each original is released as its packing
    is made (a loader's own dict: memory never holds two copies of the model); otherwise a new dict."""
    if not any(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in weights.values()) or not packing_ready():
        return weights
    fused = {f"{prefix}.{part}" for prefix in moe_prefixes(cfg) if fused_shared(weights, prefix) is not None
             for part in _SHARED_PARTS}
    out = weights if consume else dict(weights)
    tied = weights.get("embed")
    tied_id = id(tied) if tied is not None and tied is weights.get("lm_head") else None
    for names in fusion_groups(cfg).values():  # q/k/v(/gate) and gate/up stacked in one buffer (fused.py)
        if not any(id(out.get(n)) == tied_id for n in names):
            pack_fused(out, names)
    packed: dict[int, torch.Tensor] = {}  # id of an original tensor -> its packing
    for name in list(out):
        t = out[name]
        if name.rsplit(".", 1)[-1] in LINEAR_WEIGHTS and name not in fused and cpu_amx.packable(t):
            if id(t) not in packed:
                packed[id(t)] = cpu_amx.pack(t)
            out[name] = packed[id(t)]
    if tied_id is not None and tied_id in packed:
        out["embed"] = packed[tied_id]
    return out
