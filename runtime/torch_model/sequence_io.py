"""Export/import of one slot's committed state, used by the engine's spill (save/restore) operations.

What is saved: the K/V of the slot's blocks, the GDN state and its block-boundary snapshots, the
target hidden rows, tokens, seq_len, adapter id, the MTP conditioning hidden and the DFlash
context (with a checkpoint's DFlash drafter also the committed context features `dflash_features`).
Pending (uncommitted) verify rows are not saved, nor is a checkpoint MTP module's K/V cache: it is
derived state, rebuilt from the tokens and hidden rows at the slot's next proposal.

Invariant: import_sequence(export_sequence(slot)) into an empty slot of an engine with the same
model config (pool sizes may differ) reproduces the slot exactly, on fresh blocks.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .config import ModelConfig
from .errors import SpillError
from .gdn import GdnSnapshot
from .hf_drafters import PublishedDFlash, PublishedMtp
from .paged_kv import blocks_for
from .weights import torch_dtype

if TYPE_CHECKING:
    from .engine import HybridEngine

SPILL_FORMAT = "fxsched.torch_model.sequence"
# Config fields that may differ between the engine that spilled a sequence and the one restoring it.
POOL_FIELDS = ("num_blocks", "max_slots")


def state_signature(cfg: ModelConfig) -> dict[str, Any]:
    """The config fields a saved sequence depends on (all but the pool sizes)."""
    return {k: v for k, v in cfg.to_dict().items() if k not in POOL_FIELDS}


def export_sequence(engine: "HybridEngine", slot: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(meta, tensors) describing the committed state of `slot`; the engine is not modified."""
    state = engine.slot_state(slot)
    nb = blocks_for(state.seq_len, engine.cfg.block_size)
    blocks = torch.tensor(state.block_table[:nb], dtype=torch.long, device=engine.device)
    tensors: dict[str, torch.Tensor] = {}
    for a in range(len(engine.kv.k)):
        tensors[f"kv_k.{a}"] = engine.kv.k[a].index_select(0, blocks)
        tensors[f"kv_v.{a}"] = engine.kv.v[a].index_select(0, blocks)
    for k, snap in [(0, engine.gdn.snapshot(slot)), *sorted(state.boundary_states.items())]:
        for layer, (rec, conv) in enumerate(snap):
            tensors[f"gdn.{k}.recurrent.{layer}"] = rec
            tensors[f"gdn.{k}.conv.{layer}"] = conv
    tensors["hidden"] = engine.hidden_rows(slot, 0, state.seq_len)
    has_mtp_hidden = engine.has_mtp_hidden(slot)
    if has_mtp_hidden:
        tensors["mtp_hidden"] = engine.mtp_hidden[slot]
    if engine.dflash is not None:
        tensors.update(engine.dflash.export(slot))
    if engine.dflash_features is not None:
        tensors["dflash_features"] = engine.dflash_features[slot, :state.seq_len]
    meta = {"format": SPILL_FORMAT, "config": state_signature(engine.cfg), "seq_len": state.seq_len,
            "tokens": state.tokens, "adapter_id": state.adapter_id, "num_blocks": nb,
            "boundaries": sorted(state.boundary_states), "mtp_hidden": has_mtp_hidden}
    return meta, tensors


