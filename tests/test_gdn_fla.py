"""A prompt's GDN recurrence through flash-linear-attention's kernels, segment by segment
(runtime/torch_model/gdn_fla.py).

On the CPU the segmentation runs with fla's own naive recurrence as the kernel (fla's Triton kernels
need a GPU: the interpreter cannot run them) and must give what `chunked_gated_delta` gives: every
row's output and the states after the kept rows, in any order and with repeats. On CUDA fla's chunk
kernel itself is checked against `chunked_gated_delta`, and a hybrid model's prefill logits with it
against the same prefill with the torch chunked form.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

naive = pytest.importorskip("fla.ops.gated_delta_rule.naive",
                            reason="flash-linear-attention (fla-core) is not installed").naive_recurrent_gated_delta_rule

from fxsched.runtime.torch_model import gdn_fla  # noqa: E402
from fxsched.runtime.torch_model.gdn_chunked import chunked_gated_delta  # noqa: E402
from fxsched.runtime.torch_model.gdn_fla import fla_prefill_applies, segmented_gated_delta  # noqa: E402


def _naive_kernel(q, k, v, g, beta, scale, initial_state, output_final_state):
    """fla's naive recurrence under the chunk kernel's calling convention (g before beta)."""
    return naive(q, k, v, beta, g, scale=scale, initial_state=initial_state, output_final_state=output_final_state)


def _inputs(b, t, h, dk, dv, seed, device="cpu", dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)
    q = F.normalize(rand(b, t, h, dk), dim=-1) * dk ** -0.5
    k = F.normalize(rand(b, t, h, dk), dim=-1)
    v = rand(b, t, h, dv)
    g = -torch.rand(b, t, h, generator=gen).to(device) * 0.5
    beta = torch.rand(b, t, h, generator=gen).to(device)
    s0 = rand(b, h, dk, dv) * 0.1
    return q, k, v, g, beta, s0.float()


@pytest.mark.parametrize("keep", [(29,), (3, 15, 29), (29, 7, 7, 0, 15), (0, 1, 2, 28, 29)])
def test_segments_give_the_chunked_forms_outputs_and_kept_states(keep):
    q, k, v, g, beta, s0 = _inputs(2, 30, 3, 16, 8, seed=len(keep))
    out, kept = segmented_gated_delta(q, k, v, g, beta, s0, keep, kernel=_naive_kernel)
    want_out, _, want_kept = chunked_gated_delta(q, k, v, g, beta, s0, keep_rows=list(keep), chunk_size=8)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    assert want_kept is not None and kept.shape == want_kept.shape
    torch.testing.assert_close(kept, want_kept, atol=1e-5, rtol=1e-5)


def test_rows_outside_the_forward_are_refused_and_the_cpu_keeps_the_torch_form():
    q, k, v, g, beta, s0 = _inputs(1, 4, 1, 4, 4, seed=0)
    with pytest.raises(ValueError, match=r"keep_rows must lie in \[0, 4\)"):
        segmented_gated_delta(q, k, v, g, beta, s0, (4,), kernel=_naive_kernel)
    assert not fla_prefill_applies(q)  # CPU tensors: the chunked torch form (faster there)


def test_a_prefill_through_the_fla_path_equals_the_torch_chunked_prefill(monkeypatch):
    """The model's wiring of the CUDA path (gdn.gdn_layer -> segmented_gated_delta), with fla's
    naive recurrence standing in for its chunk kernel: logits of a batched prefill of prompts of
    different lengths, and the GDN states each slot keeps, equal the torch chunked form's."""
    from fxsched.runtime.torch_model import HybridEngine
    from fxsched.runtime.torch_model import gdn as gdn_module
    from fxsched.runtime.torch_model.default_model import default_model_dir

    prompts = [[5 + i, 17, 42, 7 + i] * (9 + 5 * i) for i in range(3)]
    got = {}
    segments = []

    def kernel(*args, **kwargs):
        segments.append(args[0].shape[1])
        return _naive_kernel(*args, **kwargs)
    for path in ("fla", "torch"):
        if path == "fla":
            monkeypatch.setattr(gdn_module, "fla_prefill_applies", lambda q: True)
            monkeypatch.setattr(gdn_fla, "fla_chunk_kernel", lambda: kernel)
        engine = HybridEngine.from_pretrained(default_model_dir(), max_slots=4, block_size=16)
        engine.forward_rows = None  # one forward, as on CUDA (specs/cpu-kernels.md §15.7)
        for slot in range(3):
            engine.alloc(slot)
        got[path] = (engine.commit_forward([0, 1, 2], prompts), [engine.gdn_state(s) for s in range(3)])
        monkeypatch.undo()
    assert segments and sum(segments) % 76 == 0  # every GDN layer ran the 76 rows, cut at kept rows
    torch.testing.assert_close(got["fla"][0], got["torch"][0], atol=1e-4, rtol=1e-4)
    for fla_slot, torch_slot in zip(got["fla"][1], got["torch"][1], strict=True):
        for (rec_a, conv_a), (rec_b, conv_b) in zip(fla_slot, torch_slot, strict=True):
            torch.testing.assert_close(rec_a, rec_b, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(conv_a, conv_b)


# --- CUDA ------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's Triton kernels need a CUDA device")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_chunk_kernel_equals_the_chunked_form_on_cuda(dtype):
    assert gdn_fla.fla_chunk_kernel() is not None
    t = 300
    keep = (63, 127, 200, 299)
    q, k, v, g, beta, s0 = _inputs(2, t, 4, 128, 128, seed=1, device="cuda", dtype=dtype)
    out, kept = segmented_gated_delta(q, k, v, g, beta, s0.cuda(), keep)
    ref = [x.double() for x in (q, k, v, g, beta, s0.cuda())]
    want_out, _, want_kept = chunked_gated_delta(*ref, keep_rows=list(keep))
    assert want_kept is not None
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3  # tf32 dots in the kernel
    err_out = (out.double() - want_out).norm() / want_out.norm()
    err_kept = (kept.double() - want_kept).norm() / want_kept.norm()
    assert err_out < tol and err_kept < tol, (float(err_out), float(err_kept))


@pytest.mark.gpu
@cuda
def test_a_hybrid_prefill_on_fla_equals_the_torch_chunked_prefill(monkeypatch):
    from fxsched.runtime.torch_model import HybridEngine
    from fxsched.runtime.torch_model.default_model import default_model_dir

    prompts = [[5 + i, 17, 42, 7 + i] * (9 + 5 * i) for i in range(3)]
    logits = {}
    for mode in ("fla", "torch"):
        monkeypatch.setenv("FXSCHED_GDN_PREFILL", mode)
        engine = HybridEngine.from_pretrained(default_model_dir(), device="cuda", max_slots=4, cuda_graphs=False)
        for slot in range(3):
            engine.alloc(slot)
        logits[mode] = engine.commit_forward([0, 1, 2], prompts)
    torch.testing.assert_close(logits["fla"], logits["torch"], atol=2e-3, rtol=2e-3)
