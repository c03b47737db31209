"""The request fields of ``fxsched serve`` beyond the sampling basics (specs/serve-fields.md §13.1–5),
driven with the official ``openai`` client in the request shapes lm-eval and guidellm send.

References are independent of the server: transformers' own Qwen3_5ForCausalLM on the embedded
default model (prompt logprobs: ``log_softmax`` of its logits), and for penalties and
``logit_bias`` a greedy rollout computed by hand in plain Python over transformers' logits (vLLM's
rules, written out in ``_penalised``). The default model never emits EOS on its own (its EOS rows
of ``lm_head`` are zero, so the EOS logit is exactly 0): a ``logit_bias`` of +100 on EOS makes it
the greedy pick, which is what the EOS fields are tested with.
"""

from __future__ import annotations

import math
from typing import Any, Iterator

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from support.hf_tiny import transformers_torch_gdn  # noqa: E402
from test_serve import MODEL, Server, assert_free, load_engine  # noqa: E402

from fxsched.runtime.generate import TextOptions, generate  # noqa: E402
from fxsched.runtime.text import load_tokenizer  # noqa: E402
from fxsched.runtime.torch_model.default_model import default_model_dir  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONTEXT = "The lighthouse keeper climbed the stairs"
CONTINUATION = " and looked out to sea"


@pytest.fixture(scope="module")
def tok():
    tokenizer = load_tokenizer(default_model_dir())
    assert tokenizer is not None
    return tokenizer


@pytest.fixture(scope="module")
def server(tok) -> Iterator[Server]:
    s = Server(tok)
    yield s
    s.close()


@pytest.fixture(scope="module")
def hf_model() -> Iterator[Any]:
    transformers = pytest.importorskip("transformers")
    with transformers_torch_gdn():
        yield transformers.AutoModelForCausalLM.from_pretrained(str(default_model_dir())).eval()


def _hf_logits(hf_model, tokens: list[int]) -> list[list[float]]:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float().tolist()


def _log_softmax(row: list[float]) -> list[float]:
    top = max(row)
    total = math.log(sum(math.exp(v - top) for v in row)) + top
    return [v - total for v in row]


# --- prompt logprobs: lm-eval's loglikelihood shape ------------------------------------------------


@pytest.mark.parametrize("max_tokens,chunk", [(0, 512), (1, 512), (1, 3)])
def test_echo_with_logprobs_gives_the_prompt_logprobs_of_transformers(server, tok, hf_model, max_tokens, chunk,
                                                                      monkeypatch):
    """lm-eval ``local-completions`` loglikelihood: echo + logprobs 1 + max_tokens 0/1, temperature 0
    (and the prompt's forwards in chunks of 3 rows)."""
    from fxsched.runtime.devices import torch_proposers

    monkeypatch.setattr(torch_proposers, "PROMPT_LOGPROBS_CHUNK", chunk)
    prompt = CONTEXT + CONTINUATION
    ids = tok.encode(prompt)
    want = [_log_softmax(row) for row in _hf_logits(hf_model, ids)]
    done = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, logprobs=1,
                                              temperature=0, echo=True, seed=1234)
    choice = done.choices[0]
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + max_tokens
    assert "".join(lp.tokens[:len(ids)]) == prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(want[i - 1][ids[i]], abs=2e-4), i
        (top_text, top_lp), = lp.top_logprobs[i].items()
        best = max(range(len(want[i - 1])), key=lambda t: want[i - 1][t])
        assert top_lp == pytest.approx(want[i - 1][best], abs=2e-4)
        assert top_text == tok.decode([best], skip_special_tokens=False)
    assert lp.text_offset[:3] == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]
    if max_tokens:  # the generated token's record: the greedy pick, not null
        assert lp.token_logprobs[-1] == pytest.approx(want[-1][max(range(len(want[-1])), key=lambda t: want[-1][t])],
                                                      abs=2e-4)
    assert done.usage.completion_tokens == max_tokens
    assert choice.finish_reason == "length"


