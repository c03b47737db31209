"""``fxsched serve`` started from a ``vllm serve`` command line (specs/serve.md §12.9–12,
specs/serve-security.md §14.2): the flags parsed and honoured by a running server, the served
model's names, ``/v1/models`` and vLLM's 404, a client's ``AutoTokenizer`` on the served name,
per-request log records (and ``--log-format json``), ``-v`` anywhere, the help groups, and the
command line's errors: one line, exit 2, within a second of the process's start.

The model is a tiny Qwen3 checkpoint built here with transformers (tests/support/hf_tiny.py) and
the tiny tokenizer, served as ``./tiny`` from its parent folder, as ``vllm serve ./tiny`` would be.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
structlog = pytest.importorskip("structlog")

from support.hf_tiny import build  # noqa: E402
from support.serving import running  # noqa: E402
from support.tiny_tokenizer import write_tiny_tokenizer  # noqa: E402

from fxsched.runtime.cli.app import build_parser, main  # noqa: E402
from fxsched.runtime.cli.usage import UsageError  # noqa: E402
from fxsched.runtime.cli.serve_args import ACTIVATION_RESERVE, kv_budget_from_utilization  # noqa: E402
from fxsched.runtime.logs import configure_logging  # noqa: E402
from fxsched.runtime.serve.request_log import RequestRecord  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KEY = "sk-test-key"
PROMPT = "the quick brown fox jumps over the lazy dog and the quick brown fox jumps again"
VLLM_LINE = [
    "serve", "./tiny", "--host", "127.0.0.1", "--port", "0", "--tensor-parallel-size", "1",
    "--gpu-memory-utilization", "0.9", "--no-enable-prefix-caching", "--trust-remote-code",
    "--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "1k", "--dtype", "float32",
    "--seed", "7", "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--generation-config", "vllm",
    "--uvicorn-log-level", "warning", "--enable-log-requests", "--api-key", KEY, "--timeout-keep-alive", "2",
    "--request-read-timeout", "5", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 1}',
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A folder holding the checkpoint ``tiny`` (config, safetensors, tokenizer, generation config)."""
    root = tmp_path_factory.mktemp("served")
    build("Qwen3ForCausalLM", root / "tiny")
    write_tiny_tokenizer(root / "tiny", vocab_size=160, generation_config=True)
    return root




def completion(url: str, key: str | None = KEY, **body: Any) -> Any:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + "/v1/completions", json={"max_tokens": 4, **body}, headers=headers, timeout=60)


# --- a vLLM command line, honoured --------------------------------------------------------------------


def test_a_vllm_command_line_is_parsed_and_honoured(folder, monkeypatch, capsys):
    monkeypatch.chdir(folder)
    with running(VLLM_LINE) as serving, structlog.testing.capture_logs() as logs:
        # on the CPU --gpu-memory-utilization is logged as not applicable (a warning, at start-up)
        assert "gpu_memory_utilization_not_applicable" in capsys.readouterr().err
        url = serving.url
        # --api-key: every route but /health needs it
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 401
        models = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()
        # the served name is the model argument as given, the root the same path
        assert models["object"] == "list"
        [card] = models["data"]
        assert card["id"] == "./tiny" and card["root"] == "./tiny" and card["parent"] is None
        assert card["object"] == "model" and card["owned_by"] == "fxsched" and card["spec"] == "ngram"
        assert card["max_model_len"] == serving.limits.context <= 256
        engine = serving.engine
        assert engine.max_batch == 4 and engine.config.max_batch_tokens == 1000  # --max-num-seqs, 1k
        assert engine.engine.cfg.dtype == "float32" and serving.settings.seed == 7
        # --generation-config vllm: the tokenizer's EOS token only, not the generation config's two ids
        im_end = engine.tokenizer.token_id("<|im_end|>")
        assert engine.tokenizer.eos_ids == (im_end,) and tuple(engine.config.eos_ids) == (im_end,)
        assert serving.server.config.timeout_keep_alive == 2
        assert serving.server.config.http_protocol_class.read_timeout == 5.0
        # --no-enable-prefix-caching: the same prompt twice reuses nothing
        assert engine.engine.prefix.enabled is False
        answers = [completion(url, model="./tiny", prompt=PROMPT) for _ in range(2)]
        for r in answers:
            assert r.status_code == 200, r.text
            assert r.json()["model"] == "./tiny"
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # a request naming another model: vLLM's 404
        wrong = completion(url, model="gpt-4o", prompt=PROMPT)
        assert wrong.status_code == 404
        assert wrong.json() == {"error": {"message": "The model `gpt-4o` does not exist.", "type": "NotFoundError",
                                          "param": "model", "code": 404}}
        deadline = time.monotonic() + 10
        while len([e for e in logs if e["event"] == "request_finished"]) < 2:
            assert time.monotonic() < deadline, logs
            time.sleep(0.02)
        metrics = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text
    records = [e for e in logs if e["event"] == "request_finished"]
    # n-gram drafts never count into a sequence's acc (core/ngram.py): no accepted_tokens, not a false 0,
    # although /metrics counts the accepted n-gram drafts (test_serve.py checks the field under MTP)
    assert any(line.startswith("vllm:spec_decode_num_accepted_tokens_total{") for line in metrics.splitlines())
    assert all("accepted_tokens" not in r for r in records)
    for record, answer in zip(records, answers, strict=True):
        usage = answer.json()["usage"]
        assert record["request_id"] == answer.json()["id"] and record["model"] == "./tiny"
        assert record["prompt_tokens"] == usage["prompt_tokens"]
        assert record["output_tokens"] == usage["completion_tokens"]
        assert record["cached_tokens"] == 0 and record["n"] == 1 and record["log_level"] == "info"
        assert record["finish_reason"] == answer.json()["choices"][0]["finish_reason"]
        assert 0 < record["ttft_s"] <= record["latency_s"]


