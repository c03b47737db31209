"""``fxsched serve`` in-process: the server on a free loopback port (uvicorn on a background thread)
with the embedded default model, driven by the official ``openai`` client and by raw ``httpx``.

References are independent of the server: the library ``generate()`` (the offline ``fxsched
generate``) on a separate engine gives the greedy text of every prompt, and the engine's own slot
and block counters (``HybridEngine.free_slots`` / ``num_free_blocks``) say what is still held.

The default model is random and never emits its EOS ids (their logits rows are zero), so every
greedy choice runs to ``max_tokens`` and its text is fixed by the prompt alone.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from fxsched.runtime.devices.device import DeviceError  # noqa: E402
from fxsched.runtime.generate import SERVED_CPU_MIXED_FLOOR, TextOptions, generate  # noqa: E402
from fxsched.runtime.serve.choices import ABORT  # noqa: E402
from fxsched.runtime.serve.engine import snapshot  # noqa: E402
from fxsched.runtime.serve.server import ServeSettings, Serving, bind_socket  # noqa: E402
from fxsched.runtime.text import load_tokenizer  # noqa: E402
from fxsched.runtime.torch_model import HybridEngine  # noqa: E402
from fxsched.runtime.torch_model.default_model import default_model_dir  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL = "fxsched-default"
PROMPTS = ["The quick brown fox", "Once upon a time there was", "In the beginning", "Hello, world",
           "A B C D E F", "the the the the", "Numbers: 1 2 3 4", "Why is the sky blue?"]
MAX_TOKENS = 16


def vkey(name: str, **labels: str) -> str:
    """The ``Server.metrics()`` key of a vLLM-named sample of the served model (specs/serve.md §12.8)."""
    labels = {"engine": "0", "model_name": MODEL, **labels}
    return f"vllm:{name}{{{','.join(f'{k}={v}' for k, v in sorted(labels.items()))}}}"


def load_engine() -> HybridEngine:
    return HybridEngine.from_pretrained(default_model_dir())


@pytest.fixture(scope="module")
def tok():
    tokenizer = load_tokenizer(default_model_dir())
    assert tokenizer is not None
    return tokenizer


class Server:
    """A ``Serving`` on its own thread; ``close()`` stops it and joins the thread."""

    def __init__(self, tokenizer, wrap_device=None, **settings):
        self.serving = Serving(load_engine(), tokenizer, ServeSettings(model_name=MODEL, **settings),
                               bind_socket("127.0.0.1", 0), wrap_device=wrap_device)
        self.thread = threading.Thread(target=self.serving.run, daemon=True)
        self.thread.start()
        assert self.serving.wait_started(60), "the server did not start"
        self.url = self.serving.url
        self.engine = self.serving.engine

    def client(self, **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, **kw)

    def post(self, path: str, **kw):
        return httpx.post(self.url + path, timeout=60, **kw)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics by name and labels, e.g. ``fxsched_requests_rejected_total{status=429}``."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        return out

    def idle(self, timeout: float = 30.0) -> None:
        """Wait until the engine holds no choice, then for the gauges of the idle wait."""
        deadline = time.monotonic() + timeout
        while self.engine.live or self.metrics()[vkey("num_requests_running")]:
            assert time.monotonic() < deadline, f"still {self.engine.live} choices live"
            time.sleep(0.02)

    def close(self) -> None:
        self.serving.stop()
        self.thread.join(30)
        assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def server(tok):
    s = Server(tok)
    yield s
    s.close()


def references(tok, prompts: list[list[int]], max_tokens: int = MAX_TOKENS, spec: str = "none") -> list[str]:
    """The offline greedy text of each prompt (``generate()``, a fresh engine, one batch)."""
    result = generate(load_engine(), prompts, max_tokens, spec, text=TextOptions(tok), eos_ids=tok.eos_ids)
    assert all(r.finish_reason == "length" for r in result.results)
    return [r.text or "" for r in result.results]


def chat_prompt(tok, text: str) -> list[int]:
    return tok.encode_chat([{"role": "user", "content": text}])


def assert_free(server: Server) -> None:
    """Nothing is held: from /metrics, and from the engine's own counters."""
    m = server.metrics()
    for name in ("fxsched_kv_blocks_used", "fxsched_slots_used", vkey("num_requests_running"),
                 vkey("num_requests_waiting"), vkey("kv_cache_usage_perc"), "fxsched_requests_swapped"):
        assert m[name] == 0, (name, m[name])
    held = snapshot(server.engine)
    assert (held.slots_used, held.blocks_used, held.live) == (0, 0, 0)
    cfg = server.engine.engine.cfg
    assert len(server.engine.engine.free_slots()) == cfg.max_slots


