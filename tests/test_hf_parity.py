"""HybridEngine on Hugging Face checkpoints gives transformers' logits (tiny random checkpoints).

For each supported architecture (tests/support/hf_tiny.py) the reference is transformers' own
model, run without cache over the whole sequence (`model(input_ids).logits`), with its pure-torch
GDN functions (fla's Triton kernels, which transformers would bind, cannot run on a CPU). The
engine runs the checkpoint as loaded by `load_pretrained`, with a block size of 4 so prompts span
several KV blocks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from support.hf_tiny import ARCHITECTURES, TinyCheckpoint, build, rewrite_tensors, transformers_torch_gdn

from fxsched.runtime.torch_model import HybridEngine, load_pretrained
from fxsched.runtime.torch_model.config import ModelConfig
from fxsched.runtime.torch_model.gdn import gdn_layer
from fxsched.runtime.torch_model.model import RowBatch
from fxsched.runtime.torch_model.paged_kv import flat_indices
from fxsched.runtime.torch_model.weights import init_weights

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ATOL = 1e-4
PROMPT_LEN = 12
DECODE_STEPS = 16
ENGINE_ARGS: dict[str, Any] = {"max_seq_len": 64, "max_slots": 4, "block_size": 4}
BF16_PROMPT_SEED = 2


@pytest.fixture(scope="module", autouse=True)
def _torch_gdn() -> Iterator[None]:
    with transformers_torch_gdn():
        yield


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyCheckpoint]:
    root = tmp_path_factory.mktemp("hf_tiny")
    return {arch: build(arch, root / arch, seed=i) for i, arch in enumerate(ARCHITECTURES)}


def _prompt(seed: int, n: int = PROMPT_LEN) -> list[int]:
    return torch.randint(0, 150, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def _hf_logits(model: Any, tokens: list[int]) -> torch.Tensor:
    """transformers' logits [T, V] of every position of `tokens` (one uncached forward)."""
    return model(torch.tensor([tokens])).logits[0].float()


@torch.no_grad()
def _hf_greedy(model: Any, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """(greedy continuation of `steps` tokens, logits [len(prompt) + steps, V] of the whole sequence)."""
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(_hf_logits(model, tokens)[-1].argmax()))
    return tokens[len(prompt):], _hf_logits(model, tokens)


_GREEDY: dict[tuple[str, int], tuple[list[int], torch.Tensor]] = {}


def _greedy(ck: TinyCheckpoint, seed: int, n: int = PROMPT_LEN) -> tuple[list[int], list[int], torch.Tensor]:
    key = (ck.architecture, seed * 1000 + n)
    if key not in _GREEDY:
        _GREEDY[key] = _hf_greedy(ck.model, _prompt(seed, n), DECODE_STEPS)
    gen, logits = _GREEDY[key]
    return _prompt(seed, n), gen, logits


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_hf_prefill_and_decode_logits_match_transformers(checkpoints, arch):
    ck = checkpoints[arch]
    prompt, gen, ref = _greedy(ck, seed=1)
    engine = HybridEngine.from_pretrained(ck.path, **ENGINE_ARGS)
    engine.alloc(0)
    diffs = [_maxdiff(engine.prefill(0, prompt), ref[PROMPT_LEN - 1])]
    for step, token in enumerate(gen):
        diffs.append(_maxdiff(engine.decode_batch([0], [token])[0], ref[PROMPT_LEN + step]))
    assert max(diffs) <= ATOL, (arch, diffs)
    assert len(set(gen)) > 3, gen  # the tiny model is not degenerate: the check covers varied tokens