def check_sequence(cfg: ModelConfig, dflash: Any, path: str | Path, meta: Any,
                   tensors: dict[str, torch.Tensor]) -> None:
    """Raise SpillError (naming `path`) unless meta/tensors form a sequence this engine can import
    (`dflash`: the engine's DFlash drafter, internal or a checkpoint's, or None)."""
    if not isinstance(meta, dict) or meta.get("format") != SPILL_FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise SpillError(path, f"not a sequence spill (format {found!r}, expected {SPILL_FORMAT!r})")
    try:
        seq_len, nb, tokens = int(meta["seq_len"]), int(meta["num_blocks"]), list(meta["tokens"])
        boundaries, signature = [int(k) for k in meta["boundaries"]], dict(meta["config"])
        int(meta["adapter_id"]), bool(meta["mtp_hidden"])
    except (KeyError, TypeError, ValueError) as err:
        raise SpillError(path, f"incomplete metadata ({err.__class__.__name__}: {err})") from None
    mine = state_signature(cfg)
    if signature != mine:
        diff = sorted(k for k in set(mine) | set(signature) if mine.get(k) != signature.get(k))
        raise SpillError(path, f"saved by an engine with a different model config (fields {diff})")
    if not (0 <= seq_len <= cfg.max_seq_len and len(tokens) == seq_len and nb == blocks_for(seq_len, cfg.block_size)):
        raise SpillError(path, f"inconsistent lengths (seq_len={seq_len}, tokens={len(tokens)}, blocks={nb})")
    if any(not isinstance(t, int) or not 0 <= t < cfg.vocab_size for t in tokens):
        raise SpillError(path, "token ids outside the vocabulary")
    hkv, dh = cfg.num_kv_heads, cfg.head_dim
    expected: dict[str, tuple[int, ...]] = {"hidden": (seq_len, cfg.hidden_size)}
    for a in range(len(cfg.attn_layers)):
        expected[f"kv_k.{a}"] = expected[f"kv_v.{a}"] = (nb, cfg.block_size, hkv, dh)
    for k in [0, *boundaries]:
        for i in range(len(cfg.gdn_layers)):
            expected[f"gdn.{k}.recurrent.{i}"] = (cfg.gdn_v_heads, cfg.gdn_key_dim, cfg.gdn_value_dim)
            expected[f"gdn.{k}.conv.{i}"] = (cfg.gdn_conv_channels, cfg.conv_width - 1)
    if meta["mtp_hidden"]:
        expected["mtp_hidden"] = (cfg.hidden_size,)
    ctx = tensors.get("dflash_ctx_k.0")
    n = ctx.shape[0] if ctx is not None else -1
    ctx_dtype = torch.float32
    if isinstance(dflash, PublishedDFlash):
        expected.update(dflash.export_shapes(n))
        expected["dflash_features"] = (seq_len, dflash.feature_size)
        ctx_dtype = dflash.ctx_k[0].dtype
    elif dflash is not None:
        for j in range(cfg.dflash_layers):
            expected[f"dflash_ctx_k.{j}"] = expected[f"dflash_ctx_v.{j}"] = (n, hkv, dh)
    got = {name: tuple(t.shape) for name, t in tensors.items()}
    if got != expected:
        wrong = sorted(n for n in set(got) | set(expected) if got.get(n) != expected.get(n))
        raise SpillError(path, f"tensors missing or mis-shaped for this engine: {wrong}")
    want = torch_dtype(cfg)
    if any(t.dtype != (ctx_dtype if n.startswith("dflash_ctx") else want) for n, t in tensors.items()):
        raise SpillError(path, f"tensors must be {cfg.dtype} (the model's dtype; DFlash context float32)")


def import_sequence(engine: "HybridEngine", slot: int, blocks: list[int], meta: dict[str, Any],
                    tensors: dict[str, torch.Tensor]) -> None:
    """Load a checked sequence into allocated, empty `slot`, whose new blocks are `blocks`."""
    dev = engine.device
    state = engine.slot_state(slot)
    state.adapter_id = int(meta["adapter_id"])
    state.block_table = list(blocks)
    index = torch.tensor(blocks, dtype=torch.long, device=dev)
    for a in range(len(engine.kv.k)):
        engine.kv.k[a].index_copy_(0, index, tensors[f"kv_k.{a}"].to(dev))
        engine.kv.v[a].index_copy_(0, index, tensors[f"kv_v.{a}"].to(dev))

    def snapshot(k: int) -> GdnSnapshot:
        return [(tensors[f"gdn.{k}.recurrent.{i}"].to(dev), tensors[f"gdn.{k}.conv.{i}"].to(dev))
                for i in range(engine.gdn.num_layers)]

    engine.gdn.load(slot, snapshot(0))
    state.boundary_states = {int(k): snapshot(int(k)) for k in meta["boundaries"]}
    state.tokens, state.seq_len = [int(t) for t in meta["tokens"]], int(meta["seq_len"])
    if engine.keeps_hidden:
        engine.hidden_history[slot, :state.seq_len] = tensors["hidden"].to(dev)
    if meta["mtp_hidden"]:
        engine.set_mtp_hidden(slot, tensors["mtp_hidden"].to(dev))
    if engine.dflash is not None:
        engine.dflash.load(slot, {n: t.to(dev) for n, t in tensors.items() if n.startswith("dflash_ctx")})
    if engine.dflash_features is not None:
        engine.dflash_features[slot, :state.seq_len] = tensors["dflash_features"].to(dev)
    if isinstance(engine.mtp, PublishedMtp):
        engine.mtp.reset(slot)  # a checkpoint MTP module's K/V: rebuilt at the next proposal