# --- parity: completions and chat, stream and not, against the offline greedy text ---------------


def test_completions_and_chat_stream_and_not_equal_offline_greedy(server, tok):
    client = server.client()
    texts = PROMPTS[:3]
    want_completion = references(tok, [tok.encode(t) for t in texts])
    want_chat = references(tok, [chat_prompt(tok, t) for t in texts])
    for text, want_c, want_h in zip(texts, want_completion, want_chat, strict=True):
        whole = client.completions.create(model=MODEL, prompt=text, max_tokens=MAX_TOKENS, temperature=0)
        assert whole.choices[0].text == want_c
        assert whole.choices[0].finish_reason == "length"
        assert whole.usage.prompt_tokens == len(tok.encode(text))
        assert whole.usage.completion_tokens == MAX_TOKENS
        chunks = list(client.completions.create(model=MODEL, prompt=text, max_tokens=MAX_TOKENS, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want_c
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == MAX_TOKENS and not chunks[-1].choices

        messages = [{"role": "user", "content": text}]
        chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS)
        assert chat.choices[0].message.content == want_h
        assert chat.choices[0].message.role == "assistant"
        assert chat.usage.prompt_tokens == len(chat_prompt(tok, text))
        deltas = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                                     stream=True))
        assert deltas[0].choices[0].delta.role == "assistant"
        assert "".join(d.choices[0].delta.content or "" for d in deltas) == want_h
        assert deltas[-1].choices[0].finish_reason == "length"
    # a list of prompts with n = 2: choice p * n + j of prompt p
    many = client.completions.create(model=MODEL, prompt=texts[:2], max_tokens=MAX_TOKENS, n=2)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert [c.text for c in many.choices] == [want_completion[0]] * 2 + [want_completion[1]] * 2
    assert many.usage.completion_tokens == 4 * MAX_TOKENS
    server.idle()
    assert_free(server)


def test_stop_strings_and_logprobs(server, tok):
    client = server.client()
    text = PROMPTS[0]
    full = references(tok, [tok.encode(text)])[0]
    stop = full[6:9]
    assert stop and stop not in full[:6]
    cut = client.completions.create(model=MODEL, prompt=text, max_tokens=MAX_TOKENS, stop=[stop])
    assert cut.choices[0].text == full[:full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model=MODEL, prompt=text, max_tokens=MAX_TOKENS, stop=stop,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text
    # logprobs: the chosen token's logprob is the largest of the top entries (greedy), the first's too
    lp = client.completions.create(model=MODEL, prompt=text, max_tokens=6, logprobs=3).choices[0].logprobs
    assert len(lp.tokens) == 6 and "".join(lp.tokens) == full[:len("".join(lp.tokens))]
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and chosen == pytest.approx(max(top.values())) and chosen < 0
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=4,
                                          logprobs=True, top_logprobs=2)
    entries = chat.choices[0].logprobs.content
    assert "".join(e.token for e in entries) == chat.choices[0].message.content
    assert all(len(e.top_logprobs) == 2 for e in entries)
    server.idle()
    assert_free(server)


def test_seeded_sampling_repeats_and_equals_offline_sampling(server, tok):
    from fxsched.runtime.generate import SamplingOptions

    text = PROMPTS[4]
    sampling = SamplingOptions(temperature=0.9, top_k=40, top_p=0.95, seed=1234)
    want = generate(load_engine(), [tok.encode(text)], MAX_TOKENS, text=TextOptions(tok), eos_ids=tok.eos_ids,
                    sampling=sampling).results[0].text
    greedy = references(tok, [tok.encode(text)])[0]
    assert want != greedy  # the draw matters
    client = server.client()
    kw = dict(model=MODEL, prompt=text, max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=1234,
              extra_body={"top_k": 40})
    assert client.completions.create(**kw).choices[0].text == want
    assert "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw)) == want
    server.idle()
    assert_free(server)


