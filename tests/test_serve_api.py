"""The routes beyond completions and chat (specs/serve.md §12.5–7) and the vLLM-named metrics
(§12.8), on a server in-process with the embedded default model.

References are independent of the server: the official ``openai`` client parses every answer; the
greedy text comes from the library ``generate()`` on a separate engine, over the prompt the model's
chat template gives; token ids and texts from the transformers tokenizer of the same directory.
"""

from __future__ import annotations

import json
from importlib.metadata import version
from typing import Any, Iterator

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
transformers = pytest.importorskip("transformers")

from test_serve import MODEL, Server, assert_free, references, vkey  # noqa: E402

from fxsched.effects.lifecycle import ReleaseReason, ReleaseSeq  # noqa: E402
from fxsched.runtime.serve.serve_host import _Watch  # noqa: E402
from fxsched.runtime.serve.metrics import ServeMetrics  # noqa: E402
from fxsched.runtime.text import load_tokenizer  # noqa: E402
from fxsched.runtime.torch_model.default_model import default_model_dir  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXTS = ["The quick brown fox", "Once upon a time there was", "naïve café — 東京 ✓", "  spaces\tand\nnewlines  "]
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def tok():
    tokenizer = load_tokenizer(default_model_dir())
    assert tokenizer is not None
    return tokenizer


@pytest.fixture(scope="module")
def hf():
    return transformers.AutoTokenizer.from_pretrained(str(default_model_dir()))


@pytest.fixture(scope="module")
def server(tok) -> Iterator[Server]:
    s = Server(tok)
    yield s
    s.close()


def chat_reference(tok, messages: list[dict[str, Any]], max_tokens: int) -> tuple[int, str]:
    """The prompt length and the offline greedy text of a chat (the template rendered by the tokenizer)."""
    prompt = tok.encode_chat(messages)
    return len(prompt), references(tok, [prompt], max_tokens)[0]


# --- /v1/responses ---------------------------------------------------------------------------------


def test_responses_equal_the_offline_greedy_chat_reply(server, tok):
    client = server.client()
    want_len, want = chat_reference(tok, [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Name a colour"}], 12)
    r = client.responses.create(model=MODEL, instructions="Be brief.", input="Name a colour", max_output_tokens=12,
                                temperature=0)
    assert r.object == "response" and r.model == MODEL and r.id.startswith("resp_")
    assert r.output_text == want
    [item] = r.output
    assert (item.type, item.role, item.status, item.content[0].type) == ("message", "assistant", "completed",
                                                                         "output_text")
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (want_len, 12, want_len + 12)
    # the default model never ends a reply: the budget cuts it
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.max_output_tokens == 12 and r.instructions == "Be brief."
    # a list of items: developer is a system turn, content parts join
    items = [{"type": "message", "role": "developer", "content": "Be brief."},
             {"role": "user", "content": [{"type": "input_text", "text": "Name a "}, {"type": "input_text",
                                                                                      "text": "colour"}]}]
    assert client.responses.create(model=MODEL, input=items, max_output_tokens=12).output_text == want


def test_responses_stream_sends_the_events_in_order(server, tok):
    client = server.client()
    want_len, want = chat_reference(tok, [{"role": "user", "content": "Hello, world"}], 10)
    events = list(client.responses.create(model=MODEL, input="Hello, world", max_output_tokens=10, stream=True))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.output_text.delta"] * len(deltas)
                     + ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                        "response.completed"])
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in deltas)
    assert text == want
    done = events[-4]
    assert done.text == want and events[-3].part.text == want and events[-2].item.content[0].text == want
    assert len({e.item_id for e in deltas} | {events[2].item.id, done.item_id}) == 1
    final = events[-1].response
    assert final.output_text == want and final.status == "incomplete"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (want_len, 10)
    server.idle()
    assert_free(server)


def test_every_responses_request_writes_its_log_record(server):
    """specs/serve.md §12.10 on /v1/responses: one ``request_finished`` per response, under its id,
    streamed or not (the route once submitted without a record, so nothing was logged)."""
    import time

    structlog = pytest.importorskip("structlog")
    from fxsched.runtime.logs import configure_logging

    client = server.client()
    configure_logging(True)  # the records are at INFO (-v, --enable-log-requests)
    try:
        with structlog.testing.capture_logs() as logs:
            whole = client.responses.create(model=MODEL, input="Hello, world", max_output_tokens=6)
            events = list(client.responses.create(model=MODEL, input="Hello", max_output_tokens=5, stream=True))
            deadline = time.monotonic() + 10
            while len([e for e in logs if e["event"] == "request_finished"]) < 2:
                assert time.monotonic() < deadline, logs
                time.sleep(0.02)
    finally:
        configure_logging(False)
    records = {e["request_id"]: e for e in logs if e["event"] == "request_finished"}
    streamed = events[-1].response
    for answer in (whole, streamed):
        record = records[answer.id]
        assert record["model"] == MODEL and record["n"] == 1 and record["finish_reason"] == "length"
        assert (record["prompt_tokens"], record["output_tokens"]) == (answer.usage.input_tokens,
                                                                      answer.usage.output_tokens)
        assert 0 < record["ttft_s"] <= record["latency_s"]


