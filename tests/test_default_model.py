"""The embedded default model (specs/models/default/, trained by runtime/torch_model/training/).

References: transformers' own Qwen3_5ForCausalLM on the shipped directory (logits of one uncached
forward; greedy tokens of ``generate``), with its pure-torch GDN functions (fla's Triton kernels
cannot run on a CPU). The training itself takes most of an hour, so it is not rerun here: its
forwards are checked against the engine in tests/test_training.py, and its pipeline end to end in
a few steps (``train --quick``) where this machine can fetch the corpus. What the shipped weights
must show (specs/default-model.md §19.6): English text, a held-out perplexity far below chance,
and the acceptance the issue asks of MTP and DFlash.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any, Iterator

import pytest
import torch
from support.hf_tiny import transformers_torch_gdn
from support.toy_model import run_fxsched

from fxsched.runtime.generate import generate
from fxsched.runtime.text import load_tokenizer
from fxsched.runtime.torch_model import HybridEngine, load_pretrained
from fxsched.runtime.torch_model.training.cli import main  # noqa: E402
from fxsched.runtime.torch_model.default_model import (ADDED_TOKENS, DRAFTER_FILES, EVAL_PROMPTS, FILES,
                                                       REPETITIVE_PROMPTS, TokenIds, default_drafter_dir,
                                                       default_model_dir, model_config)
from fxsched.runtime.torch_model.hf_export import hf_tensors, save_pretrained_dir
from fxsched.runtime.torch_model.training.evaluate import window_loss
from fxsched.runtime.torch_model.weights import init_weights

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SHIPPED = default_model_dir()
PROMPT = "The lighthouse keeper climbed the stairs"
MAX_TOKENS = 32
MAX_MODEL_BYTES = 20_000_000  # the issue's ~20 MB for the model; the drafter is beside it
MAX_DRAFTER_BYTES = 8_000_000
# The bars of the issue (specs/default-model.md §19.6 gives the measured figures): greedy, batch 1,
# EVAL_PROMPTS x 64 tokens.
MTP_MIN_MEAN_ACCEPTED = 2.0
DFLASH_MIN_MEAN_ACCEPTED = 2.5
# Held-out prose (from the end of Persuasion, public domain, outside the training split), read from
# a fresh state: chance over 3072 ids is perplexity 3072, and the untrained model of this shape is
# about there; the shipped model reads it at about 92 (the whole held-out text, in 256-token windows,
# at 47.6, where the bigram baseline is at 90).
HELD_OUT = ("Who can be in doubt of what followed? When any two young people take it into their heads to "
            "marry, they are pretty sure by perseverance to carry their point, be they ever so poor, or ever "
            "so imprudent, or ever so little likely to be necessary to each other's ultimate comfort.")
MAX_HELD_OUT_PERPLEXITY = 150.0


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


def _fxsched(*argv: str) -> int:
    return run_fxsched(*argv, toy=False)


def test_shipped_dirs_are_complete_small_and_load_as_their_config(ids):
    model_bytes = sum((SHIPPED / name).stat().st_size for name in FILES)
    drafter_bytes = sum((default_drafter_dir() / name).stat().st_size for name in DRAFTER_FILES)
    assert model_bytes <= MAX_MODEL_BYTES and drafter_bytes <= MAX_DRAFTER_BYTES, (model_bytes, drafter_bytes)
    cfg, _ = load_pretrained(SHIPPED, max_seq_len=256)
    want = model_config(ids, max_seq_len=256)
    differ = [f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(want, f.name)]
    assert differ == ["seed"]  # the loader does not know the build's seed
    assert cfg.architecture == "Qwen3_5ForCausalLM" and cfg.mtp_layers == 1 and cfg.tie_word_embeddings
    tok = load_tokenizer(SHIPPED)
    assert tok is not None and set(tok.eos_ids) == {ids.im_end, ids.endoftext}
    assert tok.decode(tok.encode("héllo, wörld 🙂")) == "héllo, wörld 🙂"  # byte-level: any text encodes
    assert "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True)
    report = json.loads((SHIPPED / "training_report.json").read_text())
    assert report["seconds"]["total"] < 60 * 60  # the issue's budget, on the machine that built it


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
    assert (got - want).abs().max().item() < 1e-3
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("spec", ["none", "mtp", "dflash"])
def test_cli_default_model_tokens_equal_transformers_greedy(hf_model, capsys, spec):
    """The README's main job: greedy tokens equal transformers' whatever drafts (dflash: the shipped
    drafter, taken with no --draft-model)."""
    tok = load_tokenizer(SHIPPED)
    assert tok is not None
    tokens = tok.encode(PROMPT)
    with torch.no_grad():
        want = hf_model.generate(torch.tensor([tokens]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(tokens):]
    assert _fxsched("generate", "--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS), "--spec", spec, "--json") == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert records[0]["token_ids"] == want.tolist()
    assert records[0]["text"] == tok.decode(want.tolist())
    summary = records[-1]
    assert summary["summary"] is True and summary["spec"] == spec
    if spec != "none":
        assert summary["mean_accepted_length"] > 1.5


def test_the_model_writes_english_words():
    tok = load_tokenizer(SHIPPED)
    assert tok is not None
    prompts = [tok.encode(p) for p in EVAL_PROMPTS]
    result = generate(HybridEngine.from_pretrained(SHIPPED, max_seq_len=256), prompts, 48, "none", 4, eos_ids=())
    text = " ".join(tok.decode(tokens) for tokens in result.outputs)
    assert "\ufffd" not in text
    words = text.split()
    plain = [w for w in words if re.fullmatch(r"[\"'(]*[A-Za-z]+(?:[-'][A-Za-z]+)*[.,;:!?\"')]*(?:--)?", w)]
    assert len(words) > 200 and len(plain) / len(words) > 0.9, text[:400]
    assert len({w.lower().strip(".,;:!?\"'()-") for w in words}) > 60  # not one phrase over and over


def test_held_out_prose_is_far_more_predictable_than_chance():
    tok = load_tokenizer(SHIPPED)
    assert tok is not None
    cfg, w = load_pretrained(SHIPPED)
    stream = torch.tensor(tok.encode(HELD_OUT))
    loss, _ = window_loss(cfg, w, stream, seq_len=len(stream) - 1)
    assert math.exp(loss) < MAX_HELD_OUT_PERPLEXITY, math.exp(loss)


@pytest.mark.parametrize("spec,bar", [("mtp", MTP_MIN_MEAN_ACCEPTED), ("dflash", DFLASH_MIN_MEAN_ACCEPTED)])
def test_speculation_meets_the_issues_acceptance_on_held_out_prompts(spec, bar):
    tok = load_tokenizer(SHIPPED)
    assert tok is not None
    prompts = [tok.encode(p) for p in EVAL_PROMPTS]
    draft = default_drafter_dir() if spec == "dflash" else None
    engine = HybridEngine.from_pretrained(SHIPPED, max_seq_len=256, draft_model=draft)
    result = generate(engine, prompts, 64, spec, 1, eos_ids=())
    mal = result.summary.mean_accepted_length
    assert mal is not None and mal >= bar, mal


def test_export_round_trips_bit_for_bit(tmp_path, ids):
    cfg = model_config(ids, max_seq_len=64)
    weights = init_weights(cfg)
    save_pretrained_dir(cfg, weights, tmp_path)
    loaded_cfg, loaded = load_pretrained(tmp_path, max_seq_len=64)
    assert dataclasses.replace(loaded_cfg, seed=cfg.seed) == cfg
    assert loaded.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(loaded[name], tensor), name
    raw = hf_tensors(cfg, weights)
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in raw and "mtp.fc.weight" in raw
    assert "lm_head.weight" not in raw  # tied to the embedding
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


def test_bench_generate_json_rows_per_mode_and_prompt_set(capsys):
    assert _fxsched("bench", "generate", "--batches", "1", "--max-tokens", "6", "--json") == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["prompts"], r["spec"]) for r in rows] == [
        (s, m) for s in ("held-out", "repetitive") for m in ("none", "mtp", "dflash", "ngram")]
    assert not [r for r in rows if "skipped" in r]  # the default model drafts with MTP and its DFlash drafter
    count = {"held-out": len(EVAL_PROMPTS), "repetitive": len(REPETITIVE_PROMPTS)}
    assert all(r["tokens"] == 6 * count[r["prompts"]] and r["tokens_per_s"] > 0 for r in rows)  # EOS ignored
    assert all(r["lossless"] is True for r in rows if r["spec"] != "none")
    assert all(r["mean_accepted_length"] is None for r in rows if r["spec"] == "none")
    assert all(r["mean_accepted_length"] > 1 for r in rows if r["spec"] in ("mtp", "dflash"))
    assert rows[0]["model"] == str(SHIPPED)


def test_train_and_evaluate_refuse_bad_paths_in_one_line(tmp_path, capsys):
    target = tmp_path / "file"
    target.write_text("x")
    deb = tmp_path / "missing.deb"
    assert main(["train", str(target), "--corpus-deb", str(deb)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"default model: {target}: ") and "\n" not in err
    fresh = tmp_path / "fresh"
    assert main(["train", str(fresh), "--corpus-deb", str(deb)]) == 2  # nothing left behind
    assert capsys.readouterr().err.strip() == f"default model: {fresh}: {deb}: no such file" and not fresh.exists()
    assert main(["evaluate", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err.strip() == f"default model: {tmp_path / 'none'}: no such model directory"


def test_a_quick_build_loads_and_drafts_when_the_corpus_can_be_fetched(tmp_path, capsys):
    """`train --quick`: every phase for a few steps, then the directory generates with each drafter."""
    from fxsched.runtime.torch_model.training.austen import CorpusError, fetch_deb
    from fxsched.runtime.torch_model.training.cli import DEFAULT_CACHE

    try:
        deb = fetch_deb(DEFAULT_CACHE)
    except (CorpusError, OSError) as err:
        pytest.skip(f"the corpus package cannot be fetched here: {err}")
    out = tmp_path / "model"
    assert main(["train", str(out), "--quick", "--corpus-deb", str(deb), "--cache", str(tmp_path / "cache")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["corpus"]["train_tokens"] > 500_000 and set(report["seconds"]) >= {"pretrain", "dflash", "total"}
    for spec in ("none", "mtp", "dflash"):
        extra = ("--draft-model", str(out / "dflash")) if spec == "dflash" else ()
        assert _fxsched("generate", "--model", str(out), "--prompt", PROMPT, "--max-tokens", "8", "--spec", spec,
                        *extra, "--json") == 0
        records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert len(records[0]["token_ids"]) == 8
