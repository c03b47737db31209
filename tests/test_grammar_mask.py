"""The device side of structured output (runtime/devices/grammar_mask.py) and the tool-call parser
(runtime/serve/tools.py), without a server.

References: a fresh llguidance matcher fed the whole path gives each row's mask (the book's synced
matcher, rolled back and advanced across verifies, must agree); masks are checked bit by bit
against a hand-built one; the parser against hand-written replies and their expected calls.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
llguidance = pytest.importorskip("llguidance")

from fxsched.runtime.devices.grammar_mask import GrammarBook, apply_bitmask  # noqa: E402
from fxsched.runtime.serve import tools  # noqa: E402
from fxsched.runtime.serve.structured import grammar_tokenizer, json_grammar, matcher  # noqa: E402
from fxsched.runtime.torch_model.default_model import VOCAB_SIZE as VOCAB  # noqa: E402  (the logits' width)


@pytest.fixture(scope="module")
def ll():
    from fxsched.runtime.text import load_tokenizer
    from fxsched.runtime.torch_model.default_model import default_model_dir

    tok = load_tokenizer(default_model_dir())
    return tok, grammar_tokenizer(tok, VOCAB, tuple(tok.eos_ids))


def _allowed(mask: bytes, vocab: int) -> set[int]:
    return {i for i in range(vocab) if mask[i // 8] >> (i % 8) & 1}


def test_apply_bitmask_keeps_exactly_the_allowed_ids():
    vocab = 70
    logits = torch.randn(3, vocab)
    keep = {0: {1, 5, 69}, 2: {31, 32, 33}}
    masks = []
    for row in (0, 2):
        raw = bytearray(12)  # three 32-bit words
        for i in keep[row]:
            raw[i // 8] |= 1 << (i % 8)
        masks.append(bytes(raw))
    out = apply_bitmask(logits, [0, 2], masks)
    for row in range(3):
        for i in range(vocab):
            expect = logits[row, i] if row == 1 or i in keep[row] else -torch.inf
            assert out[row, i] == expect, (row, i)
    assert torch.isfinite(logits).all()  # the input is left alone


def test_masks_along_paths_with_rollbacks_equal_a_fresh_matcher(ll):
    tok, llt = ll
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["xy", "z"]}},
              "required": ["a", "b"], "additionalProperties": False}
    grammar = json_grammar(schema, "schema")
    answer = tok.encode('{"a":123,"b":"xy"}', add_special_tokens=False)
    wrong = tok.encode('{"b"', add_special_tokens=False)
    prompt = [5, 6, 7]
    book = GrammarBook()
    book.add(11, len(prompt), matcher(llt, grammar))

    def fresh(generated):
        m = matcher(llt, grammar)
        assert m.consume_tokens(list(generated))
        return m.compute_bitmask()

    # a verify along the answer, then one along a refused draft path, then back to the answer
    steps = [[prompt + answer[:j] for j in range(0, 4)],
             [prompt + answer[:2] + wrong[1:1 + j] for j in range(0, 3)],
             [prompt + answer[:j] for j in range(2, len(answer) + 1)]]
    for k, paths in enumerate(steps):
        rows, masks = book.masks([(r, 11, p) for r, p in enumerate(paths)])
        for r, mask in zip(rows, masks, strict=True):
            assert mask == fresh(paths[r][len(prompt):]), (paths[r], r)
        valid = [r for r, p in enumerate(paths) if fresh_ok(llt, grammar, p[len(prompt):])]
        assert rows == valid  # rows past a refused token get no mask (nobody reads them)
        assert (len(valid) < len(paths)) == (k == 1)  # '{""' is refused: an empty key is not in the schema
    # the complete answer allows only the EOS ids
    assert _allowed(masks[-1], VOCAB) == set(tok.eos_ids)
    book.drop(11)
    assert book.masks([(0, 11, prompt)]) == ([], [])


def fresh_ok(llt, grammar, generated) -> bool:
    m = matcher(llt, grammar)
    return m.try_consume_tokens(list(generated)) == len(generated)


# --- the tool-call parser -----------------------------------------------------------------------------

REPLY = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "nest": {"k": [1, 2]}}}\n'
         '</tool_call>\n<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>')


def test_parse_whole_replies():
    content, calls = tools.parse(REPLY)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo", "nest": {"k": [1, 2]}}), ("ping", {})]
    assert len({c["id"] for c in calls}) == 2 and all(c["type"] == "function" for c in calls)
    assert tools.parse("no calls here") == ("no calls here", [])
    broken = "text <tool_call>\n{not json}\n</tool_call>"
    assert tools.parse(broken) == (broken, [])
    content, calls = tools.parse('<tool_call>\n{"name": "ping", "arguments": {"n": 1}}')  # cut before the close
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"n": 1}


@pytest.mark.parametrize("size", [1, 2, 3, 5, 11, 1000])
def test_streamed_deltas_join_to_the_calls_whatever_the_pieces(size):
    stream = tools.ToolStream()
    deltas = []
    for i in range(0, len(REPLY), size):
        deltas += stream.push(REPLY[i:i + size])
    deltas += stream.finish()
    content = "".join(d.get("content", "") for d in deltas)
    assert content.strip() == "Let me check."
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    for d in deltas:
        for tc in d.get("tool_calls", ()):
            if "id" in tc:
                assert tc["index"] not in names and tc["id"].startswith("chatcmpl-tool-")
                names[tc["index"]] = tc["function"]["name"]
            args[tc["index"]] = args.get(tc["index"], "") + tc["function"].get("arguments", "")
    assert names == {0: "get_weather", 1: "ping"}
    assert json.loads(args[0]) == {"city": "Oslo", "nest": {"k": [1, 2]}} and json.loads(args[1]) == {}
    assert stream.calls == 2


def test_a_partial_open_tag_is_held_back_then_released():
    stream = tools.ToolStream()
    assert stream.push("a <tool") == [{"content": "a "}]
    assert stream.push("box>") == [{"content": "<toolbox>"}]
    assert stream.push("<tool_c") == []
    assert stream.finish() == [{"content": "<tool_c"}]


# --- the torch device: masked rows through a spill, and in a verify ------------------------------------


def _device(ll, book):
    from fxsched.runtime.devices.torch import TorchDevice
    from fxsched.runtime.torch_model import HybridEngine
    from fxsched.runtime.torch_model.default_model import default_model_dir

    return TorchDevice(HybridEngine.from_pretrained(default_model_dir()), grammars=book)


def test_a_spilled_sequence_keeps_its_grammar_after_the_swap_in(ll):
    tok, llt = ll
    pattern = "[0-9]{12}"
    grammar = llguidance.LLMatcher.grammar_from_regex(pattern)
    prompt = tok.encode("Numbers:")
    book = GrammarBook(tok.eos_ids)
    book.add(7, len(prompt), matcher(llt, grammar))
    dev = _device(ll, book)
    dev.alloc_sequence(1, 7)
    dev.prefill(1, prompt, 0)
    out = [dev.argmax_on_device(0, 0)]
    for _ in range(5):
        dev.decode_batch([out[-1]], [1], 0)
        out.append(dev.argmax_batch(0, 1, 0)[0])
    dev.save_sequence_state(1)
    dev.free_sequence(1)
    dev.alloc_sequence(1, 0)  # a swap-in names session 0
    dev.restore_sequence_state(1, blocks=1)
    while out[-1] not in tok.eos_ids and len(out) < 20:
        dev.decode_batch([out[-1]], [1], 0)
        out.append(dev.argmax_batch(0, 1, 0)[0])
    assert out[-1] in tok.eos_ids
    text = tok.decode(out[:-1])
    assert len(text) == 12 and text.isdigit(), text
    dev.teardown()


def test_a_greedy_verify_never_accepts_a_draft_the_grammar_refuses(ll):
    tok, llt = ll
    grammar = llguidance.LLMatcher.grammar_from_regex("[a-z]{6}")
    prompt = tok.encode("Word:")
    book = GrammarBook(tok.eos_ids)
    book.add(3, len(prompt), matcher(llt, grammar))
    dev = _device(ll, book)
    dev.alloc_sequence(1, 3)
    dev.prefill(1, prompt, 0)
    first = dev.argmax_on_device(0, 0)

    def allowed(generated: list[int], token: int) -> bool:  # a fresh matcher's verdict
        m = matcher(llt, grammar)
        assert m.consume_tokens(generated)
        return token in _allowed(m.compute_bitmask(), VOCAB)

    assert allowed([], first)
    digit = tok.encode("7", add_special_tokens=False)[0]
    letter = tok.encode("b", add_special_tokens=False)[0]
    rows = dev.serial_verify("decode_verify", 1, [first, digit, letter])
    assert rows[0] != digit and allowed([first], rows[0])  # the refused draft is not the row's answer
    dev.truncate_sequence(1, len(prompt) + 1)
    dev.commit_accepted_prefix(1, 1, 3)
    second = rows[0]
    rows = dev.serial_verify("decode_verify", 1, [second, letter])  # the matcher rolled back the refused path
    assert allowed([first, second], rows[0])
    if allowed([first, second], letter):
        assert allowed([first, second, letter], rows[1])
    dev.teardown()


def test_an_unclosed_call_at_the_end_sends_its_whole_arguments():
    stream = tools.ToolStream()
    text = '<tool_call>\n{"name": "ping", "arguments": {"n": {"m": 1}}}'
    deltas = stream.push(text) + stream.finish()
    args = "".join(tc["function"].get("arguments", "") for d in deltas for tc in d.get("tool_calls", ()))
    assert json.loads(args) == {"n": {"m": 1}}


def test_common_prefix_against_a_plain_loop():
    import random

    from fxsched.runtime.devices.grammar_mask import _common_prefix

    rng = random.Random(3)
    for _ in range(500):
        a = [rng.randrange(3) for _ in range(rng.randrange(80))]
        b = a[:rng.randrange(len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(40))]
        want = 0
        while want < min(len(a), len(b)) and a[want] == b[want]:
            want += 1
        assert _common_prefix(a, b) == want
