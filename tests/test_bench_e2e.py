"""Smoke test of ``fxsched bench e2e`` (runtime/bench/e2e.py) on a tiny Qwen3 checkpoint.

The real bench (real-size checkpoints, vLLM) is not run in CI. Here: one round at batches 1 and 2,
prompts of 8 ids, 12 tokens (enough that the timed run outlasts the one-token run even on a busy machine), fxsched and transformers, ``--json``; the cells must be there with
positive rates, and fxsched's greedy tokens must equal transformers' (the bench's own parity
check, transformers being the independent reference). The cells run in the test's process
(``--in-process``: the worker's code without the process boundary, to keep the test fast); one
cell also runs as the worker process the real bench starts. Then the bad inputs: one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
from support.hf_tiny import build

from fxsched.runtime.bench import e2e, e2e_models
from fxsched.runtime.cli.app import main as cli_main

ARGS = ["--batches", "1,2", "--rounds", "1", "--prompt-len", "8", "--max-tokens", "12",
        "--engines", "fxsched,fxsched-overlap,fxsched-async,transformers", "--json"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bench_e2e") / "qwen3"
    build("Qwen3ForCausalLM", path)
    return path


@pytest.fixture(scope="module")
def report(ckpt: Path) -> dict:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = e2e.main(["--model", str(ckpt), *ARGS, "--in-process"])
    assert code == 0
    (line,) = out.getvalue().strip().splitlines()
    return json.loads(line)


def test_every_cell_has_positive_rates(report):
    cells = {(c["engine"], c["batch"]): c for c in report["cells"]}
    assert set(cells) == {(e, b) for e in ("fxsched", "fxsched-overlap", "fxsched-async", "transformers") for b in (1, 2)}
    for (engine, batch), c in cells.items():
        assert "error" not in c, c
        assert c["decode_tok_s"] > 0 and c["prefill_tok_s"] > 0 and c["ttft_s"] > 0 and c["peak_rss_gb"] > 0
        assert len(c["rounds"]) == 1
        assert [len(t) for t in c["tokens"]] == [12] * batch  # EOS ignored: exactly max-tokens each
        if engine == "fxsched":
            assert c["decode_x"] == pytest.approx(1.0)
    roof = report["roofline"]
    assert roof["copy_bandwidth_bytes_per_s"] > 0 and roof["roofline_tok_s"] > 0
    assert roof["fxsched_batch1_decode_tok_s"] == cells[("fxsched", 1)]["decode_tok_s"]


def test_fxsched_greedy_tokens_equal_transformers(report):
    for c in report["cells"]:
        assert c["same_tokens"] is True and c["first_diff"] is None, c
    by = {(c["engine"], c["batch"]): c["tokens"] for c in report["cells"]}
    assert by[("fxsched", 2)] == by[("transformers", 2)]
    assert by[("fxsched", 2)][0] == by[("fxsched", 1)][0]  # the same first prompt at both batches


def test_a_worker_process_gives_the_in_process_tokens(ckpt, report, tmp_path):
    args = e2e.build_parser().parse_args(["--model", str(ckpt), *ARGS])
    config = json.loads((ckpt / "config.json").read_text())
    path = e2e.prompt_file(tmp_path, config["vocab_size"], 1, args)
    record = e2e.run_cell(args, "fxsched", ckpt, path, 1, config)
    assert "error" not in record, record
    fx1 = next(c for c in report["cells"] if c["engine"] == "fxsched" and c["batch"] == 1)
    assert record["tokens"] == fx1["tokens"]
    assert record["peak_rss_bytes"] > 0 and record["ttft_s"] > 0


def test_decode_weight_bytes_counts_one_embedding_row_and_the_tied_head(ckpt):
    """Tied Qwen3: every tensor once, the embedding table again as the LM head, plus one row of it."""
    config = json.loads((ckpt / "config.json").read_text())
    sizes = e2e_models.tensor_sizes(ckpt)
    embed = sizes["model.embed_tokens.weight"]
    assert config["tie_word_embeddings"] and not any("lm_head" in n for n in sizes)
    assert e2e_models.decode_weight_bytes(ckpt) == sum(sizes.values()) + embed // config["vocab_size"]


def test_prompt_sets_are_seeded_distinct_and_nested_across_batches():
    one, eight = e2e.prompt_sets(1000, 1, 32, 0), e2e.prompt_sets(1000, 8, 32, 0)
    assert one == e2e.prompt_sets(1000, 1, 32, 0)
    assert eight["run"][:1] == one["run"] and len(eight["run"]) == len(eight["ttft"]) == 8
    assert all(len(p) == 32 for p in eight["run"] + eight["ttft"]) and len(eight["warmup"]) == 2
    runs = {tuple(p[:16]) for p in eight["run"]}
    assert not runs & {tuple(p[:16]) for p in eight["ttft"]}  # no shared first block: no prefix-cache hit


def test_failure_line_names_the_exception():
    stderr = ("Traceback (most recent call last):\n  File \"x.py\", line 1\n"
              "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig\n"
              "  Value error, Model architectures ['X'] failed to be inspected.\n"
              "    For further information visit https://errors.pydantic.dev\n")
    assert e2e.failure_line(stderr) == "Value error, Model architectures ['X'] failed to be inspected."
    assert e2e.failure_line("boom\nRuntimeError: no\nlast words\n") == "RuntimeError: no"
    assert e2e.failure_line("just this\n") == "just this"


def test_figures_and_first_diff():
    got = e2e.figures({"ttft_s": 0.5, "total_s": 2.5, "peak_rss_bytes": 2e9}, batch=4, prompt_len=100, max_tokens=11)
    assert got["prefill_tok_s"] == 800 and got["decode_tok_s"] == 20 and got["peak_rss_gb"] == 2
    assert e2e.first_diff([[1, 2], [3, 4]], [[1, 2], [3, 5]]) == [1, 1]
    assert e2e.first_diff([[1, 2]], [[1, 2]]) is None


@pytest.mark.parametrize("words, names", [
    (["--like", "qwen9-huge"], "--like qwen9-huge"),
    (["--batches", "1,x"], "--batches"),
    (["--batches", "0"], "--batches"),
    (["--engines", "transformers"], "--engines"),
    (["--vllm-python", "/nonexistent/python"], "--vllm-python /nonexistent/python"),
    (["--vllm-python", sys.executable], f"--vllm-python {sys.executable}: cannot import vllm"),
    (["--kv-cache-memory", "lots"], "--kv-cache-memory lots"),
    (["--like", "qwen3-0.6b", "--model", "/tmp"], "give one of them"),
])
def test_bad_input_is_one_line_and_exit_2(words, names, capsys):
    assert cli_main(["bench", "e2e", *words]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and names in err and "Traceback" not in err, err


def test_each_thread_count_gets_its_table_and_the_same_greedy_tokens(ckpt):
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = e2e.main(["--model", str(ckpt), "--batches", "1,2", "--rounds", "1", "--prompt-len", "8",
                         "--max-tokens", "6", "--engines", "fxsched", "--threads", "1,2", "--json", "--in-process"])
    assert code == 0
    one, two = (json.loads(line) for line in out.getvalue().strip().splitlines())
    assert (one["threads"], two["threads"]) == (1, 2)
    for a, b in zip(one["cells"], two["cells"], strict=True):
        assert a["batch"] == b["batch"] and a["tokens"] == b["tokens"]  # greedy tokens whatever the threads


def test_parser_defaults():
    args = e2e.build_parser().parse_args([])
    assert isinstance(args, argparse.Namespace)
    assert e2e._checked(args) == ["fxsched", "transformers"]  # vllm only with --vllm-python
    assert (args.batches, args.rounds, args.thread_counts, args.prompt_len, args.max_tokens, args.spec) == \
        ((1, 8, 32), 3, (1,), 512, 64, "none")
    lora = e2e.build_parser().parse_args(["--lora"])
    assert e2e._checked(lora) == ["fxsched", "fxsched-lora"] and lora.batches == (8,)  # vLLM's only with --vllm-python
    assert not args.vllm_eager  # vLLM as shipped (compiled) unless asked
    assert (lora.lora_adapters, lora.lora_rank, lora.thread_counts) == (4, 16, (1,))


def test_lora_compares_adapted_decoding_with_the_base(ckpt, tmp_path):
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = e2e.main(["--model", str(ckpt), "--lora", "--batches", "4", "--rounds", "1", "--prompt-len", "8",
                         "--max-tokens", "12", "--lora-rank", "8", "--json", "--in-process"])
    assert code == 0
    report = json.loads(out.getvalue().strip().splitlines()[-1])
    cells = {c["engine"]: c for c in report["cells"]}
    assert set(cells) == {"fxsched", "fxsched-lora"}
    lora = cells["fxsched-lora"]
    assert lora["decode_tok_s"] > 0 and lora["same_tokens"] is None
    assert lora["tokens"] != cells["fxsched"]["tokens"]  # the adapters act
    assert report["lora"] == {"adapters": 4, "rank": 8, "decode_x": {"4": lora["decode_x"]},
                              "vllm_decode_x": {"4": None}, "vs_vllm": {"4": None}}
    # the adapters are PEFT's format: the loader takes them
    dirs = e2e_models.build_adapters(ckpt, tmp_path, 2, 8)
    assert [d.name for d in dirs] == ["adapter-0", "adapter-1"]
    assert json.loads((dirs[0] / "adapter_config.json").read_text())["r"] == 8