def test_served_model_names_the_first_reported_and_prefix_caching_on_by_default(folder, monkeypatch):
    monkeypatch.chdir(folder)
    argv = ["serve", "./tiny", "--port", "0", "--served-model-name", "qwen-tiny", "tiny-alias"]
    with running(argv) as serving:
        url = serving.url
        models = httpx.get(url + "/v1/models", timeout=10).json()
        assert [c["id"] for c in models["data"]] == ["qwen-tiny", "tiny-alias"]
        assert {c["root"] for c in models["data"]} == {"./tiny"}
        by_alias = completion(url, None, model="tiny-alias", prompt=PROMPT)
        assert by_alias.status_code == 200 and by_alias.json()["model"] == "qwen-tiny"
        chat = httpx.post(url + "/v1/chat/completions", timeout=60,
                          json={"model": "./tiny", "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 404 and chat.json()["error"]["message"] == "The model `./tiny` does not exist."
        # prefix caching is on unless turned off: the second identical prompt reuses the first's blocks
        again = completion(url, None, model="qwen-tiny", prompt=PROMPT)
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_a_clients_auto_tokenizer_resolves_the_served_name_to_the_checkpoints_tokenizer(folder, monkeypatch):
    transformers = pytest.importorskip("transformers")
    monkeypatch.chdir(folder)
    with running(["serve", "./tiny", "--port", "0"]) as serving:
        name = httpx.get(serving.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        assert name == "./tiny"
        hf = transformers.AutoTokenizer.from_pretrained(name)  # as lm-eval and guidellm do with the name
        ids = hf(PROMPT)["input_ids"]
        text = completion(serving.url, None, model=name, prompt=PROMPT, max_tokens=1).json()
        assert text["usage"]["prompt_tokens"] == len(ids)
        # the client's token ids are the server's: given as ids, the echoed text is the prompt itself
        echoed = completion(serving.url, None, model=name, prompt=ids, max_tokens=0, echo=True).json()
        assert echoed["choices"][0]["text"] == PROMPT


# --- errors: one line, exit 2 ---------------------------------------------------------------------------


@pytest.mark.parametrize("argv,message", [
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size 2: only 1 is supported"),
    (["-tp", "8"], "--tensor-parallel-size 8: only 1 is supported"),
    (["--tool-call-parser", "mistral"], "--tool-call-parser mistral: this server reads the hermes format only"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice: needs --tool-call-parser (supported: hermes)"),
    (["--gpu-memory-utilization", "1.2"], "--gpu-memory-utilization 1.2: expected a fraction above 0, at most 1"),
    (["--gpu-memory-utilization", "nan"], "--gpu-memory-utilization nan: expected a fraction"),
    (["--generation-config", "{tmp}/none"], "--generation-config {tmp}/none: not auto, vllm or a directory"),
    (["--generation-config", "{tmp}"], "--generation-config {tmp}: {tmp}/generation_config.json: missing"),
    (["--max-model-len", "2.5K"], "--max-model-len 2.5K: no decimals with a binary suffix"),
    (["--max-model-len", "lots"], "--max-model-len lots: not an integer"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens 0: must be between 1"),
    (["--speculative-config", '{{"method": "eagle3"}}'], 'method "eagle3": choose from mtp, dflash, ngram'),
    (["--api-key", "a", "b"], "--api-key: 2 keys given; this server takes one"),
    (["--served-model-name", " "], "--served-model-name ' ': a name must be printable and not blank"),
    (["--enable-log-requests", "--disable-log-requests"], "--enable-log-requests and --disable-log-requests"),
    (["--timeout-keep-alive", "0"], "--timeout-keep-alive 0: must be between 1 and 86400"),
    (["--request-read-timeout", "-3"], "--request-read-timeout '-3': expected a number of seconds above 0"),
    (["{tmp}"], "--model {tmp}: {tmp}/config.json: missing (a checkpoint directory needs config.json)"),
    (["{tmp}/notjson"], "--model {tmp}/notjson: {tmp}/notjson/config.json: not valid JSON"),
    (["{tmp}/notok"], "--model {tmp}/notok: no tokenizer.json, and the server speaks text"),
])
def test_refused_flags_are_one_line_naming_the_flag(tmp_path, capsys, argv, message):
    (tmp_path / "notjson").mkdir()
    (tmp_path / "notjson" / "config.json").write_text("{")
    (tmp_path / "notok").mkdir()
    (tmp_path / "notok" / "config.json").write_text("{}")
    fill = {"tmp": str(tmp_path)}
    code = main(["serve", "--port", "0", *(a.format(**fill) for a in argv)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith("fxsched serve: ") and message.format(**fill) in lines[0], lines


def _timed(argv: list[str], cwd: Path) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "fxsched.runtime.cli", *argv], capture_output=True, text=True,
                          timeout=60, cwd=cwd)
    return time.perf_counter() - start, done


@pytest.mark.parametrize("argv,message", [
    (["generate", "--model", "{dir}", "--prompt", "hello"], "{dir}/config.json: missing"),
    (["serve", "{dir}", "--port", "0"], "{dir}/config.json: missing"),
    (["serve", "--port", "0", "--tensor-parallel-size", "2"], "--tensor-parallel-size 2: only 1 is supported"),
    (["serve", "-v", "--port", "0", "--tool-call-parser", "llama3_json"], "--tool-call-parser llama3_json"),
])
def test_usage_errors_come_within_a_second_of_the_process_start(tmp_path, argv, message):
    """Timed from the subprocess's start to its exit, Python's start-up included; the best of three
    runs, so a neighbour's load on a shared machine does not decide it."""
    notckpt = tmp_path / "notes"
    notckpt.mkdir()
    (notckpt / "README.txt").write_text("not a checkpoint")
    argv = [a.format(dir=notckpt) for a in argv]
    times = []
    for _ in range(3):
        elapsed, done = _timed(argv, tmp_path)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, done.stderr
        assert message.format(dir=notckpt) in lines[0]
        times.append(elapsed)
        if elapsed < 1.0:
            break
    assert min(times) < 1.0, times


def test_the_checks_before_the_model_import_no_torch(tmp_path):
    script = ("import sys\nfrom fxsched.runtime.cli.app import main\n"
              f"code = main(['generate', '--model', {str(tmp_path)!r}, '--prompt', 'x'])\n"
              "print(code, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["2", "False"], done.stderr
    assert "config.json: missing" in done.stderr


# --- help, -v, logs ---------------------------------------------------------------------------------------


def test_help_groups_the_flags_as_vllm_does(capsys):
    assert main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    groups = ["ModelConfig:", "ParallelConfig:", "CacheConfig:", "SchedulerConfig:", "VllmConfig:", "Frontend:"]
    at = [out.index("\n" + g) for g in groups]
    assert at == sorted(at)
    section = {g: out[a:b] for g, a, b in zip(groups, at, at[1:] + [len(out)], strict=True)}
    where = {"ModelConfig:": ["--served-model-name", "--max-model-len", "--dtype", "--seed", "--trust-remote-code",
                              "--generation-config"],
             "ParallelConfig:": ["--tensor-parallel-size"],
             "CacheConfig:": ["--gpu-memory-utilization", "--enable-prefix-caching", "--kv-cache-memory-bytes"],
             "SchedulerConfig:": ["--max-num-seqs", "--max-num-batched-tokens", "--async-scheduling"],
             "VllmConfig:": ["--speculative-config"],
             "Frontend:": ["--host", "--port", "--api-key", "--uvicorn-log-level", "--enable-auto-tool-choice",
                           "--tool-call-parser", "--enable-log-requests", "--disable-log-requests",
                           "--timeout-keep-alive", "--request-read-timeout"]}
    for group, flags in where.items():
        for flag in flags:
            assert flag in section[group], (group, flag)


@pytest.mark.parametrize("argv", [
    ["-v", "serve"], ["serve", "-v"], ["serve", "--port", "0", "--verbose"], ["generate", "-v", "--prompt", "x"],
    ["-v", "check", "--seed", "1", "--steps", "1"], ["check", "--seed", "1", "--steps", "1", "-v"],
])
def test_v_anywhere_on_the_command_line(argv):
    assert build_parser().parse_args(argv).verbose is True


def test_log_format_before_or_after_the_sub_command():
    parser = build_parser()
    assert parser.parse_args(["serve"]).log_format == "text"
    assert parser.parse_args(["serve", "--log-format", "json"]).log_format == "json"
    assert parser.parse_args(["--log-format", "json", "serve"]).log_format == "json"
    assert parser.parse_args(["run", "x", "--log-format", "json", "-v"]).verbose_run is True


def test_json_log_format_writes_the_request_record_as_one_json_object(capsys):
    import asyncio
    import logging

    loop = asyncio.new_event_loop()
    try:
        record = RequestRecord("cmpl-1", "m", 12, 2, loop)
        first = SimpleNamespace(index=0, tokens=(5,), final=False)
        done0 = SimpleNamespace(index=0, tokens=(6,), final=True, finish_reason="length", completion_tokens=8,
                                cached_tokens=16, error=None, accepted_tokens=5)
        done1 = SimpleNamespace(index=1, tokens=(7,), final=True, finish_reason="stop", completion_tokens=3,
                                cached_tokens=0, error=None, accepted_tokens=1)
        for event in (first, done0, done0, done1):  # a repeated final counts once
            record.watch(event)
        configure_logging(False, fmt="json", level=logging.INFO)
        loop.run_until_complete(asyncio.sleep(0))  # the record is written from the loop
    finally:
        loop.close()
        configure_logging(False, fmt="text")
    [line] = capsys.readouterr().err.strip().splitlines()
    data = json.loads(line)
    assert data["event"] == "request_finished" and data["level"] == "info"
    assert {k: data[k] for k in ("request_id", "model", "prompt_tokens", "output_tokens", "cached_tokens",
                                 "finish_reason", "n", "accepted_tokens")} == {
        "request_id": "cmpl-1", "model": "m", "prompt_tokens": 12, "output_tokens": 11, "cached_tokens": 16,
        "finish_reason": "length,stop", "n": 2, "accepted_tokens": 6}
    assert 0 <= data["ttft_s"] <= data["latency_s"]


# --- --gpu-memory-utilization on CUDA ----------------------------------------------------------------------


def test_gpu_memory_utilization_is_the_share_less_weights_and_activations():
    gib = 1 << 30
    assert kv_budget_from_utilization(0.5, 80 * gib, 79 * gib, 10 * gib) == 40 * gib - 10 * gib - ACTIVATION_RESERVE
    with pytest.raises(UsageError, match="has 20.00 GiB free, less than the 72.00 GiB asked"):
        kv_budget_from_utilization(0.9, 80 * gib, 20 * gib, gib)
    with pytest.raises(UsageError, match="leaves no room for the KV cache after the weights"):
        kv_budget_from_utilization(0.1, 80 * gib, 80 * gib, 8 * gib)
