"""The text layer (fxsched.runtime.text): tokenizer loading, encode/decode and the chat template
against transformers (the independent reference), streamed detokenization against whole-sequence
decoding, stop strings against a plain search, the think count, and one-line errors."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from support.tiny_tokenizer import SENTENCES, TinyTokenizer, write_tiny_tokenizer  # noqa: E402

from fxsched.runtime.text import (  # noqa: E402
    ChatTemplateError, IncrementalDetokenizer, StopMatcher, TextTokenizer, TokenizerError, load_tokenizer,
    opens_thinking, think_count,
)

SAMPLES = (*SENTENCES, "héllo 東京 🙂", "🙂🙂🙂", "a  b   c", "  leading and trailing  ", "東京タワー\n\n",
           "<think>x</think>done<|im_end|>", "<|im_start|>user\nhi<|im_end|>")


# --- fixtures ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyTokenizer:
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tiny_tok"), generation_config=True)


@pytest.fixture(scope="module")
def tok(tiny) -> TextTokenizer:
    loaded = load_tokenizer(tiny.path)
    assert loaded is not None
    return loaded


@pytest.fixture(scope="module")
def hf_tok(tiny):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(tiny.path))


def write_llama_like(directory: Path) -> Path:
    """A sentencepiece-style tokenizer: metaspace BPE with byte fallback (``<0xXX>`` tokens), the
    Llama decoder chain (Replace ▁, ByteFallback, Fuse, Strip) and a post-processor adding <s>."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    directory.mkdir(parents=True, exist_ok=True)
    base = Tokenizer(models.BPE())
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    base.train_from_iterator(list(SENTENCES) * 3, trainers.BpeTrainer(vocab_size=160, show_progress=False))
    data = json.loads(base.to_str())
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in sorted(data["model"]["vocab"], key=data["model"]["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges: list[tuple[str, str]] = [(m.split(" ")[0], m.split(" ")[1]) if isinstance(m, str) else (m[0], m[1])
                                     for m in data["model"]["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
              "add_bos_token": False, "chat_template": LLAMA_LIKE_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


# A second template in another style: bos_token, namespace, loop controls, tojson, loop.last.
LLAMA_LIKE_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for m in messages %}{% if m['role'] == 'system' %}{% set ns.system = m['content'] %}{% continue %}{% endif %}"
    "[{{ m['role'] | upper }}]{% if loop.first and ns.system %}({{ ns.system }}) {% endif %}"
    "{{ m['content'] | trim }}{% if m.get('meta') %} {{ m['meta'] | tojson }}{% endif %}"
    "{% if not loop.last %}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}\n[ASSISTANT]{% endif %}"
)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return write_llama_like(tmp_path_factory.mktemp("llama_like"))


@pytest.fixture(scope="module")
def llama_tok(llama_dir) -> TextTokenizer:
    loaded = load_tokenizer(llama_dir)
    assert loaded is not None
    return loaded


# --- loading, encode, decode ---------------------------------------------------------------------------


def test_loaded_tokenizer_knows_its_special_tokens(tiny, tok):
    assert tok.vocab_size == tiny.vocab_size
    assert tok.eos_ids == (tiny.im_end, tiny.endoftext)  # generation_config's order; eos_token already in it
    assert tok.think_ids == (tiny.think, tiny.think_end)
    assert tok.special_tokens["eos_token"] == "<|im_end|>" and tok.bos_id is None


@pytest.mark.parametrize("text", SAMPLES)
def test_encode_and_decode_match_transformers(tok, hf_tok, text):
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text  # the round trip
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip)


def test_llama_like_encoding_follows_the_post_processor_like_transformers(llama_dir, llama_tok):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(llama_dir))
    for text in SAMPLES[:6] + ("zebra ñ ÿ",):  # "zebra ñ ÿ" needs the byte-fallback tokens
        ids = llama_tok.encode(text)
        assert ids == hf.encode(text) and ids[0] == llama_tok.bos_id  # add_bos_token false: <s> still added
        assert llama_tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_ids_outside_the_tokenizer_decode_to_nothing(tok):
    ids = tok.encode("hello")
    assert tok.decode([*ids, tok.vocab_size, tok.vocab_size + 100]) == "hello"


