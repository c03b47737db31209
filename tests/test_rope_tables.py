"""Rotary embedding against the rotation written out per pair, with its cos/sin tables computed per
call or once for several calls (`rope_tables`, as a forward does for its layers); nothing is kept
between calls, so a positions tensor written in place gets new tables."""

from __future__ import annotations

import math

import torch

from fxsched.runtime.torch_model.attention import apply_rope, rope_tables


def _rotated(x: torch.Tensor, positions: list[int], theta: float, rot: int) -> torch.Tensor:
    """x [T, H, D]: dims i and i + rot/2 (i < rot/2) rotate by position * theta^(-2i/rot)."""
    out = x.clone().double()
    half = rot // 2
    for t, p in enumerate(positions):
        for i in range(half):
            a = p * theta ** (-2 * i / rot)
            c, s = math.cos(a), math.sin(a)
            x1, x2 = x[t, :, i].double(), x[t, :, i + half].double()
            out[t, :, i], out[t, :, i + half] = x1 * c - x2 * s, x2 * c + x1 * s
    return out


def test_rope_matches_the_rotation_and_follows_its_positions():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 8, generator=gen)
    positions = torch.tensor([0, 5, 11])
    for rot in (8, 4, 8):  # the same positions tensor twice, a partial rotation between
        torch.testing.assert_close(apply_rope(x, positions, 100.0, rot).double(),
                                   _rotated(x, [0, 5, 11], 100.0, rot), atol=1e-5, rtol=1e-5)
    positions[1] = 7  # written in place: the tables kept for it are stale
    torch.testing.assert_close(apply_rope(x, positions, 100.0).double(), _rotated(x, [0, 7, 11], 100.0, 8),
                               atol=1e-5, rtol=1e-5)
    fresh = torch.tensor([2, 3, 4])
    torch.testing.assert_close(apply_rope(x, fresh, 100.0).double(), _rotated(x, [2, 3, 4], 100.0, 8),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(apply_rope(x, fresh, 10.0).double(), _rotated(x, [2, 3, 4], 10.0, 8),
                               atol=1e-5, rtol=1e-5)


def test_tables_computed_once_serve_every_call_at_their_positions():
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(3, 2, 8, generator=gen), torch.randn(3, 4, 8, generator=gen)
    positions = torch.tensor([1, 4, 9])
    tables = rope_tables(positions, 100.0, 4, x.dtype)  # a partial rotation: dims 0..3
    assert tables.rotary_dim == 4
    for z in (x, y):  # other heads, the same positions: the same tables
        torch.testing.assert_close(apply_rope(z, positions, 100.0, tables=tables).double(),
                                   _rotated(z, [1, 4, 9], 100.0, 4), atol=1e-5, rtol=1e-5)
    positions[0] = 5  # the tables belong to the values they were computed from, not to the tensor
    torch.testing.assert_close(apply_rope(x, positions, 100.0, tables=tables).double(),
                               _rotated(x, [1, 4, 9], 100.0, 4), atol=1e-5, rtol=1e-5)
