"""The GDN fold of every layer in one C call (kernels/cpu_fold.c) against the rule written out entry
by entry: each committed entry's slot gets, in every layer, the recurrent state and the conv window
columns 1.. after its accepted row; nothing else changes. Skipped (with the reason) where the kernel
cannot run (no C compiler, no AVX2, or FXSCHED_KERNELS=torch)."""

from __future__ import annotations

import pytest
import torch

from fxsched.kernels import cpu_fold

needs_kernel = pytest.mark.skipif(not cpu_fold.ready(), reason="the CPU fold kernel cannot run here (needs AVX2 "
                                  "and FMA, or AVX512-BF16, and a C compiler; FXSCHED_KERNELS=torch disables it)")


def _case(dtype, layers=3, b=5, r=4, h=2, dk=3, dv=5, c=7, w=4, s=9, unfolded=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    states = [torch.randn(b, r, h, dk, dv, generator=gen).to(dtype) for _ in range(layers)]
    if unfolded:  # the model's layout: a view of the conv input's sliding windows [B, C, R, W]
        windows = [torch.randn(b, w - 1 + r, c, generator=gen).to(dtype).unfold(1, w, 1).transpose(1, 2)
                   for _ in range(layers)]
    else:
        windows = [torch.randn(b, c, r, w, generator=gen).to(dtype) for _ in range(layers)]
    cache = [torch.randn(s, h, dk, dv, generator=gen).to(dtype) for _ in range(layers)]
    conv = [torch.randn(s, c, w - 1, generator=gen).to(dtype) for _ in range(layers)]
    return states, windows, cache, conv


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("unfolded", [True, False])
def test_every_layer_folds_as_the_rule_says(dtype, unfolded):
    states, windows, cache, conv = _case(dtype, unfolded=unfolded)
    want_cache, want_conv = [t.clone() for t in cache], [t.clone() for t in conv]
    batch, rows, slots = [4, 0, 2], [3, 0, 1], [8, 2, 5]
    for layer in range(len(states)):
        for e, row, slot in zip(batch, rows, slots, strict=True):
            want_cache[layer][slot] = states[layer][e, row]
            for ch in range(windows[layer].shape[1]):
                for j in range(1, windows[layer].shape[3]):
                    want_conv[layer][slot, ch, j - 1] = windows[layer][e, ch, row, j]
    assert cpu_fold.gdn_fold_layers(states, windows, cache, conv, batch, rows, slots)
    for layer in range(len(states)):
        assert torch.equal(cache[layer], want_cache[layer]) and torch.equal(conv[layer], want_conv[layer]), layer


@needs_kernel
def test_a_fold_the_kernel_cannot_take_is_left_to_torch():
    states, windows, cache, conv = _case(torch.bfloat16)
    before = [t.clone() for t in cache + conv]
    mixed = [cache[0].float(), *cache[1:]]  # a cache in another dtype than the rows
    assert not cpu_fold.gdn_fold_layers(states, windows, mixed, conv, [0], [1], [2])
    strided = [t[:, :, :, :, ::1].transpose(3, 4) for t in states]  # a row state that is not contiguous
    assert not cpu_fold.gdn_fold_layers(strided, windows, cache, conv, [0], [1], [2])
    assert all(torch.equal(a, b) for a, b in zip(cache + conv, before, strict=True))  # nothing written


@needs_kernel
def test_an_entry_outside_the_tensors_is_refused_before_anything_is_written():
    states, windows, cache, conv = _case(torch.float32)
    before = [t.clone() for t in cache + conv]
    for batch, rows, slots in (([5], [0], [0]), ([0], [4], [0]), ([0], [0], [9]), ([0], [-1], [0])):
        with pytest.raises(IndexError):
            cpu_fold.gdn_fold_layers(states, windows, cache, conv, batch, rows, slots)
    assert all(torch.equal(a, b) for a, b in zip(cache + conv, before, strict=True))
