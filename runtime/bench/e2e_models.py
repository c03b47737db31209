"""Realistic-size random checkpoints for ``fxsched bench e2e``, built locally from config dimensions.

``LIKE`` names the shapes (``--like``):

* ``qwen3-0.6b``: Qwen3-0.6B's dimensions (hidden 1024, 28 layers, 16 q / 8 kv heads of 128,
  intermediate 3072, vocab 151936, tied embeddings);
* ``qwen3.5-hybrid``: a Qwen3.5 text model of similar size (hidden 1024, 24 layers, 3 GDN layers to
  1 gated full-attention layer, 16 GDN key and value heads of 128, 8 q / 2 kv heads of 256 with a
  quarter rotary, intermediate 3584, vocab 151936, tied) with one MTP layer (``mtp.*`` tensors, which
  transformers drops and fxsched and vLLM read);
* ``qwen3-next-moe``: Qwen3-Next-style (hidden 1024, 12 layers, 3:1 GDN / gated attention, 64
  experts, top-8, moe_intermediate 256, a shared expert of 512, vocab 151936).

Weights are transformers' own initialisation under ``torch.manual_seed(seed)``, in bfloat16, saved
with ``save_pretrained``; the default model's tokenizer files are copied next to them (its ids are
below every vocabulary here; the bench prompts are token ids anyway). A checkpoint is built once
under ``models_dir/<name>`` (``DONE`` marks a finished build) and re-used.

``decode_weight_bytes`` reads the safetensors headers only: the bytes of weights one decoded token
reads at batch 1 (the embedding row, not the table; the LM head whole, the tied table counted as it;
for a MoE model the routed experts scaled by top-k / experts; MTP tensors left out: plain decoding
does not run them).
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path
from typing import Any, Callable

import structlog

log = structlog.get_logger(__name__)

DONE = "DONE"
VOCAB = 151936
EOS_IDS = [151645, 151643]  # Qwen's <|im_end|>, <|endoftext|> (the bench ignores EOS; loaders want one)
_ROPE: dict[str, Any] = {"rope_type": "default", "rope_theta": 1_000_000.0}
_HYBRID_ROPE: dict[str, Any] = {**_ROPE, "partial_rotary_factor": 0.25, "mrope_interleaved": True, "mrope_section": [11, 11, 10]}
_GDN: dict[str, Any] = {"linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128}


def _qwen3_06b() -> Any:
    import transformers

    return transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                                    num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                                    tie_word_embeddings=True, max_position_embeddings=40960, rms_norm_eps=1e-6,
                                    rope_parameters=_ROPE, architectures=["Qwen3ForCausalLM"], eos_token_id=EOS_IDS)


def _layer_types(layers: int) -> list[str]:
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]


def _qwen35_hybrid() -> Any:
    import transformers

    return transformers.Qwen3_5TextConfig(vocab_size=VOCAB, hidden_size=1024, num_hidden_layers=24,
                                          num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                                          intermediate_size=3584, linear_num_key_heads=16, linear_num_value_heads=16,
                                          **_GDN, layer_types=_layer_types(24), tie_word_embeddings=True,
                                          max_position_embeddings=32768, rms_norm_eps=1e-6,
                                          rope_parameters=_HYBRID_ROPE, architectures=["Qwen3_5ForCausalLM"],
                                          eos_token_id=EOS_IDS)


def _qwen3_next_moe() -> Any:
    import transformers

    return transformers.Qwen3NextConfig(vocab_size=VOCAB, hidden_size=1024, num_hidden_layers=12,
                                        num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                                        intermediate_size=3072, linear_num_key_heads=8, linear_num_value_heads=16,
                                        **_GDN, layer_types=_layer_types(12), num_experts=64, num_experts_per_tok=8,
                                        moe_intermediate_size=256, shared_expert_intermediate_size=512,
                                        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                                        tie_word_embeddings=False, max_position_embeddings=32768, rms_norm_eps=1e-6,
                                        rope_parameters={**_ROPE, "partial_rotary_factor": 0.25},
                                        architectures=["Qwen3NextForCausalLM"], eos_token_id=EOS_IDS)


LIKE: dict[str, Callable[[], Any]] = {"qwen3-0.6b": _qwen3_06b, "qwen3.5-hybrid": _qwen35_hybrid,
                                      "qwen3-next-moe": _qwen3_next_moe}
MTP_LAYERS = {"qwen3.5-hybrid": 1}


def default_models_dir() -> Path:
    return Path.home() / ".cache" / "fxsched" / "e2e-models"


def ensure_model(name: str, models_dir: Path, seed: int = 0) -> Path:
    """The checkpoint directory of ``--like name`` under ``models_dir``, built first if missing."""
    if name not in LIKE:
        raise KeyError(name)
    path = models_dir / name
    if (path / DONE).exists():
        return path
    log.info("e2e_build_model", like=name, path=str(path))
    if path.exists():
        shutil.rmtree(path)
    build(LIKE[name](), path, seed, MTP_LAYERS.get(name, 0))
    (path / DONE).write_text("built\n")
    return path


def build(config: Any, path: Path, seed: int, mtp_layers: int = 0) -> None:
    """Random bf16 weights of ``config`` (transformers' initialisation, seeded) saved in ``path``,
    plus ``mtp_layers`` random MTP layers (Qwen3.5) and the default model's tokenizer."""
    import torch
    import transformers

    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    finally:
        torch.set_default_dtype(previous)
    model = model.to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS_IDS, "do_sample": False}))
    if mtp_layers:
        _add_mtp(model.config, path, mtp_layers)
    from fxsched.runtime.torch_model.default_model import default_model_dir

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir() / name, path / name)