def test_loglikelihood_batch_of_token_id_prompts(server, tok, hf_model):
    """lm-eval's tokenized form: ``prompt`` a batch of token-id lists, echo, logprobs 1, max_tokens 1;
    the continuation's summed logprob and its is-greedy flag, read as lm-eval reads them."""
    context = tok.encode(CONTEXT)
    batch = [context + tok.encode(CONTINUATION), context + tok.encode(" and fell asleep")]
    done = server.client().completions.create(model=MODEL, prompt=batch, max_tokens=1, logprobs=1, temperature=0,
                                              echo=True, seed=1234)
    assert [c.index for c in done.choices] == [0, 1]
    for ids, choice in zip(batch, done.choices, strict=True):
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(ids) + 1
        want = [_log_softmax(row) for row in _hf_logits(hf_model, ids)]
        ctxlen = len(context)
        got_sum = sum(lp.token_logprobs[ctxlen:len(ids)])
        assert got_sum == pytest.approx(sum(want[i - 1][ids[i]] for i in range(ctxlen, len(ids))), abs=1e-3)
        greedy = all(max(top, key=top.get) == lp.tokens[i] for i, top in enumerate(lp.top_logprobs[ctxlen:len(ids)],
                                                                                    start=ctxlen))
        assert greedy == all(max(range(len(want[i - 1])), key=want[i - 1].__getitem__) == ids[i]
                             for i in range(ctxlen, len(ids)))


def test_prompt_logprobs_extension_for_completions_and_chat(server, tok, hf_model):
    ids = tok.encode(CONTEXT)
    want = [_log_softmax(row) for row in _hf_logits(hf_model, ids)]
    body = server.post("/v1/completions", json={"prompt": CONTEXT, "max_tokens": 2, "prompt_logprobs": 2}).json()
    got = body["choices"][0]["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    for i in range(1, len(ids)):
        entry = got[i][str(ids[i])]
        assert entry["logprob"] == pytest.approx(want[i - 1][ids[i]], abs=2e-4)
        assert entry["rank"] == 1 + sum(v > want[i - 1][ids[i]] for v in want[i - 1])
        assert entry["decoded_token"] == tok.decode([ids[i]], skip_special_tokens=False)
        ranked = sorted(range(len(want[i - 1])), key=lambda t: -want[i - 1][t])[:2]
        assert {str(t) for t in ranked} <= set(got[i])
    assert body["choices"][0]["text"] and body["choices"][0]["logprobs"] is None
    # n choices of one prompt share one prompt forward
    device = server.engine._device
    before = device.stats.calls["prompt_logprobs"]
    many = server.post("/v1/completions", json={"prompt": CONTEXT, "max_tokens": 1, "n": 3, "temperature": 1.0,
                                                "prompt_logprobs": 2}).json()
    assert [c["prompt_logprobs"] for c in many["choices"]] == [got] * 3
    assert server.engine._device.stats.calls["prompt_logprobs"] == before + 1
    messages = [{"role": "user", "content": CONTEXT}]
    chat_ids = tok.encode_chat(messages)
    want_chat = [_log_softmax(row) for row in _hf_logits(hf_model, chat_ids)]
    chat = server.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1,
                                                     "prompt_logprobs": 0}).json()
    got = chat["prompt_logprobs"]
    assert len(got) == len(chat_ids) and got[0] is None
    assert [e[str(t)]["logprob"] for e, t in zip(got[1:], chat_ids[1:], strict=True)] == pytest.approx(
        [w[t] for w, t in zip(want_chat, chat_ids[1:], strict=False)], abs=2e-4)
    server.idle()
    assert_free(server)


def test_echo_streamed_and_chat_echo(server, tok):
    client = server.client()
    whole = client.completions.create(model=MODEL, prompt=CONTEXT, max_tokens=4, echo=True)
    stream = client.completions.create(model=MODEL, prompt=CONTEXT, max_tokens=4, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == whole.choices[0].text
    plain = client.completions.create(model=MODEL, prompt=CONTEXT, max_tokens=4)
    assert whole.choices[0].text == CONTEXT + plain.choices[0].text
    # vLLM's chat echo: the assistant's last message is continued and shown before the reply
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3,
                                          extra_body={"echo": True, "add_generation_prompt": False})
    assert chat.choices[0].message.content.startswith("Once upon")
    assert len(chat.choices[0].message.content) > len("Once upon")


