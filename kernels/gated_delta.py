"""Gated delta rule (Gated DeltaNet) recurrent steps emitting every per-token state.

Shapes (fp32/fp16/bf16 inputs, fp32 arithmetic):

* ``q``, ``k``: ``[B, T, H, Dk]``; ``v``: ``[B, T, H, Dv]``;
* ``g``: ``[B, T, H]``, log decay (``a_t = exp(g_t)``, so ``g <= 0`` decays);
* ``beta``: ``[B, T, H]``, write strength;
* ``initial_state``: ``[B, H, Dk, Dv]`` (``S[i, j]`` maps key dim i to value dim j),
  or ``None`` for zeros;
* ``scale``: output scale, default 1.0 (pass ``Dk ** -0.5`` for the usual
  query scaling).

Per head, for t = 0..T-1 with ``S_{-1} = initial_state``::

    S_t = a_t * (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T      [Dk, Dv]
    o_t = scale * S_t^T q_t                                            [Dv]

computed as ``S' = a_t S_{t-1}``, ``u = beta_t (v_t - S'^T k_t)``,
``S_t = S' + k_t u^T``. Returns ``(outputs [B, T, H, Dv]`` in ``q``'s dtype,
``states [B, T, H, Dk, Dv]`` in ``initial_state``'s dtype (fp32 when ``None``)),
where ``states[:, t]`` is ``S_t``, the state after token t (what a K-row verify
needs so that ``gdn_fold`` can keep the accepted row's state).

Why our own kernel and not ``fla-core``: its ``fused_recurrent_gated_delta_rule``
uses the same recurrence and ``[Dk, Dv]`` state layout (and its scale defaults
to ``Dk ** -0.5``), but returns only the final state, not the state after every
token, which is the whole point here; it also brings ``einops`` and targets
GPUs only. Our reference matches its naive recurrent form with an explicit scale.
"""

from __future__ import annotations

import torch

from ._triton import HAVE_TRITON, cdiv, next_power_of_2, use_triton

__all__ = ["gated_delta", "gated_delta_reference", "gated_delta_triton"]

# 32 value columns x Dk=128 keeps an sm_90 compile at ~140 registers, no spills.
_MAX_VALUE_BLOCK = 32


def _check(q, k, v, g, beta, initial_state) -> None:
    if q.dim() != 4 or q.shape != k.shape:
        raise ValueError("q and k must both be [B, T, H, Dk]")
    batch, steps, heads, key_dim = q.shape
    if v.dim() != 4 or v.shape[:3] != (batch, steps, heads):
        raise ValueError("v must be [B, T, H, Dv]")
    if g.shape != (batch, steps, heads) or beta.shape != (batch, steps, heads):
        raise ValueError("g and beta must be [B, T, H]")
    if initial_state is not None and initial_state.shape != (batch, heads, key_dim, v.shape[3]):
        raise ValueError("initial_state must be [B, H, Dk, Dv]")


