"""Structured output (specs/serve.md §12.1–2) together with the field policy and the row processors of
specs/serve-fields.md §13.1–3, through the ``openai`` client against the embedded default model.

The reference is independent of the server: a greedy rollout over transformers' logits in which a
fresh llguidance matcher (the library itself, fed the output so far) gives the allowed ids, and
penalties and ``logit_bias`` are applied by hand (``_penalised``, vLLM's rules). The server masks a
row when the forward's logits are stored and runs the processors later, at the pick; the reference
penalises first and picks the best allowed id: for a greedy pick the two orders agree exactly when
a refused id stays at −∞ whatever its bias. ``jsonschema`` validates every answer.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("fastapi")
llguidance = pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

from support.hf_tiny import transformers_torch_gdn  # noqa: E402
from test_serve import MODEL, Server, assert_free  # noqa: E402
from test_serve_fields import _hf_logits, _penalised  # noqa: E402

from fxsched.runtime.text import load_tokenizer  # noqa: E402
from fxsched.runtime.torch_model.default_model import default_model_dir  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue", "cyan"]},
                   "n": {"type": "integer", "minimum": 0, "maximum": 9},
                   "ok": {"type": "boolean"}},
    "required": ["color", "n", "ok"],
    "additionalProperties": False,
}
PROMPT = "Describe the sky as JSON:"
BUDGET = 40  # the schema's answers are about 15 tokens


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


@pytest.fixture(scope="module")
def reference(tok, hf_model):
    """``rollout(prompt, presence=, frequency=, repetition=, bias=)`` -> (tokens, the positions where
    the grammar allowed more than one id, the ids allowed at the first position)."""
    vocab = hf_model.config.vocab_size
    ll_tok = llguidance.LLTokenizer(tok.tokenizer.to_str(), n_vocab=vocab, eos_token=list(tok.eos_ids))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA),
                                                            defaults={"whitespace_flexible": False})

    def rollout(prompt: list[int], **penalties: Any) -> tuple[list[int], list[int], set[int]]:
        matcher = llguidance.LLMatcher(ll_tok, grammar)
        output: list[int] = []
        branching: list[int] = []
        first: set[int] = set()
        for _ in range(BUDGET):
            mask = matcher.compute_bitmask()
            allowed = [i for i in range(vocab) if mask[i // 8] >> (i % 8) & 1]
            assert allowed, output
            if not output:
                first = set(allowed)
            if len(allowed) > 1:
                branching.append(len(output))
            row = _penalised(_hf_logits(hf_model, prompt + output)[-1], prompt, output, **penalties)
            pick = max(allowed, key=lambda i: (row[i], -i))  # the lowest id among the maxima
            output.append(pick)
            if pick in tok.eos_ids:
                break
            assert matcher.consume_token(pick)
        return output, branching, first

    return rollout


def _text(tok, tokens: list[int]) -> str:
    return tok.decode([t for t in tokens if t not in tok.eos_ids])


@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_json_schema_with_penalties_and_logit_bias_equals_a_masked_hand_rollout(tok, hf_model, reference, server,
                                                                                spec):
    prompt = tok.encode(PROMPT)
    plain, branching, first = reference(prompt, presence=0.0, frequency=0.0, repetition=1.0, bias={})
    assert plain[-1] in tok.eos_ids and len(branching) >= 2
    raw = _hf_logits(hf_model, prompt)[-1]
    refused = max((i for i in range(len(raw)) if i not in first), key=lambda i: raw[i])
    assert raw[refused] > max(raw[i] for i in first)  # unconstrained, the model would not start with JSON
    # +100 on the model's favourite refused token (it must stay refused), -30 on the plain answer's
    # picks at its first two branch points (the bias must move the answer among the allowed ids)
    steer = {refused: 100.0, plain[branching[0]]: -30.0, plain[branching[1]]: -30.0}
    cases = [dict(presence=0.0, frequency=0.0, repetition=1.0, bias=steer),
             dict(presence=1.5, frequency=0.7, repetition=1.3, bias={refused: 100.0})]
    s = server if spec == "none" else Server(tok, spec=spec)
    try:
        client = s.client()
        fmt = {"type": "json_schema", "json_schema": {"name": "sky", "schema": SCHEMA}}
        for case in cases:
            want, _, _ = reference(prompt, **case)
            assert want[-1] in tok.eos_ids
            done = client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=BUDGET, temperature=0,
                presence_penalty=case["presence"], frequency_penalty=case["frequency"],
                logit_bias={str(t): b for t, b in case["bias"].items()},
                extra_body={"repetition_penalty": case["repetition"], "response_format": fmt})
            choice = done.choices[0]
            assert (choice.text, choice.finish_reason) == (_text(tok, want), "stop"), (spec, case)
            jsonschema.validate(json.loads(choice.text), SCHEMA)
        assert reference(prompt, **cases[0])[0] != plain  # the bias moved the answer
        # sampled: the processed, masked rows still only allow the schema's answers
        sampled = client.completions.create(model=MODEL, prompt=prompt, max_tokens=BUDGET, n=3, temperature=1.0,
                                            seed=11, presence_penalty=1.0, logit_bias={str(refused): 100},
                                            extra_body={"repetition_penalty": 1.2, "response_format": fmt})
        for choice in sampled.choices:
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.text), SCHEMA)
        s.idle()
        assert_free(s)
    finally:
        if s is not server:
            s.close()


def _unknown_count(server: Server) -> float:
    return server.metrics().get("fxsched_unknown_fields_total{endpoint=chat_completions}", 0.0)


def test_structured_output_fields_are_honoured_not_refused_nor_counted(server):
    client = server.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "sky", "schema": SCHEMA}}
    messages = [{"role": "user", "content": PROMPT}]
    before = _unknown_count(server)
    done = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=BUDGET, response_format=fmt,
                                          frequency_penalty=0.5, logit_bias={"5": -20},
                                          extra_body={"guided_decoding_backend": "guidance", "frobnicate": 1})
    assert done.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(done.choices[0].message.content), SCHEMA)
    assert _unknown_count(server) == before + 1  # frobnicate only: the structured fields are declared
    for name, value in (("guided_json", SCHEMA), ("structured_outputs", {"json": SCHEMA})):
        got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=BUDGET,
                                             extra_body={name: value})
        jsonschema.validate(json.loads(got.choices[0].message.content), SCHEMA)
    assert _unknown_count(server) == before + 1
    # what a grammar cannot honour is still a 400 naming the field
    for extra, param in (({"ignore_eos": True}, "ignore_eos"), ({"min_tokens": 2}, "min_tokens"),
                         ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern")):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, response_format=fmt,
                                           extra_body=extra)
        body = err.value.body
        assert isinstance(body, dict) and body.get("param", body.get("error", {}).get("param")) == param, body
    server.idle()
    assert_free(server)
