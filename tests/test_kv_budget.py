"""The caches sized from a memory budget (`--kv-cache-memory`, hf_checkpoint.cache_sizes).

A block holds keys and values of block_size positions in every attention layer, so it takes
attention layers * 2 * block_size * kv heads * head dim * bytes per element; a slot of a model with
GDN layers holds one state per GDN layer, value heads * key dim * value dim + conv channels *
(kernel - 1) elements. The budget holds the slots' states first and blocks with the rest; slots are
lowered to what gives each a state and one full-length sequence. The expected counts below are
worked out from the checkpoint's config.json, not from the loader.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.hf_tiny import build

from fxsched.runtime.torch_model import ConfigError, HybridEngine, load_pretrained
from fxsched.runtime.torch_model import hf_checkpoint

ARGS = {"max_seq_len": 32, "max_slots": 2, "block_size": 4}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("kv_budget") / "qwen3_5"
    build("Qwen3_5ForCausalLM", path)
    return path


def _block_bytes(path: Path, dtype_bytes: int = 4) -> int:
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    attn_layers = sum(1 for kind in text["layer_types"] if kind == "full_attention")
    return attn_layers * 2 * ARGS["block_size"] * text["num_key_value_heads"] * text["head_dim"] * dtype_bytes


def _state_bytes(path: Path, dtype_bytes: int = 4) -> int:
    text = json.loads((path / "config.json").read_text())
    text = text.get("text_config", text)
    layers = sum(1 for kind in text["layer_types"] if kind == "linear_attention")
    hk, hv = text["linear_num_key_heads"], text["linear_num_value_heads"]
    dk, dv = text["linear_key_head_dim"], text["linear_value_head_dim"]
    conv = (2 * hk * dk + hv * dv) * (text["linear_conv_kernel_dim"] - 1)
    return layers * (hv * dk * dv + conv) * dtype_bytes


def test_budget_sets_the_number_of_blocks_after_the_slots_states(ckpt):
    per_block, state = _block_bytes(ckpt), _state_bytes(ckpt)
    assert state > 0  # the Qwen3.5 checkpoint has GDN layers
    states = ARGS["max_slots"] * state
    cfg, _ = load_pretrained(ckpt, dtype="float32", kv_cache_memory=states + per_block * 37 + per_block // 2, **ARGS)
    assert (cfg.max_slots, cfg.num_blocks) == (ARGS["max_slots"], 37)
    engine = HybridEngine.from_pretrained(ckpt, dtype="float32", kv_cache_memory=states + per_block * 20, **ARGS)
    # the KV tensors hold one block more than the pool: the scratch block of static forwards' padding
    assert engine.num_free_blocks() == 20 and engine.kv.k[0].shape[0] == 20 + 1
    assert engine.gdn.recurrent[0].shape[0] == ARGS["max_slots"]
    half, _ = load_pretrained(ckpt, dtype="bfloat16", kv_cache_memory=states + per_block * 20, **ARGS)
    assert half.num_blocks == 40 + states // per_block  # bf16 blocks and states are half the size


def test_slots_are_lowered_to_what_the_budget_holds(ckpt):
    per_block, state = _block_bytes(ckpt), _state_bytes(ckpt)
    one_sequence = ARGS["max_seq_len"] // ARGS["block_size"]
    args = {**ARGS, "max_slots": 8}
    budget = 3 * (state + one_sequence * per_block) + per_block * 5  # three slots, not four
    cfg, _ = load_pretrained(ckpt, dtype="float32", kv_cache_memory=budget, **args)
    assert (cfg.max_slots, cfg.num_blocks) == (3, 3 * one_sequence + 5)
    engine = HybridEngine(cfg, load_pretrained(ckpt, dtype="float32", kv_cache_memory=budget, **args)[1])
    assert engine.free_slots() == [0, 1, 2] and engine.gdn.recurrent[0].shape[0] == 3


def test_budget_below_one_sequence_is_refused(ckpt):
    per_block, state = _block_bytes(ckpt), _state_bytes(ckpt)
    one_sequence = ARGS["max_seq_len"] // ARGS["block_size"]
    with pytest.raises(ConfigError, match="kv_cache_memory.*GDN state: one sequence of max_seq_len 32"):
        load_pretrained(ckpt, dtype="float32", kv_cache_memory=state + per_block * one_sequence - 1, **ARGS)
    with pytest.raises(ConfigError, match="kv_cache_memory"):
        load_pretrained(ckpt, kv_cache_memory=1024, num_blocks=8, **ARGS)


def test_default_reserves_every_slot_within_the_default_budget(ckpt, monkeypatch):
    per_block = _block_bytes(ckpt)
    cfg, _ = load_pretrained(ckpt, dtype="float32", **ARGS)
    assert cfg.num_blocks == ARGS["max_slots"] * ARGS["max_seq_len"] // ARGS["block_size"]
    monkeypatch.setattr(hf_checkpoint, "DEFAULT_KV_CACHE_MEMORY", per_block * 10)
    capped, _ = load_pretrained(ckpt, dtype="float32", **ARGS)
    assert capped.num_blocks == 10


@pytest.mark.parametrize("value,message", [
    ("lots", "--kv-cache-memory lots: not a size"),
    ("1KiB", "--kv-cache-memory 1024: --model"),
])
def test_cli_refuses_a_bad_budget_in_one_line(ckpt, value, message):
    out = subprocess.run([sys.executable, "-m", "fxsched.runtime.cli", "generate", "--model", str(ckpt),
                          "--prompt-ids", "1 2 3", "--max-tokens", "2", "--kv-cache-memory", value, "--no-progress"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr


def test_an_engine_without_a_drafter_keeps_no_hidden_history(tmp_path):
    """Hidden rows are kept only for drafters that read them; a model without one (Qwen3 dense here)
    spills, restores and reuses cached prefixes without them, and decodes as an unbroken run."""
    path = tmp_path / "qwen3"
    build("Qwen3ForCausalLM", path)
    engine = HybridEngine.from_pretrained(path, dtype="float32", **ARGS)
    assert not engine.keeps_hidden and engine.hidden_history.shape[1] == 0
    reference = HybridEngine.from_pretrained(path, dtype="float32", **ARGS)
    prompt = [3, 9, 4, 1, 7, 2, 8, 6, 5]
    for e in (engine, reference):
        e.alloc(0)
        e.prefill(0, prompt)
        e.decode_batch([0], [11])
    spill = tmp_path / "seq.spill"
    engine.save_sequence_state(0, spill)
    engine.free(0)
    engine.restore_sequence_state(1, spill)
    got = engine.decode_batch([1], [12])
    want = reference.decode_batch([0], [12])
    assert torch.allclose(got, want, atol=1e-5)
    engine.cache_sequence(1)
    engine.alloc(0)
    engine.prefill(0, prompt + [11, 12])
    assert engine.cached_prompt_tokens(0) == 8  # two blocks of 4 reused without hidden rows
