"""``fxsched serve`` as a real process: ``python -m fxsched.runtime.cli serve`` on a free port, a
real SIGTERM during 8 streams (all 8 finish, whole, and the process exits 0 within the drain
timeout), one-line start-up errors (exit 2), and ``fxsched bench serve`` end to end.

The child's environment drops ``TRITON_INTERPRET`` (tests/conftest.py sets it for this process):
the server should run the torch kernels it runs in production, not the Triton interpreter.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

DRAIN_TIMEOUT = 30.0


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def start(*argv: str) -> tuple[subprocess.Popen, str]:
    """A server process and its URL (from its 'listening on' line)."""
    proc = subprocess.Popen([sys.executable, "-m", "fxsched.runtime.cli", "serve", *argv],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=child_env())
    assert proc.stderr is not None
    deadline = time.monotonic() + 120
    for line in proc.stderr:
        if "listening on " in line:
            return proc, line.split("listening on ", 1)[1].split()[0]
        assert time.monotonic() < deadline
    proc.wait(10)
    pytest.fail(f"the server exited ({proc.returncode}) before listening")


def test_sigterm_during_8_streams_lets_them_finish_and_exits_0():
    proc, url = start("--port", "0", "--drain-timeout", str(DRAIN_TIMEOUT))
    try:
        max_tokens = 120
        results: dict[int, list[dict]] = {}
        first = [threading.Event() for _ in range(8)]

        def stream(i: int) -> None:
            body = {"prompt": f"stream number {i}", "max_tokens": max_tokens, "stream": True,
                    "stream_options": {"include_usage": True}}
            got = []
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        got.append({"done": True} if line == "data: [DONE]" else json.loads(line[6:]))
                        first[i].set()
            results[i] = got

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        assert all(e.wait(60) for e in first), "not every stream started"
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        # no new connection is taken once the drain has begun
        deadline = time.monotonic() + 10
        while True:
            try:
                refused = httpx.post(url + "/v1/completions", json={"prompt": "late"}, timeout=10)
                if refused.status_code == 503:
                    assert refused.json()["error"]["code"] == "server_shutting_down"
                    break
            except httpx.TransportError:
                break
            assert time.monotonic() < deadline, "still accepting requests after SIGTERM"
            time.sleep(0.05)
        for t in threads:
            t.join(60)
        code = proc.wait(DRAIN_TIMEOUT)
        elapsed = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0
    assert elapsed < DRAIN_TIMEOUT
    assert sorted(results) == list(range(8))
    for got in results.values():
        assert got[-1] == {"done": True}
        usage = got[-2]["usage"]
        assert usage["completion_tokens"] == max_tokens
        finals = [c["choices"][0]["finish_reason"] for c in got[:-2] if c["choices"][0]["finish_reason"]]
        assert finals == ["length"]


@pytest.mark.parametrize("argv,message", [
    (["--model", "{tmp}/missing"], "no such directory"),
    (["--spec", "eagle"], "--spec eagle: unknown speculation mode"),
    (["--spec", "dflash", "--draft-model", "{tmp}/none"], "--draft-model {tmp}/none: no such directory"),
    (["--port", "70000"], "--port 70000: must be between 0 and 65535"),
    (["--max-batch", "99"], "--max-batch 99: must be between 1 and 16"),
    (["--max-batch", "5000"], "--max-batch 5000: must be between 1 and 4096"),
    (["--drain-timeout", "-1"], "--drain-timeout"),
    (["--record", "{tmp}/no/log"], "--record {tmp}/no/log: no such folder"),
    (["--port", "{busy}"], "--port {busy}: cannot listen there"),
])
def test_startup_errors_are_one_line_and_exit_2(tmp_path, capsys, argv, message):
    from fxsched.runtime.cli.app import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        fill = {"tmp": str(tmp_path), "busy": str(busy.getsockname()[1])}
        code = main(["serve", "--port", "0", *(a.format(**fill) for a in argv)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith("fxsched serve: ") and message.format(**fill) in lines[0], lines


def test_bench_serve_prints_the_figures_per_mode():
    done = subprocess.run([sys.executable, "-m", "fxsched.runtime.cli", "bench", "serve", "--specs", "none,dflash",
                           "--clients", "1,2", "--requests", "3", "--max-tokens", "6", "--json"],
                          capture_output=True, text=True, timeout=300, env=child_env())
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(r["spec"], r["clients"]) for r in rows] == [("none", 1), ("none", 2), ("dflash", 1), ("dflash", 2)]
    for r in rows:  # dflash: the default model's own drafter (no --draft-model)
        assert r["completed"] == 3 and r["failed"] == 0 and r["output_tokens"] == 18
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p90_ms"] <= r["ttft_p99_ms"]
        assert r["itl_p50_ms"] is not None
        assert (r["mean_accepted_length"] is None) == (r["spec"] == "none")