@pytest.mark.parametrize("arch", ["Qwen3_5ForCausalLM", "Qwen3NextForCausalLM"])
def test_hf_long_prompt_prefill_matches_transformers(checkpoints, arch):
    """A prompt longer than the window-product threshold of the GDN short convolution (its
    depthwise conv1d path; the prompts above take the window products) gives transformers' logits,
    and so do the decode rows after it."""
    ck = checkpoints[arch]
    n = 40
    prompt, gen, ref = _greedy(ck, seed=4, n=n)
    engine = HybridEngine.from_pretrained(ck.path, **ENGINE_ARGS)
    engine.alloc(0)
    diffs = [_maxdiff(engine.prefill(0, prompt), ref[n - 1])]
    for step, token in enumerate(gen[:4]):
        diffs.append(_maxdiff(engine.decode_batch([0], [token])[0], ref[n + step]))
    assert max(diffs) <= ATOL, (arch, diffs)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_hf_batched_decode_and_verify_match_transformers(checkpoints, arch):
    ck = checkpoints[arch]
    engine = HybridEngine.from_pretrained(ck.path, **ENGINE_ARGS)
    # Two sequences of different lengths decoded together.
    (p0, g0, r0), (p1, g1, r1) = _greedy(ck, seed=2), _greedy(ck, seed=3, n=7)
    engine.alloc(0)
    engine.alloc(1)
    engine.prefill(0, p0)
    engine.prefill(1, p1)
    diffs = []
    for step in range(4):
        logits = engine.decode_batch([0, 1], [g0[step], g1[step]])
        diffs += [_maxdiff(logits[0], r0[len(p0) + step]), _maxdiff(logits[1], r1[len(p1) + step])]
    assert max(diffs) <= ATOL, (arch, "batched decode", diffs)
    # A verify of 4 rows (anchor + 3 drafts, the last one wrong), then commit 2 and decode on.
    prompt, gen, ref = _greedy(ck, seed=1)
    engine.alloc(2)
    engine.prefill(2, prompt)
    wrong = (gen[3] + 1) % 150
    rows = gen[:3] + [wrong]
    verify_ref = _hf_logits(ck.model, prompt + rows)
    logits = engine.verify(2, rows)
    assert _maxdiff(logits, verify_ref[PROMPT_LEN - 1 + 1:PROMPT_LEN + 4]) <= ATOL, arch
    engine.commit_accepted_prefix(2, 2)
    assert engine.seq_len(2) == PROMPT_LEN + 2
    after = engine.decode_batch([2], [gen[2]])[0]
    assert _maxdiff(after, ref[PROMPT_LEN + 2]) <= ATOL, (arch, "decode after a partial accept")


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_hf_bf16_greedy_tokens_equal_fp32(checkpoints, arch):
    ck = checkpoints[arch]
    prompt, gen, ref = _greedy(ck, seed=BF16_PROMPT_SEED)
    cfg, weights = load_pretrained(ck.path, dtype="bfloat16", **ENGINE_ARGS)
    assert cfg.dtype == "bfloat16" and weights["embed"].dtype == torch.bfloat16
    assert weights["final_norm"].dtype == weights["layers.0.input_norm"].dtype == torch.float32  # weights.py
    engine = HybridEngine(cfg, weights)
    assert engine.kv.k[0].dtype == torch.bfloat16 and engine.hidden_history.dtype == torch.bfloat16
    engine.alloc(0)
    logits = engine.prefill(0, prompt)
    assert logits.dtype == torch.bfloat16
    matched = 0
    for step in range(DECODE_STEPS):
        fp32 = ref[PROMPT_LEN - 1 + step]
        err = _maxdiff(logits, fp32)
        assert err <= 0.1 * float(fp32.abs().max()), (arch, step, err)  # the bf16 model stays close
        token = int(logits.argmax())
        if token != gen[step]:
            # bf16 weights make a slightly different model: it may legitimately pick another token
            # where fp32's top logits nearly tie -- then the fp32 logit gap between the two picks is
            # within the two logits' bf16 deviations. The tokens are compared up to that step.
            assert float(fp32[gen[step]] - fp32[token]) <= 2 * err, (arch, step, token, gen[step], err)
            break
        matched += 1
        if step + 1 < DECODE_STEPS:
            logits = engine.decode_batch([0], [token])[0]
    assert matched >= 8, (arch, "greedy bf16 left fp32 very early: pick a prompt without early near-ties", matched)


def test_hf_capture_layers_are_transformers_hidden_states(checkpoints):
    ck = checkpoints["Qwen3NextForCausalLM"]
    engine = HybridEngine.from_pretrained(ck.path, **ENGINE_ARGS)
    prompt = _prompt(4)
    with torch.no_grad():
        hf = ck.model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    engine.alloc(0)  # seats slot 0: a zero GDN state
    blocks = engine.pool.allocate(3)
    batch = RowBatch(torch.tensor([prompt]), torch.arange(PROMPT_LEN)[None], torch.ones(1, PROMPT_LEN, dtype=torch.bool),
                     torch.tensor(flat_indices(blocks, 0, PROMPT_LEN, 4)), torch.tensor([blocks]), torch.tensor([0]))
    out = engine.model.forward(batch, engine.kv, engine.gdn, capture_layers=(0, 2))
    assert sorted(out.layer_hidden) == [0, 2]
    for layer in (0, 2):  # hidden_states[0] is the embedding output: layer l is entry l + 1
        assert _maxdiff(out.layer_hidden[layer][0], hf[layer + 1][0]) <= ATOL, layer
    with pytest.raises(ValueError, match="capture_layers"):
        engine.model.forward(batch, engine.kv, engine.gdn, capture_layers=(4,))