def test_models_health_and_metrics(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    m = server.metrics()
    assert m["fxsched_kv_blocks_total"] == server.engine.engine.cfg.num_blocks
    assert m["fxsched_slots_total"] == server.engine.engine.cfg.max_slots
    assert m[vkey("generation_tokens_total")] > 0 and m[vkey("time_to_first_token_seconds_count")] > 0
    assert m["fxsched_step_seconds_count"] > 0


# --- 64 concurrent streams, 16 of them disconnecting -------------------------------------------


def test_requests_on_a_kept_alive_connection_are_not_held_by_delayed_acks(server):
    """The server's small writes go out at once (TCP_NODELAY): with Nagle's algorithm on, a reused
    connection waited for the client's delayed ACK, about 40 ms per request and per streamed chunk."""
    times = []
    with httpx.Client(base_url=server.url, timeout=10) as http:
        for _ in range(11):
            start = time.perf_counter()
            assert http.get("/health").status_code == 200
            times.append(time.perf_counter() - start)
    assert sorted(times)[5] < 0.02, times


def test_64_streams_16_disconnect_mid_stream_then_everything_is_free(server, tok):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(64)]
    max_tokens, long = MAX_TOKENS, 400  # a leaver asks for many tokens: only its cancel ends it early
    want = dict(zip(PROMPTS, references(tok, [tok.encode(t) for t in PROMPTS], max_tokens), strict=True))
    leavers = set(range(3, 64, 4))  # 16 clients
    before = server.metrics()
    recent_before = len(server.engine.recent)

    async def client_run(client, i: int) -> tuple[int, str, str | None]:
        body = {"model": MODEL, "prompt": prompts[i], "max_tokens": long if i in leavers else max_tokens,
                "stream": True}
        text, reason, chunks = "", None, 0
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                reason = choice["finish_reason"] or reason
                chunks += 1
                if i in leavers and chunks == 3:
                    return i, text, None  # the client goes away mid-stream (leaving the block closes it)
        return i, text, reason

    async def main():
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=120) as client:
            return await asyncio.gather(*(client_run(client, i) for i in range(64)))

    results = asyncio.run(main())
    for i, text, reason in results:
        if i in leavers:
            assert reason is None and text and (want[prompts[i]].startswith(text) or text.startswith(want[prompts[i]]))
        else:
            assert (text, reason) == (want[prompts[i]], "length"), i
    server.idle()
    finals = list(server.engine.recent)[recent_before:]
    assert len(finals) == 64
    cancelled = [f for f in finals if f.cancelled]
    assert len(cancelled) == 16
    assert all(f.finish_reason == ABORT and f.completion_tokens < long for f in cancelled)
    assert all(f.finish_reason == "length" and f.completion_tokens == max_tokens for f in finals if not f.cancelled)
    after = server.metrics()
    for reason, count in ((ABORT, 16), ("length", 48)):
        key = vkey("request_success_total", finished_reason=reason)
        assert after[key] - before.get(key, 0) == count
    assert_free(server)


# --- bad requests ---------------------------------------------------------------------------------


def _error_body(response, status: int, param):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == param
    if param:
        assert body["error"]["message"].startswith(param)
    return body["error"]


@pytest.mark.parametrize("path,payload,param", [
    ("/v1/completions", {"prompt": "hi", "model": 5}, "model"),  # another model's name: 404 (test_serve_cli.py)
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 5000}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "suffix": "!"}, "suffix"),
    ("/v1/completions", {"prompt": 7}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 99999]}, "prompt"),
    ("/v1/completions", {"prompt": "word " * 3000}, "prompt"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3},
     "top_logprobs"),
])
def test_bad_requests_get_400_naming_the_field(server, path, payload, param):
    _error_body(server.post(path, json=payload), 400, param)


def test_malformed_json_unknown_fields_and_unknown_routes(server):
    bad = server.post("/v1/completions", content=b'{"prompt": "hi",', headers={"content-type": "application/json"})
    assert "not valid JSON" in _error_body(bad, 400, None)["message"]
    _error_body(server.post("/v1/completions", json=["hi"]), 400, None)
    # an unknown field is accepted and ignored (as vLLM does)
    ok = server.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "frobnicate": {"x": 1}})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(server.url + "/v1/nothing").status_code == 404
    # a method a route does not take: 405 naming the ones it does (RFC 9110's Allow)
    wrong = httpx.request("TRACE", server.url + "/health")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "GET"
    assert httpx.get(server.url + "/v1/completions").headers["allow"] == "POST"
    # the openai client sees a 400 as BadRequestError
    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(model=MODEL, prompt="hi", max_tokens=-1)


