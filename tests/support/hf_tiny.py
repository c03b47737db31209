"""Tiny, seeded Hugging Face checkpoints of the four supported architectures, written with transformers.

Each builder creates the transformers model from its own config class (hidden 64, 4 layers, vocab
160), re-draws every parameter from a seeded generator at scales that give well-separated logits
(transformers' init -- std 0.02, zero norms -- would make greedy decoding a coin toss between
near-ties), saves it with `save_pretrained`, and writes generation_config.json with two EOS ids.
The hybrid families also get random `mtp.*` tensors under the names real checkpoints use (which
transformers itself drops), appended to the saved safetensors -- as an extra shard listed in the
index for the sharded Qwen3-Next checkpoint -- so the loader is exercised on them.

Layouts exercised: Qwen3.5 dense (split GDN projections, grouped value heads, gated attention,
partial RoPE); Qwen3.5-MoE (all layers MoE + shared expert, per-expert tensors as save_pretrained
writes them); Qwen3-Next (fused, per-key-head interleaved in_proj_qkvz / in_proj_ba, 3:1
linear/full attention, MoE with shared expert, layer 1 dense via mlp_only_layers, norm_topk_prob
false, sharded with an index); Qwen3 dense (plain norms, q/k norm, no gate, tied embeddings).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from safetensors.torch import load_file, save_file

VOCAB = 160
HIDDEN = 64
LAYERS = 4
EOS_IDS = [VOCAB - 1, VOCAB - 2]
ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM", "Qwen3ForCausalLM")
HYBRID = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM")

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6, "max_position_embeddings": 256,
}
_GDN: dict[str, Any] = {
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
}
_MOE: dict[str, Any] = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                        "shared_expert_intermediate_size": 48}


@dataclass
class TinyCheckpoint:
    """A saved tiny checkpoint and the transformers model it came from (fp32, eval mode)."""

    architecture: str
    path: Path
    model: Any  # the transformers *ForCausalLM (kept so tests need not reload it)


def _config(architecture: str) -> Any:
    import transformers

    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if architecture == "Qwen3_5ForCausalLM":
        return transformers.Qwen3_5TextConfig(**_COMMON, **_GDN, intermediate_size=128,
                                              rope_parameters={**rope, "partial_rotary_factor": 0.25,
                                                               "mrope_interleaved": True, "mrope_section": [1, 1, 0]})
    if architecture == "Qwen3_5MoeForCausalLM":
        return transformers.Qwen3_5MoeTextConfig(**_COMMON, **_GDN, **_MOE,
                                                 rope_parameters={**rope, "partial_rotary_factor": 0.5})
    if architecture == "Qwen3NextForCausalLM":
        return transformers.Qwen3NextConfig(**_COMMON, **_GDN, **_MOE, intermediate_size=96, mlp_only_layers=[1],
                                            decoder_sparse_step=1, norm_topk_prob=False,
                                            rope_parameters={**rope, "partial_rotary_factor": 0.25})
    if architecture == "Qwen3ForCausalLM":
        return transformers.Qwen3Config(**_COMMON, intermediate_size=128, tie_word_embeddings=True,
                                        rope_parameters=rope)
    raise ValueError(f"no tiny builder for {architecture}")


def _redraw(model: torch.nn.Module, gen: torch.Generator, zero_centred: bool, residual_scale: float,
            embed_std: float) -> None:
    """Seeded parameters at scales giving varied, well-separated greedy tokens; the residual branches'
    output projections get an extra `residual_scale` (small enough that fp32 rounding noise is not
    amplified layer after layer, large enough that a tied model does not just repeat its input)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1] if not name.endswith(".weight") else name.rsplit(".", 2)[-2]
            if p.dim() == 1 and ("norm" in name):
                centre = 0.0 if zero_centred and not name.endswith("linear_attn.norm.weight") else 1.0
                p.copy_(centre + 0.2 * torch.randn(p.shape, generator=gen))
            elif leaf == "A_log":
                p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen).log())
            elif leaf == "dt_bias":
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif leaf == "embed_tokens":
                p.copy_(torch.randn(p.shape, generator=gen) * embed_std)
            elif leaf == "lm_head":
                p.copy_(torch.randn(p.shape, generator=gen) * (4.0 / math.sqrt(p.shape[-1])))
            elif leaf == "conv1d":
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
            else:  # projections, experts [E, out, in], routers, gates: fan-in scaling
                scale = 1.0 / math.sqrt(p.shape[-1])
                if leaf in ("o_proj", "out_proj", "down_proj"):
                    scale *= residual_scale
                p.copy_(torch.randn(p.shape, generator=gen) * scale)