def test_eos_ids_fall_back_to_config_json(tmp_path, tiny):
    d = tmp_path / "m"
    write_tiny_tokenizer(d)
    (d / "config.json").write_text(json.dumps({"text_config": {"eos_token_id": [tiny.endoftext]}}))
    loaded = load_tokenizer(d)
    assert loaded is not None and loaded.eos_ids == (tiny.endoftext, tiny.im_end)  # then the eos_token
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    loaded = load_tokenizer(d)
    assert loaded is not None and loaded.eos_ids == (5, tiny.im_end)


def test_a_directory_without_tokenizer_json_has_no_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert load_tokenizer(tmp_path) is None


def test_chat_template_jinja_file_overrides_the_config(tmp_path, tok):
    write_tiny_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}<{{ m.role }}>{% endfor %}")
    loaded = load_tokenizer(tmp_path)
    assert loaded is not None
    assert loaded.apply_chat_template([{"role": "user", "content": "x"}]) == "<user>"


# --- malformed files: one line naming the file ---------------------------------------------------------


def _one_line_error(directory: Path, file: str) -> str:
    with pytest.raises(TokenizerError) as info:
        load_tokenizer(directory)
    message = str(info.value)
    assert "\n" not in message and str(directory / file) in message, message
    return message


@pytest.mark.parametrize("file, content, problem", [
    ("tokenizer.json", '{"model": ', "invalid JSON"),
    ("tokenizer.json", '[1, 2]', "expected a JSON object"),
    ("tokenizer.json", '{"version": "1.0", "model": {"type": "BPE", "vocab": 3}}', "tokenizers library can read"),
    ("tokenizer_config.json", '{"eos_token": "<|im_end|>",', "invalid JSON"),
    ("tokenizer_config.json", '{"eos_token": 7}', "eos_token"),
    ("tokenizer_config.json", '{"chat_template": 3}', "chat_template"),
    ("tokenizer_config.json", '{"add_bos_token": "yes"}', "add_bos_token"),
    ("tokenizer_config.json", '{"added_tokens_decoder": {"3": {"content": "<|im_end|>", "special": true}}}',
     "declared as id 3"),
    ("generation_config.json", '{"eos_token_id": "two"}', "eos_token_id"),
    ("generation_config.json", '{"eos_token_id": [1, -1]}', "eos_token_id"),
])
def test_malformed_files_are_one_line_errors(tmp_path, file, content, problem):
    write_tiny_tokenizer(tmp_path)
    (tmp_path / file).write_text(content)
    assert problem in _one_line_error(tmp_path, file)


def test_a_missing_directory_is_an_error(tmp_path):
    with pytest.raises(TokenizerError, match="no such directory"):
        load_tokenizer(tmp_path / "nope")


# --- chat template ------------------------------------------------------------------------------------


TOOLS = [{"type": "function", "function": {"name": "météo", "description": "weather in 東京",
                                           "parameters": {"type": "object", "properties": {}}}}]
CONVERSATIONS = [
    ([{"role": "user", "content": "héllo 東京 🙂"}], {}),
    ([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
      {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and?"}], {}),
    ([{"role": "user", "content": "weather?"}], {"tools": TOOLS}),
    ([{"role": "system", "content": "s"}, {"role": "user", "content": "w"}], {"tools": TOOLS}),
    ([{"role": "user", "content": "no thinking"}], {"enable_thinking": False}),
]


@pytest.mark.parametrize("messages, kwargs", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_like_transformers(tok, hf_tok, messages, kwargs, add_generation_prompt):
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
    theirs = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                        **kwargs)
    assert ours == theirs
    ids = hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                     **kwargs)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert tok.encode_chat(messages, add_generation_prompt, **kwargs) == list(ids)


def test_a_second_template_style_renders_like_transformers(llama_dir, llama_tok):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(llama_dir))
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "  q1  ", "meta": {"é": [1, 2]}},
                {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]
    for add in (True, False):
        assert llama_tok.apply_chat_template(messages, add) == hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add)


def test_template_errors_are_one_line(tmp_path, tok):
    with pytest.raises(ChatTemplateError, match="unknown role robot") as info:
        tok.apply_chat_template([{"role": "robot", "content": "beep"}])
    assert "\n" not in str(info.value)
    write_tiny_tokenizer(tmp_path / "none", chat_template=None)
    bare = load_tokenizer(tmp_path / "none")
    assert bare is not None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])
    write_tiny_tokenizer(tmp_path / "bad", chat_template="{% for m in messages %}{{ m.role }\n")
    broken = load_tokenizer(tmp_path / "bad")
    assert broken is not None
    with pytest.raises(ChatTemplateError, match="syntax error") as info:
        broken.apply_chat_template([{"role": "user", "content": "x"}])
    assert "\n" not in str(info.value)


