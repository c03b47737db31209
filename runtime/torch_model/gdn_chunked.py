"""Chunked (WY / UT-transform) gated delta rule: a prompt's GDN recurrence without per-row states.

Same recurrence and conventions as `gdn._recurrence` (and the Triton `gated_delta` kernel): per
head, S is [Dk, Dv]; with log-decay g_t <= 0 and write strength b_t,
    S' = exp(g_t) S_{t-1},   u_t = b_t (v_t - S'^T k_t),   S_t = S' + k_t u_t^T,   o_t = S_t^T q_t,
with q and k given already normalised (and q already scaled by 1/sqrt(Dk)): the caller does that.

Chunk form. Split the rows into chunks of C rows; within a chunk let G_i = g_0 + ... + g_i (the
cumulative log-decay, inclusive) and S_0 the state entering the chunk. Unrolling the recurrence,
    S_i = exp(G_i) S_0 + sum_{j<=i} exp(G_i - G_j) k_j u_j^T,
    u_i = b_i v_i - b_i exp(G_i) S_0^T k_i - sum_{j<i} b_i exp(G_i - G_j) (k_i . k_j) u_j,
i.e. (I + A) U = diag(b) V - diag(b exp(G)) K S_0 with A strictly lower triangular,
A_ij = b_i exp(G_i - G_j) k_i . k_j. One unit-triangular solve per chunk gives U0 = (I+A)^-1 diag(b) V
and W = (I+A)^-1 diag(b exp(G)) K, both independent of S_0, so all chunks are solved at once; only
the cheap state hand-off runs chunk by chunk:
    U = U0 - W S_0,   O = diag(exp(G)) Q S_0 + (Q K^T * D) U,
    S_C = exp(G_last) S_0 + (K * exp(G_last - G))^T U,
with D_ij = exp(G_i - G_j) for j <= i and 0 above the diagonal.

Invariants:
* Numerically safe in fp32: every exponent is G_i - G_j with j <= i, G_i, or G_last - G_j, all
  <= 0 when g <= 0 (masked entries are set to -inf *before* exp, never exp of a large positive
  number); G_i - G_j is summed directly from the g's in between, not subtracted from two large
  cumulative sums (strong decay makes |G| ~ 1e3 within a chunk). bf16/fp16 inputs are computed in fp32 (fp64 stays fp64) and cast back: outputs to q's
  dtype, states to state0's dtype. g > 0 is not checked (that needs a device sync) and may overflow.
* No per-row states: besides the output [B,T,H,Dv] and the R requested states, the working set is
  the chunk terms of about GROUP_ROWS rows at a time, O(GROUP_ROWS * H * (Dk + Dv + C)), whatever T
  is. The state after a requested row r (`keep_rows`) is the partial sum above restricted to
  j <= r of r's chunk, computed only for the requested rows; a requested row that ends a chunk (or
  the prompt) is the hand-off state itself.
* T need not be a multiple of C: the last chunk is padded with k = v = 0, b = 0, g = 0, rows that
  leave the state unchanged, so the final state is the state after row T-1.
* Rows are independent per batch element and processed left to right, as in `gdn._recurrence`:
  for right-padded batches the outputs and states of a sequence's valid rows do not depend on the
  padding rows, but the *final* state of a shorter sequence includes its padding rows -- the caller
  asks for the state after its last valid row with `keep_rows` (shared by the batch: pass the
  union of the sequences' rows and pick per sequence).
* Heads: q, k and v have the same number of heads (grouped value heads repeat q/k first).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["GROUP_ROWS", "chunked_gated_delta"]

GROUP_ROWS = 1024  # chunk terms are built for about this many rows at a time: bounds the working set


def chunked_gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        state0: torch.Tensor, *, keep_rows: torch.Tensor | Sequence[int] | None = None,
                        chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gated delta rule over q, k [B,T,H,Dk], v [B,T,H,Dv], g (log decay), beta [B,T,H] from state0 [B,H,Dk,Dv].

    Returns (out [B,T,H,Dv], final state [B,H,Dk,Dv], kept [B,R,H,Dk,Dv] or None): kept[:, i] is the
    state after row keep_rows[i] (R row indices in [0, T), shared by the batch; any order, repeats
    allowed; on CUDA reading them is one host sync). None when keep_rows is None.
    """
    b, t, h, dk, dv, rows = _check(q, k, v, g, beta, state0, keep_rows, chunk_size)
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    if t == 0:
        kept0 = None if rows is None else state0.new_empty(b, 0, h, dk, dv)
        return v.new_empty(b, 0, h, dv).to(q.dtype), state0.clone(), kept0
    c = min(chunk_size, t)
    group = max(1, GROUP_ROWS // c) * c  # rows whose chunk terms are built at once
    wanted: dict[int, list[tuple[int, int]]] = {}  # chunk -> [(position in keep_rows, row in chunk)]
    for i, r in enumerate(rows or ()):
        wanted.setdefault(r // c, []).append((i, r % c))
    kept = None if rows is None else state0.new_empty(b, len(rows), h, dk, dv)
    out = torch.empty(b, t, h, dv, dtype=q.dtype, device=q.device)
    state = state0.to(cdt)
    for first in range(0, t, group):
        last = min(first + group, t)
        terms = _chunk_terms(q[:, first:last], k[:, first:last], v[:, first:last], g[:, first:last],
                             beta[:, first:last], c, cdt)
        for ci in range(terms.u0.shape[2]):
            row0 = first + ci * c
            here = min(c, t - row0)  # rows of this chunk that exist (the rest is padding)
            chunk_rows = wanted.get(row0 // c, [])
            u = terms.u0[:, :, ci] - terms.w[:, :, ci] @ state  # [B,H,C,Dv]
            o = terms.q_dec[:, :, ci] @ state + terms.attn[:, :, ci] @ u
            out[:, row0:row0 + here] = o[:, :, :here].transpose(1, 2).to(out.dtype)
            inner = [(i, j) for i, j in chunk_rows if j < here - 1]
            if inner and kept is not None:
                loc = torch.tensor([j for _, j in inner], device=q.device)
                weights = terms.decay[:, :, ci].index_select(2, loc)  # [B,H,Ri,C]: exp(G_r - G_j), 0 for j > r
                part = (weights[..., None] * terms.k[:, :, ci, None]).transpose(-1, -2) @ u[:, :, None]
                start = torch.exp(terms.cum[:, :, ci].index_select(2, loc))[..., None, None] * state[:, :, None]
                kept[:, [i for i, _ in inner]] = (start + part).transpose(1, 2).to(kept.dtype)  # [B,Ri,H,Dk,Dv]
            state = terms.chunk_decay[:, :, ci] * state + terms.k_dec[:, :, ci].transpose(-1, -2) @ u
            ends = [i for i, j in chunk_rows if j >= here - 1]  # the chunk's (or the prompt's) last row
            if ends and kept is not None:
                kept[:, ends] = state[:, None].to(kept.dtype)
    return out, state.to(state0.dtype), kept


class _ChunkTerms(NamedTuple):
    """The state-independent terms of each chunk of a row range, [B, H, N, C, ...] (see the module docstring)."""

    k: torch.Tensor  # K, [B,H,N,C,Dk]
    u0: torch.Tensor  # (I+A)^-1 diag(b) V, [B,H,N,C,Dv]
    w: torch.Tensor  # (I+A)^-1 diag(b exp(G)) K, [B,H,N,C,Dk]
    attn: torch.Tensor  # Q K^T * D, [B,H,N,C,C]
    q_dec: torch.Tensor  # diag(exp(G)) Q, [B,H,N,C,Dk]
    k_dec: torch.Tensor  # K * exp(G_last - G), [B,H,N,C,Dk]
    chunk_decay: torch.Tensor  # exp(G_last), [B,H,N,1,1]
    cum: torch.Tensor  # G, [B,H,N,C]
    decay: torch.Tensor  # D, [B,H,N,C,C]


def _chunk_terms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 c: int, cdt: torch.dtype) -> _ChunkTerms:
    """Chunk terms of rows [B, T', H, ...]; the last chunk is padded with rows that leave the state as is."""
    b, t, h, _ = q.shape
    n = -(-t // c)
    pad = n * c - t

    def per_row(x: torch.Tensor) -> torch.Tensor:  # [B,T',H,X] -> [B,H,N,C,X]
        x = F.pad(x.to(cdt).transpose(1, 2), (0, 0, 0, pad))
        return x.reshape(b, h, n, c, x.shape[-1])

    def per_head(x: torch.Tensor) -> torch.Tensor:  # [B,T',H] -> [B,H,N,C]
        return F.pad(x.to(cdt).transpose(1, 2), (0, pad)).reshape(b, h, n, c)

    qc, kc, vc, bc, gc = per_row(q), per_row(k), per_row(v), per_head(beta), per_head(g)
    cum = gc.cumsum(-1)
    decay = torch.exp(_segment_sums(gc))
    kt = kc.transpose(-1, -2)
    a = torch.tril((kc @ kt) * decay, diagonal=-1) * bc[..., None]
    a.diagonal(dim1=-2, dim2=-1).fill_(1.0)  # I + A (the solve reads only the strict lower part anyway)
    rhs = torch.cat([vc * bc[..., None], kc * (bc * torch.exp(cum))[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
    u0, w = solved.split([vc.shape[-1], kc.shape[-1]], dim=-1)
    return _ChunkTerms(k=kc, u0=u0, w=w, attn=(qc @ kt) * decay, q_dec=qc * torch.exp(cum)[..., None],
                       k_dec=kc * decay[..., -1, :, None], chunk_decay=torch.exp(cum[..., -1])[..., None, None],
                       cum=cum, decay=decay)


def _segment_sums(x: torch.Tensor) -> torch.Tensor:
    """[..., C] -> [..., C, C]: entry (i, j) = x_{j+1} + ... + x_i (= G_i - G_j) for j <= i, -inf above.

    Summed directly rather than as a difference of cumulative sums: G_i - G_j from two large G's
    loses digits (|G| ~ 1e3 in fp32 gives ~1e-4 absolute error in an exponent near 0).
    """
    c = x.shape[-1]
    ones = torch.ones(c, c, dtype=torch.bool, device=x.device)
    terms = x[..., :, None].expand(*x.shape, c).masked_fill(~torch.tril(ones, diagonal=-1), 0.0)  # x_i if i > j
    return terms.cumsum(-2).masked_fill(~torch.tril(ones), float("-inf"))


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           state0: torch.Tensor, keep_rows: torch.Tensor | Sequence[int] | None,
           chunk_size: int) -> tuple[int, int, int, int, int, list[int] | None]:
    """Validate shapes and keep_rows; return (B, T, H, Dk, Dv, keep_rows as a list or None)."""
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, T, H, Dk], got {tuple(q.shape)} and {tuple(k.shape)}")
    b, t, h, dk = q.shape
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, Dv] with q's B, T, H {(b, t, h)}, got {tuple(v.shape)}")
    dv = v.shape[-1]
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != q.shape[:3]:
            raise ValueError(f"{name} must be [B, T, H] = {(b, t, h)}, got {tuple(x.shape)}")
    if state0.shape != (b, h, dk, dv):
        raise ValueError(f"state0 must be [B, H, Dk, Dv] = {(b, h, dk, dv)}, got {tuple(state0.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if keep_rows is None:
        return b, t, h, dk, dv, None
    if isinstance(keep_rows, torch.Tensor):
        if keep_rows.dim() != 1 or keep_rows.dtype.is_floating_point or keep_rows.dtype == torch.bool:
            raise ValueError(f"keep_rows must be a 1-D integer tensor, got {keep_rows.dtype} {tuple(keep_rows.shape)}")
        rows = [int(r) for r in keep_rows.tolist()]
    else:
        rows = [int(r) for r in keep_rows]
    bad = [r for r in rows if not 0 <= r < t]
    if bad:
        raise ValueError(f"keep_rows must lie in [0, {t}), got {bad[:4]}")
    return b, t, h, dk, dv, rows
