"""Gated DeltaNet (linear attention with a delta-rule recurrent state) and its per-slot state cache.

Recurrence per value head (S is [Dk, Dv], k and q are L2-normalised):
    S_t = a_t * S_{t-1} + b_t * k_t (v_t - k_t^T a_t S_{t-1})^T,   o_t = S_t^T q_t / sqrt(Dk)
with decay a_t = exp(-exp(A_log) * softplus(x W_a + dt_bias)) and write strength b_t = sigmoid(x W_b).
q, k, v first pass a causal depthwise short conv (width W) + SiLU, whose state is the last W-1 inputs;
the conv channels are ordered q (Hk*Dk), k (Hk*Dk), v (Hv*Dv), as transformers' conv input.
The output is o_proj(RMSNorm(o) * silu(x W_g)) per value head (a plain, not zero-centred, norm weight).

Grouped value heads: q/k have Hk = gdn_num_heads heads, v, a, b, the gate and the state have
Hv = cfg.gdn_v_heads (a multiple of Hk); value head j reads q/k head j // (Hv / Hk) -- q and k are
repeated per value head (repeat_interleave) exactly as transformers' Qwen3-Next / Qwen3.5 do.

Dtypes: projections and the conv input run in x's dtype (cfg.dtype); the conv, the normalisations,
the decay and the recurrence compute in fp32; recurrent and conv states are stored in the state
cache's dtype (cfg.dtype), outputs are cast back to x's dtype.

Invariant: the forward never mutates the cache; it returns the state after *every* row, so a caller
can keep the state after any accepted prefix (write-on-accept) without recomputation.

Kernels (see kernel_paths.py): the recurrence runs as `fxsched.kernels.gated_delta` where
kernel_paths allows Triton. Its conventions match this layer exactly: S is [Dk, Dv]; with
g_t = log a_t = -exp(A_log) * softplus(x W_a + dt_bias) it computes S' = exp(g_t) S,
u = b_t (v_t - S'^T k_t), S_t = S' + k_t u^T, o_t = scale * S_t^T q_t -- our q is already
L2-normalised and scaled by 1/sqrt(Dk), so scale = 1 -- and it returns every per-row state, as the
commit needs. The short conv, the normalisations, the gate and the projections stay in torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fxsched.kernels.cpu_gdn import gdn_step
from fxsched.kernels.gated_delta import gated_delta

from .config import ModelConfig
from .gdn_chunked import KeepIndex, KeepPlan, chunked_gated_delta
from .gdn_fla import fla_prefill_applies, segmented_gated_delta
from .kernel_paths import gdn_recurrence_kernel_applies
from .lora_rows import LoraRows, project
from .ops import l2_normalize, rms_norm

GdnSnapshot = list[tuple[torch.Tensor, torch.Tensor]]  # per GDN layer: (recurrent [Hv,Dk,Dv], conv [C,W-1])


@dataclass
class GdnRows:
    """The recurrent and conv states of one GDN layer forward over a batch [B, T].

    states [B, R, Hv, Dk, Dv] are recurrent states and windows [B, C, R, W] conv input windows,
    whose [..., 1:] slice is the conv state: after *every* row when `rows` is None (R = T, a
    verify: any prefix may be accepted), else after the rows listed in `rows` only (a forward that
    commits all its rows: the chunked prefill of gdn_chunked.py keeps the block-boundary rows and
    each sequence's last row, never T states, and the conv windows of those rows only -- a view of
    every row's windows would hold the layer's whole conv input, [B, W-1+T, C], until the commit:
    13 MB a bf16 layer for 8 prompts of 128 tokens).
    """

    states: torch.Tensor
    windows: torch.Tensor
    rows: tuple[int, ...] | None = None
    in_cache: bool = False  # the forward committed its row in the caches itself (gdn_layer's in_place)

    @classmethod
    def committed(cls) -> "GdnRows":
        """The rows of an in-place forward: nothing to fold, the slot's state is the cache's."""
        empty = torch.empty(0)
        return cls(empty, empty, (), in_cache=True)

    def index(self, t: int) -> int:
        """Where the state after row t sits in `states` (ValueError if that state was not kept)."""
        if self.rows is None:
            return t
        try:
            return self.rows.index(t)
        except ValueError:
            raise ValueError(f"the GDN state after row {t} was not kept by this forward "
                             f"(kept rows {list(self.rows)})") from None

    def row(self, b: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(recurrent [Hv, Dk, Dv], conv [C, W-1]) of batch element b after row t (views)."""
        i = self.index(t)
        return self.states[b, i], self.windows[b, :, i, 1:]

    def conv_rows(self) -> torch.Tensor:
        """Conv state after each kept row, [B, R, C, W-1], the `conv_rows` layout of `gdn_fold`
        (matching `states`: index it with `index(t)`)."""
        return self.windows[..., 1:].permute(0, 2, 1, 3)