def test_responses_function_tools_parse_as_the_chat_path_does(server, tok):
    """A forced call (``tool_choice`` naming the function: a grammar) comes back as a function_call
    item whose arguments satisfy the schema; earlier calls and their outputs are input items that
    reach the chat template as the chat path's ``tool_calls`` and tool replies."""
    client = server.client()
    history = [{"role": "user", "content": "Weather in Oslo, then Rome?"},
               {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"},
               {"type": "function_call_output", "call_id": "call_1", "output": "rain"}]
    kw = dict(model=MODEL, input=history, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
              max_output_tokens=60)
    r = client.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    args = json.loads(calls[0].arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str)
    chat_tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    messages = [{"role": "user", "content": "Weather in Oslo, then Rome?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                       "arguments": {"city": "Oslo"}}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    assert r.usage.input_tokens == len(tok.encode_chat(messages, tools=chat_tools))
    # streamed: the same call, its arguments in deltas
    events = list(client.responses.create(stream=True, **kw))
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert pieces == done.arguments == calls[0].arguments
    assert [o.type for o in events[-1].response.output] == [o.type for o in r.output]


@pytest.mark.parametrize("extra, param", [
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"type": "message", "role": {}, "content": ""}]}, "input[0].role"),  # found by schemathesis: was a 500
    ({"input": [{"type": {}, "role": "user", "content": ""}]}, "input[0].type"),
    ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 10**9}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"tools": [{"type": "function", "name": ""}]}, "tools[0].name"),
    ({"text": {"format": {"type": "xml"}}}, "text.format"),
    ({"instructions": 7}, "instructions"),
])
def test_a_bad_responses_field_is_a_400_naming_it(server, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().responses.create(**{"model": MODEL, "input": "hi", "max_output_tokens": 4, **extra})
    error = caught.value.body
    assert error["param"] == param and error["message"].startswith(param + ":"), error


# --- /tokenize and /detokenize ----------------------------------------------------------------------


def test_tokenize_detokenize_round_trip_equals_transformers(server, hf):
    context = server.serving.limits.context
    for text in TEXTS:
        for special in (None, False, True):
            body: dict[str, Any] = {"model": MODEL, "prompt": text}
            if special is not None:
                body["add_special_tokens"] = special
            got = server.post("/tokenize", json=body).json()
            want = hf.encode(text, add_special_tokens=special is not False)
            assert got == {"count": len(want), "max_model_len": context, "tokens": want, "token_strs": None}
            back = server.post("/detokenize", json={"model": MODEL, "tokens": got["tokens"]}).json()
            assert back == {"prompt": hf.decode(want, skip_special_tokens=False)}
        assert server.post("/detokenize", json={"tokens": hf.encode(text, add_special_tokens=False)}).json() == \
            {"prompt": text}
    strs = server.post("/tokenize", json={"prompt": TEXTS[2], "return_token_strs": True}).json()["token_strs"]
    assert strs == hf.convert_ids_to_tokens(hf.encode(TEXTS[2]))


def test_tokenize_messages_equal_the_transformers_chat_template(server, hf):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[2]}]
    for generation in (True, False):
        got = server.post("/tokenize", json={"messages": messages, "add_generation_prompt": generation}).json()
        text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
        assert got["tokens"] == hf.encode(text, add_special_tokens=False) and got["count"] == len(got["tokens"])


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, "prompt"),
    ("/tokenize", {}, "messages"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "continue_final_message": True},
     "continue_final_message"),
    ("/detokenize", {"tokens": [1, 10**6]}, "tokens[1]"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens[1]"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {}, "tokens"),
])
def test_a_bad_tokenize_field_is_a_400_naming_it(server, path, body, param):
    r = server.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"].startswith(param + ":")


# --- /version, /docs, /v1/embeddings ----------------------------------------------------------------