def _add_mtp(cfg: Any, path: Path, layers: int) -> None:
    """Append random MTP tensors (the names Qwen3.5 checkpoints publish: fc over [embedding; hidden],
    two input norms, a final norm, a gated-attention decoder layer with a dense MLP) to the saved
    single-file checkpoint and declare them in config.json."""
    import torch
    from safetensors.torch import load_file, save_file

    d, i = cfg.hidden_size, cfg.intermediate_size
    hq, hkv, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(shape) * (0.02 if len(shape) > 1 else 1.0)).to(torch.bfloat16)

    def norm(n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.bfloat16)  # zero-centred norms: weight 1 + 0

    mtp = {"mtp.fc.weight": rand(d, 2 * d), "mtp.pre_fc_norm_embedding.weight": norm(d),
           "mtp.pre_fc_norm_hidden.weight": norm(d), "mtp.norm.weight": norm(d)}
    for layer in range(layers):
        p = f"mtp.layers.{layer}"
        mtp.update({f"{p}.input_layernorm.weight": norm(d), f"{p}.post_attention_layernorm.weight": norm(d),
                    f"{p}.self_attn.q_proj.weight": rand(2 * hq * dh, d), f"{p}.self_attn.k_proj.weight": rand(hkv * dh, d),
                    f"{p}.self_attn.v_proj.weight": rand(hkv * dh, d), f"{p}.self_attn.o_proj.weight": rand(d, hq * dh),
                    f"{p}.self_attn.q_norm.weight": norm(dh), f"{p}.self_attn.k_norm.weight": norm(dh),
                    f"{p}.mlp.gate_proj.weight": rand(i, d), f"{p}.mlp.up_proj.weight": rand(i, d),
                    f"{p}.mlp.down_proj.weight": rand(d, i)})
    file = path / "model.safetensors"
    save_file({**load_file(str(file)), **mtp}, str(file), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["mtp_num_hidden_layers"] = layers
    (path / "config.json").write_text(json.dumps(config, indent=2))


# --- random LoRA adapters (bench e2e --lora) -------------------------------------------------------------

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_adapters(model_dir: Path, out_dir: Path, count: int, rank: int, seed: int = 0) -> list[Path]:
    """``count`` random PEFT LoRA adapters of rank ``rank`` on every attention and MLP projection of
    the dense (Qwen3) checkpoint in ``model_dir`` (adapter_config.json + adapter_model.safetensors in
    bf16, as PEFT's ``save_pretrained`` writes them), under ``out_dir``; their directories. A and B
    are random at scales that keep the activations in range (B non-zero: the adapter moves the
    output)."""
    import torch
    from safetensors.torch import save_file

    text = json.loads((model_dir / "config.json").read_text())
    text = text.get("text_config", text)
    d, inter = int(text["hidden_size"]), int(text["intermediate_size"])
    hq, hkv = int(text["num_attention_heads"]), int(text["num_key_value_heads"])
    dh = int(text.get("head_dim") or d // hq)
    shapes = {"q_proj": (hq * dh, d), "k_proj": (hkv * dh, d), "v_proj": (hkv * dh, d), "o_proj": (d, hq * dh),
              "gate_proj": (inter, d), "up_proj": (inter, d), "down_proj": (d, inter)}
    gen = torch.Generator().manual_seed(seed)
    dirs = []
    for i in range(count):
        tensors = {}
        for layer in range(int(text["num_hidden_layers"])):
            for module, (out, inp) in shapes.items():
                part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                name = f"base_model.model.model.layers.{layer}.{part}.{module}"
                tensors[f"{name}.lora_A.weight"] = (torch.randn(rank, inp, generator=gen) / math.sqrt(inp)
                                                    ).to(torch.bfloat16)
                tensors[f"{name}.lora_B.weight"] = (torch.randn(out, rank, generator=gen) * 0.01).to(torch.bfloat16)
        folder = out_dir / f"adapter-{i}"
        folder.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
        (folder / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(LORA_TARGETS),
            "bias": "none", "base_model_name_or_path": str(model_dir), "task_type": "CAUSAL_LM"}))
        dirs.append(folder)
    return dirs


# --- what a decoded token reads ------------------------------------------------------------------------

_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BOOL": 1}


def tensor_sizes(model_dir: Path) -> dict[str, int]:
    """Bytes of every tensor of a safetensors checkpoint (one file or sharded), from the headers."""
    sizes: dict[str, int] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, info in header.items():
            if name != "__metadata__":
                sizes[name] = _DTYPE_BYTES.get(info["dtype"], 2) * math.prod(info["shape"])
    return sizes


def decode_weight_bytes(model_dir: Path) -> int:
    """Weight bytes one decoded token reads at batch 1 (see the module docstring)."""
    config = json.loads((model_dir / "config.json").read_text())
    config = config.get("text_config", config)
    vocab = int(config["vocab_size"])
    experts, top_k = int(config.get("num_experts") or 0), int(config.get("num_experts_per_tok") or 0)
    total = 0.0
    sizes = tensor_sizes(model_dir)
    for name, size in sizes.items():
        if name.startswith("mtp."):
            continue
        if "embed_tokens" in name:
            total += size / vocab  # one row of the table
            if config.get("tie_word_embeddings") and not any("lm_head" in n for n in sizes):
                total += size  # the tied table is read whole as the LM head
        elif ".mlp.experts." in name and experts:
            total += size * top_k / experts
        else:
            total += size
    return int(total)
