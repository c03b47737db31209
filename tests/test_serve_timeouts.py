"""The server's read timeouts and keep-alive timeout (specs/serve.md §12.11), on raw sockets: a
client that sends half a request head, or stalls in its body, has its connection closed after
``request_read_timeout`` while another client is served meanwhile; an idle kept-alive connection is
closed after ``timeout_keep_alive``; a slow response (a stream) is never cut.

The server is the embedded default model's, in-process (as tests/test_serve.py runs it), with short
timeouts.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from fxsched.runtime.serve.server import ServeSettings, Serving, bind_socket  # noqa: E402
from fxsched.runtime.text import load_tokenizer  # noqa: E402
from fxsched.runtime.torch_model import HybridEngine  # noqa: E402
from fxsched.runtime.torch_model.default_model import default_model_dir  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

READ_TIMEOUT = 0.6
KEEP_ALIVE = 1


@pytest.fixture(scope="module")
def server():
    serving = Serving(HybridEngine.from_pretrained(default_model_dir()), load_tokenizer(default_model_dir()),
                      ServeSettings(model_name="fxsched-default", request_read_timeout=READ_TIMEOUT,
                                    timeout_keep_alive=KEEP_ALIVE),
                      bind_socket("127.0.0.1", 0))
    thread = threading.Thread(target=serving.run, daemon=True)
    thread.start()
    assert serving.wait_started(60)
    yield serving
    serving.stop()
    thread.join(30)


def connect(serving) -> socket.socket:
    sock = socket.create_connection(serving.address, timeout=10)
    sock.settimeout(10)
    return sock


def closed_after(sock: socket.socket, start: float) -> float:
    """Seconds from ``start`` until the server closed ``sock`` (reads whatever came before)."""
    while True:
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            break
        if not data:
            break
    return time.monotonic() - start


def served_meanwhile(serving) -> None:
    """Another client gets whole answers while the slow one holds its connection."""
    with httpx.Client(base_url=serving.url, timeout=30) as client:
        assert client.get("/health").json() == {"status": "ok"}
        r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


HEAD = ("POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        "Content-Length: {n}\r\n\r\n")


def test_half_a_request_head_is_closed_after_the_read_timeout_while_others_are_served(server):
    sock = connect(server)
    start = time.monotonic()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty")
    served_meanwhile(server)
    waited = closed_after(sock, start)
    sock.close()
    assert READ_TIMEOUT * 0.9 <= waited < READ_TIMEOUT + 2, waited


def test_a_head_sent_a_byte_at_a_time_cannot_outlast_the_timeout(server):
    """The head's time counts from its first byte: trickling does not restart it (slowloris)."""
    sock = connect(server)
    start = time.monotonic()
    head = HEAD.format(n=2).encode()
    try:
        for byte in head[:-4]:
            sock.sendall(bytes([byte]))
            time.sleep(READ_TIMEOUT / 6)
            if time.monotonic() - start > READ_TIMEOUT * 4:
                break
    except (BrokenPipeError, ConnectionResetError):
        pass
    waited = closed_after(sock, start)
    sock.close()
    assert waited < READ_TIMEOUT + 2, waited


def test_a_stalled_body_is_closed_after_the_read_timeout(server):
    body = json.dumps({"prompt": "Hello", "max_tokens": 4}).encode()
    sock = connect(server)
    sock.sendall(HEAD.format(n=len(body)).encode() + body[:10])
    start = time.monotonic()
    served_meanwhile(server)
    waited = closed_after(sock, start)
    sock.close()
    assert READ_TIMEOUT * 0.9 <= waited < READ_TIMEOUT + 2, waited


def test_a_body_that_keeps_moving_is_read_whole(server):
    """Pauses shorter than the timeout, the whole read longer than it: the request is answered."""
    body = json.dumps({"prompt": "Hello", "max_tokens": 4}).encode()
    sock = connect(server)
    sock.sendall(HEAD.format(n=len(body)).encode())
    pieces = [body[i:i + 6] for i in range(0, len(body), 6)]
    for piece in pieces:
        time.sleep(READ_TIMEOUT / 3)
        sock.sendall(piece)
    assert len(pieces) * READ_TIMEOUT / 3 > READ_TIMEOUT
    answer = b""
    while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
        chunk = sock.recv(65536)
        assert chunk, answer
        answer += chunk
    sock.close()
    assert answer.startswith(b"HTTP/1.1 200")
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["usage"]["completion_tokens"] == 4


def test_an_idle_kept_alive_connection_is_closed_after_the_keep_alive_timeout(server):
    sock = connect(server)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    answer = sock.recv(65536)
    start = time.monotonic()
    assert answer.startswith(b"HTTP/1.1 200")
    waited = closed_after(sock, start)
    sock.close()
    assert KEEP_ALIVE * 0.9 <= waited < KEEP_ALIVE + 2, waited


def test_a_stream_longer_than_the_read_timeout_is_not_cut(server):
    """The read timeout is about reading a request, never about writing its answer."""
    body = {"prompt": "Once upon a time", "max_tokens": 400, "stream": True}
    start = time.monotonic()
    chunks, last = 0, ""
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            chunks += line.startswith("data: {")
            last = line or last
    assert last == "data: [DONE]" and chunks > 0
    if time.monotonic() - start < READ_TIMEOUT * 1.5:
        pytest.skip("the stream was too fast to outlast the read timeout on this machine")
