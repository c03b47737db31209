"""Structured output and tool calling of ``fxsched serve`` (runtime/serve/structured.py, tools.py,
runtime/devices/grammar_mask.py), driven by the ``openai`` client against the embedded default model.

The model is random: whatever it prefers, the grammar decides what it may say. So the checks are
on the grammar's side, with independent validators: ``jsonschema`` validates the JSON answers
(a hand check where it is not installed), ``re.fullmatch`` the regex answers, the choice list the
guided choices. Speculation (greedy) must give the constrained greedy text of a server without it,
with drafts checked against the grammar: a drafter proposing the model's *unconstrained* greedy
continuation (which the grammar refuses) changes nothing, and one proposing the constrained
continuation gets its drafts accepted (the verify rows' masks follow the draft path).
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any, Optional

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from test_serve import MODEL, Server, assert_free, load_engine  # noqa: E402

from fxsched.runtime.serve.protocol import ChoiceSpec  # noqa: E402
from fxsched.runtime.serve.server import ServeSettings, Serving, bind_socket  # noqa: E402
from fxsched.runtime.serve.structured import json_grammar  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "ok", "color"],
    "additionalProperties": False,
}
WEATHER: dict[str, Any] = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping", "parameters": {
             "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
             "required": ["n"], "additionalProperties": False}}}]
PROMPT = "Describe a person as JSON:"


def validate(value: Any, schema: dict[str, Any]) -> None:
    """``jsonschema`` when installed, else a hand check of the subset the schemas here use."""
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    if jsonschema is not None:
        jsonschema.validate(value, schema)
        return
    kinds: dict[str, type] = {"object": dict, "string": str, "boolean": bool, "array": list}
    if "enum" in schema:
        assert value in schema["enum"]
        return
    kind = schema["type"]
    if kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool)
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value)
        return
    assert isinstance(value, kinds[kind]), (value, kind)
    v: Any = value
    if kind == "string":
        assert len(v) <= schema.get("maxLength", len(v))
    if kind == "array":
        assert len(v) <= schema.get("maxItems", len(v))
        for item in v:
            validate(item, schema["items"])
    if kind == "object":
        assert set(schema.get("required", ())) <= set(v)
        assert set(v) <= set(schema["properties"])
        for key, item in v.items():
            validate(item, schema["properties"][key])


@pytest.fixture(scope="module")
def tok():
    from fxsched.runtime.text import load_tokenizer
    from fxsched.runtime.torch_model.default_model import default_model_dir

    return load_tokenizer(default_model_dir())


@pytest.fixture(scope="module")
def server(tok):
    s = Server(tok)
    yield s
    s.close()


def _chat(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], **kw)


def _streamed_text(stream) -> tuple[str, Optional[str]]:
    text, reason = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
    return text, reason


# --- structured output ------------------------------------------------------------------------------


def test_json_schema_answers_validate_streamed_and_not(server):
    client = server.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    whole = _chat(client, max_tokens=120, response_format=fmt)
    assert whole.choices[0].finish_reason == "stop"
    validate(json.loads(whole.choices[0].message.content), SCHEMA)
    streamed, reason = _streamed_text(_chat(client, max_tokens=120, response_format=fmt, stream=True))
    assert (streamed, reason) == (whole.choices[0].message.content, "stop")
    # sampled choices too, through vLLM's spellings
    for extra in ({"guided_json": SCHEMA}, {"structured_outputs": {"json": json.dumps(SCHEMA)}}):
        done = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=120, n=3, temperature=1.0,
                                                  seed=7, extra_body=extra)
        for choice in done.choices:
            assert choice.finish_reason == "stop"
            validate(json.loads(choice.text), SCHEMA)
    server.idle()
    assert_free(server)


def test_json_object_regex_choice_and_grammar(server, tok):
    client = server.client()
    # the default model, trained on novels, fills a free JSON object with prose for ever; a bias towards
    # the quote and the closing brace makes it close as soon as the grammar lets it
    close = {str(tok.encode(c)[0]): 8 for c in ('"', "}")}
    obj = _chat(client, max_tokens=120, response_format={"type": "json_object"}, logit_bias=close)
    assert obj.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    unbiased = _chat(client, max_tokens=40, response_format={"type": "json_object"})
    assert unbiased.choices[0].message.content.startswith("{")  # a prefix of an object, cut at max_tokens
    choices = ["yes", "no", "maybe later"]
    seen = set()
    for seed in range(4):
        done = client.completions.create(model=MODEL, prompt=["Pick one:", "Answer:"], max_tokens=10, n=2,
                                         temperature=1.0, seed=seed, extra_body={"guided_choice": choices})
        for choice in done.choices:
            assert choice.text in choices and choice.finish_reason == "stop"
            seen.add(choice.text)
    assert len(seen) > 1  # sampling reaches more than one choice
    pattern = r"[a-c]{3}-[0-9]{2}"
    done = client.completions.create(model=MODEL, prompt="Code:", max_tokens=20, n=3, temperature=0.9, seed=3,
                                     extra_body={"structured_outputs": {"regex": pattern}})
    assert all(re.fullmatch(pattern, c.text) and c.finish_reason == "stop" for c in done.choices)
    gbnf = 'root ::= "<" pair pair? ">"\npair ::= "ab" | "cd"'
    done = client.completions.create(model=MODEL, prompt="x", max_tokens=30, extra_body={"guided_grammar": gbnf})
    assert re.fullmatch(r"<(ab|cd){1,2}>", done.choices[0].text) and done.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("payload, param", [
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "guided_regex"),
    ({"guided_choice": ["a", "b"], "min_tokens": 3}, "min_tokens"),
])
def test_bad_constraints_get_400_naming_the_field(server, payload, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **payload}
    r = server.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error
    assert "/" not in error["message"].split(":", 1)[1] or "regex" in param  # no server paths


# --- speculation: drafts checked against the grammar ------------------------------------------------


def _tokens(engine, spec: ChoiceSpec) -> list[int]:
    """The token ids of one choice run straight through ``ServeEngine.submit``."""
    got: list[int] = []
    done = threading.Event()

    def sink(event) -> None:
        got.extend(event.tokens)
        if event.final:
            done.set()

    engine.submit([spec], sink)
    assert done.wait(60)
    return got


class _ListDrafter:
    """Proposes the continuation of ``target`` after what the sequence has generated (``prompt``
    tokens, then the generated ones); past its end, the last token again."""

    def __init__(self, prompt: list[int], target: list[int]):
        self.prompt, self.target = prompt, target

    def __call__(self, committed: list, last: int, n: int) -> list:
        done = len(committed) + 1 - len(self.prompt)
        tail = self.target[done:done + n]
        return tail + [self.target[-1]] * (n - len(tail))


def _spec_server(tok, drafter) -> Serving:
    serving = Serving(load_engine(), tok, ServeSettings(model_name=MODEL, spec="mtp"), bind_socket("127.0.0.1", 0),
                      drafter=drafter)
    thread = threading.Thread(target=serving.run, daemon=True)
    thread.start()
    assert serving.wait_started(60)
    serving._test_thread = thread  # type: ignore[attr-defined]
    return serving


def _stop(serving: Serving) -> None:
    serving.stop()
    serving._test_thread.join(30)  # type: ignore[attr-defined]


def test_speculative_drafts_are_checked_against_the_grammar(server, tok):
    prompt = tok.encode(PROMPT)
    grammar = json_grammar(SCHEMA, "schema")
    constrained = _tokens(server.engine, ChoiceSpec(tuple(prompt), 120, grammar=grammar))
    free = _tokens(server.engine, ChoiceSpec(tuple(prompt), 40))
    assert constrained[:5] != free[:5]  # the grammar changes the greedy answer
    reference = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=120,
                                                   extra_body={"guided_json": SCHEMA}).choices[0].text
    validate(json.loads(reference), SCHEMA)
    for target, accepted in ((free, False), (constrained, True)):  # 0 and 29 of 40 here
        serving = _spec_server(tok, _ListDrafter(prompt, target))
        try:
            client = openai.OpenAI(base_url=serving.url + "/v1", api_key="x", max_retries=0)
            done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=120,
                                             extra_body={"guided_json": SCHEMA})
            assert done.choices[0].text == reference
            if not accepted:  # a rejection-sampled verify with drafts the grammar refuses
                sampled = client.completions.create(model=MODEL, prompt=prompt, max_tokens=120, temperature=1.0,
                                                    seed=5, extra_body={"guided_json": SCHEMA})
                validate(json.loads(sampled.choices[0].text), SCHEMA)
            metrics = httpx.get(serving.url + "/metrics", timeout=10).text
            kept = [float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("vllm:spec_decode_num_accepted_tokens_total{")]
            # the unconstrained drafts are refused by the grammar (row masks); the constrained ones are
            # accepted (the masks of the verify rows follow the draft path)
            assert kept and (kept[0] >= len(constrained) // 2 if accepted else kept[0] <= 2), kept
        finally:
            _stop(serving)


@pytest.mark.parametrize("spec", ["mtp", "ngram"])
def test_speculative_servers_answer_the_constrained_greedy_text(server, tok, spec):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    plain = _chat(server.client(), max_tokens=120, response_format=fmt).choices[0].message.content
    s = Server(tok, spec=spec)
    try:
        got = _chat(s.client(), max_tokens=120, response_format=fmt)
        assert got.choices[0].message.content == plain
        validate(json.loads(plain), SCHEMA)
        sampled = s.client().completions.create(model=MODEL, prompt="Pick one:", max_tokens=10, n=4, temperature=1.0,
                                                seed=1, extra_body={"guided_choice": ["yes", "no"]})
        assert all(c.text in ("yes", "no") for c in sampled.choices)
        s.idle()
        assert_free(s)
    finally:
        s.close()


# --- tool calling -----------------------------------------------------------------------------------


def _tool_chat(client, max_tokens: int = 150, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                          tools=TOOLS, max_tokens=max_tokens, **kw)


def test_named_and_required_tool_calls_streamed_and_not(server):
    client = server.client()
    named = {"type": "function", "function": {"name": "get_weather"}}
    done = _tool_chat(client, tool_choice=named)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-") and call.function.name == "get_weather"
    validate(json.loads(call.function.arguments), WEATHER)
    # streamed: the name once, then argument pieces that join to the same arguments
    names, pieces, ids, reason, content = [], [], [], None, ""
    for chunk in _tool_chat(client, tool_choice=named, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or ():
            assert tc.index == 0
            if tc.id:
                ids.append(tc.id)
            if tc.function.name:
                names.append(tc.function.name)
            pieces.append(tc.function.arguments or "")
        reason = chunk.choices[0].finish_reason or reason
    assert (names, len(ids), reason, content) == (["get_weather"], 1, "tool_calls", "")
    assert json.loads("".join(pieces)) == json.loads(call.function.arguments)
    required = _tool_chat(client, tool_choice="required")
    calls = required.choices[0].message.tool_calls
    assert calls and all(c.function.name in ("get_weather", "ping") for c in calls)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    if required.choices[0].finish_reason == "tool_calls":
        for c in calls:
            validate(json.loads(c.function.arguments), schemas[c.function.name])
    single = _tool_chat(client, tool_choice="required", parallel_tool_calls=False)
    assert single.choices[0].finish_reason == "tool_calls" and len(single.choices[0].message.tool_calls) == 1
    (only,) = single.choices[0].message.tool_calls
    validate(json.loads(only.function.arguments), schemas[only.function.name])
    # auto: the random model writes no call, so the answer is content; none: the tools are not shown
    auto = _tool_chat(client, max_tokens=8)
    assert auto.choices[0].message.tool_calls is None and auto.choices[0].finish_reason == "length"
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
               {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    follow = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert follow.choices[0].finish_reason == "length" and follow.choices[0].message.tool_calls is None
    # the prompts the template rendered: as transformers renders the same history (tools shown unless "none")
    transformers = pytest.importorskip("transformers")
    from fxsched.runtime.torch_model.default_model import default_model_dir

    hf = transformers.AutoTokenizer.from_pretrained(str(default_model_dir()))
    for tool_choice, shown in (("none", None), ("auto", TOOLS)):
        got = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice=tool_choice,
                                             max_tokens=1)
        ids = hf.apply_chat_template(history, tools=shown, tokenize=True, add_generation_prompt=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        assert got.usage.prompt_tokens == len(ids)
