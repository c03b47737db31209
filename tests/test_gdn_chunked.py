"""`chunked_gated_delta` (the chunk form of the gated delta rule) against independent row-by-row loops.

References: `gdn._recurrence` (our torch loop, which keeps every per-row state) and
flash-linear-attention's pure-torch `naive_recurrent_gated_delta_rule` (runs on the CPU; its
final state on a prefix gives the state after any row). fp32 agreement within 1e-5; fp64 within
1e-10, which shows the chunk algebra is exact rather than merely close.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

naive_recurrent_gated_delta_rule = pytest.importorskip(
    "fla.ops.gated_delta_rule.naive", reason="flash-linear-attention (fla-core) is not installed"
).naive_recurrent_gated_delta_rule

from fxsched.runtime.torch_model import gdn_chunked
from fxsched.runtime.torch_model.gdn import _recurrence
from fxsched.runtime.torch_model.gdn_chunked import chunked_gated_delta

TOL = {"atol": 1e-5, "rtol": 1e-5}


def make_inputs(b, t, h, dk, dv, *, decay, seed, dtype=torch.float32, state_scale=1.0):
    """q (normalised, scaled), k (normalised), v, g (log decay <= 0), beta, state0 as the layer makes them.

    decay: "strong" -> g in (-6, -1], "weak" -> g in (-0.01, 0], "mixed" -> per-head spread incl. g = 0.
    """
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(b, t, h, dk, generator=gen), dim=-1) * dk ** -0.5
    k = F.normalize(torch.randn(b, t, h, dk, generator=gen), dim=-1)
    v = torch.randn(b, t, h, dv, generator=gen)
    u = torch.rand(b, t, h, generator=gen)
    if decay == "strong":
        g = -(1.0 + 5.0 * u)
    elif decay == "weak":
        g = -0.01 * u
    else:
        g = -u * torch.logspace(-3, 1, h)
        g[..., 0] = 0.0
    beta = torch.rand(b, t, h, generator=gen)
    state0 = state_scale * torch.randn(b, h, dk, dv, generator=gen)
    return tuple(x.to(dtype) for x in (q, k, v, g, beta, state0))


CASES = [  # (B, T, H, Dk, Dv, chunk, decay)
    (2, 1, 3, 8, 4, 64, "mixed"),  # T = 1
    (1, 5, 2, 16, 8, 64, "weak"),  # T < chunk
    (2, 37, 3, 8, 12, 16, "strong"),  # T not a multiple of chunk
    (1, 64, 2, 32, 32, 64, "weak"),  # exactly one chunk
    (2, 130, 2, 16, 16, 32, "mixed"),  # several chunks plus a tail
    (1, 200, 2, 64, 64, 64, "weak"),  # near-identity decay, long prompt
    (1, 97, 4, 8, 8, 7, "strong"),  # odd chunk size
]


def boundary_rows(t, c):
    """0, T-1, the rows around every chunk boundary, and a middle row."""
    rows = {0, t - 1, t // 2}
    for edge in range(c, t, c):
        rows |= {edge - 1, edge, edge + 1}
    return sorted(r for r in rows if 0 <= r < t)


@pytest.mark.parametrize("b,t,h,dk,dv,c,decay", CASES)
def test_matches_torch_loop_outputs_final_and_kept_states(b, t, h, dk, dv, c, decay):
    q, k, v, g, beta, s0 = make_inputs(b, t, h, dk, dv, decay=decay, seed=t * 31 + c)
    rows = boundary_rows(t, c)
    out, final, kept = chunked_gated_delta(q, k, v, g, beta, s0, keep_rows=torch.tensor(rows), chunk_size=c)
    ref_out, ref_states = _recurrence(q, k, v, torch.exp(g), beta, s0)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(final, ref_states[:, -1], **TOL)
    assert kept is not None and kept.shape == (b, len(rows), h, dk, dv)
    torch.testing.assert_close(kept, ref_states[:, rows], **TOL)


@pytest.mark.parametrize("b,t,h,dk,dv,c,decay", CASES[:5])
def test_matches_fla_naive_recurrence(b, t, h, dk, dv, c, decay):
    q, k, v, g, beta, s0 = make_inputs(b, t, h, dk, dv, decay=decay, seed=7 + t)
    rows = boundary_rows(t, c)
    out, final, kept = chunked_gated_delta(q, k, v, g, beta, s0, keep_rows=rows, chunk_size=c)
    ref_out, ref_final = naive_recurrent_gated_delta_rule(q, k, v, beta, g, scale=1.0, initial_state=s0,
                                                          output_final_state=True)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(final, ref_final, **TOL)
    assert kept is not None
    for i, r in enumerate(rows):
        _, ref_r = naive_recurrent_gated_delta_rule(q[:, :r + 1], k[:, :r + 1], v[:, :r + 1], beta[:, :r + 1],
                                                    g[:, :r + 1], scale=1.0, initial_state=s0,
                                                    output_final_state=True)
        torch.testing.assert_close(kept[:, i], ref_r, **TOL)


def test_fp64_is_exact_to_rounding():
    q, k, v, g, beta, s0 = make_inputs(2, 150, 3, 16, 8, decay="mixed", seed=3, dtype=torch.float64)
    rows = boundary_rows(150, 32)
    out, final, kept = chunked_gated_delta(q, k, v, g, beta, s0, keep_rows=rows, chunk_size=32)
    ref_out, ref_states = _recurrence(q, k, v, torch.exp(g), beta, s0)
    assert out.dtype == final.dtype == torch.float64
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(final, ref_states[:, -1], atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(kept, ref_states[:, rows], atol=1e-10, rtol=1e-10)


def test_extreme_decay_stays_finite_and_exact():
    """Cumulative log-decays of about -1e3 within a chunk: no inf/nan, kept states still within 1e-5."""
    q, k, v, g, beta, s0 = make_inputs(1, 150, 2, 16, 16, decay="strong", seed=11)
    g = g * 30.0  # g in (-180, -30]
    rows = list(range(0, 150, 5))
    out, final, kept = chunked_gated_delta(q, k, v, g, beta, s0, keep_rows=rows, chunk_size=64)
    ref_out, ref_states = _recurrence(q, k, v, torch.exp(g), beta, s0)
    assert torch.isfinite(out).all() and torch.isfinite(final).all()
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(kept, ref_states[:, rows], **TOL)


@pytest.mark.parametrize("c", [1, 5, 16, 64, 1000])
def test_chunk_size_does_not_change_the_result(c):
    q, k, v, g, beta, s0 = make_inputs(1, 50, 2, 8, 8, decay="mixed", seed=5)
    ref_out, ref_states = _recurrence(q, k, v, torch.exp(g), beta, s0)
    out, final, kept = chunked_gated_delta(q, k, v, g, beta, s0, keep_rows=[49, 3, 3, 0], chunk_size=c)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(final, ref_states[:, -1], **TOL)
    torch.testing.assert_close(kept, ref_states[:, [49, 3, 3, 0]], **TOL)  # any order, repeats allowed


@pytest.mark.parametrize("group_rows", [16, 40, 10_000])
def test_row_groups_hand_the_state_over(monkeypatch, group_rows):
    """Chunk terms built a group of rows at a time (GROUP_ROWS): states and outputs cross group edges."""
    monkeypatch.setattr(gdn_chunked, "GROUP_ROWS", group_rows)
    q, k, v, g, beta, s0 = make_inputs(2, 101, 2, 8, 8, decay="mixed", seed=17)
    rows = [15, 16, 31, 32, 47, 63, 64, 79, 95, 100]
    out, final, kept = chunked_gated_delta(q, k, v, g, beta, s0, keep_rows=rows, chunk_size=16)
    ref_out, ref_states = _recurrence(q, k, v, torch.exp(g), beta, s0)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(final, ref_states[:, -1], **TOL)
    torch.testing.assert_close(kept, ref_states[:, rows], **TOL)


def test_bf16_inputs_computed_in_fp32_and_cast_back():
    q, k, v, g, beta, s0 = make_inputs(1, 40, 2, 16, 16, decay="mixed", seed=9, dtype=torch.bfloat16)
    state0 = s0.float()
    out, final, kept = chunked_gated_delta(q, k, v, g, beta, state0, keep_rows=[10], chunk_size=16)
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32 and kept is not None
    assert kept.dtype == torch.float32
    f32 = [x.float() for x in (q, k, v, g, beta)]
    ref_out, ref_states = _recurrence(f32[0], f32[1], f32[2], torch.exp(f32[3]), f32[4], state0)
    torch.testing.assert_close(out, ref_out.to(torch.bfloat16))  # bf16 tolerances: only the final cast differs
    torch.testing.assert_close(final, ref_states[:, -1], **TOL)
    torch.testing.assert_close(kept[:, 0], ref_states[:, 10], **TOL)


def test_right_padded_batch_valid_rows_ignore_padding():
    """Sequence 1 is 23 rows long in a batch of 40: its outputs and the state after its last row do not
    depend on the padding rows; its *final* state does (the caller keeps the state after row 22)."""
    q, k, v, g, beta, s0 = make_inputs(2, 40, 2, 8, 8, decay="weak", seed=13)
    n = 23
    out, final, kept = chunked_gated_delta(q, k, v, g, beta, s0, keep_rows=[n - 1], chunk_size=16)
    alone_out, alone_final, _ = chunked_gated_delta(q[1:, :n], k[1:, :n], v[1:, :n], g[1:, :n], beta[1:, :n],
                                                    s0[1:], chunk_size=16)
    assert kept is not None
    torch.testing.assert_close(out[1, :n], alone_out[0], **TOL)
    torch.testing.assert_close(kept[1, 0], alone_final[0], **TOL)
    assert not torch.allclose(final[1], alone_final[0], **TOL)


def test_no_keep_rows_and_empty_prompt():
    q, k, v, g, beta, s0 = make_inputs(1, 9, 2, 4, 4, decay="weak", seed=1)
    _, _, kept = chunked_gated_delta(q, k, v, g, beta, s0)
    assert kept is None
    out, final, kept = chunked_gated_delta(q[:, :0], k[:, :0], v[:, :0], g[:, :0], beta[:, :0], s0, keep_rows=[])
    assert out.shape == (1, 0, 2, 4) and kept is not None and kept.shape == (1, 0, 2, 4, 4)
    torch.testing.assert_close(final, s0, atol=0.0, rtol=0.0)


@pytest.mark.parametrize("kwargs,match", [
    ({"keep_rows": [9]}, r"keep_rows must lie in \[0, 9\)"),
    ({"keep_rows": [-1]}, r"keep_rows must lie"),
    ({"keep_rows": torch.tensor([1.0])}, r"1-D integer tensor"),
    ({"chunk_size": 0}, r"chunk_size must be >= 1"),
])
def test_bad_arguments_raise(kwargs, match):
    q, k, v, g, beta, s0 = make_inputs(1, 9, 2, 4, 4, decay="weak", seed=1)
    with pytest.raises(ValueError, match=match):
        chunked_gated_delta(q, k, v, g, beta, s0, **kwargs)


def test_bad_shapes_raise():
    q, k, v, g, beta, s0 = make_inputs(1, 9, 2, 4, 4, decay="weak", seed=1)
    with pytest.raises(ValueError, match="state0 must be"):
        chunked_gated_delta(q, k, v, g, beta, s0[:, :1])
    with pytest.raises(ValueError, match="g must be"):
        chunked_gated_delta(q, k, v, g[:, :5], beta, s0)


# ---- the engine's prefill takes the chunked form -------------------------------------------------

def test_engine_prefill_keeps_only_boundary_and_last_states():
    """A 40-token prefill (block size 16) keeps 3 GDN states per layer (rows 15, 31, 39), not 40, and
    leaves the slot in the state a per-row forward (a verify of the same rows, then a full commit)
    reaches; the prefix-cache boundary snapshots agree too."""
    from fxsched.runtime.torch_model import HybridEngine

    prompt = [(7 * i + 3) % 60 for i in range(40)]
    chunked, per_row = HybridEngine(), HybridEngine()
    chunked.alloc(0)
    per_row.alloc(0)
    seen: list[tuple[int, ...] | None] = []
    forward = chunked.model.forward

    def spy(batch, *args, **kwargs):
        out = forward(batch, *args, **kwargs)
        seen.append(batch.gdn_keep_rows)
        assert all(r.states.shape[1] == len(batch.gdn_keep_rows or range(batch.tokens.shape[1]))
                   for r in out.gdn_rows)
        return out

    chunked.model.forward = spy
    logits = chunked.prefill(0, prompt)
    assert seen == [(15, 31, 39)]
    want = per_row.verify(0, prompt)
    per_row.commit_accepted_prefix(0, len(prompt))
    assert torch.allclose(logits, want[-1], atol=1e-5)
    for (r1, c1), (r2, c2) in zip(chunked.gdn_state(0), per_row.gdn_state(0), strict=True):
        assert torch.allclose(r1, r2, atol=1e-5) and torch.allclose(c1, c2, atol=1e-5)
    for k in (1, 2):
        for (r1, _), (r2, _) in zip(chunked.slot_state(0).boundary_states[k],
                                    per_row.slot_state(0).boundary_states[k], strict=True):
            assert torch.allclose(r1, r2, atol=1e-5)
