"""The front door of ``fxsched serve`` (runtime/serve/guard.py, serve-security.md §14.1): the API
key, the Host and Origin checks, JSON-only bodies under a size limit, the bad inputs that were 500s,
and a 10 MB prompt that neither stalls ``/health`` and a running stream nor keeps its memory.

The clients are the official ``openai`` client, ``httpx`` and a raw socket (for a chunked upload
that never ends); the servers are the in-process ``Server`` of tests/test_serve.py, and for the
latency and memory figures a real ``fxsched serve`` process (its RSS is read from /proc).
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from test_serve import MODEL, Server  # noqa: E402
from test_serve_process import child_env, start  # noqa: E402

from fxsched.runtime.text import load_tokenizer  # noqa: E402
from fxsched.runtime.torch_model.default_model import default_model_dir  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KEY = "sk-test-7f3a"
ORIGIN = "http://app.example"
BIG = 10 * 1000 * 1000  # a 10 MB prompt
LIMIT_S = 1.0  # the bar for a refusal (the issue's); the figures measured are printed


@pytest.fixture(scope="module")
def tok():
    tokenizer = load_tokenizer(default_model_dir())
    assert tokenizer is not None
    return tokenizer


@pytest.fixture(scope="module")
def keyed(tok):
    """A server with an API key, one allowed origin, and a waiting queue of 8 choices."""
    s = Server(tok, api_key=KEY, allowed_origins=(ORIGIN,), max_waiting=8, max_request_bytes=64 * 1024)
    yield s
    s.close()


def auth(**headers: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEY}", **headers}


def error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


# --- who may call ---------------------------------------------------------------------------------


def test_api_key_guards_every_route_but_health(keyed):
    url = keyed.url
    good = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    out = good.completions.create(model=MODEL, prompt="hi", max_tokens=3)
    assert out.usage.completion_tokens == 3
    for wrong in ("x", KEY + "x", KEY[:-1], ""):
        bad = openai.OpenAI(base_url=url + "/v1", api_key=wrong or "-", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=MODEL, prompt="hi", max_tokens=3)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    for path in ("/v1/models", "/metrics", "/v1/nothing"):
        refused = httpx.get(url + path, timeout=10)
        assert error(refused, 401)["code"] == "invalid_api_key" and refused.headers["www-authenticate"] == "Bearer"
        assert httpx.get(url + path, headers={"authorization": f"Basic {KEY}"}, timeout=10).status_code == 401
    assert httpx.get(url + "/metrics", headers=auth(), timeout=10).status_code == 200
    assert httpx.get(url + "/health", timeout=10).status_code == 200


def test_metrics_open_leaves_metrics_without_the_key(tok):
    s = Server(tok, api_key=KEY, metrics_open=True)
    try:
        assert httpx.get(s.url + "/metrics", timeout=10).status_code == 200
        assert httpx.get(s.url + "/v1/models", timeout=10).status_code == 401
    finally:
        s.close()


def test_host_origin_and_content_type(keyed):
    url = keyed.url + "/v1/completions"
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    # DNS rebinding: a page on evil.example whose name now points at 127.0.0.1
    rebound = httpx.post(url, content=body, headers=auth(**{"content-type": "application/json",
                                                            "host": "evil.example:8000"}), timeout=10)
    assert error(rebound, 400)["code"] == "invalid_host"
    for host in ("localhost:8000", "127.0.0.1", "[::1]:80"):
        ok = httpx.post(url, content=body, headers=auth(**{"content-type": "application/json", "host": host}),
                        timeout=30)
        assert ok.status_code == 200, (host, ok.text)
    # a browser's simple request (no preflight): text/plain, a form, or no type at all
    for kind in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = auth(**({"content-type": kind} if kind else {}))
        assert error(httpx.post(url, content=body, headers=headers, timeout=10), 415)["code"] == \
            "unsupported_media_type"
    ok = httpx.post(url, content=body, headers=auth(**{"content-type": "application/json; charset=utf-8"}),
                    timeout=30)
    assert ok.status_code == 200
    # a method or path no route takes: the app's 405 (with Allow) or 404, whatever the body's type or size
    # (schemathesis: a PUT /health once got the 415, an undeclared method must get 405)
    for method, path, kind in (("PUT", "/health", None), ("PATCH", "/v1/completions", "text/plain"),
                               ("PUT", "/v1/models", "application/json")):
        headers = auth(**({"content-type": kind} if kind else {}))
        wrong = httpx.request(method, keyed.url + path, content=b"x" if kind else None, headers=headers, timeout=10)
        assert wrong.status_code == 405, (method, path, wrong.text)
        assert wrong.headers["allow"] == ("POST" if path == "/v1/completions" else "GET")
    assert error(httpx.post(keyed.url + "/v1/nothing", content=b"x", headers=auth(), timeout=10), 404)
    # cross-origin: refused unless allowed; the allowed origin gets CORS headers and its preflight answered
    other = httpx.post(url, content=body, headers=auth(**{"content-type": "application/json",
                                                          "origin": "http://evil.example"}), timeout=10)
    assert error(other, 403)["code"] == "origin_not_allowed" and "access-control-allow-origin" not in other.headers
    allowed = httpx.post(url, content=body, headers=auth(**{"content-type": "application/json", "origin": ORIGIN}),
                         timeout=30)
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
    preflight = httpx.options(url, headers={"origin": ORIGIN, "access-control-request-method": "POST",
                                            "access-control-request-headers": "authorization,content-type"},
                              timeout=10)
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == ORIGIN


def test_no_cors_headers_without_allowed_origins(tok):
    s = Server(tok)
    try:
        preflight = httpx.options(s.url + "/v1/completions", headers={
            "origin": "http://evil.example", "access-control-request-method": "POST"}, timeout=10)
        assert "access-control-allow-origin" not in preflight.headers
        assert httpx.get(s.url + "/v1/models", timeout=10).status_code == 200  # no key: open
    finally:
        s.close()


# --- what a body may be ---------------------------------------------------------------------------


def test_body_over_the_limit_is_refused_from_content_length(keyed):
    started = time.monotonic()
    big = httpx.post(keyed.url + "/v1/completions", json={"prompt": "x" * 100_000}, headers=auth(), timeout=10)
    assert error(big, 413)["code"] == "request_too_large"
    assert time.monotonic() - started < LIMIT_S


def test_chunked_body_is_cut_off_at_the_limit_not_read_whole(keyed):
    """A chunked upload of up to 100 MB (no Content-Length): the 413 comes once 64 KiB have arrived,
    and the server stops reading (the upload cannot finish)."""
    host, port = keyed.serving.address
    piece = b"x" * (1 << 20)
    sent = 0
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
                     f"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        reply = b""
        try:
            for _ in range(100):
                if select.select([sock], [], [], 0)[0]:
                    break
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                sent += len(piece)
        except (BrokenPipeError, ConnectionResetError):
            pass
        sock.settimeout(10)
        try:
            while b"\r\n\r\n" not in reply:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                reply += chunk
        except ConnectionResetError:
            pass
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert sent < 100 * len(piece)


# --- bad inputs that were 500s --------------------------------------------------------------------

CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path,raw,param", [
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", "max_tokens"),
    ("/v1/completions", b'{"prompt": "hi", "extra": ' + b"[" * 1000 + b"]" * 1000 + b"}", "extra"),
    ("/v1/completions", b'{"prompt": "hi", "extra": ' + b"[" * 200 + b"]" * 200 + b"}", "extra"),
    ("/v1/completions", b'{"prompt": "hi \\ud800 there", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": ["ok", "hi \\udfff"], "max_tokens": 2}', "prompt[1]"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "a\\udc00"}]}).replace(
        "\\\\", "\\").encode(), "messages[0].content"),
    ("/v1/chat/completions", json.dumps({"messages": CHAT, "chat_template_kwargs": {"messages": []}}).encode(),
     "chat_template_kwargs.messages"),
    ("/v1/chat/completions", json.dumps({"messages": CHAT, "chat_template_kwargs": {
        "add_generation_prompt": False}}).encode(), "chat_template_kwargs.add_generation_prompt"),
    ("/v1/completions", json.dumps({"prompt": ["a", "b", "c"], "n": 3, "max_tokens": 2}).encode(), "n"),
    ("/v1/completions", json.dumps({"prompt": "hello " * 5000, "max_tokens": 2}).encode(), "prompt"),
])
def test_former_500s_are_400s_naming_the_field(keyed, path, raw, param):
    started = time.monotonic()
    r = httpx.post(keyed.url + path, content=raw, headers=auth(**{"content-type": "application/json"}), timeout=30)
    elapsed = time.monotonic() - started
    err = error(r, 400)
    assert err["param"] is not None and err["param"].startswith(param), err
    assert err["message"].startswith(err["param"])
    assert elapsed < LIMIT_S, f"{elapsed:.2f} s"


def test_unknown_role_error_does_not_show_the_model_path(keyed):
    r = httpx.post(keyed.url + "/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "hi"}]},
                   headers=auth(), timeout=30)
    err = error(r, 400)
    assert err["param"] == "messages" and "wizard" in err["message"]
    model_dir = str(default_model_dir())
    assert model_dir not in r.text and str(default_model_dir().resolve()) not in r.text and "/" not in err["message"]


def test_a_request_larger_than_the_waiting_queue_is_400_but_one_that_fits_is_served(keyed):
    client = openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, n=9)
    assert caught.value.status_code == 400 and "--max-waiting" in caught.value.message
    out = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, n=8)
    assert len(out.choices) == 8


def test_seed_makes_unseeded_sampling_repeat_across_restarts(tok):
    def run() -> list[str]:
        s = Server(tok, seed=1234)
        try:
            client = s.client()
            return [client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12,
                                              temperature=1.0).choices[0].text for _ in range(3)]
        finally:
            s.close()

    first, second = run(), run()
    assert first == second


# --- a 10 MB prompt in flight ---------------------------------------------------------------------


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def process_server():
    """``fxsched serve`` taking bodies up to 64 MiB, so a 10 MB prompt reaches the prompt checks."""
    proc, url = start("--port", "0", "--max-request-bytes", "64MiB")
    yield proc, url
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_a_10mb_prompt_stalls_neither_health_nor_a_running_stream(process_server):
    proc, url = process_server
    body = json.dumps({"prompt": "x" * BIG, "max_tokens": 4}).encode()
    gaps: list[float] = []
    health: list[float] = []
    streaming = threading.Event()
    done = threading.Event()
    refusals: list[tuple[int, str, float]] = []

    def stream() -> None:
        last = None
        with httpx.stream("POST", url + "/v1/completions", json={"prompt": "stream", "max_tokens": 1500,
                                                                 "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                now = time.monotonic()
                if done.is_set():
                    break
                if line.startswith("data: ") and last is not None:
                    gaps.append(now - last)
                last = now
                streaming.set()

    def big() -> None:
        with httpx.Client(timeout=60) as client:
            for _ in range(5):
                started = time.monotonic()
                r = client.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"})
                refusals.append((r.status_code, r.json()["error"]["param"], time.monotonic() - started))
        done.set()

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    assert streaming.wait(60)
    sender = threading.Thread(target=big)
    sender.start()
    with httpx.Client(timeout=30) as client:
        while not done.is_set():
            started = time.monotonic()
            assert client.get(url + "/health").status_code == 200
            health.append(time.monotonic() - started)
            time.sleep(0.01)
    sender.join(60)
    reader.join(60)
    assert [(code, param) for code, param, _ in refusals] == [(400, "prompt")] * 5
    print(f"\n10 MB prompts: refused in {max(t for *_, t in refusals) * 1000:.0f} ms at most; /health "
          f"{max(health) * 1000:.1f} ms at most over {len(health)} polls; stream gap {max(gaps) * 1000:.1f} ms at most "
          f"over {len(gaps)} chunks")
    assert health and gaps
    assert max(health) < LIMIT_S and max(gaps) < LIMIT_S
    assert max(t for *_, t in refusals) < LIMIT_S


def test_memory_goes_back_after_20_refused_10mb_prompts(process_server):
    proc, url = process_server
    body = json.dumps({"prompt": "y" * BIG, "max_tokens": 4}).encode()
    with httpx.Client(timeout=60) as client:
        client.post(url + "/v1/completions", json={"prompt": "warm up", "max_tokens": 2})
        before = rss_bytes(proc.pid)
        for _ in range(20):
            r = client.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    after = rss_bytes(proc.pid)
    print(f"\nRSS before {before / 2**20:.0f} MiB, after 20 refused 10 MB prompts {after / 2**20:.0f} MiB")
    assert after - before < 100 * 2**20


# --- the command line -----------------------------------------------------------------------------


def cli(*argv: str, cwd=None) -> subprocess.CompletedProcess:
    """``fxsched ARGV`` in a fresh interpreter that reports whether torch was imported (on stdout)."""
    code = ("import sys; from fxsched.runtime.cli.app import main; code = main(sys.argv[1:]); "
            "print('torch imported' if 'torch' in sys.modules else 'no torch'); sys.exit(code)")
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120,
                          env=child_env(), cwd=cwd)


@pytest.mark.parametrize("argv,message", [
    (["generate", "--prompt-ids-file", "/dev/zero"], "--prompt-ids-file /dev/zero: larger than 64 MiB"),
    (["generate", "--prompt-file", "/dev/zero"], "--prompt-file /dev/zero: larger than 64 MiB"),
    (["replay", "/dev/zero"], "/dev/zero: larger than 64 MiB"),
    (["generate", "--prompt-ids", "1", "--record", "{exists}"], "the file exists (give --force"),
    (["serve", "--record", "{exists}"], "the file exists (give --force"),
    (["generate", "--prompt-ids", "1", "--dtype", "fp8"], "--dtype fp8: unknown dtype"),
    (["serve", "--dtype", "fp8"], "--dtype fp8: unknown dtype"),
    (["serve", "--speculative-config", "{bad"], "--speculative-config {bad: not valid JSON"),
    (["serve", "--speculative-config", '{"method": "eagle"}'], 'method "eagle": choose from'),
    (["serve", "--speculative-config", '{"method": "mtp", "k": 1}'], "unknown key 'k'"),
    (["serve", "--allowed-origins", "evil"], "--allowed-origins evil: not an origin"),
    (["serve", "--max-request-bytes", "lots"], "--max-request-bytes lots: not a size"),
    (["serve", "--chat-template", "/no/such/template.jinja"], "--chat-template /no/such/template.jinja: no such file"),
    (["serve", "a/model", "--model", "b/model"], "MODEL a/model and --model b/model: give one of them"),
    (["serve", "/no/such/model"], "--model /no/such/model: no such directory"),
    (["generate", "--prompt-ids", "1", "--model", "/no/such/model"], "--model /no/such/model: no such directory"),
    (["serve", "--ep-ranks", "2"], "--ep-ranks 2: needs a --model directory"),
])
def test_cli_refuses_bad_files_and_arguments_before_importing_torch(tmp_path, argv, message):
    exists = tmp_path / "run.log"
    exists.write_text("keep me\n")
    done = cli(*(a.replace("{exists}", str(exists)) for a in argv), cwd=tmp_path)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and message in lines[0], lines
    assert done.stdout.strip() == "no torch"
    assert exists.read_text() == "keep me\n"


def test_record_with_force_overwrites(tmp_path):
    log = tmp_path / "run.log"
    log.write_text("old\n")
    done = cli("generate", "--prompt-ids", "1 2 3", "--max-tokens", "2", "--record", str(log), "--force")
    assert done.returncode == 0, done.stderr
    assert log.read_text() != "old\n"
    os.remove(log)


# --- vLLM's flags ---------------------------------------------------------------------------------


def test_vllm_flag_names_reach_the_server(tmp_path):
    """``fxsched serve MODEL --max-model-len --max-num-seqs --speculative-config --chat-template --dtype
    --seed`` as vLLM users type them: the context, the mode and the template are the ones served."""
    tok = load_tokenizer(default_model_dir())
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}<<{{ m['role'] }}: {{ m['content'] }}>>{% endfor %}ASSISTANT:")
    proc, url = start(str(default_model_dir()), "--port", "0", "--max-model-len", "256", "--max-num-seqs", "2",
                      "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}',
                      "--chat-template", str(template), "--dtype", "bf16", "--seed", "5",
                      "--served-model-name", MODEL)
    try:
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]
        assert model["spec"] == "mtp" and model["max_model_len"] < 256
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi there"}],
                                             max_tokens=3)
        rendered = "<<user: hi there>>ASSISTANT:"
        assert out.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))
        with pytest.raises(openai.BadRequestError):  # the context is the one asked for
            client.completions.create(model=MODEL, prompt=[1] * 300, max_tokens=2)
    finally:
        proc.terminate()
        proc.wait(60)


def test_speculative_config_asking_for_drafts_the_mode_does_not_run_is_one_line(tmp_path):
    done = cli("serve", "--port", "0", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 5}')
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1
    assert "num_speculative_tokens 5: the mtp mode of this model runs 3" in lines[0]


def test_vllm_aliases_parse_to_the_same_options():
    from fxsched.runtime.cli.app import build_parser

    parser = build_parser()
    vllm = parser.parse_args(["serve", "some/dir", "--max-model-len", "512", "--max-num-seqs", "4"])
    own = parser.parse_args(["serve", "--model", "some/dir", "--max-seq-len", "512", "--max-batch", "4"])
    assert (vllm.model_tag, vllm.max_seq_len, vllm.max_batch) == (own.model, own.max_seq_len, own.max_batch)


def test_max_num_batched_tokens_cuts_prompt_chunks_and_keeps_the_text(tok):
    """``--max-num-batched-tokens 64``: the scheduler's forward budget is 64 rows (a prompt chunk
    too), and a 200-token prompt still gets the offline greedy text."""
    from test_serve import references

    s = Server(tok, max_batch_tokens=64)
    try:
        config = s.engine.config
        assert config.max_batch_tokens == 64 and config.max_prefill_tokens == 64  # a step: 64 rows, as vLLM
        prompt = tok.encode("the lighthouse keeper counted the waves " * 30)[:200]
        want = references(tok, [prompt], 8)
        got = s.client().completions.create(model=MODEL, prompt=prompt, max_tokens=8).choices[0].text
        assert got == want[0]
    finally:
        s.close()


def test_api_key_from_the_environment():
    env = {**child_env(), "FXSCHED_API_KEY": KEY}
    proc = subprocess.Popen([sys.executable, "-m", "fxsched.runtime.cli", "serve", "--port", "0"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        assert proc.stderr is not None
        line = next((ln for ln in proc.stderr if "listening on " in ln), "")
        assert "API key required" in line, line
        url = line.split("listening on ", 1)[1].split()[0]
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 401
        assert httpx.get(url + "/v1/models", headers=auth(), timeout=10).status_code == 200
    finally:
        proc.terminate()
        proc.wait(60)