def test_hf_loads_published_mtp_tensors(checkpoints):
    for arch in ("Qwen3_5ForCausalLM", "Qwen3NextForCausalLM"):
        ck = checkpoints[arch]
        cfg, w = load_pretrained(ck.path, **ENGINE_ARGS)
        stored: dict[str, torch.Tensor] = {}
        for shard in ck.path.glob("*.safetensors"):
            stored.update(load_file(str(shard)))
        assert cfg.mtp_layers == 1 and not cfg.mtp
        assert torch.equal(w["mtp.fc"], stored["mtp.fc.weight"])
        assert torch.equal(w["mtp.embed_norm"], 1 + stored["mtp.pre_fc_norm_embedding.weight"])
        assert torch.equal(w["mtp.final_norm"], 1 + stored["mtp.norm.weight"])
        q = stored["mtp.layers.0.self_attn.q_proj.weight"].view(4, 2, 16, -1)
        assert torch.equal(w["mtp.layers.0.attn.q_proj"], q[:, 0].reshape(64, -1))
        assert torch.equal(w["mtp.layers.0.attn.gate_proj"], q[:, 1].reshape(64, -1))
        moe = arch == "Qwen3NextForCausalLM"
        assert ("mtp.layers.0.moe.router" in w) == moe and ("mtp.layers.0.mlp.up_proj" in w) == (not moe)
        if moe:
            assert torch.equal(w["mtp.layers.0.moe.down_proj"][3], stored["mtp.layers.0.mlp.experts.3.down_proj.weight"])


def test_hf_fused_expert_tensors_load_like_per_expert_ones(checkpoints, tmp_path):
    ck = checkpoints["Qwen3_5MoeForCausalLM"]
    _, per_expert = load_pretrained(ck.path, **ENGINE_ARGS)
    fused_dir = tmp_path / "fused"
    fused_dir.mkdir()
    for f in ck.path.iterdir():
        (fused_dir / f.name).write_bytes(f.read_bytes())

    def fuse(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {k: v for k, v in tensors.items() if ".experts." not in k or k.startswith("mtp.")}
        for i in range(4):
            p = f"model.layers.{i}.mlp.experts"
            gate_up = [torch.cat([tensors[f"{p}.{e}.gate_proj.weight"], tensors[f"{p}.{e}.up_proj.weight"]])
                       for e in range(4)]
            out[f"{p}.gate_up_proj"] = torch.stack(gate_up)
            out[f"{p}.down_proj"] = torch.stack([tensors[f"{p}.{e}.down_proj.weight"] for e in range(4)])
        return out

    rewrite_tensors(fused_dir, fuse)
    _, fused = load_pretrained(fused_dir, **ENGINE_ARGS)
    assert sorted(fused) == sorted(per_expert)
    assert all(torch.equal(fused[n], per_expert[n]) for n in fused)


def test_hf_composite_qwen3_5_layout_loads_the_text_model(checkpoints, tmp_path):
    """A Qwen3_5ForConditionalGeneration-style directory: nested text_config, `model.language_model.`
    tensor names and vision tensors (skipped) give the text model's logits."""
    ck = checkpoints["Qwen3_5ForCausalLM"]
    text = json.loads((ck.path / "config.json").read_text())
    outer = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text,
             "vision_config": {"depth": 1}, "tie_word_embeddings": False}
    composite = tmp_path / "composite"
    composite.mkdir()
    (composite / "config.json").write_text(json.dumps(outer))
    (composite / "generation_config.json").write_bytes((ck.path / "generation_config.json").read_bytes())
    tensors = load_file(str(ck.path / "model.safetensors"))
    renamed = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in tensors.items()}
    renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    save_file(renamed, str(composite / "model.safetensors"), metadata={"format": "pt"})
    engine = HybridEngine.from_pretrained(composite, **ENGINE_ARGS)
    assert engine.cfg.architecture == "Qwen3_5ForConditionalGeneration" and engine.cfg.mtp_layers == 1
    prompt, _, ref = _greedy(ck, seed=1)
    engine.alloc(0)
    assert _maxdiff(engine.prefill(0, prompt), ref[PROMPT_LEN - 1]) <= ATOL


