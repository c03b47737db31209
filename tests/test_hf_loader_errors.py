"""load_pretrained rejects every broken checkpoint directory with ONE-line ModelDirError naming the file.

Each case copies a tiny, valid Qwen3.5 checkpoint (tests/support/hf_tiny.py), breaks one thing and
checks the error names the right file (and tensor) and says what is wrong.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from support.hf_tiny import build, rewrite_tensors

from fxsched.runtime.torch_model import ConfigError, ModelDirError, load_pretrained

ARGS: dict[str, Any] = {"max_seq_len": 32, "max_slots": 2, "block_size": 4}
Q_PROJ = "model.layers.3.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hf_errors") / "qwen3_5"
    build("Qwen3_5ForCausalLM", path)
    return path


@pytest.fixture
def ckpt(pristine: Path, tmp_path: Path) -> Path:
    path = tmp_path / "model"
    shutil.copytree(pristine, path)
    return path


def _error(path: Path) -> str:
    with pytest.raises(ModelDirError) as info:
        load_pretrained(path, **ARGS)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def _edit_config(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))


def test_the_pristine_copy_loads(ckpt):
    cfg, weights = load_pretrained(ckpt, **ARGS)
    assert cfg.architecture == "Qwen3_5ForCausalLM" and "layers.3.attn.gate_proj" in weights


def test_missing_directory(tmp_path):
    assert _error(tmp_path / "nope") == f"{tmp_path / 'nope'}: no such model directory"


def test_directory_is_a_file(ckpt):
    message = _error(ckpt / "config.json")
    assert message.startswith(f"{ckpt / 'config.json'}: not a directory")


def test_missing_config_json(ckpt):
    (ckpt / "config.json").unlink()
    assert _error(ckpt).startswith(f"{ckpt / 'config.json'}: missing")


def test_invalid_config_json(ckpt):
    (ckpt / "config.json").write_text('{"architectures": ["Qwen3_5ForCausalLM"],\n  "hidden_size": 64,,}')
    message = _error(ckpt)
    assert message.startswith(f"{ckpt / 'config.json'}: not valid JSON") and "line 2" in message


def test_unknown_architecture(ckpt):
    _edit_config(ckpt, lambda c: c.update(architectures=["LlamaForCausalLM"]))
    message = _error(ckpt)
    assert message.startswith(f"{ckpt / 'config.json'}: unknown architecture 'LlamaForCausalLM'")
    assert "Qwen3NextForCausalLM" in message and "Qwen3ForCausalLM" in message  # lists the supported ones


def test_attention_bias_is_refused(ckpt):
    _edit_config(ckpt, lambda c: c.update(attention_bias=True))
    assert _error(ckpt) == f"{ckpt / 'config.json'}: attention_bias: true is not supported " \
                           "(attention projections have no bias)"


def test_missing_config_field(ckpt):
    _edit_config(ckpt, lambda c: c.pop("linear_num_value_heads"))
    assert _error(ckpt) == f"{ckpt / 'config.json'}: missing field 'linear_num_value_heads'"


def test_unsupported_rope_type(ckpt):
    _edit_config(ckpt, lambda c: c["rope_parameters"].update(rope_type="yarn"))
    assert "rope_type 'yarn' is not supported" in _error(ckpt)


def test_missing_tensor(ckpt):
    rewrite_tensors(ckpt, lambda t: {k: v for k, v in t.items() if k != Q_PROJ})
    assert _error(ckpt) == f"{ckpt / 'model.safetensors'}: missing tensor '{Q_PROJ}'"


def test_unexpected_tensor(ckpt):
    rewrite_tensors(ckpt, lambda t: {**t, "model.layers.0.mlp.extra.weight": torch.zeros(2)})
    message = _error(ckpt)
    assert message.startswith(f"{ckpt / 'model.safetensors'}: unexpected tensor 'model.layers.0.mlp.extra.weight'")


def test_misshaped_tensor(ckpt):
    rewrite_tensors(ckpt, lambda t: {**t, Q_PROJ: t[Q_PROJ][:-1]})
    assert _error(ckpt) == f"{ckpt / 'model.safetensors'}: tensor '{Q_PROJ}' has shape [127, 64], expected [128, 64]"


def test_incomplete_mtp_layer_is_a_missing_tensor(ckpt):
    name = "mtp.layers.0.mlp.down_proj.weight"
    rewrite_tensors(ckpt, lambda t: {k: v for k, v in t.items() if k != name})
    assert _error(ckpt) == f"{ckpt / 'model.safetensors'}: missing tensor '{name}'"


def test_unreadable_shard(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\x00\x01 this is not a safetensors file")
    assert _error(ckpt).startswith(f"{ckpt / 'model.safetensors'}: unreadable safetensors shard")


def test_no_weight_files(ckpt):
    (ckpt / "model.safetensors").unlink()
    assert _error(ckpt) == f"{ckpt}: no *.safetensors weight files"


def test_missing_shard_listed_in_index(ckpt):
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                                            "lm_head.weight": "model.safetensors"}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    assert _error(ckpt) == (f"{ckpt / 'model-00001-of-00002.safetensors'}: missing shard "
                            "(listed in model.safetensors.index.json)")


def test_no_eos_token(ckpt):
    (ckpt / "generation_config.json").unlink()
    assert _error(ckpt) == f"{ckpt / 'config.json'}: no eos_token_id in generation_config.json or config.json"


def test_eos_falls_back_to_config_json(ckpt):
    (ckpt / "generation_config.json").unlink()
    _edit_config(ckpt, lambda c: c.update(eos_token_id=7))
    cfg, _ = load_pretrained(ckpt, **ARGS)
    assert (cfg.eos_id, cfg.eos_ids) == (7, ())


def test_bad_runtime_argument_is_a_config_error_not_a_file_error(ckpt):
    with pytest.raises(ConfigError, match="field 'block_size': expected a positive integer, got 0"):
        load_pretrained(ckpt, max_seq_len=32, block_size=0)
    with pytest.raises(ConfigError, match="field 'dtype'"):
        load_pretrained(ckpt, dtype="float64")