def test_every_generated_token_has_a_logprob_the_first_included(server, tok, hf_model):
    """Code that sums logprobs needs the first token's too: completions and chat, streamed and not,
    greedy and sampled; the first token's equals transformers' logprob of it after the prompt."""
    client = server.client()
    ids = tok.encode(CONTEXT)
    first = _log_softmax(_hf_logits(hf_model, ids)[-1])
    for temperature in (0.0, 0.9):
        whole = client.completions.create(model=MODEL, prompt=CONTEXT, max_tokens=5, logprobs=2,
                                          temperature=temperature, seed=7).choices[0].logprobs
        assert len(whole.token_logprobs) == 5 and None not in whole.token_logprobs
        # the ids whose text is the first token's (several when it is part of a character: U+FFFD)
        ids_of_text = [t for t in range(len(first)) if tok.decode([t]) == whole.tokens[0]]
        assert any(whole.token_logprobs[0] == pytest.approx(first[t], abs=2e-4) for t in ids_of_text)
        streamed = [c.choices[0].logprobs for c in client.completions.create(
            model=MODEL, prompt=CONTEXT, max_tokens=5, logprobs=2, temperature=temperature, seed=7, stream=True)
            if c.choices and c.choices[0].logprobs]
        # (the second request reuses the first's prefix-cache blocks: equal up to float rounding)
        assert [v for lp in streamed for v in lp.token_logprobs] == pytest.approx(whole.token_logprobs, abs=1e-4)
        messages = [{"role": "user", "content": CONTEXT}]
        chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, logprobs=True,
                                              temperature=temperature, seed=7).choices[0].logprobs.content
        assert len(chat) == 5 and all(e.logprob is not None and e.logprob <= 0 for e in chat)
        chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, logprobs=True,
                                                temperature=temperature, seed=7, stream=True)
        assert [e.logprob for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content] == pytest.approx([e.logprob for e in chat], abs=1e-4)


# --- generate_until shape, EOS fields, stop token ids ----------------------------------------------


def test_a_stream_sends_a_chunk_per_token_even_when_its_text_is_empty(server, tok):
    """vLLM streams one chunk per generated token, its text empty where the token shows nothing
    (a skipped special token, an incomplete character): clients time TTFT and inter-token latency
    by chunks (``vllm bench serve`` does). ``<|im_start|>`` is special and not an EOS here."""
    special = tok.tokenizer.token_to_id("<|im_start|>")
    client = server.client()
    stream = client.completions.create(model=MODEL, prompt=CONTEXT, max_tokens=5, temperature=0, stream=True,
                                       logprobs=0, logit_bias={str(special): 100})
    chunks = [c.choices[0] for c in stream if c.choices]
    assert all(c.text == "" for c in chunks), [(c.text, c.finish_reason) for c in chunks]
    # a chunk per token, each with its own token's logprobs, then the finish
    assert [len(c.logprobs.tokens) if c.logprobs else 0 for c in chunks] == [1] * 5 + [0]
    assert [c.finish_reason for c in chunks] == [None] * 5 + ["length"]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, stream=True, logit_bias={str(special): 100})
    assert len([c for c in chat if c.choices]) >= 4


