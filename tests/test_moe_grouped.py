"""The grouped routed sum (moe.routed_sum: assignments sorted by expert, grouped GEMMs, or the
per-assignment C kernel for a few bf16 rows on the CPU) against a plain reference written here: a
loop over tokens and over each token's chosen experts, in fp64.

Cases: experts that receive no token, an expert with one token, every token to one expert,
expert-shard ranges (experts outside the range add nothing), and both paths in fp32 and bf16.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from fxsched.kernels import cpu_gemv  # noqa: E402
from fxsched.runtime.torch_model import moe  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

E, D, I, K = 8, 48, 24, 3
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def reference(flat, weights, experts, gate_w, up_w, down_w, first=0):
    """Per token t, per slot s: p[t, s] * SwiGLU_e(x_t) for e = experts[t, s] in range, in fp64."""
    out = torch.zeros(flat.shape, dtype=torch.float64)
    for t in range(flat.shape[0]):
        x = flat[t].double()
        for s in range(experts.shape[1]):
            e = int(experts[t, s]) - first
            if not 0 <= e < gate_w.shape[0]:
                continue
            g, u = gate_w[e].double() @ x, up_w[e].double() @ x
            out[t] += float(weights[t, s]) * (down_w[e].double() @ (torch.nn.functional.silu(g) * u))
    return out


def _layer(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, generator=gen) * 0.2).to(dtype) for shape in ((E, I, D), (E, I, D), (E, D, I))]


def _tokens(n, dtype, experts, seed=1):
    gen = torch.Generator().manual_seed(seed)
    flat = torch.randn(n, D, generator=gen).to(dtype)
    weights = torch.softmax(torch.randn(n, experts.shape[1], generator=gen), -1).to(dtype)
    return flat, weights


def _random_experts(n, seed, pool=E):
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(pool, generator=gen)[:K] for _ in range(n)])


def _check(dtype, flat, weights, experts, layer, first=0, *, path):
    gate_w, up_w, down_w = layer
    if path == "grouped":
        got = moe._grouped(flat, weights, _local(experts, first, gate_w.shape[0]), gate_w, up_w, down_w)
    elif path == "per_assignment":
        got = moe._per_assignment(flat, weights, _local(experts, first, gate_w.shape[0]), gate_w, up_w, down_w)
    else:
        got = moe.routed_sum(flat, weights, experts, gate_w, up_w, down_w, first)
    want = reference(flat, weights, experts, gate_w, up_w, down_w, first)
    assert got.dtype == dtype and got.shape == flat.shape
    scale = max(1.0, float(want.abs().max()))
    assert (got.double() - want).abs().max() <= TOL[dtype] * scale


def _local(experts, first, count):
    local = (experts - first).reshape(-1)
    return torch.where((local < 0) | (local >= count), torch.full_like(local, count), local)


PATHS = ["grouped", "per_assignment", "routed_sum"]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_random_routing_with_idle_experts(dtype, path):
    experts = _random_experts(5, seed=2, pool=E - 3)  # experts 5, 6, 7 receive no token
    flat, weights = _tokens(5, dtype, experts)
    _check(dtype, flat, weights, experts, _layer(dtype), path=path)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_one_token_and_a_lone_expert(dtype, path):
    experts = torch.tensor([[7, 0, 3]])
    flat, weights = _tokens(1, dtype, experts)
    _check(dtype, flat, weights, experts, _layer(dtype), path=path)
    experts = torch.tensor([[1, 2, 3], [1, 2, 3], [6, 2, 1]])  # expert 6 has a single token
    flat, weights = _tokens(3, dtype, experts)
    _check(dtype, flat, weights, experts, _layer(dtype), path=path)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_token_to_one_expert(dtype, path):
    experts = torch.full((6, 1), 4)
    flat, weights = _tokens(6, dtype, experts)
    _check(dtype, flat, weights, experts, _layer(dtype), path=path)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_shard_ranges_sum_to_the_whole(dtype, path):
    """A shard [first, first + count) adds its experts only; the shards' sums add up to the whole."""
    layer = _layer(dtype)
    experts = _random_experts(7, seed=3)
    flat, weights = _tokens(7, dtype, experts)
    total = torch.zeros(flat.shape, dtype=torch.float64)
    for first, count in moe.expert_bounds(E, 3):
        part = [t[first:first + count].contiguous() for t in layer]
        _check(dtype, flat, weights, experts, part, first, path=path)
        total += moe.routed_sum(flat, weights, experts, *part, first=first).double()
    want = reference(flat, weights, experts, *layer)
    assert (total - want).abs().max() <= 2 * TOL[dtype] * max(1.0, float(want.abs().max()))