class GdnStateCache:
    """Per-slot GDN state of every GDN layer: recurrent [slots, Hv, Dk, Dv] and conv [slots, C, W-1].

    The pool is allocated, not zeroed: a slot's state is defined once `reset` has zeroed it, which
    the engine does when it seats a sequence (HybridEngine.alloc). On a CPU the pages of slots
    never seated are then never touched and take no resident memory (a 16-slot pool of a
    Qwen3.5-0.8B-like model is 151 MB, most of it idle at batch 1).
    """

    def __init__(self, cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype = torch.float32) -> None:
        n = len(cfg.gdn_layers)
        rec_shape = (cfg.max_slots, cfg.gdn_v_heads, cfg.gdn_key_dim, cfg.gdn_value_dim)
        conv_shape = (cfg.max_slots, cfg.gdn_conv_channels, cfg.conv_width - 1)
        self.recurrent = [torch.empty(rec_shape, device=device, dtype=dtype) for _ in range(n)]
        self.conv = [torch.empty(conv_shape, device=device, dtype=dtype) for _ in range(n)]

    @property
    def num_layers(self) -> int:
        """Number of GDN layers whose state is cached."""
        return len(self.recurrent)

    def reset(self, slot: int) -> None:
        """Zero the state of `slot` (the state of an empty sequence)."""
        for rec, conv in zip(self.recurrent, self.conv, strict=True):
            rec[slot].zero_()
            conv[slot].zero_()

    def move(self, src: int, dst: int) -> None:
        """Copy the state of slot src into slot dst and zero src."""
        for rec, conv in zip(self.recurrent, self.conv, strict=True):
            rec[dst].copy_(rec[src])
            conv[dst].copy_(conv[src])
        self.reset(src)

    def snapshot(self, slot: int) -> GdnSnapshot:
        """Detached copies of the state of `slot`."""
        return [(rec[slot].clone(), conv[slot].clone()) for rec, conv in zip(self.recurrent, self.conv, strict=True)]

    def load(self, slot: int, snap: GdnSnapshot) -> None:
        """Overwrite the state of `slot` with `snap`."""
        for (rec, conv), (r, c) in zip(zip(self.recurrent, self.conv, strict=True), snap, strict=True):
            rec[slot].copy_(r)
            conv[slot].copy_(c)

    def write_rows(self, layer: int, slots: torch.Tensor, recurrent: torch.Tensor, conv: torch.Tensor) -> None:
        """Set layer `layer`'s state of each slot in slots [N] to recurrent [N,Hv,Dk,Dv] / conv [N,C,W-1]."""
        self.recurrent[layer].index_copy_(0, slots, recurrent)
        self.conv[layer].index_copy_(0, slots, conv)