def assert_texts_spell(entries, content: str) -> None:
    """The entries' token texts spell ``content``: joined, exactly; where a token holds part of a
    character's bytes (its text is U+FFFD, as in the OpenAI API), the whole texts between such tokens
    in order."""
    texts = [e.token for e in entries]
    if not any("\ufffd" in t for t in texts):
        assert "".join(texts) == content
        return
    at = 0
    for text in texts:
        if "\ufffd" not in text:
            found = content.find(text, at)
            assert found >= 0, (texts, content)
            at = found + len(text)


def test_speculative_server_samples_for_the_openai_client_streamed_and_not(tok):
    """``--spec mtp`` and temperature 0.8 (specs/speculation.md §6.16): a seeded choice gives the same
    text streamed and not, and sampling leaves the greedy text."""
    s = Server(tok, spec="mtp")
    try:
        client = s.client()
        text = PROMPTS[1]
        greedy = references(tok, [tok.encode(text)], spec="mtp")[0]
        got = []
        for seed in (1, 2, 3):
            done = client.completions.create(model=MODEL, prompt=text, max_tokens=MAX_TOKENS, temperature=0.8,
                                             seed=seed)
            assert done.choices[0].finish_reason in ("length", "stop") and done.usage.completion_tokens > 0
            stream = client.completions.create(model=MODEL, prompt=text, max_tokens=MAX_TOKENS, temperature=0.8,
                                               seed=seed, stream=True)
            pieces = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
            assert pieces == done.choices[0].text, f"seed {seed}: streamed and whole answers differ"
            got.append(done.choices[0].text)
        assert any(g != greedy for g in got)  # it sampled
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=8, temperature=0.8, top_p=0.9, seed=5, logprobs=True,
                                              top_logprobs=2)
        assert chat.choices[0].message.content is not None
        entries = chat.choices[0].logprobs.content  # every token's, the first included, through the verifies
        assert len(entries) == chat.usage.completion_tokens
        assert_texts_spell(entries, chat.choices[0].message.content)
        assert all(e.logprob <= 0 and len(e.top_logprobs) == 2 and e.logprob <= e.top_logprobs[0].logprob + 1e-6
                   for e in entries)
        s.idle()
        assert_free(s)
        # each final event says how many drafts its choice had accepted, as the metrics count them
        m = s.metrics()
        finals = list(s.engine.recent)
        assert all(f.accepted_tokens is not None for f in finals)
        # (at most: the device counts drafts kept past the budget, a client is told at most n - 1, core/retire.py)
        assert 0 < sum(f.accepted_tokens or 0 for f in finals) <= m[vkey("spec_decode_num_accepted_tokens_total")]
        # per-position acceptance: position 0 saw every verify's first draft; the kept drafts add up
        drafted = {k: v for k, v in m.items() if k.startswith("fxsched_spec_drafts_per_position_total")}
        kept = {k: v for k, v in m.items() if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total")}
        assert drafted["fxsched_spec_drafts_per_position_total{mode=mtp,position=0}"] == \
            m[vkey("spec_decode_num_drafts_total")] > 0
        assert sum(drafted.values()) == m[vkey("spec_decode_num_draft_tokens_total")]
        assert sum(kept.values()) == m[vkey("spec_decode_num_accepted_tokens_total")]
        rate = m["fxsched_spec_acceptance_per_position{mode=mtp,position=0}"]
        assert rate == kept[vkey("spec_decode_num_accepted_tokens_per_pos_total", position="0")] / \
            drafted["fxsched_spec_drafts_per_position_total{mode=mtp,position=0}"]
    finally:
        s.close()


def test_speculative_server_queues_and_answers_429(tok):
    devices: list[FaultyDevice] = []

    def wrap(device):
        devices.append(FaultyDevice(device))
        return devices[-1]

    s = Server(tok, spec="ngram", max_batch=1, max_waiting=1, wrap_device=wrap)
    try:
        # greedy n-gram speculation is lossless
        text = PROMPTS[5]
        want = references(tok, [tok.encode(text)])[0]
        got = s.client().completions.create(model=MODEL, prompt=text, max_tokens=MAX_TOKENS)
        assert got.choices[0].text == want
        # one running (batch 1), one waiting (the queue's bound), the third is refused; the engine
        # thread is held still meanwhile, so nothing finishes or starts in between
        with httpx.Client(base_url=s.url, timeout=60) as http:
            body = {"prompt": "a long one", "max_tokens": 32, "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as running:
                running_lines = running.iter_lines()
                next(line for line in running_lines if line)  # it has its first token
                devices[-1].gate.clear()
                with http.stream("POST", "/v1/completions", json=body) as queued:
                    assert queued.status_code == 200
                    refused = httpx.post(s.url + "/v1/completions", json={"prompt": "hi"}, timeout=60)
                    error = _error_body(refused, 429, None)
                    assert error["code"] == "rate_limit_exceeded"
                    devices[-1].gate.set()
                    assert [line for line in queued.iter_lines() if line][-1] == "data: [DONE]"
                assert [line for line in running_lines if line][-1] == "data: [DONE]"
        s.idle()
        assert s.metrics()["fxsched_requests_rejected_total{status=429}"] == 1
        assert_free(s)
    finally:
        s.close()


def test_a_client_that_leaves_while_queued_frees_its_place_without_a_seat_or_a_prefill(tok):
    """Batch 1: while one stream runs, a second waits for the seat and its client goes away. The
    cancel ends it at the next tick (specs/scheduler.md §5.4 step 1): the waiting gauge drops to 0
    while the first still runs, its final record has no token, and it was never prefilled."""
    prefills: list[int] = []

    class SlowDevice:  # 5 ms per device call, so the running stream outlasts the queued one
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            attr = getattr(self.inner, name)
            if not callable(attr):
                return attr

            def call(*args, **kwargs):
                time.sleep(0.005)
                if name.startswith("prefill") or name.startswith("mixed"):
                    prefills.append(len(prefills))
                return attr(*args, **kwargs)

            return call

    s = Server(tok, max_batch=1, max_waiting=4, wrap_device=SlowDevice)
    try:
        recent_before = len(s.engine.recent)
        with httpx.Client(base_url=s.url, timeout=60) as http:
            body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 300, "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as running:
                lines = running.iter_lines()
                next(line for line in lines if line.startswith("data: {"))
                prefills_before = len(prefills)
                with http.stream("POST", "/v1/completions", json=dict(body, prompt=PROMPTS[1])) as queued:
                    assert queued.status_code == 200
                    deadline = time.monotonic() + 10
                    while s.metrics()[vkey("num_requests_waiting")] != 1:
                        assert time.monotonic() < deadline
                        time.sleep(0.01)
                # the queued client has gone; the running one has most of its 300 tokens to go
                deadline = time.monotonic() + 10
                while s.metrics()[vkey("num_requests_waiting")] != 0:
                    assert time.monotonic() < deadline, "the cancelled request still waits"
                    time.sleep(0.01)
                m = s.metrics()
                assert m[vkey("num_requests_running")] == 1
                finals = list(s.engine.recent)[recent_before:]
                assert len(finals) == 1 and finals[0].cancelled and finals[0].completion_tokens == 0
                assert [line for line in lines if line][-1] == "data: [DONE]"
        s.idle()
        assert len(prefills) == prefills_before  # the queued prompt never reached the device
        assert_free(s)
    finally:
        s.close()


# --- engine faults --------------------------------------------------------------------------------


class FaultyDevice:
    """A TorchDevice behind a layer that raises once, at the next call of one of ``arm``'s methods;
    while ``gate`` is clear, every call waits for it (the engine thread stands still)."""

    def __init__(self, inner):
        self.inner = inner
        self.armed: dict[str, BaseException] = {}
        self.fired: list[str] = []
        self.gate = threading.Event()
        self.gate.set()

    def arm(self, error: BaseException, *names: str) -> None:
        self.armed = {n: error for n in names}

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            assert self.gate.wait(60)
            if name not in self.armed:
                return attr(*args, **kwargs)
            if name in self.armed:
                error = self.armed[name]
                self.armed = {}
                self.fired.append(name)
                raise error
            return attr(*args, **kwargs)

        return call


@pytest.mark.parametrize("budget", [32, None])
def test_a_long_prompt_beside_a_running_stream_rides_in_chunks_of_the_served_budget(tok, budget):
    """A server with a budget of 32 rows a step (``--max-num-batched-tokens 32``), or a CPU server's
    default (generate.served_config: beside one decoding stream the mixed-prefill bound's floor of
    64 rows, specs/scheduler.md §5.13 C) prefills at most that many prompt rows a step beside
    decoding streams: a 150-token prompt arriving while a stream runs is cut into such chunks,
    never one forward, and both texts equal the offline greedy ones."""
    rows = budget if budget is not None else SERVED_CPU_MIXED_FLOOR
    chunks: list[int] = []

    class Recording:  # the mixed forwards' prompt rows
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            attr = getattr(self.inner, name)
            if name == "mixed_forward":
                return lambda tokens, seqs, prefill, stream: (chunks.append(prefill.length),
                                                              attr(tokens, seqs, prefill, stream))[1]
            if name == "mixed_forward_batch":
                return lambda tokens, seqs, prefills, stream: (chunks.append(sum(p.length for p in prefills)),
                                                               attr(tokens, seqs, prefills, stream))[1]
            return attr

    long_prompt = " ".join(f"w{i}" for i in range(75))
    s = Server(tok, wrap_device=Recording, max_batch_tokens=budget)
    try:
        client = s.client()
        stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=200, temperature=0, stream=True)
        pieces = [next(iter(stream)).choices[0].text]
        long = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=4, temperature=0)
        pieces += [c.choices[0].text for c in stream]
        s.idle()
    finally:
        s.close()
    prompt_len = len(tok.encode(long_prompt))
    assert prompt_len > 100
    assert chunks and max(chunks) <= rows and sum(chunks) >= prompt_len - rows and len(chunks) >= 2, chunks
    first, second = references(tok, [tok.encode(PROMPTS[0])], 200)[0], references(tok, [tok.encode(long_prompt)], 4)[0]
    assert "".join(pieces) == first and long.choices[0].text == second