def gated_delta_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch recurrence, one token at a time, batched over B and H."""
    _check(q, k, v, g, beta, initial_state)
    batch, steps, heads, key_dim = q.shape
    value_dim = v.shape[3]
    state_dtype = initial_state.dtype if initial_state is not None else torch.float32
    if initial_state is None:
        state = torch.zeros(batch, heads, key_dim, value_dim, dtype=torch.float32, device=q.device)
    else:
        state = initial_state.float()
    outputs = torch.empty(batch, steps, heads, value_dim, dtype=q.dtype, device=q.device)
    states = torch.empty(batch, steps, heads, key_dim, value_dim, dtype=state_dtype, device=q.device)
    for t in range(steps):
        q_t, k_t, v_t = q[:, t].float(), k[:, t].float(), v[:, t].float()
        decayed = state * torch.exp(g[:, t].float())[..., None, None]
        predicted = torch.einsum("bhkv,bhk->bhv", decayed, k_t)
        update = beta[:, t].float()[..., None] * (v_t - predicted)
        state = decayed + k_t[..., :, None] * update[..., None, :]
        outputs[:, t] = (scale * torch.einsum("bhkv,bhk->bhv", state, q_t)).to(q.dtype)
        states[:, t] = state.to(state_dtype)
    return outputs, states


if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _gated_delta_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        g_ptr,
        beta_ptr,
        initial_state_ptr,
        out_ptr,
        states_ptr,
        scale,
        steps,
        heads,
        key_dim,
        value_dim,
        HAS_INITIAL_STATE: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        # Program (b*H + h, value chunk) keeps the [Dk, BLOCK_V] column slice of
        # the state in registers: columns of S evolve independently, since
        # u_j = beta (v_j - sum_i S'_ij k_i) and S_ij += k_i u_j.
        # All tensors are contiguous in their documented layouts.
        batch_head = tl.program_id(0).to(tl.int64)
        value_chunk = tl.program_id(1)
        batch = batch_head // heads
        head = batch_head % heads
        key_idx = tl.arange(0, BLOCK_K)
        value_idx = value_chunk * BLOCK_V + tl.arange(0, BLOCK_V)
        key_ok = key_idx < key_dim
        value_ok = value_idx < value_dim
        tile_mask = key_ok[:, None] & value_ok[None, :]
        tile_offsets = key_idx[:, None] * value_dim + value_idx[None, :]
        state_size = key_dim * value_dim

        if HAS_INITIAL_STATE:
            state = tl.load(initial_state_ptr + batch_head * state_size + tile_offsets, mask=tile_mask, other=0.0)
            state = state.to(tl.float32)
        else:
            state = tl.zeros((BLOCK_K, BLOCK_V), tl.float32)

        for t in range(steps):
            token = (batch * steps + t) * heads + head  # flat index into [B, T, H]
            q_t = tl.load(q_ptr + token * key_dim + key_idx, mask=key_ok, other=0.0).to(tl.float32)
            k_t = tl.load(k_ptr + token * key_dim + key_idx, mask=key_ok, other=0.0).to(tl.float32)
            v_t = tl.load(v_ptr + token * value_dim + value_idx, mask=value_ok, other=0.0).to(tl.float32)
            decay = tl.exp(tl.load(g_ptr + token).to(tl.float32))
            beta_t = tl.load(beta_ptr + token).to(tl.float32)

            state = state * decay
            predicted = tl.sum(state * k_t[:, None], axis=0)
            update = beta_t * (v_t - predicted)
            state = state + k_t[:, None] * update[None, :]
            out_t = tl.sum(state * q_t[:, None], axis=0) * scale

            tl.store(out_ptr + token * value_dim + value_idx, out_t.to(out_ptr.dtype.element_ty), mask=value_ok)
            tl.store(
                states_ptr + token * state_size + tile_offsets,
                state.to(states_ptr.dtype.element_ty),
                mask=tile_mask,
            )
else:  # pragma: no cover
    _gated_delta_kernel = None


def gated_delta_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float = 1.0,
    value_block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton recurrence: one program per (sequence, head, chunk of ``value_block`` value dims)."""
    _check(q, k, v, g, beta, initial_state)
    batch, steps, heads, key_dim = q.shape
    value_dim = v.shape[3]
    state_dtype = initial_state.dtype if initial_state is not None else torch.float32
    outputs = torch.empty(batch, steps, heads, value_dim, dtype=q.dtype, device=q.device)
    states = torch.empty(batch, steps, heads, key_dim, value_dim, dtype=state_dtype, device=q.device)
    if outputs.numel() == 0:
        return outputs, states
    block_v = next_power_of_2(value_block or min(_MAX_VALUE_BLOCK, value_dim))
    grid = (batch * heads, cdiv(value_dim, block_v))
    has_initial_state = initial_state is not None
    _gated_delta_kernel[grid](
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        g.contiguous(),
        beta.contiguous(),
        initial_state.contiguous() if initial_state is not None else states,  # dummy pointer when absent
        outputs,
        states,
        float(scale),
        steps,
        heads,
        key_dim,
        value_dim,
        HAS_INITIAL_STATE=has_initial_state,
        BLOCK_K=next_power_of_2(key_dim),
        BLOCK_V=block_v,
    )
    return outputs, states


def gated_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta steps: Triton when it can run for these tensors, else the reference."""
    tensors = [q, k, v, g, beta] + ([initial_state] if initial_state is not None else [])
    if use_triton(*tensors, kernel=_gated_delta_kernel):
        return gated_delta_triton(q, k, v, g, beta, initial_state, scale)
    return gated_delta_reference(q, k, v, g, beta, initial_state, scale)