def test_generate_until_shape(server, tok):
    """lm-eval generate_until: several prompts, ``stop`` strings, temperature 0, a seed."""
    client = server.client()
    full = client.completions.create(model=MODEL, prompt=CONTEXT, max_tokens=12, temperature=0).choices[0].text
    stop = full[5:8]
    assert stop not in full[:5] and stop
    got = client.completions.create(model=MODEL, prompt=[CONTEXT, CONTEXT], max_tokens=12, temperature=0, seed=1234,
                                    stop=[stop, "\n\n\n\n"])
    assert [c.text for c in got.choices] == [full[:full.index(stop)]] * 2
    assert all(c.finish_reason == "stop" for c in got.choices)
    kept = client.completions.create(model=MODEL, prompt=CONTEXT, max_tokens=12, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == full[:full.index(stop)] + stop


def test_eos_fields_ignore_eos_min_tokens_and_stop_token_ids(server, tok):
    client = server.client()
    eos = tok.eos_ids[0]
    bias = {str(eos): 100}
    ended = client.completions.create(model=MODEL, prompt=CONTEXT, max_tokens=8, logit_bias=bias)
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens == 1
    # guidellm's default request: ignore_eos runs to max_tokens even with EOS the likeliest token
    ran = client.completions.create(model=MODEL, prompt=CONTEXT, max_tokens=8, logit_bias=bias,
                                    extra_body={"ignore_eos": True})
    assert ran.choices[0].finish_reason == "length" and ran.usage.completion_tokens == 8
    least = client.completions.create(model=MODEL, prompt=CONTEXT, max_tokens=8, logit_bias=bias,
                                      extra_body={"min_tokens": 3})
    assert least.choices[0].finish_reason == "stop" and least.usage.completion_tokens == 4  # 3 + the EOS
    messages = [{"role": "user", "content": CONTEXT}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, logit_bias=bias)
    assert chat.choices[0].finish_reason == "stop" and chat.usage.completion_tokens == 1
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, logit_bias=bias,
                                          extra_body={"ignore_eos": True, "min_tokens": 2})
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 6
    # stop_token_ids: the first greedy token (offline generate()) not seen before it, past the first, ends
    # the choice there; its text only when asked
    greedy = generate(load_engine(), [tok.encode(CONTEXT)], 8, text=TextOptions(tok), eos_ids=tok.eos_ids).results[0]
    at = next(j for j in range(1, 8) if greedy.tokens[j] not in greedy.tokens[:j])
    third = greedy.tokens[at]
    pieces = [tok.decode([t], skip_special_tokens=False) for t in greedy.tokens]
    cut = client.completions.create(model=MODEL, prompt=CONTEXT, max_tokens=8, extra_body={"stop_token_ids": [third]})
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens == at + 1
    assert cut.choices[0].text == tok.decode(greedy.tokens[:at])
    body = server.post("/v1/completions", json={"prompt": CONTEXT, "max_tokens": 8, "stop_token_ids": [third],
                                                "include_stop_str_in_output": True}).json()["choices"][0]
    assert body["text"] == tok.decode(greedy.tokens[:at + 1]) and body["stop_reason"] == third
    assert "".join(pieces[:at + 1]) == body["text"]
    server.idle()
    assert_free(server)


# --- penalties and logit_bias: a hand computation over transformers' logits ------------------------


def _penalised(row: list[float], prompt: list[int], output: list[int], presence: float, frequency: float,
               repetition: float, bias: dict[int, float]) -> list[float]:
    """vLLM's order: logit_bias, then repetition (prompt and output), then frequency and presence (output)."""
    out = list(row)
    for t, b in bias.items():
        out[t] += b
    for t in set(prompt) | set(output):
        out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
    for t in set(output):
        out[t] -= frequency * output.count(t) + presence
    return out


def _hand_rollout(hf_model, prompt: list[int], n: int, **penalties: Any) -> list[int]:
    output: list[int] = []
    for _ in range(n):
        row = _penalised(_hf_logits(hf_model, prompt + output)[-1], prompt, output, **penalties)
        best = max(row)
        output.append(row.index(best))  # the lowest id among the maxima
    return output


PENALTIES = [
    dict(presence=0.0, frequency=0.0, repetition=1.8, bias={}),
    dict(presence=1.5, frequency=0.7, repetition=1.0, bias={}),
    dict(presence=0.5, frequency=0.5, repetition=1.3, bias={}),
]


@pytest.mark.parametrize("spec", ["none", "mtp", "ngram"])
def test_penalties_and_logit_bias_equal_a_hand_rollout(tok, hf_model, spec, server):
    prompt = tok.encode("Explain why the ocean is salty.")  # its greedy output loops: penalties change it
    plain = _hand_rollout(hf_model, prompt, 10, presence=0.0, frequency=0.0, repetition=1.0, bias={})
    biased = {plain[1]: -30.0, plain[3]: -30.0}
    cases = [*PENALTIES, dict(presence=0.0, frequency=0.0, repetition=1.0, bias=biased)]
    s = server if spec == "none" else Server(tok, spec=spec)
    try:
        client = s.client()
        for case in cases:
            want = _hand_rollout(hf_model, prompt, 10, **case)
            assert want != plain, case  # the case changes the greedy output
            done = client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=10, temperature=0, logprobs=0,
                presence_penalty=case["presence"], frequency_penalty=case["frequency"],
                logit_bias={str(t): b for t, b in case["bias"].items()},
                extra_body={"repetition_penalty": case["repetition"]})
            assert done.choices[0].text == tok.decode(want), (spec, case, want)
        s.idle()
        assert_free(s)
    finally:
        if s is not server:
            s.close()


