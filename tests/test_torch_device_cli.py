"""``fxsched generate`` / ``fxsched bench generate``: wired into the real ``fxsched`` parser the
way the CLI owner will (one line each), tokens and summary on stdout, one-line errors with exit 2."""

from __future__ import annotations


import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from support.toy_model import run_fxsched  # noqa: E402

from fxsched.runtime.torch_model import HybridEngine, default_config, init_weights, save_weights  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def fxsched(*argv: str) -> int:
    return run_fxsched(*argv)  # the internal model unless one is named


def test_generate_prints_tokens_and_summary(capsys):
    assert fxsched("generate", "--prompt-ids", "1 2 3 4 5", "--max-tokens", "8") == 0
    out = capsys.readouterr().out.splitlines()
    want = HybridEngine(default_config()).greedy_generate([1, 2, 3, 4, 5], 8)
    assert out[0].startswith("request 1: " + " ".join(map(str, want)) + " (")
    assert out[-1].startswith("summary: spec=none device=cpu batch=1 requests=1 tokens=8 ")
    assert "tokens/s=" in out[-1] and "forwards/token=1.000" in out[-1]


@pytest.mark.parametrize("spec", ["mtp", "dflash", "ngram"])
def test_generate_with_speculation_matches_none(capsys, spec):
    assert fxsched("generate", "--prompt-ids", "5,6,7,5,6,7,5,6", "--max-tokens", "10", "--batch", "3") == 0
    plain = capsys.readouterr().out.splitlines()
    assert fxsched("generate", "--prompt-ids", "5,6,7,5,6,7,5,6", "--max-tokens", "10", "--batch", "3",
                   "--spec", spec) == 0
    out = capsys.readouterr().out.splitlines()
    strip = lambda lines: [line.split(" (")[0] for line in lines[:-1]]  # noqa: E731
    assert strip(out) == strip(plain) and len(out) == 4
    assert f"spec={spec}" in out[-1] and "batch=3 requests=3" in out[-1]


def test_prompt_file_one_request_per_line(tmp_path, capsys):
    f = tmp_path / "prompts.txt"
    f.write_text("1 2 3\n\n4 5 6 7\n9\n")
    assert fxsched("generate", "--prompt-ids-file", str(f), "--max-tokens", "3", "--batch", "2") == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out[:-1]] == ["request 1", "request 2", "request 3"]
    assert "requests=3" in out[-1]


def test_weights_file(tmp_path, capsys):
    cfg = default_config()
    path = tmp_path / "w.safetensors"
    save_weights(path, init_weights(cfg), cfg)
    assert fxsched("generate", "--prompt-ids", "1 2 3", "--max-tokens", "4", "--weights", str(path)) == 0
    assert "tokens=4" in capsys.readouterr().out
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not safetensors")
    assert fxsched("generate", "--prompt-ids", "1 2 3", "--weights", str(bad)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"fxsched generate: --weights {bad}: ") and "\n" not in err


