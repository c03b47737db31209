"""The embedded default model (specs/models/default/, built by runtime/torch_model/default_model.py).

References: transformers' own Qwen3_5ForCausalLM on the shipped directory (logits of one uncached
forward; 32 greedy tokens of ``generate``), with its pure-torch GDN functions (fla's Triton kernels
cannot run on a CPU); for the distillation forward, hf_drafters.PublishedMtp (the K/V-cached MTP
the engine drafts with) on the same weights. Rebuilding with distillation takes minutes, so the
build is checked without it: every file but the MTP tensors must equal the shipped ones byte for
byte (tokenizer, configs) or bit for bit (target tensors), and two such builds must be identical.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Iterator

import pytest
import torch
from safetensors.torch import load_file
from support.hf_tiny import transformers_torch_gdn
from support.toy_model import run_fxsched

from fxsched.runtime.generate import generate
from fxsched.runtime.text import load_tokenizer
from fxsched.runtime.torch_model import HybridEngine, load_pretrained
from fxsched.runtime.torch_model.default_model import (ADDED_TOKENS, EVAL_PROMPTS, FILES, REPETITIVE_PROMPTS,
                                                       TokenIds,
                                                       build_default_model, build_tokenizer, chain_data, corpus_text,
                                                       default_model_dir, main, model_config, mtp_chain_logits,
                                                       target_weights)
from fxsched.runtime.torch_model.hf_checkpoint import hf_tensors, save_pretrained_dir
from fxsched.runtime.torch_model.hf_drafters import PublishedMtp

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SHIPPED = default_model_dir()
PROMPT = "The lighthouse keeper climbed the stairs"
MAX_TOKENS = 32
MAX_BYTES = 2_100_000  # the shipped directory stays small (about 2 MB)
# Mean accepted length of --spec mtp over EVAL_PROMPTS x 64 tokens, batch 1, measured on the shipped
# model: 2.85 (up to 4 with three drafts); the MTP at its seeded init, before distillation, accepts
# nothing: 1.00. The figure is deterministic; the margin allows a refreshed build to differ a little.
MTP_MIN_MEAN_ACCEPTED = 2.5


@pytest.fixture(scope="module")
def hf_model() -> Iterator[Any]:
    transformers = pytest.importorskip("transformers")
    with transformers_torch_gdn():
        yield transformers.AutoModelForCausalLM.from_pretrained(str(SHIPPED)).eval()


@pytest.fixture(scope="module")
def ids() -> TokenIds:
    tok = load_tokenizer(SHIPPED)
    assert tok is not None
    return TokenIds(*[tok.encode(t)[0] for t in ADDED_TOKENS])


def test_shipped_dir_is_complete_small_and_loads_as_its_config(ids):
    sizes = {name: (SHIPPED / name).stat().st_size for name in FILES}
    assert sum(sizes.values()) <= MAX_BYTES, sizes
    cfg, weights = load_pretrained(SHIPPED, max_seq_len=256)
    want = model_config(ids, max_seq_len=256)
    differ = [f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(want, f.name)]
    assert differ == ["seed"]  # the loader does not know the build's seed
    assert cfg.architecture == "Qwen3_5ForCausalLM" and cfg.mtp_layers == 1
    assert cfg.layer_pattern == ("gdn", "gdn", "gdn", "attn") * 2
    tok = load_tokenizer(SHIPPED)
    assert tok is not None and set(tok.eos_ids) == {ids.im_end, ids.endoftext}
    assert tok.decode(tok.encode("héllo, wörld 🙂")) == "héllo, wörld 🙂"  # byte-level: any text encodes
    assert "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert float(weights["lm_head"][list(ids.all)].abs().max()) == 0.0  # the random model never emits them


def test_logits_equal_transformers(hf_model):
    tok = load_tokenizer(SHIPPED)
    assert tok is not None
    tokens = tok.encode(PROMPT)
    with torch.no_grad():
        want = hf_model(torch.tensor([tokens])).logits[0]
    engine = HybridEngine.from_pretrained(SHIPPED, max_seq_len=128, max_slots=2, block_size=4)
    engine.alloc(0)
    engine.prefill(0, tokens)
    got = engine.model.lm_head(engine.hidden_history[0, :len(tokens)])
    assert (got - want).abs().max().item() < 1e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def _fxsched(*argv: str) -> int:
    return run_fxsched(*argv, toy=False)


@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_cli_default_model_tokens_equal_transformers_greedy(hf_model, capsys, spec):
    tok = load_tokenizer(SHIPPED)
    assert tok is not None
    tokens = tok.encode(PROMPT)
    with torch.no_grad():
        want = hf_model.generate(torch.tensor([tokens]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(tokens):]
    assert _fxsched("generate", "--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS), "--spec", spec, "--json") == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert records[0]["token_ids"] == want.tolist()
    assert records[0]["text"] == tok.decode(want.tolist())
    assert records[-1]["summary"] is True and records[-1]["spec"] == spec


def test_mtp_speculation_accepts_more_than_chance():
    tok = load_tokenizer(SHIPPED)
    assert tok is not None
    prompts = [tok.encode(p) for p in EVAL_PROMPTS]
    result = generate(HybridEngine.from_pretrained(SHIPPED, max_seq_len=256), prompts, 64, "mtp", 1, eos_ids=())
    mal = result.summary.mean_accepted_length
    assert mal is not None and mal > MTP_MIN_MEAN_ACCEPTED, mal


def test_training_forward_gives_the_published_mtp_drafts():
    """mtp_chain_logits (full sequence, differentiable) == PublishedMtp.propose_logits (K/V cache)
    at every anchor of a few slots, for the whole draft chain, on the shipped weights."""
    engine = HybridEngine.from_pretrained(SHIPPED, max_seq_len=128, max_slots=4, block_size=4)
    tok = load_tokenizer(SHIPPED)
    assert tok is not None
    prompts = [tok.encode(p) for p in EVAL_PROMPTS[:3]]
    for slot, prompt in enumerate(prompts):
        engine.alloc(slot)
        engine.prefill(slot, prompt)
    w, depth = engine.model.w, 3
    assert isinstance(engine.mtp, PublishedMtp)
    for n_cut in (1, 5, 9):  # anchor rows inside each prompt
        slots = list(range(len(prompts)))
        anchors = [p[n_cut] for p in prompts]
        committed = [p[:n_cut] for p in prompts]
        # propose over the first n_cut committed rows: the hidden rows past them are ignored
        cached = engine.mtp.propose_logits(slots, committed, engine.hidden_history, anchors, depth)
        drafts = cached.argmax(-1)  # [B, depth]
        for b, prompt in enumerate(prompts):
            n = n_cut
            nxt = torch.tensor([prompt[1:n] + [anchors[b]]])
            hidden = engine.hidden_history[b:b + 1, :n]
            chain = []
            for k in range(1, depth):
                c = torch.zeros(1, n, dtype=torch.long)
                c[0, n - 1] = drafts[b, k - 1]
                chain.append(c)
            with torch.no_grad():
                full = mtp_chain_logits(engine.cfg, w, nxt, hidden, chain)
            got = torch.stack([f[0, n - 1] for f in full])
            assert (got - cached[b]).abs().max().item() < 1e-4
            assert torch.equal(got.argmax(-1), drafts[b])


def test_chain_data_labels_only_greedy_continuations():
    # prompt 10 11 12, then the target continued greedily: greedy[j] = token after prefix 0..j
    tokens = torch.tensor([[10, 11, 12, 20, 21, 22, 23]])
    greedy = torch.tensor([[5, 6, 20, 21, 22, 23, 24]])  # greedy[2] = 20 = tokens[3], ...
    hidden = torch.arange(7, dtype=torch.float32)[None, :, None].expand(1, 7, 2)
    data = chain_data(tokens, hidden, greedy, depth=3)
    assert data.next_tokens.tolist() == [[11, 12, 20, 21, 22, 23]]
    assert data.labels[0].tolist() == [[6, 20, 21, 22, 23, 24]]
    assert data.valid[0].tolist() == [[True] * 6]
    # depth 2 at row i reads g_{i+1} and predicts g_{i+2}; valid only if t_{i+2} == g_{i+1}
    assert data.chain_tokens[0][0, :5].tolist() == [6, 20, 21, 22, 23]
    assert data.valid[1].tolist() == [[False, True, True, True, True, False]]
    assert data.valid[2].tolist() == [[False, True, True, True, False, False]]
    assert data.labels[2][0, 1:4].tolist() == [22, 23, 24]


def test_untrained_build_is_deterministic_and_equals_the_shipped_target(tmp_path, ids):
    first, second = tmp_path / "a", tmp_path / "b"
    build_default_model(first, distill=False)
    build_default_model(second, distill=False)
    for name in FILES:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (first / name).read_bytes() == (SHIPPED / name).read_bytes(), name
    built, shipped = load_file(str(first / "model.safetensors")), load_file(str(SHIPPED / "model.safetensors"))
    assert built.keys() == shipped.keys()
    for name in built:
        if not name.startswith("mtp."):
            assert torch.equal(built[name], shipped[name]), name
    assert any(not torch.equal(built[n], shipped[n]) for n in built if n.startswith("mtp."))  # trained


def test_export_round_trips_bit_for_bit(tmp_path):
    tok, ids = build_tokenizer(corpus_text())
    cfg = model_config(ids, max_seq_len=64)
    weights = target_weights(cfg, ids)
    save_pretrained_dir(cfg, weights, tmp_path)
    loaded_cfg, loaded = load_pretrained(tmp_path, max_seq_len=64)
    assert dataclasses.replace(loaded_cfg, seed=cfg.seed) == cfg
    assert loaded.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(loaded[name], tensor), name
    raw = hf_tensors(cfg, weights)
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in raw and "mtp.fc.weight" in raw
    assert torch.equal(raw["model.norm.weight"], weights["final_norm"] - 1)  # zero-centred on disk


def test_bench_generate_reports_accepted_length_and_acceptance_by_position_at_a_temperature(capsys):
    assert _fxsched("bench", "generate", "--batches", "2", "--max-tokens", "8", "--specs", "none,mtp",
                    "--prompts", "held-out", "--temperature", "0.8", "--json") == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["spec"] for r in rows] == ["none", "mtp"] and all(r["temperature"] == 0.8 for r in rows)
    none, mtp = rows
    assert none["acceptance_by_position"] is None and mtp["lossless"] is None  # sampled: no token equality
    positions = mtp["acceptance_by_position"]
    assert 1 <= len(positions) <= 3 and all(0 <= a <= 1 for a in positions)
    assert mtp["mean_accepted_length"] > 1  # the MTP head's drafts are kept at T = 0.8 too
    assert _fxsched("bench", "generate", "--temperature", "-1") == 2
    assert "--temperature -1" in capsys.readouterr().err


def test_rebuild_entry_point_rejects_a_file_as_out_dir(tmp_path, capsys):
    target = tmp_path / "file"
    target.write_text("x")
    assert main([str(target), "--no-distill"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"default model: {target}: ") and "\n" not in err


def test_bench_generate_json_rows_per_mode_and_prompt_set(capsys):
    assert _fxsched("bench", "generate", "--batches", "1", "--max-tokens", "6", "--json") == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["prompts"], r["spec"]) for r in rows] == [
        (s, m) for s in ("held-out", "repetitive") for m in ("none", "mtp", "dflash", "ngram")]
    skipped = [r for r in rows if "skipped" in r]
    assert [r["spec"] for r in skipped] == ["dflash", "dflash"] and "DFlash" in skipped[0]["skipped"]
    ran = [r for r in rows if "skipped" not in r]
    count = {"held-out": len(EVAL_PROMPTS), "repetitive": len(REPETITIVE_PROMPTS)}
    assert all(r["tokens"] == 6 * count[r["prompts"]] and r["tokens_per_s"] > 0 for r in ran)  # EOS ignored
    assert all(r["lossless"] is True for r in ran if r["spec"] != "none")
    assert all(r["mean_accepted_length"] is None for r in ran if r["spec"] == "none")
    assert all(r["mean_accepted_length"] > 1 for r in ran if r["spec"] == "mtp")  # n-gram may not verify in 6
    assert rows[0]["model"] == str(SHIPPED)