def test_the_sandbox_refuses_unsafe_attribute_access(tmp_path):
    write_tiny_tokenizer(tmp_path, chat_template="{{ messages.__class__.__mro__ }}")
    loaded = load_tokenizer(tmp_path)
    assert loaded is not None
    with pytest.raises(ChatTemplateError, match="unsafe"):
        loaded.apply_chat_template([{"role": "user", "content": "x"}])
    write_tiny_tokenizer(tmp_path, chat_template="{{ messages.append(1) }}")
    loaded = load_tokenizer(tmp_path)
    assert loaded is not None
    with pytest.raises(ChatTemplateError):
        loaded.apply_chat_template([{"role": "user", "content": "x"}])


# --- incremental detokenization -------------------------------------------------------------------------


def stream(tokenizer: TextTokenizer, ids: list[int], skip: bool = True, context: tuple[int, ...] = ()) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip, context=context)
    pieces = [detok.push(t) for t in ids]
    return pieces + [detok.flush()]


def check_stream(tokenizer: TextTokenizer, ids: list[int], skip: bool) -> None:
    pieces = stream(tokenizer, ids, skip)
    full = tokenizer.decode(ids, skip_special_tokens=skip)
    assert "".join(pieces) == full
    shown = ""
    for piece in pieces[:-1]:
        assert not piece.endswith("\ufffd")  # never a character that may still change
        shown += piece
        assert full.startswith(shown)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_incremental_detokenization_equals_full_decode_byte_level(tok, data):
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=40))
    check_stream(tok, ids, data.draw(st.booleans()))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_incremental_detokenization_equals_full_decode_sentencepiece_style(llama_tok, data):
    # Random ids that are not byte tokens, mixed with characters spelled as byte-fallback tokens
    # (<0xXX>), so each multi-byte character is partial for a token or three. Byte runs that are
    # not valid UTF-8 are left out: ByteFallback then rewrites characters already shown (the
    # documented exception, next test).
    byte_token = {b: llama_tok.token_id(f"<0x{b:02X}>") for b in range(256)}
    other = st.integers(0, llama_tok.vocab_size - 1).filter(lambda i: i not in byte_token.values())
    spelled = st.characters(codec="utf-8", exclude_categories=("Cs",)).map(
        lambda ch: [byte_token[b] for b in ch.encode()])
    chunks = data.draw(st.lists(st.one_of(other.map(lambda i: [i]), spelled), max_size=20))
    ids = [i for chunk in chunks for i in chunk]
    check_stream(llama_tok, ids, data.draw(st.booleans()))


def test_byte_fallback_runs_that_are_not_utf8_are_the_documented_exception(llama_tok):
    for raw, first in (("é".encode() + b"\x80", "é"), (b"0\xc2", "0")):  # a stray byte; a character cut short
        byte_ids = [llama_tok.token_id(f"<0x{b:02X}>") for b in raw]
        shown = "".join(stream(llama_tok, byte_ids))
        assert shown.startswith(first)  # the complete first character was shown as it came ...
        assert llama_tok.decode(byte_ids) == "\ufffd" * len(raw)  # ... and decode replaces the whole run


@pytest.mark.parametrize("which", ["byte_level", "sentencepiece"])
def test_valid_text_streams_without_holding_anything_back(tok, llama_tok, which):
    tokenizer = tok if which == "byte_level" else llama_tok
    for text in SAMPLES:
        ids = tokenizer.encode(text, add_special_tokens=False)
        pieces = stream(tokenizer, ids, skip=False)
        assert pieces[-1] == "" and "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=False)
        assert sum(1 for p in pieces if p) > 1 or len(ids) <= 1  # text arrives piece by piece


def test_multibyte_character_split_over_tokens_comes_out_whole(llama_tok):
    ids = llama_tok.encode("a 🙂", add_special_tokens=False)
    emoji = [llama_tok.token_id(f"<0x{b:02X}>") for b in "🙂".encode()]
    ids = [i for i in ids if i not in emoji][:2] + emoji  # "▁a", "▁", then the four byte tokens
    pieces = stream(llama_tok, ids)
    assert pieces[-5:-2] == ["", "", ""] and pieces[-2].endswith("🙂")
    assert "".join(pieces) == llama_tok.decode(ids)


