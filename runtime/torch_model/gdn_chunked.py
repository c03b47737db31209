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
* Host work: where each requested state goes (its chunk, its row in the chunk, its place in
  `kept`) is host bookkeeping of `keep_rows` and T alone. `KeepPlan` works it out once per
  forward, and its index tensors go over with the forward's other inputs in one non-blocking
  copy (`KeepIndex`, built by the engine's batch; specs/async.md §16.2): the layers select and
  place the states with `index_select` / `index_copy_` on those tensors, never with Python lists,
  so a layer makes no host-to-device copy of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .transfers import send_ints

__all__ = ["CHUNK_SIZE", "GROUP_ROWS", "KeepIndex", "KeepPlan", "chunked_gated_delta"]

GROUP_ROWS = 1024  # chunk terms are built for about this many rows at a time: bounds the working set
CHUNK_SIZE = 64  # rows of a chunk (fewer when the forward has fewer rows)


@dataclass(frozen=True)
class KeepPlan:
    """Where the states after `rows` (keep_rows) of a T-row forward go, worked out on the host:
    per chunk holding a requested row, the spans of `fields` its rows take (`spans[chunk]` =
    (inner from, inner to, ends from, ends to)). `fields` are the int lists of its `KeepIndex`:
    the rows; the inner rows' places within their chunks and their positions in `rows`,
    chunk by chunk; the positions in `rows` of rows that end their chunk (or the forward)."""

    rows: tuple[int, ...]
    t: int
    chunk: int
    spans: dict[int, tuple[int, int, int, int]]
    fields: tuple[list[int], list[int], list[int], list[int]]

    @classmethod
    def of(cls, keep_rows: Sequence[int], t: int, chunk_size: int = CHUNK_SIZE) -> "KeepPlan":
        """The plan of `keep_rows` (row indices in [0, t), any order, repeats allowed)."""
        c = max(1, min(chunk_size, t))
        rows = tuple(int(r) for r in keep_rows)
        by_chunk: dict[int, list[tuple[int, int]]] = {}  # chunk -> [(position in rows, row in chunk)]
        for i, r in enumerate(rows):
            by_chunk.setdefault(r // c, []).append((i, r % c))
        loc: list[int] = []
        inner: list[int] = []
        ends: list[int] = []
        spans = {}
        for chunk, wanted in sorted(by_chunk.items()):
            last = min(c, t - chunk * c) - 1  # the chunk's last row that exists
            a, e = len(inner), len(ends)
            for i, j in wanted:
                if j < last:
                    loc.append(j)
                    inner.append(i)
                else:
                    ends.append(i)
            spans[chunk] = (a, len(inner), e, len(ends))
        return cls(rows, t, c, spans, (list(rows), loc, inner, ends))

    def index(self, tensors: Sequence[torch.Tensor]) -> "KeepIndex":
        """The `KeepIndex` of this plan, given its `fields` on the device (in order)."""
        rows, loc, inner, ends = tensors
        return KeepIndex(self, rows, loc, inner, ends)

    def send(self, device: torch.device) -> "KeepIndex":
        """The `KeepIndex` of this plan, its fields sent in one copy of their own."""
        return self.index(send_ints(self.fields, device))


@dataclass(frozen=True)
class KeepIndex:
    """A `KeepPlan` with its index tensors on the device: `rows` [R] (keep_rows), `loc` and `inner`
    (the inner rows' places in their chunks, their positions in keep_rows), `ends` (positions in
    keep_rows of chunk-ending rows)."""

    plan: KeepPlan
    rows: torch.Tensor
    loc: torch.Tensor
    inner: torch.Tensor
    ends: torch.Tensor


def chunked_gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        state0: torch.Tensor, *, keep_rows: torch.Tensor | Sequence[int] | None = None,
                        chunk_size: int = CHUNK_SIZE, keep_index: KeepIndex | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gated delta rule over q, k [B,T,H,Dk], v [B,T,H,Dv], g (log decay), beta [B,T,H] from state0 [B,H,Dk,Dv].

    Returns (out [B,T,H,Dv], final state [B,H,Dk,Dv], kept [B,R,H,Dk,Dv] or None): kept[:, i] is the
    state after row keep_rows[i] (R row indices in [0, T), shared by the batch; any order, repeats
    allowed). None when keep_rows is None. keep_index: the rows' `KeepPlan` (of T and chunk_size)
    with its indices already on the device (keep_rows is then left out); without it the plan of
    keep_rows is worked out here and sent in one non-blocking copy (a tensor keep_rows is read back
    first: on CUDA one host sync).
    """
    if keep_index is not None:
        if keep_rows is not None:
            raise ValueError("give keep_rows or keep_index, not both")
        keep_rows = keep_index.plan.rows
    b, t, h, dk, dv, rows = _check(q, k, v, g, beta, state0, keep_rows, chunk_size)
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    if t == 0:
        kept0 = None if rows is None else state0.new_empty(b, 0, h, dk, dv)
        return v.new_empty(b, 0, h, dv).to(q.dtype), state0.clone(), kept0
    c = min(chunk_size, t)
    group = max(1, GROUP_ROWS // c) * c  # rows whose chunk terms are built at once
    index = None  # the kept rows' indices on the device (none kept: None)
    if rows:
        index = keep_index if keep_index is not None else KeepPlan.of(rows, t, chunk_size).send(q.device)
        if (index.plan.t, index.plan.chunk) != (t, c):
            raise ValueError(f"keep_index was planned for {index.plan.t} rows in chunks of {index.plan.chunk}, "
                             f"not {t} in chunks of {c}")
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
            u = terms.u0[:, :, ci] - terms.w[:, :, ci] @ state  # [B,H,C,Dv]
            o = terms.q_dec[:, :, ci] @ state + terms.attn[:, :, ci] @ u
            out[:, row0:row0 + here] = o[:, :, :here].transpose(1, 2).to(out.dtype)
            a, z, e0, e1 = (0, 0, 0, 0) if index is None else index.plan.spans.get(row0 // c, (0, 0, 0, 0))
            if z > a and kept is not None and index is not None:  # requested rows inside the chunk
                loc = index.loc[a:z]
                weights = terms.decay[:, :, ci].index_select(2, loc)  # [B,H,Ri,C]: exp(G_r - G_j), 0 for j > r
                part = (weights[..., None] * terms.k[:, :, ci, None]).transpose(-1, -2) @ u[:, :, None]
                start = torch.exp(terms.cum[:, :, ci].index_select(2, loc))[..., None, None] * state[:, :, None]
                kept.index_copy_(1, index.inner[a:z], (start + part).transpose(1, 2).to(kept.dtype))  # [B,Ri,H,Dk,Dv]
            state = terms.chunk_decay[:, :, ci] * state + terms.k_dec[:, :, ci].transpose(-1, -2) @ u
            if e1 > e0 and kept is not None and index is not None:  # the chunk's (or the prompt's) last row
                ends = state[:, None].to(kept.dtype).expand(b, e1 - e0, h, dk, dv)
                kept.index_copy_(1, index.ends[e0:e1], ends)
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
