"""Qwen3-Next-80B-A3B's published configuration builds, and forwards run on the `meta` device.

The config.json is written from transformers' own Qwen3NextConfig with the published dimensions
(hidden 2048, 48 layers of which every 4th is full attention, 16 query / 2 KV heads of 256, GDN with
16 key / 32 value heads of 128, 512 experts top-10 of 512 with a 512 shared expert, vocab 151936),
turned into the project's ModelConfig by the loader's own path (hf_checkpoint.pretrained_config),
and every tensor of param_shapes is allocated on `meta` (shapes only: no memory). A HybridEngine on
meta then runs a batched prefill of two sequences and a decode step through its normal
batch-building path (prepare / _row_batch / send_ints): every op of the forward must work without
reading data back (which a meta tensor cannot do), and the logits have the right shapes.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="the published config is built with transformers")

from safetensors.torch import save_file  # noqa: E402

from fxsched.runtime.torch_model import HybridEngine  # noqa: E402
from fxsched.runtime.torch_model.hf_checkpoint import pretrained_config  # noqa: E402
from fxsched.runtime.torch_model.weights import param_dtype, param_shapes  # noqa: E402

PUBLISHED = {  # Qwen/Qwen3-Next-80B-A3B-Instruct config.json
    "hidden_size": 2048, "num_hidden_layers": 48, "full_attention_interval": 4,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "linear_num_value_heads": 32, "linear_num_key_heads": 16, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "norm_topk_prob": True, "intermediate_size": 5632, "vocab_size": 151936,
    "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "bos_token_id": 151643, "eos_token_id": 151645,
}


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_next_80b")
    hf = transformers.Qwen3NextConfig(**PUBLISHED)
    raw = {**hf.to_dict(), "architectures": ["Qwen3NextForCausalLM"], "dtype": "bfloat16"}
    (root / "config.json").write_text(json.dumps(raw))
    save_file({"placeholder": torch.zeros(1)}, str(root / "model.safetensors"))  # the loader wants a shard
    return pretrained_config(root, max_seq_len=64, max_slots=2, block_size=16)


def test_published_config_becomes_the_model_config(config):
    assert config.architecture == "Qwen3NextForCausalLM" and config.dtype == "bfloat16"
    assert config.num_layers == 48 and config.hidden_size == 2048 and config.vocab_size == 151936
    assert config.layer_pattern == ("gdn", "gdn", "gdn", "attn") * 12
    assert (config.num_attention_heads, config.num_kv_heads, config.head_dim) == (16, 2, 256)
    assert (config.gdn_num_heads, config.gdn_num_v_heads, config.gdn_key_dim, config.gdn_value_dim) == (16, 32, 128, 128)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
            config.shared_expert_intermediate_size) == (512, 10, 512, 512)
    assert all(config.mlp_kind(i) == "moe" for i in range(48))
    shapes = param_shapes(config)
    total = sum(torch.Size(s).numel() for s in shapes.values())
    assert 79e9 < total < 82e9, total  # "80B": every expert counted
    assert shapes["layers.0.moe.gate_proj"] == (512, 512, 2048)


def test_prefill_and_decode_run_on_meta(config):
    weights = {name: torch.empty(shape, dtype=param_dtype(name, config), device="meta")
               for name, shape in param_shapes(config).items()}
    engine = HybridEngine(config, weights, device="meta")
    for slot in (0, 1):
        engine.alloc(slot)
    logits = engine.commit_forward([0, 1], [[11, 12, 13, 14, 15], [21, 22, 23]])  # ragged: 5 and 3 rows
    assert logits.device.type == "meta" and tuple(logits.shape) == (2, 151936)
    logits = engine.decode_batch([0, 1], [16, 24])
    assert logits.device.type == "meta" and tuple(logits.shape) == (2, 151936)
    assert [engine.seq_len(s) for s in (0, 1)] == [6, 4]