# --- the field policy -------------------------------------------------------------------------------


def _unknown_count(server: Server, endpoint: str) -> float:
    return server.metrics().get(f"fxsched_unknown_fields_total{{endpoint={endpoint}}}", 0.0)


def test_field_policy_unknown_ignored_and_counted_refused_named(server):
    before = _unknown_count(server, "completions")
    ok = server.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "frobnicate": 1, "zork": [1]})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    assert _unknown_count(server, "completions") == before + 2
    chat_before = _unknown_count(server, "chat_completions")
    ok = server.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                   "max_tokens": 1, "store": True})
    assert ok.status_code == 200 and _unknown_count(server, "chat_completions") == chat_before + 1
    for path, payload, param in [
        ("/v1/completions", {"prompt": "hi", "guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
        ("/v1/completions", {"prompt": "hi", "suffix": "x"}, "suffix"),
        ("/v1/completions", {"prompt": "hi", "use_beam_search": True}, "use_beam_search"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
        ("/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
        ("/v1/completions", {"prompt": "hi", "min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids"),
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                  "functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ]:
        r = server.post(path, json=payload)
        assert r.status_code == 400, (payload, r.text)
        assert r.json()["error"]["param"] == param and r.json()["error"]["message"].startswith(param)


def test_openapi_describes_the_routes_and_their_request_models(server):
    doc = httpx.get(server.url + "/openapi.json", timeout=10).json()
    for path, model in [("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")]:
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
        fields = doc["components"]["schemas"][model]["properties"]
        assert {"echo", "logit_bias", "ignore_eos", "min_tokens", "stop_token_ids", "prompt_logprobs"} <= set(fields)
    assert {"/health", "/metrics", "/v1/models"} <= set(doc["paths"])
    # every status a JSON route can answer is documented (schemathesis --checks all reads them), and
    # /metrics is Prometheus text, not JSON
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize",
                 "/v1/embeddings"):
        answers = doc["paths"][path]["post"]["responses"]
        assert {"401", "404", "413", "415", "503"} <= set(answers), (path, sorted(answers))
        seen = {str(server.post(path, content=b"{}").status_code),
                str(server.post(path, json={"model": "nobody"}).status_code)}
        assert seen <= set(answers), (path, seen)
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert httpx.get(server.url + "/metrics").headers["content-type"].startswith("text/plain")


def _value_schema(doc: dict[str, Any], model: str, field: str) -> dict[str, Any]:
    """The schema of ``field``'s non-null values in ``model`` (an Optional is anyOf [T, null])."""
    prop = doc["components"]["schemas"][model]["properties"][field]
    shapes = [b for b in prop.get("anyOf", [prop]) if b.get("type") != "null"]
    assert len(shapes) == 1, (model, field, prop)
    return shapes[0]


def _nudge(value: float, up: bool, integer: bool) -> float:
    step = 1 if integer else 1e-6
    return value + step if up else value - step


def test_openapi_states_the_bounds_the_server_enforces(server, tok):
    """Every range /openapi.json states for a sampling number is the range a request meets: the
    bound itself (unless exclusive) is served, one step past it is a 400 naming the field. The
    bounds are read from the document, the verdicts from the server."""
    doc = httpx.get(server.url + "/openapi.json", timeout=10).json()
    fields = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
              "n", "top_k", "prompt_logprobs", "logprobs")
    probed = 0
    for field in fields:
        shape = _value_schema(doc, "CompletionRequest", field)
        integer = shape["type"] == "integer"
        for key, up in (("minimum", False), ("exclusiveMinimum", False), ("maximum", True)):
            if key not in shape:
                continue
            bound = shape[key]
            inside = _nudge(bound, not up, integer) if key == "exclusiveMinimum" else bound
            outside = bound if key == "exclusiveMinimum" else _nudge(bound, up, integer)
            body = {"prompt": "hi", "max_tokens": 1}
            ok = server.post("/v1/completions", json={**body, field: inside})
            assert ok.status_code == 200, (field, inside, ok.text)
            bad = server.post("/v1/completions", json={**body, field: outside})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == field, (field, outside, bad.text)
            probed += 1
    assert probed >= 14  # each float has two bounds; n, prompt_logprobs, logprobs two; top_k a floor
    # lists and ids: the stated limits are the served ones
    vocab = _value_schema(doc, "CompletionRequest", "stop_token_ids")["items"]["maximum"] + 1
    assert vocab == tok.vocab_size
    assert server.post("/detokenize", json={"tokens": [vocab - 1]}).status_code == 200
    assert server.post("/detokenize", json={"tokens": [vocab]}).status_code == 400
    prop = doc["components"]["schemas"]["CompletionRequest"]["properties"]["stop"]
    most = next(b["maxItems"] for b in prop["anyOf"] if b.get("type") == "array")
    assert server.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1,
                                                "stop": [f"s{i}" for i in range(most)]}).status_code == 200
    assert server.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1,
                                                "stop": [f"s{i}" for i in range(most + 1)]}).status_code == 400
    # a refused field takes only its neutral values in the document, and any other is a 400
    assert doc["components"]["schemas"]["CompletionRequest"]["properties"]["suffix"]["enum"] == [None]
    assert server.post("/v1/completions", json={"prompt": "hi", "suffix": "x"}).status_code == 400
    assert _value_schema(doc, "ChatCompletionRequest", "messages")["minItems"] == 1
    assert server.post("/v1/chat/completions", json={"messages": []}).status_code == 400