def test_routed_sum_takes_the_kernel_for_few_bf16_rows_only(monkeypatch):
    """Which path routed_sum takes: the per-assignment kernel for a few bf16 CPU assignments (when
    the kernel is ready), the grouped GEMMs otherwise."""
    taken = []
    monkeypatch.setattr(moe, "_per_assignment", lambda *a: taken.append("kernel") or a[0])
    monkeypatch.setattr(moe, "_grouped", lambda *a: taken.append("grouped") or a[0])
    layer16, layer32 = _layer(torch.bfloat16), _layer(torch.float32)
    few = _random_experts(2, seed=4)
    many = torch.zeros((moe.GEMV_MAX_ASSIGNMENTS // K + 1, K), dtype=torch.int64)
    for experts, layer, dtype in ((few, layer16, torch.bfloat16), (few, layer32, torch.float32),
                                  (many, layer16, torch.bfloat16)):
        moe.routed_sum(*_tokens(experts.shape[0], dtype, experts), experts, *layer)
    assert taken == (["kernel"] if cpu_gemv.ready() else ["grouped"]) + ["grouped", "grouped"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_shared_expert_is_the_gated_swiglu(dtype):
    """fuse_shared_experts keeps every name and shape (the shared gate/up/gate rows become views of
    one matrix) and shared_expert on it is sigmoid(x W_g^T) * down(silu(x W_gate^T) * x W_up^T)."""
    from dataclasses import replace

    from fxsched.runtime.torch_model.config import default_config
    from fxsched.runtime.torch_model.weights import init_weights

    base = default_config()
    cfg = replace(base, num_layers=1, layer_pattern=("attn",), mlp_pattern=("moe",), num_experts=E,
                  num_experts_per_tok=K, moe_intermediate_size=I, shared_expert_intermediate_size=20,
                  dtype="float32" if dtype == torch.float32 else "bfloat16")
    w = init_weights(cfg)
    fused = moe.fuse_shared_experts(w, cfg)
    prefix = moe.moe_prefixes(cfg)[0]
    assert moe.fused_shared(w, prefix) is None and moe.fused_shared(fused, prefix) is not None
    assert {n: t.shape for n, t in fused.items()} == {n: t.shape for n, t in w.items()}
    assert all(torch.equal(fused[n], w[n]) for n in w)
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(5)).to(dtype)
    p = {n: w[f"{prefix}.{n}"].double() for n in ("shared.gate_proj", "shared.up_proj", "shared.down_proj", "shared_gate")}
    xd = x.double()
    act = torch.nn.functional.silu(xd @ p["shared.gate_proj"].T) * (xd @ p["shared.up_proj"].T)
    want = torch.sigmoid(xd @ p["shared_gate"].T) * (act @ p["shared.down_proj"].T)
    for weights in (w, fused):  # the separate products and the fused one
        got = moe.shared_expert(x, weights, prefix)
        assert got.dtype == dtype
        assert (got.double() - want).abs().max() <= TOL[dtype] * max(1.0, float(want.abs().max()))


@pytest.mark.skipif(not cpu_gemv.ready(), reason="the CPU row kernel is not available on this host (needs AVX2 or AVX512-BF16 and a C compiler)")
def test_per_assignment_kernel_split_across_threads():
    """cpu_gemv.moe_gemv_bf16 with its output rows split over two threads (at least 256 rows each):
    each row against its own expert, zero for an id outside the experts."""
    from support.torch_testing import single_thread

    gen = torch.Generator().manual_seed(6)
    x = torch.randn(4, 40, generator=gen).to(torch.bfloat16)
    w = torch.randn(3, 516, 40, generator=gen).to(torch.bfloat16)
    ids = torch.tensor([0, 2, 3, 2])  # 3: not one of the 3 experts
    want = torch.stack([w[int(e)].double() @ x[a].double() if int(e) < 3 else torch.zeros(516, dtype=torch.float64)
                        for a, e in enumerate(ids)])
    with single_thread():
        torch.set_num_threads(2)
        got = cpu_gemv.moe_gemv_bf16(x, w, ids)
    assert (got.double() - want).abs().max() <= 3e-2 * float(want.abs().max())
    assert torch.equal(got[2], torch.zeros(516, dtype=torch.bfloat16))
