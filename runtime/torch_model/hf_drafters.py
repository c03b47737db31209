"""Drafters of published checkpoints: the MTP module of Qwen3-Next / Qwen3.5 and DFlash block drafters.

Both are greedy and deterministic; their drafts only change speed, never the verified output.
Positions and rows follow the engine's vocabulary: a slot's committed tokens t_0..t_{n-1} have
target hidden rows h_0..h_{n-1} (h_i is the target's last hidden state after t_i, pre final
norm), and the *anchor* x = t_n is the next token, known but not yet run by the target.

PublishedMtp (the `mtp.*` weights of a hybrid checkpoint). Its row i (rope position i) reads the
target's normed hidden state of position i and the embedding of token i+1:
  z_i = fc(cat(embed_norm(E[t_{i+1}]), hidden_norm(final_norm(h_i)))),
then its decoder layer (attention with its own K/V cache, MLP or MoE) and `mtp.final_norm`
give m_i, and the target's lm_head(m_i) predicts t_{i+2}. Row n-1 reads the anchor x and gives
draft d_1; draft d_k (k >= 2) comes from row n+k-2 with inputs (E[d_{k-1}], m_{n+k-3}): the
module's own normed output is fed back, as vLLM's MTP proposer does. Invariants per slot:
  * rows [0, valid) of the MTP K/V cache were computed from committed hidden rows, and row i used
    token row_tokens[i]; a proposal recomputes from the first row whose token differs from the
    one it needs (t_{i+1}, or x for row n-1), and always recomputes row n-1;
  * rows >= valid (the draft chain's rows, or rows past a rejected branch) are stale and are
    overwritten; after a proposal valid = n.
  The cache is derived state: a spill does not save it (it is rebuilt from tokens and hidden rows).

PublishedDFlash (a `--draft-model DIR` in the public DFlash format, read by
`hf_dflash_dir.load_dflash_drafter`). The context of a slot is the sequence of its committed
positions' *features*
hidden_norm(fc(cat(target layer outputs at target_layer_ids))) (the output of target layer l;
for the last layer the normed final hidden state, as transformers' `hidden_states[l + 1]`).
Each drafter layer keeps per slot the K/V of the context rows (k_norm(k_proj(feature)) roped at
the row's position, v_proj(feature); no input norm). A proposal runs one block forward over
[anchor, mask x (block_size - 1)] at positions ctx_len.. : the block's rows attend to the whole
context and (non-causally, unless the config says causal) to each other, the block's own K/V are
never stored, and the last block_size - 1 rows give the drafts through `norm` and the lm_head.
Invariant: the context of a slot holds exactly ctx_len(slot) rows, appended by `append_many`, dropped
by `trim`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .attention import RopeTables, apply_rope, attention_out, attention_qkv, masked_attention, rope_tables
from .config import ModelConfig
from .drafters import SlotContext
from .model import mlp_block
from .ops import embed_rows, linear, rms_norm, swiglu_mlp
from .transfers import send_ints

Weights = dict[str, torch.Tensor]

MTP_MAX_DRAFTS = 16  # most drafts one MTP proposal chains (rows past max_seq_len its cache holds)


# ==========================================================================================
# MTP
# ==========================================================================================


class PublishedMtp:
    """The published MTP module over canonical `mtp.*` weights, with its own per-slot K/V cache.

    See the module docstring for the rows it computes and the cache invariants. Only one MTP layer
    is supported (every published Qwen3-Next / Qwen3.5 checkpoint has one); vLLM would use layer
    k % mtp_layers for draft k, which needs a K/V history per layer that no catch-up provides.
    """

    LAYER = "mtp.layers.0"

    def __init__(self, cfg: ModelConfig, w: Weights, device: str | torch.device = "cpu") -> None:
        if cfg.mtp_layers != 1:
            raise ValueError(f"published MTP needs exactly one MTP layer, the config has mtp_layers={cfg.mtp_layers}")
        self.cfg, self.w = cfg, w
        dtype = w["mtp.fc"].dtype
        # one row past the last position a draft can reach takes the K/V of padding rows, so a
        # ragged catch-up writes every row of its batch without selecting the live ones on the host
        self.trash_row = cfg.max_seq_len + MTP_MAX_DRAFTS
        shape = (cfg.max_slots, self.trash_row + 1, cfg.num_kv_heads, cfg.head_dim)
        self.k_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.v_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.valid = [0] * cfg.max_slots
        self.row_tokens: list[list[int]] = [[] for _ in range(cfg.max_slots)]

    # ---- per-slot state ------------------------------------------------------------------------
    def reset(self, slot: int) -> None:
        """Forget every row of `slot` (a new sequence, or a restored one)."""
        self.valid[slot] = 0
        self.row_tokens[slot] = []

    def move(self, src: int, dst: int) -> None:
        """Move the valid rows of slot src to slot dst; src becomes empty."""
        n = self.valid[src]
        self.k_cache[dst, :n] = self.k_cache[src, :n]
        self.v_cache[dst, :n] = self.v_cache[src, :n]
        self.valid[dst], self.row_tokens[dst] = n, self.row_tokens[src]
        self.reset(src)

    def valid_rows(self, slot: int) -> int:
        """Rows of `slot` whose K/V come from committed hidden rows (see the module docstring)."""
        return self.valid[slot]

    # ---- the module ----------------------------------------------------------------------------
    def _rows(self, slot_index: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor,
              positions: torch.Tensor, write_at: torch.Tensor, span: int) -> torch.Tensor:
        """Run rows (tokens [B, T], conditioning hidden [B, T, D] already normed as the module
        takes it, at positions [B, T]); each row's K/V is written to the cache at write_at [B, T]
        (its position, or `trash_row` for padding) before attending causally over the slot's rows
        0..position; `span` (host-known) exceeds every position. Returns the normed outputs [B, T, D]."""
        cfg, w, eps, p = self.cfg, self.w, self.cfg.rms_norm_eps, self.LAYER
        z = linear(torch.cat([rms_norm(embed_rows(w["embed"], tokens), w["mtp.embed_norm"], eps),
                              rms_norm(hidden, w["mtp.hidden_norm"], eps)], dim=-1), w["mtp.fc"])
        q, k, v, gate = attention_qkv(rms_norm(z, w[f"{p}.input_norm"], eps), w, f"{p}.attn", cfg, positions)
        rows = slot_index[:, None].expand_as(positions)
        self.k_cache[rows, write_at] = k.to(self.k_cache.dtype)
        self.v_cache[rows, write_at] = v.to(self.v_cache.dtype)
        allowed = torch.arange(span, device=positions.device)[None, None, :] <= positions[:, :, None]
        attn = masked_attention(q, self.k_cache[slot_index, :span], self.v_cache[slot_index, :span], allowed)
        h = z + attention_out(attn, gate, w, f"{p}.attn")
        x = rms_norm(h, w[f"{p}.post_norm"], eps)
        h = h + mlp_block(x, w, p, cfg, 0)
        return rms_norm(h, w["mtp.final_norm"], eps)

    def _logits(self, m: torch.Tensor) -> torch.Tensor:
        return linear(m, self.w["lm_head"])

    def propose(self, slots: Sequence[int], committed: Sequence[Sequence[int]], hidden_history: torch.Tensor,
                last_tokens: Sequence[int], num_drafts: int) -> torch.Tensor:
        """Drafts [B, num_drafts] (see `propose_logits`)."""
        return self.propose_logits(slots, committed, hidden_history, last_tokens, num_drafts).argmax(-1)

    def propose_logits(self, slots: Sequence[int], committed: Sequence[Sequence[int]],
                       hidden_history: torch.Tensor, last_tokens: Sequence[int], num_drafts: int) -> torch.Tensor:
        """Draft logits [B, num_drafts, V] for `slots` (each draft is the argmax of its row and feeds
        the next): committed[b] are the slot's committed tokens (n_b >= 1 of them),
        hidden_history[slot, :n_b] their target hidden rows (pre final norm), last_tokens[b] the anchor.

        Catch-up first: the rows from the first one whose token is not the needed one (and at
        least row n_b - 1) are recomputed in one batched forward; then each further draft is one
        row per slot, whose K/V land past the committed rows (stale afterwards).
        """
        cfg, w, eps = self.cfg, self.w, self.cfg.rms_norm_eps
        device = hidden_history.device
        b = len(slots)
        if not 0 <= num_drafts <= MTP_MAX_DRAFTS:
            raise ValueError(f"MTP proposals chain 0..{MTP_MAX_DRAFTS} drafts, not {num_drafts}")
        if b == 0 or num_drafts == 0:
            return torch.zeros((b, num_drafts, cfg.vocab_size), device=device)
        lens, firsts, needs = [], [], []
        for slot, toks, x in zip(slots, committed, last_tokens, strict=True):
            n = len(toks)
            if n < 1:
                raise ValueError(f"slot {slot}: MTP needs at least one committed token")
            need = [int(t) for t in toks[1:]] + [int(x)]
            have = self.row_tokens[slot][:self.valid[slot]]
            j = next((i for i, (a, c) in enumerate(zip(have, need[:len(have)], strict=False)) if a != c),
                     min(len(have), n))
            lens.append(n)
            firsts.append(min(j, n - 1))
            needs.append(need)
        t = max(n - j for n, j in zip(lens, firsts, strict=True))
        tokens, positions, write_at = [0] * (b * t), [0] * (b * t), [self.trash_row] * (b * t)
        for i, (n, j, need) in enumerate(zip(lens, firsts, needs, strict=True)):
            tokens[i * t:i * t + n - j] = need[j:]
            positions[i * t:i * t + n - j] = write_at[i * t:i * t + n - j] = range(j, n)
        last = [n - j - 1 for n, j in zip(lens, firsts, strict=True)]
        # the host's inputs go over in one copy; the hidden rows are gathered on the device
        slot_t, tok_t, pos_t, write_t, last_t, end_t = send_ints(
            [slots, tokens, positions, write_at, last, [n - 1 for n in lens]], device)
        tok_t, pos_t, write_t = (x.view(b, t) for x in (tok_t, pos_t, write_t))
        hidden = hidden_history[slot_t[:, None], pos_t]
        out = self._rows(slot_t, tok_t, rms_norm(hidden, w["final_norm"], eps), pos_t, write_t, max(lens))
        for slot, n, j, need in zip(slots, lens, firsts, needs, strict=True):
            self.row_tokens[slot] = self.row_tokens[slot][:j] + need[j:]
            self.valid[slot] = n
        m = out[torch.arange(b, device=device), last_t]  # [B, D]: output of row n - 1
        pos = end_t[:, None]
        all_logits = [self._logits(m)]
        drafts = [all_logits[-1].argmax(-1)]
        for k in range(1, num_drafts):
            pos = pos + 1  # draft k's row sits at n - 1 + k
            m = self._rows(slot_t, drafts[-1][:, None], m[:, None], pos, pos, max(lens) + k)[:, 0]
            all_logits.append(self._logits(m))
            drafts.append(all_logits[-1].argmax(-1))
        return torch.stack(all_logits, dim=1)


# ==========================================================================================
# DFlash: what a drafter directory declares (read by hf_dflash_dir.py)
# ==========================================================================================


@dataclass(frozen=True)
class DFlashSpec:
    """What a DFlash drafter directory declares (config.json), validated against the target."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    causal: bool
    attention_bias: bool
    input_embedding_scale: float = 1.0

    @property
    def gamma(self) -> int:
        """Drafts per block forward: block_size - 1."""
        return self.block_size - 1


