"""Config loading/validation, deterministic seeded init and the safetensors round trip."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from safetensors.torch import load_file, save_file  # noqa: E402
from fxsched.runtime.torch_model.config import ModelConfig, default_config, load_config  # noqa: E402
from fxsched.runtime.torch_model.engine import HybridEngine  # noqa: E402
from fxsched.runtime.torch_model.errors import ConfigError, WeightsError  # noqa: E402
from fxsched.runtime.bench.prompts import random_prompts  # noqa: E402
from fxsched.runtime.torch_model.weights import init_weights, load_weights, param_shapes, save_weights  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_weights_default_toml_matches_dataclass_defaults():
    assert default_config() == ModelConfig()
    cfg = default_config()
    assert cfg.layer_pattern == ("gdn", "attn", "gdn", "attn") and cfg.dflash_gamma == 5


def test_weights_seeded_init_is_deterministic_and_leaves_global_rng_alone():
    cfg = default_config()
    state = torch.get_rng_state()
    a, b = init_weights(cfg), init_weights(cfg)
    assert torch.equal(state, torch.get_rng_state())
    assert a.keys() == b.keys() == param_shapes(cfg).keys()
    assert all(torch.equal(a[n], b[n]) for n in a)
    c = init_weights(dataclasses.replace(cfg, seed=1))
    assert not torch.equal(a["embed"], c["embed"])


def test_weights_random_model_is_interesting():
    engine = HybridEngine(default_config())
    outs = [engine.greedy_generate(p, 16) for p in random_prompts(41, 4, 64, 4, 12)]
    assert all(len(set(out)) >= 4 for out in outs if len(out) == 16)
    assert len({tuple(o) for o in outs}) == 4


def test_weights_safetensors_round_trip(tmp_path):
    cfg = dataclasses.replace(default_config(), seed=5)
    weights = init_weights(cfg)
    path = tmp_path / "model.safetensors"
    save_weights(path, weights, cfg)
    loaded, loaded_cfg = load_weights(path)
    assert loaded_cfg == cfg
    assert all(torch.equal(weights[n], loaded[n]) for n in weights)
    prompt = [1, 2, 3, 4, 5]
    assert HybridEngine.from_weights_file(path).greedy_generate(prompt, 8) == \
        HybridEngine(cfg).greedy_generate(prompt, 8)
    with pytest.raises(WeightsError, match="differs from the given config in fields \\['seed'\\]"):
        load_weights(path, default_config())


def test_weights_missing_and_misshaped_tensors(tmp_path):
    cfg = default_config()
    weights = init_weights(cfg)
    path = tmp_path / "w.safetensors"
    save_weights(path, weights, cfg)
    tensors = load_file(str(path))
    del tensors["layers.1.attn.k_proj"]
    save_file(tensors, str(path))
    with pytest.raises(WeightsError, match=r"w.safetensors: missing tensors \['layers.1.attn.k_proj'\]"):
        load_weights(path, cfg)
    tensors["layers.1.attn.k_proj"] = torch.zeros(3, 3)
    save_file(tensors, str(path))
    with pytest.raises(WeightsError, match=r"'layers.1.attn.k_proj' has shape \[3, 3\], expected \[32, 64\]"):
        load_weights(path, cfg)
    with pytest.raises(WeightsError, match="no 'fxsched_model_config' metadata"):
        load_weights(path)
    with pytest.raises(WeightsError, match="not found"):
        load_weights(tmp_path / "missing.safetensors", cfg)
    (tmp_path / "junk.safetensors").write_bytes(b"not safetensors at all")
    with pytest.raises(WeightsError, match="not a readable safetensors file"):
        load_weights(tmp_path / "junk.safetensors", cfg)


@pytest.mark.parametrize("line,field,expected", [
    ("hiden_size = 64", "hiden_size", "a known field name"),
    ("hidden_size = \"64\"", "hidden_size", "an integer"),
    ("mtp = 1", "mtp", "a boolean"),
    ("num_blocks = 0", "num_blocks", "a positive integer"),
    ("eos_id = 64", "eos_id", "a token id in \\[0, vocab_size=64\\)"),
    ("layer_pattern = [\"gdn\", \"mamba\", \"gdn\", \"attn\"]", "layer_pattern", "only layer kinds"),
    ("num_layers = 3\nlayer_pattern = [\"gdn\", \"attn\"]", "layer_pattern", "a list of num_layers=3 layer kinds"),
    ("num_kv_heads = 3", "num_kv_heads", "a divisor of num_attention_heads=4"),
    ("conv_width = 1", "conv_width", "an integer >= 2"),
])
def test_weights_bad_config_field_names_file_and_field(tmp_path, line, field, expected):
    path = tmp_path / "bad.toml"
    path.write_text(line + "\n")
    with pytest.raises(ConfigError, match=f"bad.toml: field '{field}': expected {expected}") as info:
        load_config(path)
    assert info.value.field == field and info.value.source == str(path)


def test_weights_config_toml_parsing(tmp_path):
    path = tmp_path / "ok.toml"
    path.write_text("num_layers = 6\nseed = 3\n")
    cfg = load_config(path)
    assert cfg.layer_pattern == ("gdn", "attn") * 3 and cfg.seed == 3
    path.write_text("[model]\nhidden_size = 32\n")
    assert load_config(path).hidden_size == 32
    path.write_text("hidden_size = = 3\n")
    with pytest.raises(ConfigError, match="ok.toml: field '<file>': expected valid TOML"):
        load_config(path)
    with pytest.raises(ConfigError, match="missing.toml: field '<file>': expected a readable TOML file"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="field 'seed'"):
        dataclasses.replace(default_config(), seed=-1)
