"""``fxsched bench serve --vllm-python PY`` (runtime/bench/serve_vllm.py): its refusals (one line,
exit 2, before any server starts) and its table's ratios. Running it needs a vLLM environment and
minutes per server start: the figures come from running the verb itself (issue notes), not from CI."""

from __future__ import annotations

import sys

import pytest

from fxsched.runtime.bench import serve_vllm
from fxsched.runtime.cli.app import main as cli_main


@pytest.fixture
def ckpt(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # the verb checks only that it is there; no server starts
    return str(tmp_path)


@pytest.mark.parametrize("words, names", [
    (["--vllm-python", "/nonexistent/python"], "--vllm-python /nonexistent/python: not an executable file"),
    (["--vllm-python", sys.executable], f"--vllm-python {sys.executable}: no vllm package there"),
    (["--vllm-python", sys.executable, "--model", "/tmp"], "--model /tmp: no config.json there"),
])
def test_bad_python_or_model_is_one_line_and_exit_2(words, names, capsys, ckpt):
    words = words if "--model" in words else [*words, "--model", ckpt]
    assert cli_main(["bench", "serve", *words]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and names in err and "Traceback" not in err, err


@pytest.mark.parametrize("words, names", [
    (["--engines", "vllm,sglang"], "--engines vllm,sglang"),
    (["--engines", "vllm,vllm"], "--engines vllm,vllm"),
    (["--clients", "1,0"], "--clients 1,0"),
    (["--threads", "4096"], "--threads 4096: this process may use"),
    (["--input-len", "2000", "--output-len", "64"], "over --max-model-len 2048"),
])
def test_bad_options_are_one_line_and_exit_2(words, names, capsys, ckpt, monkeypatch):
    monkeypatch.setattr(serve_vllm, "_vllm_problem", lambda python: None)  # as if PY had vLLM
    started = []
    monkeypatch.setattr(serve_vllm, "_start", lambda *a: started.append(a))
    assert cli_main(["bench", "serve", "--vllm-python", sys.executable, "--model", ckpt, *words]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and names in err and "Traceback" not in err, err
    assert not started


def test_the_table_gives_medians_and_fxsched_over_vllm():
    setup = serve_vllm.Setup("py", "/m", (8,), 1, 3, 256, 64, None, ("fxsched", "vllm"), 2048)
    figures = {"fxsched": (12.0, 100.0, 300.0, 20.0, 40.0, 21.0), "vllm": (10.0, 200.0, 300.0, 25.0, 80.0, 24.0)}
    records = [{"clients": 8, "engine": e, "medians": dict(zip(serve_vllm.FIGURES, figures[e], strict=True))}
               for e in ("fxsched", "vllm")]
    lines = serve_vllm.format_table(records, setup).splitlines()
    ratio = lines[-1].split()
    assert ratio[:2] == ["8", "fx/vLLM"]
    assert ratio[2:] == ["1.20", "0.50", "1.00", "0.80", "0.50", "0.88"]


def test_a_failed_vllm_start_is_named_by_its_workers_cause(tmp_path):
    log = tmp_path / "vllm-serve.log"
    log.write_text("(APIServer pid=1) WARNING ulimit ... `OSError: [Errno 24] Too many open files`\n"
                   "(VllmWorker-0 pid=2) ERROR 12-07 [x.py:1] WorkerProc failed to start.\n"
                   "(VllmWorker-0 pid=2) ERROR 12-07 [x.py:1] ValueError: Available memory on node 0 is less\n"
                   "RuntimeError: Engine core initialization failed. See root cause above.\n")
    assert serve_vllm._reason(log) == "ValueError: Available memory on node 0 is less"
    log.write_text("just one line\n")
    assert serve_vllm._reason(log) == "just one line"
