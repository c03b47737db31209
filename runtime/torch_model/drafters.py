"""Draft proposers: the MTP head, the DFlash block drafter (with its per-slot context), and n-gram lookup.

All proposers are greedy (argmax) and deterministic; their drafts only affect speed, never the
verified output, because the target verifies every draft.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from .attention import RopeTables, apply_rope, masked_attention, rope_tables
from .config import ModelConfig
from .ops import embed_rows, linear, rms_norm, swiglu_mlp
from .transfers import send_ints
from .weights import Weights, torch_dtype


class MtpHead:
    """Multi-token-prediction head: (hidden of position p, token p+1) -> token p+2, chained n times.

    z = in_proj([norm(h); norm(embed(x))]); z += MLP(norm(z)); logits = lm_head(norm(z)); the next
    step uses (z, argmax). Stateless: the caller passes the saved hidden state.
    """

    def __init__(self, cfg: ModelConfig, w: Weights) -> None:
        if not cfg.mtp:
            raise ValueError("config has mtp = false: the model has no MTP head")
        self.cfg, self.w = cfg, w

    def propose(self, hidden: torch.Tensor, tokens: torch.Tensor, num_drafts: int) -> torch.Tensor:
        """Drafts [B, num_drafts] from target hidden [B, D] (pre-norm) and the tokens [B] that follow it."""
        w, eps = self.w, self.cfg.rms_norm_eps
        drafts = []
        h, x = hidden, tokens
        for _ in range(num_drafts):
            z = linear(torch.cat([rms_norm(h, w["mtp.hidden_norm"], eps),
                                  rms_norm(embed_rows(w["embed"], x), w["mtp.embed_norm"], eps)], dim=-1), w["mtp.in_proj"])
            z = z + swiglu_mlp(rms_norm(z, w["mtp.mlp_norm"], eps), w, "mtp.mlp")
            x = linear(rms_norm(z, w["mtp.final_norm"], eps), w["lm_head"]).argmax(-1)
            drafts.append(x)
            h = z
        if not drafts:
            return torch.zeros((hidden.shape[0], 0), dtype=torch.long, device=hidden.device)
        return torch.stack(drafts, dim=1)


class SlotContext:
    """Per-slot context K/V of a block drafter: for each drafter layer j, ctx_k[j] / ctx_v[j]
    [slots, max_len, Hkv, Dh], of which the first ctx_len[slot] rows of a slot are valid.
    Invariant: rows are only appended (`append_many`) and dropped from the end (`trim`)."""

    def __init__(self, layers: int, slots: int, max_len: int, kv_heads: int, head_dim: int,
                 device: torch.device | str, dtype: torch.dtype) -> None:
        shape = (slots, max_len, kv_heads, head_dim)
        self.ctx_k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)]
        self.ctx_v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)]
        self.ctx_len = [0] * slots
        self.max_len = max_len

    def new_rows(self, slots: Sequence[int], counts: Sequence[int],
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot, position) index tensors of the context rows that appending counts[i] rows to each
        slots[i] (distinct) would write, in order: positions ctx_len.. of each slot. A context row's
        position is its token's position, so the same indices pick the rows from a [slots, positions]
        history."""
        if len(set(slots)) != len(slots):
            raise ValueError(f"duplicate slots in one DFlash context append: {list(slots)}")
        at_slot: list[int] = []
        at_pos: list[int] = []
        for slot, n in zip(slots, counts, strict=True):
            start = self.ctx_len[slot]
            if start + n > self.max_len:
                raise ValueError(f"DFlash context of slot {slot} would exceed max_seq_len={self.max_len}")
            at_slot += [slot] * n
            at_pos += range(start, start + n)
        slot_t, pos_t = send_ints([at_slot, at_pos], device)
        return slot_t, pos_t

    def append_many(self, slots: Sequence[int], counts: Sequence[int], rows: torch.Tensor,
                    index: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Extend the contexts of several slots in one pass: rows [sum(counts), D] hold counts[i]
        rows for slots[i], slot after slot, each in position order (`index`: their `new_rows`, when
        the caller made it). One projection and one indexed write per layer serve every slot."""
        slot_t, pos_t = self.new_rows(slots, counts, rows.device) if index is None else index
        if rows.shape[0] != pos_t.shape[0]:
            raise ValueError(f"{rows.shape[0]} DFlash context rows for {pos_t.shape[0]} positions")
        if rows.shape[0]:
            x = self.context_input(rows)
            rope = self.context_rope(pos_t, x.dtype)
            for j, (ctx_k, ctx_v) in enumerate(zip(self.ctx_k, self.ctx_v, strict=True)):
                k, v = self.context_kv(x, j, pos_t, rope)
                ctx_k.index_put_((slot_t, pos_t), k)
                ctx_v.index_put_((slot_t, pos_t), v)
        for slot, n in zip(slots, counts, strict=True):
            self.ctx_len[slot] += n

    def context_input(self, rows: torch.Tensor) -> torch.Tensor:
        """What the layers' K/V projections read for appended rows (the drafter's own input map)."""
        raise NotImplementedError

    def context_rope(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """The rotary tables of the context rows at `positions`."""
        raise NotImplementedError

    def context_kv(self, x: torch.Tensor, layer: int, positions: torch.Tensor,
                   rope: RopeTables) -> tuple[torch.Tensor, torch.Tensor]:
        """The roped K and the V rows [n, Hkv, Dh] of drafter layer `layer` for inputs x [n, D]."""
        raise NotImplementedError

    def trim(self, slot: int, n_drop: int) -> None:
        """Drop the last n_drop context rows of `slot` (0 <= n_drop <= ctx_len)."""
        if not 0 <= n_drop <= self.ctx_len[slot]:
            raise ValueError(f"cannot drop {n_drop} of {self.ctx_len[slot]} DFlash context rows of slot {slot}")
        self.ctx_len[slot] -= n_drop

    def reset(self, slot: int) -> None:
        """Empty the context of `slot`."""
        self.ctx_len[slot] = 0

    def move(self, src: int, dst: int) -> None:
        """Move the context of slot src to slot dst; src becomes empty."""
        n = self.ctx_len[src]
        for cache in (*self.ctx_k, *self.ctx_v):
            cache[dst, :n] = cache[src, :n]
        self.ctx_len[dst], self.ctx_len[src] = n, 0

    def export(self, slot: int) -> dict[str, torch.Tensor]:
        """Copies of the context tensors of `slot` ([ctx_len, Hkv, Dh] per layer, K then V)."""
        n = self.ctx_len[slot]
        out = {f"dflash_ctx_k.{j}": k[slot, :n].clone() for j, k in enumerate(self.ctx_k)}
        out.update({f"dflash_ctx_v.{j}": v[slot, :n].clone() for j, v in enumerate(self.ctx_v)})
        return out

    def load(self, slot: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Inverse of `export` (shapes already checked by the caller)."""
        n = tensors["dflash_ctx_k.0"].shape[0]
        for j in range(len(self.ctx_k)):
            self.ctx_k[j][slot, :n] = tensors[f"dflash_ctx_k.{j}"]
            self.ctx_v[j][slot, :n] = tensors[f"dflash_ctx_v.{j}"]
        self.ctx_len[slot] = n