def test_engine_fault_fails_the_requests_it_touched_and_the_server_keeps_serving(tok):
    devices: list[FaultyDevice] = []

    def wrap(device):
        devices.append(FaultyDevice(device))
        return devices[-1]

    s = Server(tok, wrap_device=wrap)
    try:
        client = s.client()
        want = references(tok, [tok.encode(PROMPTS[1])], MAX_TOKENS)[0]
        # an exception out of the drive loop (a bug in a decode): both requests in flight fail
        whole: dict[str, httpx.Response] = {}
        with httpx.Client(base_url=s.url, timeout=60) as http:
            with http.stream("POST", "/v1/completions",
                             json={"prompt": PROMPTS[1], "max_tokens": 400, "stream": True}) as stream:
                lines = stream.iter_lines()
                first = next(line for line in lines if line)
                other = threading.Thread(target=lambda: whole.update(r=httpx.post(
                    s.url + "/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 400}, timeout=60)))
                other.start()
                deadline = time.monotonic() + 30
                while not (s.engine.live == 2 and s.engine.waiting == 0):  # both have their first token
                    assert time.monotonic() < deadline
                    time.sleep(0.001)
                devices[-1].arm(RuntimeError("injected decode fault"), "decode_batch")
                lines = [first] + [line for line in lines if line]
                other.join(30)
        error = _error_body(whole["r"], 500, None)
        assert "injected decode fault" in error["message"] and error["code"] == "engine_fault"
        assert lines[-1] == "data: [DONE]" and '"error"' in lines[-2]
        assert devices[0].fired == ["decode_batch"]
        deadline = time.monotonic() + 30
        while len(devices) < 2:  # the loop starts again on a fresh device
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(openai.APIError):  # the openai client raises on the error event of a stream
            devices[-1].arm(RuntimeError("injected again"), "decode_batch")
            list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, stream=True))
        s.idle()
        assert_free(s)
        got = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=MAX_TOKENS)
        assert got.choices[0].text == want
        # a device error answering a query is the scheduler's: its fault scope fails that request (500)
        devices[-1].arm(DeviceError("injected prefill fault"), "prefill", "prefill_batch_chunk",
                        "mixed_forward_batch", "prefill_chunk")
        failed = httpx.post(s.url + "/v1/completions", json={"prompt": PROMPTS[3], "max_tokens": 4}, timeout=60)
        assert _error_body(failed, 500, None)["code"] == "engine_fault"
        got = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=MAX_TOKENS)
        assert got.choices[0].text == want
        s.idle()
        m = s.metrics()
        assert m["fxsched_engine_faults_total"] == 2
        assert m["fxsched_requests_failed_total"] == 4
        assert_free(s)
    finally:
        s.close()