def _mtp_tensors(model: Any, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random published-structure MTP tensors (one layer: full attention + the model's MLP kind)."""
    cfg = model.config
    d = cfg.hidden_size

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen) / math.sqrt(shape[-1])

    hq, hkv, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    out = {"mtp.fc.weight": rand(d, 2 * d), "mtp.pre_fc_norm_embedding.weight": 0.1 * rand(d),
           "mtp.pre_fc_norm_hidden.weight": 0.1 * rand(d), "mtp.norm.weight": 0.1 * rand(d)}
    p = "mtp.layers.0"
    out.update({f"{p}.input_layernorm.weight": 0.1 * rand(d), f"{p}.post_attention_layernorm.weight": 0.1 * rand(d),
                f"{p}.self_attn.q_proj.weight": rand(hq * dh * 2, d), f"{p}.self_attn.k_proj.weight": rand(hkv * dh, d),
                f"{p}.self_attn.v_proj.weight": rand(hkv * dh, d), f"{p}.self_attn.o_proj.weight": rand(d, hq * dh),
                f"{p}.self_attn.q_norm.weight": 0.1 * rand(dh), f"{p}.self_attn.k_norm.weight": 0.1 * rand(dh)})
    experts = getattr(cfg, "num_experts", 0)
    if experts:  # MTP layer 0 is MoE in both MoE families (layer 0 is not in mlp_only_layers)
        i, s = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        out[f"{p}.mlp.gate.weight"] = rand(experts, d)
        for e in range(experts):
            out.update({f"{p}.mlp.experts.{e}.gate_proj.weight": rand(i, d),
                        f"{p}.mlp.experts.{e}.up_proj.weight": rand(i, d),
                        f"{p}.mlp.experts.{e}.down_proj.weight": rand(d, i)})
        out.update({f"{p}.mlp.shared_expert.gate_proj.weight": rand(s, d),
                    f"{p}.mlp.shared_expert.up_proj.weight": rand(s, d),
                    f"{p}.mlp.shared_expert.down_proj.weight": rand(d, s),
                    f"{p}.mlp.shared_expert_gate.weight": rand(1, d)})
    else:
        i = cfg.intermediate_size
        out.update({f"{p}.mlp.gate_proj.weight": rand(i, d), f"{p}.mlp.up_proj.weight": rand(i, d),
                    f"{p}.mlp.down_proj.weight": rand(d, i)})
    return out


def build(architecture: str, directory: Path, seed: int = 0) -> TinyCheckpoint:
    """Build, save and return the tiny checkpoint of `architecture` in `directory` (created)."""
    import transformers

    gen = torch.Generator().manual_seed(seed)
    model = getattr(transformers, architecture)(_config(architecture)).eval()
    # Tied embeddings (Qwen3 here): logits = embed . h, so an embedding that dominates the residual
    # stream makes the model echo its last token: smaller embeddings, full-strength branches.
    tied = architecture == "Qwen3ForCausalLM"
    _redraw(model, gen, zero_centred=architecture in HYBRID,
            residual_scale=1.0 if tied else 1.0 / math.sqrt(2.0 * LAYERS), embed_std=0.1 if tied else 1.0)
    directory.mkdir(parents=True, exist_ok=True)
    sharded = architecture == "Qwen3NextForCausalLM"
    model.save_pretrained(directory, max_shard_size="200KB" if sharded else "1GB")
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS_IDS, "do_sample": False}))
    if architecture in HYBRID:
        mtp = _mtp_tensors(model, gen)
        config = json.loads((directory / "config.json").read_text())
        config["mtp_num_hidden_layers" if "Qwen3_5" in architecture else "num_nextn_predict_layers"] = 1
        (directory / "config.json").write_text(json.dumps(config, indent=2))
        index_path = directory / "model.safetensors.index.json"
        if index_path.exists():
            save_file(mtp, str(directory / "model-mtp.safetensors"), metadata={"format": "pt"})
            index = json.loads(index_path.read_text())
            index["weight_map"].update({name: "model-mtp.safetensors" for name in mtp})
            index_path.write_text(json.dumps(index, indent=2))
        else:
            path = directory / "model.safetensors"
            save_file({**load_file(str(path)), **mtp}, str(path), metadata={"format": "pt"})
    return TinyCheckpoint(architecture, directory, model)


def rewrite_tensors(directory: Path, edit: Any) -> None:
    """Apply edit(tensors: dict) -> dict to the single-file checkpoint model.safetensors in place."""
    path = directory / "model.safetensors"
    save_file(edit(load_file(str(path))), str(path), metadata={"format": "pt"})


_GDN_MODULES = ("qwen3_5.modeling_qwen3_5", "qwen3_5_moe.modeling_qwen3_5_moe", "qwen3_next.modeling_qwen3_next")
_GDN_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
                  "causal_conv1d_fn", "causal_conv1d_update")


@contextlib.contextmanager
def transformers_torch_gdn() -> Iterator[None]:
    """Make transformers' GDN layers use their own pure-torch functions.

    With flash-linear-attention installed, transformers binds fla's Triton kernels at import time,
    and those cannot run on a CPU; the reference paths are the functions they wrap.
    """
    import importlib

    with pytest.MonkeyPatch.context() as patch:
        for module_name in _GDN_MODULES:
            module = importlib.import_module(f"transformers.models.{module_name}")
            for fn in _GDN_FUNCTIONS:
                patch.setattr(module, fn, inspect.unwrap(getattr(module, fn)))
        yield