def test_version_docs_and_no_embeddings(server):
    assert httpx.get(server.url + "/version", timeout=10).json() == {"version": version("fxsched")}
    docs = httpx.get(server.url + "/docs", timeout=10)
    assert docs.status_code == 200 and docs.headers["content-type"].startswith("text/html")
    assert "swagger-ui" in docs.text and "/openapi.json" in docs.text
    doc = httpx.get(server.url + "/openapi.json", timeout=10).json()
    for path, model in [("/v1/responses", "ResponsesRequest"), ("/tokenize", "TokenizeRequest"),
                        ("/detokenize", "DetokenizeRequest")]:
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"} and model in doc["components"]["schemas"]
    with pytest.raises(openai.NotFoundError) as caught:
        server.client().embeddings.create(model=MODEL, input="hello")
    error = caught.value.body
    assert error["code"] == "embeddings_not_served" and "/v1/chat/completions" in error["message"]


# --- vLLM's metrics ---------------------------------------------------------------------------------


def _delta(before: dict[str, float], after: dict[str, float], name: str, **labels: str) -> float:
    key = vkey(name, **labels)
    return after[key] - before.get(key, 0.0)


def test_vllm_metrics_move_with_the_requests(server, tok):
    """Over a few requests (a repeated long prompt for prefix cache hits, n=2, a stream, a Responses
    request), each vLLM-named metric moves by what the openai client reports; a refused request counts
    nowhere."""
    client = server.client()
    server.idle()
    before = server.metrics()
    long_prompt = " ".join(f"word{i}" for i in range(60))
    usages, choices = [], 0
    for _ in range(2):
        usages.append(client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=5).usage)
        choices += 1
    two = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, n=2)
    stream = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hey"}],
                                                 max_tokens=4, stream=True, stream_options={"include_usage": True}))
    usages.append(stream[-1].usage)
    choices += 1
    resp = client.responses.create(model=MODEL, input="Yo", max_output_tokens=6)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=5, temperature=-1)
    server.idle()
    after = server.metrics()
    prompt = sum(u.prompt_tokens for u in usages) + 2 * two.usage.prompt_tokens + resp.usage.input_tokens
    generated = sum(u.completion_tokens for u in usages) + two.usage.completion_tokens + resp.usage.output_tokens
    choices += 2 + 1
    assert _delta(before, after, "prompt_tokens_total") == prompt
    assert _delta(before, after, "generation_tokens_total") == generated
    assert _delta(before, after, "prefix_cache_queries_total") == prompt
    # the second long prompt came from the prefix cache (whole blocks); "Hi" is shorter than a block
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages) + resp.usage.input_tokens_details.cached_tokens
    assert usages[1].prompt_tokens_details.cached_tokens > 0
    assert _delta(before, after, "prefix_cache_hits_total") == cached
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                      "request_prefill_time_seconds", "request_decode_time_seconds",
                      "request_inference_time_seconds"):
        assert _delta(before, after, histogram + "_count") == choices, histogram
        assert after[vkey(histogram + "_bucket", le="+Inf")] == after[vkey(histogram + "_count")]
    # one frame per token without speculation: every token after a choice's first is one gap
    assert _delta(before, after, "inter_token_latency_seconds_count") == generated - choices
    assert _delta(before, after, "request_success_total", finished_reason="length") == choices
    assert _delta(before, after, "request_success_total", finished_reason="stop") == 0
    assert _delta(before, after, "num_preemptions_total") == 0
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert after[vkey(gauge)] == 0, gauge
    # vLLM's buckets
    assert vkey("time_to_first_token_seconds_bucket", le="2560.0") in after
    assert vkey("e2e_request_latency_seconds_bucket", le="7680.0") in after
    assert vkey("inter_token_latency_seconds_bucket", le="80.0") in after


def test_a_preemption_is_counted_once_per_released_sequence():
    """The engine's observer counts each sequence released for memory (requeued or spilled), and
    marks a request scheduled at its first allocation only (a swap-in names session 0)."""
    from fxsched.effects import device_calls as dc

    metrics = ServeMetrics("none", 8, 2, model_name="m")
    scheduled: list[int] = []
    watch = _Watch(scheduled.append, lambda: metrics.preemptions.inc())
    effects = [dc.AllocSequence(1, 7), ReleaseSeq(1, 0, cache=True, reason=ReleaseReason.PREEMPT_REQUEUE),
               ReleaseSeq(2, 1, cache=False, reason=ReleaseReason.SPILL_OUT_SEQUENCE),
               ReleaseSeq(3, 1, cache=True, reason=ReleaseReason.FINISH_SEQUENCE), dc.AllocSequence(4, 0),
               dc.AllocSequenceFor(5, 9, 100)]
    watch.stepped(None, None, effects)
    assert metrics.registry.get_sample_value("vllm:num_preemptions_total", {"model_name": "m", "engine": "0"}) == 2
    assert scheduled == [7, 9]