def test_context_gives_the_text_past_the_prompt(llama_tok):
    prompt = llama_tok.encode("hello", add_special_tokens=False)
    whole = llama_tok.encode("hello world 東京", add_special_tokens=False)
    assert whole[:len(prompt)] == prompt
    answer = whole[len(prompt):]  # "▁", "w", "orld", "▁東京"
    plain = "".join(stream(llama_tok, answer))
    with_context = "".join(stream(llama_tok, answer, context=tuple(prompt)))
    assert with_context == llama_tok.decode(prompt + answer)[len(llama_tok.decode(prompt)):] == " world 東京"
    assert plain == "world 東京"  # alone, the first metaspace token loses its space (as decode does)


def test_random_ids_with_many_seeds_byte_level(tok):
    rng = random.Random(5)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 60))]
        check_stream(tok, ids, skip=True)


# --- stop strings -------------------------------------------------------------------------------------


def run_stops(stops: list[str], pieces: list[str]) -> tuple[str, str | None, list[str]]:
    matcher = StopMatcher(stops)
    shown: list[str] = []
    after: list[str] = []
    stop: str | None = None
    for piece in pieces:
        m = matcher.push(piece)
        (after if stop is not None else shown).append(m.text)
        stop = stop or m.stop
    if stop is None:
        shown.append(matcher.flush())
    return "".join(shown), stop, after


def reference_cut(text: str, stops: list[str]) -> tuple[str, str | None]:
    """The text before the stop string whose first occurrence ends first (then: starts first)."""
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not hits:
        return text, None
    _, index, stop = min(hits)
    return text[:index], stop


def test_stop_across_piece_boundaries():
    assert run_stops(["o w"], ["hel", "lo", " ", "wo", "rld"])[:2] == ("hell", "o w")
    assert run_stops(["东京", "🙂"], ["a 东", "x"])[:2] == ("a 东x", None)  # a false start is released
    assert run_stops(["ab"], ["xa", "a", "b", "more"]) == ("xa", "ab", [""])  # nothing after the stop
    matcher = StopMatcher(["abc"])
    assert matcher.push("xxab").text == "xx"  # "ab" is held back: it may start "abc"
    assert matcher.push("d").text == "abd"


@settings(max_examples=400, deadline=None)
@given(text=st.text("ab c", max_size=30), stops=st.lists(st.text("ab c", min_size=1, max_size=4), max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=6))
def test_stop_matching_equals_a_search_of_the_whole_text(text, stops, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    shown, stop, after = run_stops(stops, pieces)
    assert (shown, stop) == reference_cut(text, stops)
    assert "".join(after) == ""


@settings(max_examples=200, deadline=None)
@given(text=st.text("ab", max_size=20), stops=st.lists(st.text("ab", min_size=1, max_size=4), min_size=1, max_size=2))
def test_only_a_possible_stop_start_is_held_back(text, stops):
    matcher = StopMatcher(stops)
    shown = ""
    for i, ch in enumerate(text):
        m = matcher.push(ch)
        shown += m.text
        if m.stop is not None:
            return
        seen = text[:i + 1]
        held = max((n for s in stops for n in range(1, len(s)) if seen.endswith(s[:n])), default=0)
        assert shown == seen[:len(seen) - held]


def test_empty_stop_strings_are_refused():
    with pytest.raises(ValueError):
        StopMatcher(["a", ""])


# --- thinking -------------------------------------------------------------------------------------------


def test_think_count_counts_tokens_inside_the_block(tiny):
    ids = (tiny.think, tiny.think_end)
    T, E = ids
    assert think_count([T, 1, 2, 3, E, 4, 5], ids) == 3
    assert think_count([1, T, 2, E, T, 3, 4, E], ids) == 3  # two blocks
    assert think_count([T, 1, 2], ids) == 2  # still thinking at the end
    assert think_count([1, 2, E, 3], ids, inside=True) == 2  # the prompt opened the block
    assert think_count([1, 2, 3], None) == 0
    assert opens_thinking([5, T], ids) and not opens_thinking([T, 1, E, 2], ids) and not opens_thinking([1], ids)
    assert not opens_thinking([T], None)