def test_an_engine_that_faults_at_every_start_stops_and_the_server_answers_503(tok):
    class Broken(FaultyDevice):
        def __getattr__(self, name):
            if name == "create_stream":
                raise RuntimeError("injected: no streams on this device")
            return super().__getattr__(name)

    s = Server(tok, wrap_device=Broken)
    try:
        deadline = time.monotonic() + 30
        while s.engine.alive:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert s.engine.gave_up and len(s.engine.faults) == 5
        assert httpx.get(s.url + "/health").status_code == 503
        refused = s.post("/v1/completions", json={"prompt": "hi"})
        assert _error_body(refused, 503, None)["code"] == "engine_stopped"
    finally:
        s.close()


# --- drain in-process: past the timeout, streams end with a final chunk ---------------------------


def test_drain_timeout_cancels_streams_with_a_final_chunk(tok):
    s = Server(tok, drain_timeout=0.3)
    lines: dict[int, list[str]] = {}

    def read(i: int, started: threading.Event) -> None:
        with httpx.stream("POST", s.url + "/v1/completions", timeout=60,
                          json={"prompt": PROMPTS[i], "max_tokens": 1500, "stream": True}) as r:
            got = []
            for line in r.iter_lines():
                if line:
                    got.append(line)
                    started.set()
            lines[i] = got

    events = [threading.Event() for _ in range(3)]
    readers = [threading.Thread(target=read, args=(i, e)) for i, e in enumerate(events)]
    for t in readers:
        t.start()
    assert all(e.wait(30) for e in events)
    s.serving.begin_drain()
    for t in readers:
        t.join(30)
    s.thread.join(30)
    assert not s.thread.is_alive()
    for got in lines.values():
        assert got[-1] == "data: [DONE]" and f'"finish_reason":"{ABORT}"' in got[-2]
    assert s.engine.live == 0 and not s.engine.alive