# ==========================================================================================
# DFlash: the drafter
# ==========================================================================================


class PublishedDFlash(SlotContext):
    """A DFlash block drafter with its per-slot context K/V (see the module docstring)."""

    def __init__(self, spec: DFlashSpec, w: Weights, max_slots: int, max_seq_len: int,
                 device: str | torch.device = "cpu") -> None:
        self.spec, self.w = spec, w
        super().__init__(spec.num_layers, max_slots, max_seq_len, spec.num_kv_heads, spec.head_dim, device,
                         w["fc"].dtype)

    @property
    def gamma(self) -> int:
        """Drafts per proposal (block_size - 1)."""
        return self.spec.gamma

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.spec.target_layer_ids

    @property
    def feature_size(self) -> int:
        """Width of one context feature row (the drafter's hidden size)."""
        return self.spec.hidden_size

    def features(self, layer_outputs: Sequence[torch.Tensor]) -> torch.Tensor:
        """Context features [..., D] of target layer outputs [..., D_target], one per target_layer_id."""
        x = torch.cat(list(layer_outputs), dim=-1)
        return rms_norm(linear(x, self.w["fc"]), self.w["hidden_norm"], self.spec.rms_norm_eps)

    # ---- per-layer projections ----------------------------------------------------------------
    def _proj(self, x: torch.Tensor, name: str) -> torch.Tensor:
        out = linear(x, self.w[name])
        bias = self.w.get(f"{name}.bias")
        return out + bias if bias is not None else out

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(*x.shape[:-1], n, self.spec.head_dim)

    def _kv(self, x: torch.Tensor, layer: int, positions: torch.Tensor,
            rope: RopeTables | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        s, p = self.spec, f"layers.{layer}.self_attn"
        k = rms_norm(self._heads(self._proj(x, f"{p}.k_proj"), s.num_kv_heads), self.w[f"{p}.k_norm"], s.rms_norm_eps)
        return (apply_rope(k, positions, s.rope_theta, tables=rope),
                self._heads(self._proj(x, f"{p}.v_proj"), s.num_kv_heads))

    # ---- context -------------------------------------------------------------------------------
    def context_input(self, rows: torch.Tensor) -> torch.Tensor:
        """Context feature rows [n, D] (`features`), in the context's dtype (`SlotContext.append_many`)."""
        return rows.to(self.ctx_k[0].dtype)

    def context_rope(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        return rope_tables(positions, self.spec.rope_theta, self.spec.head_dim, dtype)

    def context_kv(self, x: torch.Tensor, layer: int, positions: torch.Tensor,
                   rope: RopeTables) -> tuple[torch.Tensor, torch.Tensor]:
        return self._kv(x, layer, positions, rope)

    def export_shapes(self, n: int) -> dict[str, tuple[int, ...]]:
        """Shapes `export` gives for a context of n rows."""
        shape = (n, self.spec.num_kv_heads, self.spec.head_dim)
        return {f"dflash_ctx_{kv}.{j}": shape for kv in "kv" for j in range(self.spec.num_layers)}

    # ---- proposals -----------------------------------------------------------------------------
    def propose(self, slots: Sequence[int], last_tokens: Sequence[int], device: torch.device) -> torch.Tensor:
        """Drafts [B, gamma] on `device` for `slots`, each continuing its context with its anchor
        last_tokens[b]."""
        return self.propose_logits(slots, last_tokens, device).argmax(-1)

    def propose_logits(self, slots: Sequence[int], last_tokens: Sequence[int], device: torch.device) -> torch.Tensor:
        """The draft logits [B, gamma, V] behind `propose` (its drafts are their argmax)."""
        s, w, eps = self.spec, self.w, self.spec.rms_norm_eps
        b, t = len(slots), s.block_size
        ctx = [self.ctx_len[x] for x in slots]
        index, lens, anchors = send_ints([slots, ctx, last_tokens], device)  # one copy, no read
        max_len = max(ctx, default=0)
        ids = torch.full((b, t), s.mask_token_id, dtype=torch.long, device=device)
        ids[:, 0] = anchors
        x = embed_rows(w["embed"], ids) * s.input_embedding_scale
        positions = lens[:, None] + torch.arange(t, device=device)
        ctx_ok = (torch.arange(max_len, device=device)[None] < lens[:, None])[:, None, :].expand(b, t, max_len)
        block_ok = torch.ones(t, t, dtype=torch.bool, device=device)
        if s.causal:
            block_ok = torch.tril(block_ok)
        allowed = torch.cat([ctx_ok, block_ok[None].expand(b, t, t)], dim=2)
        rope = rope_tables(positions, s.rope_theta, s.head_dim, x.dtype)
        for j in range(s.num_layers):
            p = f"layers.{j}"
            r = rms_norm(x, w[f"{p}.input_layernorm"], eps)
            q = rms_norm(self._heads(self._proj(r, f"{p}.self_attn.q_proj"), s.num_heads),
                         w[f"{p}.self_attn.q_norm"], eps)
            q = apply_rope(q, positions, s.rope_theta, tables=rope)
            k, v = self._kv(r, j, positions, rope)
            keys = torch.cat([self.ctx_k[j][index, :max_len], k], dim=1)
            values = torch.cat([self.ctx_v[j][index, :max_len], v], dim=1)
            attn = masked_attention(q, keys, values, allowed)
            x = x + self._proj(attn.reshape(b, t, -1), f"{p}.self_attn.o_proj")
            x = x + swiglu_mlp(rms_norm(x, w[f"{p}.post_attention_layernorm"], eps), w, f"{p}.mlp")
        return linear(rms_norm(x[:, 1:], w["norm"], eps), w["lm_head"])