def test_integral_numbers_are_integers_and_an_empty_model_is_the_served_one(server):
    """JSON Schema counts 2.0 as an integer, and vLLM serves its model for ``"model": ""``; a
    string or a boolean is still no integer, and another name is still vLLM's 404."""
    r = server.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2.0, "n": 1.0, "model": ""})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    for bad in ("2", True, 2.5):
        r = server.post("/v1/completions", json={"prompt": "hi", "max_tokens": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", (bad, r.text)
    ids = server.post("/tokenize", json={"prompt": "hi", "model": ""}).json()["tokens"]
    assert server.post("/detokenize", json={"tokens": [float(t) for t in ids]}).json()["prompt"] == "hi"
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": ids}),
                       ("/v1/responses", {"input": "hi", "max_output_tokens": 1})):
        wrong = server.post(path, json={**body, "model": "nobody"})
        assert wrong.status_code == 404 and wrong.json()["error"]["code"] == 404, (path, wrong.text)


# --- a bounded schemathesis run against /openapi.json -----------------------------------------------

FUZZ_EXAMPLES = 30  # per operation; derandomized, so every run sends the same requests
BUDGETS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "min_tokens", "n", "best_of")


def _bounded(body: Any) -> Any:
    """Keep the fuzzed bodies cheap to serve: budgets above 4 become 4 (out-of-range values, negative
    or beyond the context, stay as generated: they must get their 400)."""
    if isinstance(body, dict):
        if "input" in body and "max_output_tokens" not in body:  # /v1/responses: the default budget is the context
            body["max_output_tokens"] = 4
        for key in BUDGETS:
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and 4 < value < 10**6:
                body[key] = 4
    return body


def test_schemathesis_finds_no_server_error(server):
    """Requests generated from /openapi.json (schemathesis, in-process over ASGI): never a 5xx."""
    schemathesis = pytest.importorskip("schemathesis")
    hypothesis = pytest.importorskip("hypothesis")
    # the server listens on loopback, so it answers only a loopback Host (serve-security.md §14.1)
    local = {"host": "localhost"}
    schema = schemathesis.openapi.from_asgi("/openapi.json", server.serving.app, headers=local)
    seen: dict[str, set[int]] = {}
    for result in schema.get_all_operations():
        operation = result.ok()

        @hypothesis.settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=True,
                             suppress_health_check=list(hypothesis.HealthCheck),
                             phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate])
        @hypothesis.given(operation.as_strategy())
        def check(case: Any) -> None:
            case.body = _bounded(case.body)
            response = case.call(headers=local)
            seen.setdefault(case.operation.label, set()).add(response.status_code)
            assert response.status_code < 500, (case.operation.label, case.body, response.text[:300])

        check()
    assert {"POST /v1/completions", "POST /v1/chat/completions", "POST /v1/responses", "POST /tokenize",
            "POST /detokenize"} <= set(seen)
    assert 200 in seen["POST /v1/completions"] and 400 in seen["POST /v1/completions"]
    server.idle()
    assert_free(server)
