"""``fxsched generate`` with text: prompts through the tokenizer and the chat template, streamed
text, stop strings (a Cancel to the scheduler), EOS ids from the generation config, --ignore-eos,
--json records, and one-line errors.

The model is the internal one with its vocabulary sized to the tiny tokenizer (``--weights`` plus
``--tokenizer``); its reference tokens come from a plain prefill-and-decode loop on the engine (no
scheduler), and text is checked against the tokenizer's whole-sequence
decode. A Hugging Face checkpoint (``--model``) is checked against transformers' ``generate`` once
the checkpoint loader exists.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from support.tiny_tokenizer import TinyTokenizer, write_tiny_tokenizer  # noqa: E402
from support.toy_model import run_fxsched  # noqa: E402

from fxsched.runtime.generate import SPECS, TextOptions, generate  # noqa: E402
from fxsched.runtime.text import TextTokenizer, load_tokenizer  # noqa: E402
from fxsched.runtime.torch_model import HybridEngine, default_config, init_weights, save_weights  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "the quick brown"


def fxsched(*argv: str) -> int:
    return run_fxsched(*argv)  # the internal model unless one is named


@dataclasses.dataclass
class TextModel:
    tiny: TinyTokenizer
    tok: TextTokenizer
    weights: Path
    engine_cfg: object

    def argv(self, *more: str) -> list[str]:
        return ["generate", "--weights", str(self.weights), "--tokenizer", str(self.tiny.path), *more]

    def reference(self, prompt: list[int], n: int, eos: tuple[int, ...]) -> list[int]:
        """Greedy tokens from a plain prefill-and-decode loop on the engine, stopping after the
        first of ``eos`` (like ``greedy_generate``, with a set of EOS ids)."""
        engine = HybridEngine.from_weights_file(self.weights)
        engine.alloc(0, 0)
        with torch.no_grad():
            token = int(engine.prefill(0, prompt).argmax())
            out = [token]
            while len(out) < n and token not in eos:
                token = int(engine.decode_batch([0], [token])[0].argmax())
                out.append(token)
        return out


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> TextModel:
    root = tmp_path_factory.mktemp("text_model")
    tiny = write_tiny_tokenizer(root / "tok", generation_config=True)
    tok = load_tokenizer(tiny.path)
    assert tok is not None
    cfg = dataclasses.replace(default_config(), vocab_size=tiny.vocab_size)
    weights = root / "w.safetensors"
    save_weights(weights, init_weights(cfg), cfg)
    return TextModel(tiny, tok, weights, cfg)


def json_lines(out: str) -> tuple[list[dict], dict]:
    records = [json.loads(line) for line in out.splitlines()]  # every stdout line is JSON
    assert records and records[-1].get("summary") is True
    assert all("summary" not in r for r in records[:-1])
    return records[:-1], records[-1]


# --- token ids, unchanged ----------------------------------------------------------------------------


def test_prompt_ids_print_todays_token_lines(capsys):
    assert fxsched("generate", "--prompt-ids", "1 2 3 4 5", "--max-tokens", "8") == 0
    out = capsys.readouterr().out.splitlines()
    want = HybridEngine(default_config()).greedy_generate([1, 2, 3, 4, 5], 8)
    assert out[0] == f"request 1: {' '.join(map(str, want))} (length, n=8, acc=0)"
    assert out[1].startswith("summary: spec=none device=cpu batch=1 requests=1 tokens=8 ") and len(out) == 2


def test_text_prompt_without_a_tokenizer_is_one_line(capsys):
    assert fxsched("generate", "--prompt", "hello") == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("fxsched generate: --prompt: the model has no tokenizer") and "--prompt-ids" in err
    assert "\n" not in err and captured.out == ""


# --- text, JSON, EOS --------------------------------------------------------------------------------


def test_json_records_parse_and_their_text_is_the_decoded_tokens(model, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{PROMPT}\n\nhéllo 東京 🙂\n")
    assert fxsched(*model.argv("--prompt-file", str(prompts), "--max-tokens", "24", "--batch", "3", "--json")) == 0
    records, summary = json_lines(capsys.readouterr().out)
    assert sorted(r["index"] for r in records) == [0, 1, 2]
    texts = [PROMPT, "héllo 東京 🙂", PROMPT]  # fewer prompts than --batch: repeated in order
    for r in records:
        prompt = model.tok.encode(texts[r["index"]])
        assert r["prompt_token_ids"] == prompt and r["num_prompt_tokens"] == len(prompt)
        assert r["token_ids"] == model.reference(prompt, 24, model.tok.eos_ids)
        assert r["text"] == model.tok.decode(r["token_ids"])
        assert r["num_generated_tokens"] == len(r["token_ids"])
        stopped = r["token_ids"][-1] in model.tok.eos_ids
        assert r["finish_reason"] == ("stop" if stopped else "length")
        assert isinstance(r["think_tokens"], int) and isinstance(r["accepted_draft_tokens"], int)
    assert summary["requests"] == 3 and summary["generated_tokens"] == sum(len(r["token_ids"]) for r in records)
    for key in ("tokens_per_s", "mean_accepted_length", "forwards_per_token"):
        assert key in summary


def test_eos_from_the_generation_config_and_ignore_eos(model, capsys):
    assert fxsched(*model.argv("--prompt", PROMPT, "--max-tokens", "40", "--json")) == 0
    [record], _ = json_lines(capsys.readouterr().out)
    # with this seed the model says <|im_end|> well before 40 tokens: the test needs that
    assert record["finish_reason"] == "stop" and record["token_ids"][-1] in model.tok.eos_ids
    assert len(record["token_ids"]) < 40
    assert fxsched(*model.argv("--prompt", PROMPT, "--max-tokens", "40", "--json", "--ignore-eos")) == 0
    [free], _ = json_lines(capsys.readouterr().out)
    assert free["finish_reason"] == "length" and len(free["token_ids"]) == 40
    assert free["token_ids"][:len(record["token_ids"])] == record["token_ids"]


def test_chat_prompt_is_the_rendered_template(model, capsys):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(model.tiny.path))
    assert fxsched(*model.argv("--prompt", "héllo", "--chat", "--max-tokens", "4", "--json")) == 0
    [record], _ = json_lines(capsys.readouterr().out)
    want = hf.apply_chat_template([{"role": "user", "content": "héllo"}], add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert record["prompt_token_ids"] == list(want)


def test_single_request_streams_its_text(model, capsys):
    assert fxsched(*model.argv("--prompt", PROMPT, "--max-tokens", "20", "--ignore-eos")) == 0
    out = capsys.readouterr().out
    want = model.tok.decode(model.reference(model.tok.encode(PROMPT), 20, ()))
    assert out.startswith(want)
    tail = out[len(want):].lstrip("\n").splitlines()
    assert tail[0].startswith("--- request 1 (length, n=20, acc=0") and tail[1].startswith("summary: ")


def test_several_requests_print_a_heading_and_text_each(model, capsys):
    assert fxsched(*model.argv("--prompt", PROMPT, "--max-tokens", "6", "--batch", "2", "--ignore-eos")) == 0
    out = capsys.readouterr().out
    want = model.tok.decode(model.reference(model.tok.encode(PROMPT), 6, ()))
    for rid in (1, 2):
        heading = f"--- request {rid} (length, n=6, acc=0, think="
        assert heading in out and out.split(heading, 1)[1].split("\n", 1)[1].startswith(want)
    assert out.splitlines()[-1].startswith("summary: ")


def test_streamed_pieces_arrive_one_by_one_and_add_up(tmp_path):
    cfg = default_config()
    tiny = write_tiny_tokenizer(tmp_path, vocab_size=cfg.vocab_size)  # 64 ids: fits the default model
    tok = load_tokenizer(tiny.path)
    assert tok is not None
    pieces: list[tuple[int, str]] = []
    result = generate(HybridEngine(cfg), [[1, 2, 3], [4, 5]], 30, eos_ids=(), text=TextOptions(tok),
                      on_text=lambda rid, piece: pieces.append((rid, piece)))
    for r in result.results:
        mine = [p for rid, p in pieces if rid == r.id]
        assert len(mine) > 1 and "".join(mine) == r.text == tok.decode(r.tokens)


# --- stop strings -------------------------------------------------------------------------------------


def pick_stop(text: str) -> str:
    """A 3-character stop string that first occurs some way into ``text``."""
    for start in range(6, len(text) - 3):
        stop = text[start:start + 3]
        if "\ufffd" not in stop and text.find(stop) == start and stop.strip():
            return stop
    raise AssertionError(f"no stop string in {text!r}")


@pytest.mark.parametrize("spec", SPECS)
def test_stop_string_cuts_the_text_and_ends_the_request(model, capsys, spec):
    prompt = model.tok.encode(PROMPT)
    full_ids = model.reference(prompt, 60, ())
    full = model.tok.decode(full_ids)
    stop = pick_stop(full)
    assert fxsched(*model.argv("--prompt", PROMPT, "--max-tokens", "60", "--ignore-eos", "--stop", stop,
                               "--stop", "never seen", "--spec", spec, "--json")) == 0
    [record], summary = json_lines(capsys.readouterr().out)
    assert record["finish_reason"] == "stop" and record["stop_reason"] == stop
    assert record["text"] == full[:full.index(stop)]
    ids = record["token_ids"]
    assert ids == full_ids[:len(ids)] and stop in model.tok.decode(ids) and len(ids) < 60
    # the Cancel reached the sink (plain or speculative): the scheduler stopped, nothing was thrown away
    assert summary["discarded_tokens"] == 0 and summary["target_forwards"] < 60


def test_several_eos_ids_are_told_apart_in_every_mode():
    """Three EOS ids that the model says often: each request's last token is the EOS it really
    produced (the scheduler never streams it), in every speculation mode, in a batch."""
    cfg = default_config()
    prompts = [[1, 2, 3], [4, 5], [7, 8, 9, 10], [11, 12]]
    free = [HybridEngine(cfg).greedy_generate(p, 30) for p in prompts]
    counts: dict[int, int] = {}
    for out in free:
        for t in out[:-1]:
            counts[t] = counts.get(t, 0) + 1
    eos = tuple(sorted(counts, key=lambda t: -counts[t])[:3])
    want = []
    for out in free:
        cut = next((i for i, t in enumerate(out) if t in eos or t == cfg.eos_id), len(out) - 1)
        assert out[cut] in eos, "the test needs every request to end on one of the chosen ids"
        want.append(out[:cut + 1])
    assert len({w[-1] for w in want}) > 1, "the test needs different EOS ids to end the requests"
    for spec in SPECS:
        result = generate(HybridEngine(cfg), prompts, 30, spec, batch=4, eos_ids=eos)
        assert result.outputs == want, spec


# --- a Hugging Face model directory -------------------------------------------------------------------


def _hf_loader_ready() -> bool:
    try:
        import fxsched.runtime.torch_model.hf_checkpoint  # noqa: F401
    except ImportError:
        return False
    return hasattr(HybridEngine, "from_pretrained")


@pytest.mark.skipif(not _hf_loader_ready(), reason="needs fxsched.runtime.torch_model.hf_checkpoint and "
                                                   "HybridEngine.from_pretrained (being written)")
def test_model_dir_generates_what_transformers_generates(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    tiny = write_tiny_tokenizer(tmp_path)
    config = transformers.Qwen3Config(
        vocab_size=tiny.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=tiny.im_end, pad_token_id=tiny.endoftext)
    torch.manual_seed(0)
    hf_model = transformers.Qwen3ForCausalLM(config).eval()
    hf_model.save_pretrained(tmp_path)
    write_tiny_tokenizer(tmp_path, generation_config=True)  # generation_config.json: both end tokens
    tok = load_tokenizer(tmp_path)
    assert tok is not None
    prompt = tok.encode(PROMPT)
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                eos_token_id=list(tok.eos_ids), pad_token_id=tiny.endoftext)
    want = out[0, len(prompt):].tolist()
    assert fxsched("generate", "--model", str(tmp_path), "--prompt", PROMPT, "--max-tokens", "16", "--json") == 0
    [record], _ = json_lines(capsys.readouterr().out)
    assert record["token_ids"] == want and record["text"] == tok.decode(want)


# --- one-line errors ------------------------------------------------------------------------------------


def bad_tokenizer_dir(tmp_path: Path) -> Path:
    d = tmp_path / "badtok"
    write_tiny_tokenizer(d)
    (d / "tokenizer.json").write_text('{"model": ')
    return d


@pytest.mark.parametrize("argv, message", [
    (["--prompt-ids", "1 2", "--chat"], "--chat: needs text prompts (--prompt or --prompt-file), not --prompt-ids"),
    (["--prompt-ids", "1 2", "--stop", "x"], "--stop: stop strings need a tokenizer"),
    (["--prompt-ids", "1 2", "--dtype", "bfloat16"], "--dtype bfloat16: only for a --model checkpoint"),
    (["--prompt-ids", "1 2", "--dtype", "float64"], "--dtype float64: unknown dtype"),
    (["--prompt-ids", "1 2", "--model", "/no/such/dir"], "--model /no/such/dir: no such directory"),
    (["--prompt-ids", "1 2", "--model", "/tmp", "--weights", "w"], "--weights and --model: give one of them"),
    (["--prompt-ids", "1 2", "--tokenizer", "/no/such/dir"], "--tokenizer: /no/such/dir: no such directory"),
    (["--prompt-file", __file__], "--prompt-file: the model has no tokenizer"),  # a file that exists: read first
    (["--prompt-file", "/no/such/file"], "--prompt-file /no/such/file: no such file"),
    (["--prompt", "a", "--prompt-ids", "1"], "--prompt and --prompt-ids: give one of them, not both"),
])
def test_bad_input_exits_2_with_one_line(capsys, argv, message):
    assert fxsched("generate", *argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("fxsched generate: " + message), err
    assert "\n" not in err and captured.out == ""


def test_text_input_errors_exit_2_with_one_line(model, tmp_path, capsys):
    cases = [
        (["--tokenizer", str(bad_tokenizer_dir(tmp_path)), "--prompt", "x"], "tokenizer.json: invalid JSON"),
        (["--tokenizer", str(tmp_path), "--prompt", "x"], f"--tokenizer {tmp_path}: no tokenizer.json"),
        (model.argv("--prompt", "   "), "--prompt: the prompt is empty"),
        (model.argv("--prompt", "x", "--stop", ""), "--stop: a stop string must not be empty"),
        (model.argv("--prompt", "x" * 2000), "--prompt: the prompt of"),
    ]
    for argv, message in cases:
        if argv[0] != "generate":
            argv = ["generate", *argv]
        assert fxsched(*argv) == 2
        captured = capsys.readouterr()
        err = captured.err.strip()
        assert err.startswith("fxsched generate: ") and message in err, err
        assert "\n" not in err and captured.out == ""


def test_chat_template_failure_is_one_line(tmp_path, capsys):
    cfg = default_config()
    write_tiny_tokenizer(tmp_path, vocab_size=cfg.vocab_size, chat_template="{{ raise_exception('no chat here') }}")
    assert fxsched("generate", "--tokenizer", str(tmp_path), "--prompt", "hi", "--chat") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fxsched generate: --chat: ") and "no chat here" in err and "\n" not in err