# --- --record: the event log of a serving run replays through step -----------------------------


def test_record_writes_an_event_log_that_replays_identically(tok, tmp_path):
    from fxsched.runtime.eventlog_replay import replay_log

    path = tmp_path / "serve.log"
    s = Server(tok, record=str(path))
    try:
        client = s.client()
        texts = [client.completions.create(model=MODEL, prompt=p, max_tokens=6).choices[0].text for p in PROMPTS[:2]]
        list(client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=6, stream=True))
    finally:
        s.close()
    result = replay_log(path)
    assert result.departure is None and result.cut_short is None
    assert result.meta.get("command") == "serve"
    done = [o for _, o in result.outputs if type(o).__name__ == "DoneOut"]
    assert len(done) == 3 and all(o.n == 6 for o in done)
    assert all(texts)


def test_replay_of_a_served_run_reports_where_a_changed_rule_departs(tok, tmp_path, monkeypatch):
    """A changed publish rule (one occupancy read per tick instead of two) departs at the first
    publish answer of the served run; the index is found independently by stepping both rules."""
    import attrs

    from fxsched.core import machine, table
    from fxsched.core import phases as ph
    from fxsched.core.state import initial_state
    from fxsched.runtime.eventlog_reader import read_log
    from fxsched.runtime.eventlog_replay import replay_log

    path = tmp_path / "serve.log"
    s = Server(tok, record=str(path))
    try:
        s.client().completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4)
    finally:
        s.close()
    phase = table.ANSWERS[ph.AwaitPublishBlocks]

    def one_read(state, waiting, event, out):
        state = phase.rule(state, waiting, event, out)
        out.pop()  # the rule's second SsmSnapshotOccupancy
        return state

    changed = attrs.evolve(phase, rule=one_read)
    log = read_log(path)
    before = after = initial_state(log.config, log.model)
    first = None
    for item in log.steps:
        monkeypatch.setitem(table.ANSWERS, ph.AwaitPublishBlocks, phase)
        before, want = machine.step(before, item.event)
        monkeypatch.setitem(table.ANSWERS, ph.AwaitPublishBlocks, changed)
        after, got = machine.step(after, item.event)
        if want != got:
            first = item.index
            break
    assert first is not None
    result = replay_log(path)  # the changed rule is still in the table
    assert result.departure is not None and result.departure.index == first
    monkeypatch.setitem(table.ANSWERS, ph.AwaitPublishBlocks, phase)
    assert replay_log(path).departure is None