class DFlashDrafter(SlotContext):
    """DFlash-style block drafter: one non-causal forward over [last token, MASK x gamma].

    Each slot has a context of projected target hidden states (K/V per drafter layer, roped at
    their positions 0..ctx_len-1). The block's rows sit at positions ctx_len..ctx_len+gamma and
    attend to the whole context and to each other; rows 1..gamma give the drafts. Invariant: the
    context of a slot holds exactly ctx_len(slot) rows, appended by `append_many` and dropped by `trim`.
    """

    def __init__(self, cfg: ModelConfig, w: Weights, device: torch.device | str) -> None:
        if cfg.dflash_gamma <= 0:
            raise ValueError("config has dflash_gamma = 0: the model has no DFlash drafter")
        self.cfg, self.w = cfg, w
        # the context holds projected K/V rows, in the model's dtype
        super().__init__(cfg.dflash_layers, cfg.max_slots, cfg.max_seq_len, cfg.num_kv_heads, cfg.head_dim,
                         device, torch_dtype(cfg))

    def _project(self, x: torch.Tensor, prefix: str, positions: torch.Tensor,
                 rope: RopeTables | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        shape = (*x.shape[:-1], cfg.num_kv_heads, cfg.head_dim)
        k = apply_rope(linear(x, self.w[f"{prefix}.k_proj"]).view(shape), positions, cfg.rope_theta, tables=rope)
        return k, linear(x, self.w[f"{prefix}.v_proj"]).view(shape)

    def context_input(self, rows: torch.Tensor) -> torch.Tensor:
        """Target hidden rows [n, D] (pre-norm) projected to the drafter's context features."""
        return rms_norm(linear(rows, self.w["dflash.ctx_proj"]), self.w["dflash.ctx_norm"], self.cfg.rms_norm_eps)

    def context_rope(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        return rope_tables(positions, self.cfg.rope_theta, self.cfg.head_dim, dtype)

    def context_kv(self, x: torch.Tensor, layer: int, positions: torch.Tensor,
                   rope: RopeTables) -> tuple[torch.Tensor, torch.Tensor]:
        return self._project(x, f"dflash.layers.{layer}.attn", positions, rope)

    def propose(self, slots: Sequence[int], last_tokens: Sequence[int], device: torch.device) -> torch.Tensor:
        """Drafts [B, gamma] on `device` for `slots`, each continuing its context with last_tokens[b]."""
        cfg, w, eps, gamma = self.cfg, self.w, self.cfg.rms_norm_eps, self.cfg.dflash_gamma
        b = len(slots)
        ctx = [self.ctx_len[s] for s in slots]
        slot_index, lens, anchors = send_ints([slots, ctx, last_tokens], device)
        max_len = max(ctx, default=0)
        x = torch.cat([embed_rows(w["embed"], anchors)[:, None], w["dflash.mask_embed"].expand(b, gamma, -1)], dim=1)
        positions = lens[:, None] + torch.arange(gamma + 1, device=device)
        allowed = torch.cat([torch.arange(max_len, device=device)[None] < lens[:, None],
                             torch.ones(b, gamma + 1, dtype=torch.bool, device=device)], dim=1)
        allowed = allowed[:, None, :].expand(b, gamma + 1, max_len + gamma + 1)
        rope = rope_tables(positions, cfg.rope_theta, cfg.head_dim, x.dtype)
        for j in range(cfg.dflash_layers):
            p = f"dflash.layers.{j}"
            r = rms_norm(x, w[f"{p}.attn_norm"], eps)
            q = apply_rope(linear(r, w[f"{p}.attn.q_proj"]).view(b, gamma + 1, cfg.num_attention_heads, cfg.head_dim),
                           positions, cfg.rope_theta, tables=rope)
            k, v = self._project(r, f"{p}.attn", positions, rope)
            keys = torch.cat([self.ctx_k[j][slot_index, :max_len], k], dim=1)
            values = torch.cat([self.ctx_v[j][slot_index, :max_len], v], dim=1)
            attn = masked_attention(q, keys, values, allowed)
            x = x + linear(attn.reshape(b, gamma + 1, -1), w[f"{p}.attn.o_proj"])
            x = x + swiglu_mlp(rms_norm(x, w[f"{p}.mlp_norm"], eps), w, f"{p}.mlp")
        logits = linear(rms_norm(x[:, 1:], w["dflash.final_norm"], eps), w["lm_head"])
        return logits.argmax(-1)


def ngram_propose(history: Sequence[int], num_drafts: int, min_n: int = 2, max_n: int = 16) -> list[int]:
    """Prompt-lookup drafts: find the longest suffix of `history` (length max_n down to min_n) that
    also occurs earlier, take its earliest occurrence, and return up to num_drafts tokens following it.

    Returns [] when no suffix of length >= min_n recurs or num_drafts == 0.
    """
    tokens = list(history)
    size = len(tokens)
    if num_drafts <= 0:
        return []
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = tokens[size - n:]
        first = suffix[0]
        for i in range(size - n):  # occurrences strictly before the suffix itself
            if tokens[i] == first and tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + num_drafts]
    return []