def gdn_layer(x: torch.Tensor, w: dict[str, torch.Tensor], prefix: str, cfg: ModelConfig,
              state0: torch.Tensor | None, conv0: torch.Tensor | None,
              keep_rows: tuple[int, ...] | None = None,
              in_place: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
              keep_index: KeepIndex | None = None, lora: LoraRows | None = None) -> tuple[torch.Tensor, GdnRows]:
    """One GDN layer over x [B, T, D] from initial states state0 [B,Hv,Dk,Dv], conv0 [B,C,W-1].

    Returns (output [B, T, D], states in state0's / conv0's dtype). keep_rows None: the state after
    every row (the per-row loop or the Triton kernel); else the sorted rows whose states to keep, and
    the recurrence runs in the chunked form without materialising per-row states (gdn_chunked.py; on
    CUDA flash-linear-attention's chunked kernels, gdn_fla.py).
    keep_index: keep_rows' plan with its indices on the device (gdn_chunked.KeepIndex, built once
    per forward with the batch's inputs); without it the layer sends its own (one non-blocking
    copy). Rows are processed strictly left to right, so for right-padded batches the states of the
    valid rows do not depend on the padding.

    in_place = (recurrent cache, conv cache, slots [B]) commits a one-row forward (a decode) as it
    runs: the states are read from and written back to the caches' rows `slots` (the recurrence by
    `fxsched.kernels.cpu_gdn.gdn_step`), state0 and conv0 are not used, and the returned GdnRows is
    `GdnRows.committed()` -- the caller must not fold it again.

    lora: the batch's adapters, added to each projection (specs/lora.md §18.2).
    """
    if in_place is not None:
        return _decode_in_place(x, w, prefix, cfg, *in_place, lora=lora)
    assert state0 is not None and conv0 is not None  # only the in-place form goes without them
    q, k, v, log_decay, beta, windows = _project(x, w, prefix, cfg, conv0, lora)
    if keep_rows is not None:
        if keep_index is None or keep_index.plan.rows != tuple(keep_rows):
            keep_index = KeepPlan.of(keep_rows, x.shape[1]).send(x.device)
        if fla_prefill_applies(q):  # CUDA: flash-linear-attention's chunked kernels (gdn_fla.py)
            o, kept = segmented_gated_delta(q, k, v, log_decay, beta, state0.float(), keep_rows)
        else:
            o, _, chunk_kept = chunked_gated_delta(q, k, v, log_decay, beta, state0.float(), keep_index=keep_index)
            assert chunk_kept is not None  # keep_rows given
            kept = chunk_kept
        states = kept.to(state0.dtype)
        windows = windows.index_select(2, keep_index.rows)  # [B, C, R, W], a copy: no view holding the conv input
    elif gdn_recurrence_kernel_applies(q, k, v, log_decay, beta, state0):
        o, states = gated_delta(q, k, v, log_decay, beta, state0, scale=1.0)  # [B,T,Hv,Dv], [B,T,Hv,Dk,Dv]
    else:
        o, states = _recurrence(q, k, v, torch.exp(log_decay), beta, state0)
    return _output(o, x, w, prefix, cfg, lora), GdnRows(states, windows, keep_rows)


# Rows per sequence up to which the short convolution is taken as window products (decode, verify)
# rather than as shifted multiply-adds over whole rows (prefill chunks).
_FEW_ROWS = 16