def test_hf_eos_ids_and_tied_embeddings(checkpoints):
    cfg, w = load_pretrained(checkpoints["Qwen3ForCausalLM"].path, **ENGINE_ARGS)
    assert (cfg.eos_id, cfg.eos_ids, cfg.stop_ids) == (159, (158,), (159, 158))
    assert cfg.tie_word_embeddings and w["lm_head"] is w["embed"]
    assert (cfg.max_seq_len, cfg.block_size, cfg.num_blocks) == (64, 4, 4 * 16)
    cfg2, w2 = load_pretrained(checkpoints["Qwen3NextForCausalLM"].path, **ENGINE_ARGS)
    assert not cfg2.tie_word_embeddings and w2["lm_head"] is not w2["embed"]
    assert (cfg2.rotary_dim, cfg2.gdn_v_heads, cfg2.norm_topk_prob) == (4, 4, False)


def test_hf_gdn_grouped_value_heads_match_fla_reference():
    """gdn_layer with 2 key heads serving 4 value heads, from a non-zero state, against an independent
    layer built on F.conv1d and flash-linear-attention's naive recurrent gated delta rule."""
    fla_naive = pytest.importorskip("fla.ops.gated_delta_rule.naive")
    cfg = ModelConfig(gdn_num_heads=2, gdn_num_v_heads=4, mtp=False, dflash_gamma=0, seed=7)
    w = init_weights(cfg)
    prefix = f"layers.{cfg.gdn_layers[0]}.gdn"
    gen = torch.Generator().manual_seed(11)
    b, t, hk, hv, dk, dv, width = 2, 9, 2, 4, cfg.gdn_key_dim, cfg.gdn_value_dim, cfg.conv_width
    x = torch.randn(b, t, cfg.hidden_size, generator=gen)
    state0 = 0.2 * torch.randn(b, hv, dk, dv, generator=gen)
    conv0 = torch.randn(b, cfg.gdn_conv_channels, width - 1, generator=gen)
    out, rows = gdn_layer(x, w, prefix, cfg, state0, conv0)

    def p(name: str) -> torch.Tensor:
        return w[f"{prefix}.{name}"]

    qkv = torch.cat([x @ p("q_proj").T, x @ p("k_proj").T, x @ p("v_proj").T], -1).transpose(1, 2)
    conv_in = torch.cat([conv0, qkv], 2)
    conv = F.conv1d(conv_in, p("conv")[:, None, :], groups=cfg.gdn_conv_channels)
    q, k, v = F.silu(conv).transpose(1, 2).split([hk * dk, hk * dk, hv * dv], -1)
    q = F.normalize(q.reshape(b, t, hk, dk), dim=-1, eps=0).repeat_interleave(2, 2)
    k = F.normalize(k.reshape(b, t, hk, dk), dim=-1, eps=0).repeat_interleave(2, 2)
    g = -p("A_log").exp() * F.softplus(x @ p("a_proj").T + p("dt_bias"))
    beta = torch.sigmoid(x @ p("b_proj").T)
    o, final = fla_naive.naive_recurrent_gated_delta_rule(q, k, v.reshape(b, t, hv, dv), beta, g,
                                                          scale=dk ** -0.5, initial_state=state0,
                                                          output_final_state=True)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * p("o_norm")
    o = o * F.silu(x @ p("g_proj").T).view(b, t, hv, dv)
    ref = o.reshape(b, t, hv * dv) @ p("o_proj").T
    assert _maxdiff(out, ref) <= 1e-5
    assert _maxdiff(rows.states[:, -1], final) <= 1e-5
    assert torch.equal(rows.row(1, t - 1)[1], conv_in[1, :, -(width - 1):])  # conv state: last W-1 inputs


def test_hf_sharded_fixture_has_an_index(checkpoints):
    """The Qwen3-Next fixture really is sharded with an index, so the parity tests cover that path."""
    path: Path = checkpoints["Qwen3NextForCausalLM"].path
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3