@pytest.mark.parametrize("argv, message", [
    (["--prompt-ids", ""], "--prompt-ids: the prompt is empty"),
    (["--prompt-ids", "  ,  "], "--prompt-ids: the prompt is empty"),
    (["--prompt-ids", "1 2 64"], "--prompt-ids: token id 64 is outside the vocabulary [0, 64)"),
    (["--prompt-ids", "1 -3"], "--prompt-ids: token id -3 is outside the vocabulary [0, 64)"),
    (["--prompt-ids", "1 two"], "--prompt-ids: 'two' is not a token id"),
    (["--prompt-ids", " ".join(["1"] * 600)], "--prompt-ids: the prompt of 600 tokens is longer than the context"),
    (["--prompt-ids", "1", "--spec", "eagle"], "--spec eagle: unknown speculation mode (choose from none, mtp, dflash, ngram)"),
    (["--prompt-ids", "1", "--weights", "/no/such/file.safetensors"], "--weights /no/such/file.safetensors: no such file"),
    (["--prompt-ids", "1", "--batch", "17"], "--batch 17: must be between 1 and 16"),
    (["--prompt-ids", "1", "--batch", "x"], "--batch x: not an integer"),
    (["--prompt-ids", "1", "--max-tokens", "0"], "--max-tokens 0: must be at least 1"),
    (["--prompt-ids", "1", "--device", "tpu"], "--device tpu: unknown device"),
    (["--prompt-ids-file", "/no/such/prompts.txt"], "--prompt-ids-file /no/such/prompts.txt: no such file"),
    (["--prompt-ids", "1", "--prompt-file", "x"], "--prompt-ids and --prompt-file: give one of them, not both"),
    ([], "no prompt"),
])
def test_bad_input_exits_2_with_one_line(capsys, argv, message):
    assert fxsched("generate", *argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("fxsched generate: " + message), err
    assert "\n" not in err and captured.out == ""


def test_prompt_file_errors_name_the_line(tmp_path, capsys):
    f = tmp_path / "p.txt"
    f.write_text("1 2\n3 99\n")
    assert fxsched("generate", "--prompt-ids-file", str(f)) == 2
    assert capsys.readouterr().err.strip() == (
        f"fxsched generate: --prompt-ids-file {f} line 2: token id 99 is outside the vocabulary [0, 64)")
    f.write_text("\n\n")
    assert fxsched("generate", "--prompt-ids-file", str(f)) == 2
    assert "no prompts" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_without_cuda_exits_2(capsys):
    assert fxsched("generate", "--prompt-ids", "1 2", "--device", "cuda") == 2
    assert capsys.readouterr().err.strip() == "fxsched generate: --device cuda: CUDA is not available on this machine"


def test_bench_generate_table(capsys):
    assert fxsched("bench", "generate", "--batches", "1,2", "--max-tokens", "4", "--specs", "none,dflash",
                   "--prompts", "held-out") == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("bench generate: device=cpu max_tokens=4 temperature=0")
    header = out[1].split()
    assert header == ["prompts", "spec", "batch", "tokens", "tokens/s", "fwd/token", "mean_acc_len", "acc/pos",
                      "lossless"]
    rows = [line.split() for line in out[2:]]
    assert [(r[1], r[2]) for r in rows] == [("none", "1"), ("dflash", "1"), ("none", "2"), ("dflash", "2")]
    assert [r[-1] for r in rows] == ["-", "yes", "-", "yes"]  # none is the reference


def test_bench_still_dispatches_the_other_benchmarks(capsys):
    assert fxsched("bench", "step", "--sizes", "1", "--ticks", "2", "--repeats", "1") == 0
    assert capsys.readouterr().out.strip()


def test_progress_callback_counts_every_generated_token():
    from fxsched.runtime.generate import generate

    seen = []
    result = generate(HybridEngine(default_config()), [[1, 2, 3], [4, 5]], 20, "dflash", batch=2,
                      progress=seen.append)
    assert sum(seen) == result.summary.generated_tokens == sum(len(o) for o in result.outputs)


def test_long_runs_show_a_progress_bar(monkeypatch, capsys):
    import io

    import tqdm as tqdm_module

    made = []
    real = tqdm_module.tqdm

    def recording_tqdm(*args, **kwargs):
        kwargs.update(disable=False, file=io.StringIO())
        bar = real(*args, **kwargs)
        made.append(bar)
        return bar

    monkeypatch.setattr(tqdm_module, "tqdm", recording_tqdm)
    assert fxsched("generate", "--prompt-ids", "1 2 3", "--max-tokens", "130", "--batch", "4") == 0
    assert len(made) == 1 and made[0].total == 4 * 130 and made[0].n > 0
    assert fxsched("generate", "--prompt-ids", "1 2 3", "--max-tokens", "8") == 0
    assert len(made) == 1  # short runs: no bar