def _project(x: torch.Tensor, w: dict[str, torch.Tensor], prefix: str, cfg: ModelConfig, conv0: torch.Tensor,
             lora: LoraRows | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v (fp32, normalised, grouped heads repeated), log-decay, beta and the conv windows
    [B, C, T, W] of x [B, T, D] after conv state conv0 [B, C, W-1]."""
    b, t, _ = x.shape
    hk, hv, dk, dv, width = cfg.gdn_num_heads, cfg.gdn_v_heads, cfg.gdn_key_dim, cfg.gdn_value_dim, cfg.conv_width
    qkv = torch.cat([project(x, w, f"{prefix}.q_proj", lora), project(x, w, f"{prefix}.k_proj", lora),
                     project(x, w, f"{prefix}.v_proj", lora)], dim=-1)  # [B, T, C]
    conv_in = torch.cat([conv0.transpose(1, 2), qkv.to(conv0.dtype)], dim=1)  # [B, W-1+T, C]
    windows = conv_in.unfold(1, width, 1).transpose(1, 2)  # [B, C, T, W] (a view: the conv state after each row)
    weight = w[f"{prefix}.conv"].float()
    if t <= _FEW_ROWS:  # decode and verify: a product with each row's window
        mixed = F.silu((windows.float() * weight[:, None, :]).sum(-1)).transpose(1, 2)
    else:  # prefill: W shifted multiply-adds over rows with the channels contiguous (conv1d's depthwise
        # path, which needs the transposed layout, ran 10-100x slower on some CPUs)
        src = conv_in.float()
        acc = src[:, :t] * weight[:, 0]
        for j in range(1, width):
            acc.addcmul_(src[:, j:j + t], weight[:, j])
        mixed = F.silu(acc)
    q, k, v = torch.split(mixed, [hk * dk, hk * dk, hv * dv], dim=-1)
    q = l2_normalize(q.reshape(b, t, hk, dk)) * dk ** -0.5
    k = l2_normalize(k.reshape(b, t, hk, dk))
    if hv != hk:
        q = q.repeat_interleave(hv // hk, dim=2)
        k = k.repeat_interleave(hv // hk, dim=2)
    beta = torch.sigmoid(project(x, w, f"{prefix}.b_proj", lora)).float()
    log_decay = -torch.exp(w[f"{prefix}.A_log"].float()) * F.softplus(
        project(x, w, f"{prefix}.a_proj", lora).float() + w[f"{prefix}.dt_bias"].float())
    return q, k, v.reshape(b, t, hv, dv), log_decay, beta, windows


def _output(o: torch.Tensor, x: torch.Tensor, w: dict[str, torch.Tensor], prefix: str, cfg: ModelConfig,
            lora: LoraRows | None = None) -> torch.Tensor:
    """o_proj(RMSNorm(o) * silu(x W_g)) for recurrence outputs o [B, T, Hv, Dv]."""
    b, t, _ = x.shape
    hv, dv = cfg.gdn_v_heads, cfg.gdn_value_dim
    gate = F.silu(project(x, w, f"{prefix}.g_proj", lora)).view(b, t, hv, dv)
    o = rms_norm(o.to(x.dtype), w[f"{prefix}.o_norm"], cfg.rms_norm_eps)
    o = (o.float() * gate.float()).to(x.dtype)
    return project(o.reshape(b, t, hv * dv), w, f"{prefix}.o_proj", lora)


def _decode_in_place(x: torch.Tensor, w: dict[str, torch.Tensor], prefix: str, cfg: ModelConfig,
                     recurrent: torch.Tensor, conv: torch.Tensor, slots: torch.Tensor,
                     lora: LoraRows | None = None) -> tuple[torch.Tensor, GdnRows]:
    """`gdn_layer`'s one-row forward committed in the caches (see its in_place)."""
    if x.shape[1] != 1:
        raise ValueError(f"an in-place GDN forward takes one row per sequence, not {x.shape[1]}")
    q, k, v, log_decay, beta, windows = _project(x, w, prefix, cfg, conv.index_select(0, slots), lora)
    conv.index_copy_(0, slots, windows[:, :, 0, 1:].to(conv.dtype))
    o = gdn_step(q[:, 0], k[:, 0], v[:, 0], log_decay[:, 0], beta[:, 0], recurrent, slots)
    return _output(o[:, None], x, w, prefix, cfg, lora), GdnRows.committed()


def _recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
                state0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch delta-rule loop in fp32: outputs [B, T, H, Dv] (fp32) and the state after every row
    [B, T, H, Dk, Dv] (in state0's dtype)."""
    b, t, h, dk = k.shape
    state = state0.float()
    states = torch.empty(b, t, h, dk, v.shape[-1], dtype=state0.dtype, device=state0.device)
    outs: list[torch.Tensor] = []
    for i in range(t):
        state = state * decay[:, i, :, None, None]
        k_i = k[:, i]
        predicted = torch.einsum("bhk,bhkv->bhv", k_i, state)
        delta = (v[:, i] - predicted) * beta[:, i, :, None]
        state = state + k_i[..., None] * delta[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, i], state))
        states[:, i] = state
    return torch.stack(outs, dim=1), states
