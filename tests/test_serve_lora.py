"""``fxsched serve --enable-lora`` (specs/lora.md §18.7): adapters selected by the OpenAI ``model``
field give PEFT's greedy tokens for that adapter, the base name the base model's, and a batch of
concurrent requests over two adapters and the base each get their own; ``/v1/models`` lists the
adapters as vLLM does; ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` at run time (behind
the API key, refusals naming the adapter); a bad adapter on the command line is one line, exit 2;
the LoRA metrics.

The model is a tiny Qwen3 checkpoint (tests/support/hf_tiny.py) with the tiny tokenizer; the
adapters are random PEFT adapters (B non-zero) saved with ``save_pretrained``, and the reference is
the PEFT model each was saved from, run greedily without cache (as tests/test_lora.py does).
"""

from __future__ import annotations

import copy
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
peft = pytest.importorskip("peft")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from support.hf_tiny import build  # noqa: E402
from support.serving import running  # noqa: E402
from support.tiny_tokenizer import write_tiny_tokenizer  # noqa: E402

from fxsched.runtime.cli.app import build_parser, main  # noqa: E402
from fxsched.runtime.cli.usage import UsageError  # noqa: E402
from fxsched.runtime.cli.serve import open_serving  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KEY = "sk-lora"
BASE = "tiny"
STEPS = 6
ADAPTERS: dict[str, dict[str, Any]] = {  # name -> LoraConfig arguments
    "sql": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]},
    "chat": {"r": 8, "lora_alpha": 6, "target_modules": "all-linear"},
    "third": {"r": 2, "lora_alpha": 4, "target_modules": ["o_proj", "up_proj"]},
}
PROMPTS = [[5, 17, 33, 60, 12, 90, 41], [70, 3, 3, 99, 120, 8], [11, 22, 33, 44, 55, 66, 77, 88]]


class Setup:
    def __init__(self, root: Path, ck: Any, dirs: dict[str, Path], models: dict[str, Any]):
        self.root, self.ck, self.dirs, self.models = root, ck, dirs, models


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Setup:
    root = tmp_path_factory.mktemp("served_lora")
    ck = build("Qwen3ForCausalLM", root / BASE)
    write_tiny_tokenizer(root / BASE, vocab_size=160, generation_config=True)
    dirs, models = {}, {}
    for i, (name, kwargs) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + i)
        model = peft.get_peft_model(copy.deepcopy(ck.model),
                                    peft.LoraConfig(init_lora_weights=False, lora_dropout=0.0, **kwargs)).eval()
        with torch.no_grad():  # B at a scale that moves the greedy tokens
            for pname, p in model.named_parameters():
                if "lora_B" in pname:
                    p.copy_(torch.randn(p.shape) * 0.5 / p.shape[-1] ** 0.5)
        model.save_pretrained(root / name)
        dirs[name], models[name] = root / name, model
    return Setup(root, ck, dirs, models)


@torch.no_grad()
def reference(setup: Setup, name: str | None, prompt: list[int], eos: tuple[int, ...]) -> list[int]:
    """PEFT's greedy tokens of ``prompt`` with adapter ``name`` (None: the base model), up to EOS
    (which the server reports as the last token, as vLLM does)."""
    model = setup.ck.model if name is None else setup.models[name]
    tokens = list(prompt)
    for _ in range(STEPS):
        token = int(model(torch.tensor([tokens])).logits[0, -1].argmax())
        tokens.append(token)
        if token in eos:
            break
    return tokens[len(prompt):]




def serve_argv(setup: Setup, *extra: str) -> list[str]:
    return ["serve", str(setup.root / BASE), "--served-model-name", BASE, "--port", "0", "--dtype", "float32",
            "--max-num-seqs", "8", "--max-model-len", "128", "--api-key", KEY, "--enable-lora", *extra]


def client(serving: Any) -> Any:
    return openai.OpenAI(base_url=serving.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def served_tokens(serving: Any, c: Any, model: str, prompt: list[int]) -> list[str]:
    """The token strings of a greedy completion (logprobs' ``tokens``)."""
    r = c.completions.create(model=model, prompt=prompt, max_tokens=STEPS, temperature=0, logprobs=0)
    assert r.model == model
    return list(r.choices[0].logprobs.tokens)


def as_strings(serving: Any, tokens: list[int]) -> list[str]:
    tok = serving.engine.tokenizer
    return [tok.decode([t], skip_special_tokens=False) for t in tokens]


def post(serving: Any, path: str, key: str | None = KEY, **body: Any) -> Any:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(serving.url + path, json=body, headers=headers, timeout=60)


def metrics(serving: Any) -> dict[str, float]:
    text = httpx.get(serving.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def test_each_adapter_by_model_name_gives_pefts_tokens_and_the_base_name_the_base(setup):
    modules = [f"sql={setup.dirs['sql']}",
               json.dumps({"name": "chat", "path": str(setup.dirs["chat"]), "base_model_name": "Qwen/tiny"})]
    with running(serve_argv(setup, "--lora-modules", *modules)) as serving:
        eos = tuple(serving.engine.config.eos_ids or ())
        c = client(serving)
        # /v1/models: the base, then each adapter with vLLM's parent and root
        cards = {m.id: m for m in c.models.list().data}
        assert list(cards) == [BASE, "sql", "chat"]
        assert cards["sql"].parent == BASE and cards["sql"].root == str(setup.dirs["sql"])
        assert cards["chat"].parent == "Qwen/tiny" and cards["chat"].root == str(setup.dirs["chat"])
        assert cards[BASE].parent is None
        outputs: dict[str | None, list[list[int]]] = {}
        for name in (None, "sql", "chat"):
            outputs[name] = []
            for prompt in PROMPTS:
                want = reference(setup, name, prompt, eos)
                got = served_tokens(serving, c, name or BASE, prompt)
                assert got == as_strings(serving, want), (name, prompt)
                outputs[name].append(want)
        # the adapters change the tokens (else the comparison would prove little)
        assert outputs["sql"] != outputs[None] and outputs["chat"] != outputs[None]
        assert outputs["sql"] != outputs["chat"]
        # chat completions name the adapter too, and report it
        chat = c.chat.completions.create(model="sql", messages=[{"role": "user", "content": "hello"}], max_tokens=3)
        assert chat.model == "sql"
        # a concurrent batch over the two adapters and the base: each request its own tokens
        jobs = [(name, prompt) for prompt in PROMPTS for name in (None, "sql", "chat")] * 2
        with ThreadPoolExecutor(len(jobs)) as pool:
            got_all = list(pool.map(lambda job: served_tokens(serving, c, job[0] or BASE, job[1]), jobs))
        for (name, prompt), got in zip(jobs, got_all, strict=True):
            assert got == as_strings(serving, outputs[name][PROMPTS.index(prompt)]), (name, prompt)
        # an unknown model is vLLM's 404
        with pytest.raises(openai.NotFoundError):
            c.completions.create(model="nope", prompt=PROMPTS[0], max_tokens=2)
        m = metrics(serving)
        assert m["fxsched_lora_adapters_resident"] == 2 and m["fxsched_lora_loads_total"] == 2
        assert m["fxsched_lora_evictions_total"] == 0  # a slot per adapter: none swapped
        assert m["fxsched_lora_requests_total{lora_name=sql}"] == len(PROMPTS) + 1 + len(PROMPTS) * 2
        info = [k for k in m if k.startswith("vllm:lora_requests_info")]
        assert len(info) == 1 and "max_lora=2" in info[0], info


def test_load_and_unload_at_run_time(setup, tmp_path):
    with running(serve_argv(setup, "--lora-modules", f"sql={setup.dirs['sql']}", "--max-loras", "2")) as serving:
        eos = tuple(serving.engine.config.eos_ids or ())
        c = client(serving)
        third = str(setup.dirs["third"])
        # behind the API key
        assert post(serving, "/v1/load_lora_adapter", key=None, lora_name="third", lora_path=third).status_code == 401
        r = post(serving, "/v1/load_lora_adapter", lora_name="third", lora_path=third)
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'third' added successfully."
        assert [m.id for m in c.models.list().data] == [BASE, "sql", "third"]
        want = reference(setup, "third", PROMPTS[0], eos)
        assert served_tokens(serving, c, "third", PROMPTS[0]) == as_strings(serving, want)
        # refusals name the adapter: a taken name, a bad adapter (below)
        again = post(serving, "/v1/load_lora_adapter", lora_name="third", lora_path=third)
        assert again.status_code == 400 and "'third' has already been loaded" in again.json()["error"]["message"]
        # an unload while a request still streams with the adapter: 400; after it: 200
        stream = c.completions.create(model="third", prompt=PROMPTS[1], max_tokens=40, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
        next(iter(stream))
        [info] = [k for k in metrics(serving) if k.startswith("vllm:lora_requests_info")]
        assert "running_lora_adapters=third" in info and "max_lora=2" in info, info
        busy = post(serving, "/v1/unload_lora_adapter", lora_name="third")
        assert busy.status_code == 400 and "'third' is in use by 1 request" in busy.json()["error"]["message"]
        for _ in stream:
            pass
        gone = post(serving, "/v1/unload_lora_adapter", lora_name="third")
        assert gone.status_code == 200 and gone.text == "Success: LoRA adapter 'third' removed successfully."
        with pytest.raises(openai.NotFoundError):
            c.completions.create(model="third", prompt=PROMPTS[0], max_tokens=2)
        missing = post(serving, "/v1/unload_lora_adapter", lora_name="third")
        assert missing.status_code == 404 and "'third' cannot be found" in missing.json()["error"]["message"]
        # a bad adapter: 400, the adapter and the file at fault named, the slot still free
        bad = tmp_path / "bad"
        bad.mkdir()
        for f in setup.dirs["chat"].iterdir():
            (bad / f.name).write_bytes(f.read_bytes())
        config = json.loads((bad / "adapter_config.json").read_text())
        (bad / "adapter_config.json").write_text(json.dumps({**config, "r": 64}))
        refused = post(serving, "/v1/load_lora_adapter", lora_name="big", lora_path=str(bad))
        message = refused.json()["error"]["message"]
        assert refused.status_code == 400 and "'big'" in message and "adapter_config.json" in message, message
        assert "above the pool's max LoRA rank 16" in message
        # two adapters listed with one slot free: the second waits on disk until named
        for name in ("chat", "third"):
            r = post(serving, "/v1/load_lora_adapter", lora_name=name, lora_path=str(setup.dirs[name]))
            assert r.status_code == 200, r.text
        m = metrics(serving)
        assert m["fxsched_lora_adapters_served"] == 3 and m["fxsched_lora_adapters_resident"] == 2
        for name, prompt in (("chat", PROMPTS[2]), ("third", PROMPTS[0]), ("sql", PROMPTS[1])):
            want = reference(setup, name, prompt, eos)
            assert served_tokens(serving, c, name, prompt) == as_strings(serving, want), name
        m = metrics(serving)
        # sql, third (at start / listed), chat, then third again and sql again on demand
        assert m["fxsched_lora_loads_total"] == 5 and m["fxsched_lora_unloads_total"] == 1, m
        assert m["fxsched_lora_evictions_total"] == 2 and m["fxsched_lora_adapters_resident"] == 2


def test_a_bad_adapter_on_the_command_line_is_one_line_exit_2(setup, tmp_path, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in setup.dirs["sql"].iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "adapter_config.json").write_text("{not json")
    argv = serve_argv(setup, "--lora-modules", f"sql={setup.dirs['sql']}", f"broken={bad}")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("fxsched serve: --lora-modules broken: "), err
    assert "adapter_config.json" in err
    big = serve_argv(setup, "--lora-modules", f"chat={setup.dirs['chat']}", "--max-lora-rank", "4")
    assert main(big) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fxsched serve: --lora-modules chat: ") and err.endswith("(raise --max-lora-rank)"), err


@pytest.mark.parametrize("extra, says", [
    (["--lora-modules", "a=/no/such/dir"], "--lora-modules a: /no/such/dir: no such adapter directory"),
    (["--lora-modules", "a"], "expected name=path or a JSON object"),
    (["--lora-modules", '{"name": "a"}'], '"name" and "path" must be strings'),
    (["--max-loras", "0"], "--max-loras 0"),
])
def test_bad_lora_flags_are_refused_before_the_model_loads(setup, capsys, extra, says):
    assert main(serve_argv(setup, *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err


def test_more_adapters_than_slots_are_loaded_on_demand(setup):
    """--max-loras 1 with three adapters: each request's adapter is loaded into the one slot when the
    slot's adapter has no request in flight; a request for another adapter waits meanwhile, and one
    cancelled while it waits ends without running."""
    modules = [f"{name}={setup.dirs[name]}" for name in ADAPTERS]
    with running(serve_argv(setup, "--lora-modules", *modules, "--max-loras", "1")) as serving:
        eos = tuple(serving.engine.config.eos_ids or ())
        c = client(serving)
        assert [m.id for m in c.models.list().data] == [BASE, *ADAPTERS]
        want = {(name, i): reference(setup, name, p, eos) for name in (None, *ADAPTERS) for i, p in enumerate(PROMPTS)}
        # concurrent requests over the three adapters and the base: each its own adapter's tokens
        jobs = [(name, i) for i in range(len(PROMPTS)) for name in (*ADAPTERS, None)]
        with ThreadPoolExecutor(len(jobs)) as pool:
            got = list(pool.map(lambda job: served_tokens(serving, c, job[0] or BASE, PROMPTS[job[1]]), jobs))
        for job, tokens in zip(jobs, got, strict=True):
            assert tokens == as_strings(serving, want[job]), job
        # while a stream runs with "sql", a request for "chat" waits; cancelled there, it never runs
        stream = c.completions.create(model="sql", prompt=PROMPTS[1], max_tokens=40, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
        next(iter(stream))
        resident = serving.engine.adapters.resident()
        assert list(resident) == ["sql"]
        with httpx.stream("POST", serving.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": "chat", "prompt": PROMPTS[0], "max_tokens": 4, "stream": True},
                          timeout=60) as waiting:
            assert waiting.status_code == 200
            [info] = [k for k in metrics(serving) if k.startswith("vllm:lora_requests_info")]
            assert "waiting_lora_adapters=chat" in info and "running_lora_adapters=sql" in info, info
        deadline = time.monotonic() + 30
        while serving.engine.live > 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert serving.engine.live == 1  # the waiting choice ended; the stream goes on
        for _ in stream:
            pass
        assert serving.engine.recent[-1].finish_reason == "length"
        aborted = [r for r in serving.engine.recent if r.cancelled]
        assert aborted and aborted[-1].finish_reason == "abort" and aborted[-1].completion_tokens == 0
        m = metrics(serving)
        assert m["fxsched_lora_adapters_resident"] == 1 and m["fxsched_lora_adapters_served"] == 3
        assert m["fxsched_lora_evictions_total"] >= 2 and m["fxsched_lora_loads_total"] >= 3


def test_modules_without_enable_lora_are_refused(setup):
    argv = [a for a in serve_argv(setup, "--lora-modules", f"a={setup.dirs['sql']}") if a != "--enable-lora"]
    with pytest.raises(UsageError, match="--lora-modules: needs --enable-lora"):
        with open_serving(build_parser().parse_args(argv)):
            pass


def test_lora_routes_say_how_to_enable_them(setup):
    argv = [a for a in serve_argv(setup) if a != "--enable-lora"]
    with running(argv) as serving:
        r = post(serving, "/v1/load_lora_adapter", lora_name="x", lora_path=str(setup.dirs["sql"]))
        assert r.status_code == 404 and "--enable-lora" in r.json()["error"]["message"]


def test_help_has_a_lora_group(capsys):
    assert main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    group = out[out.index("\nLoRAConfig:"):out.index("\nFrontend:")]
    for flag in ("--enable-lora", "--lora-modules", "--max-loras", "--max-lora-rank"):
        assert flag in group, flag


# --- fxsched generate --lora ----------------------------------------------------------------------


def test_generate_runs_each_prompt_with_its_adapter(setup, tmp_path, capsys):
    ids = tmp_path / "prompts.txt"
    ids.write_text("\n".join(" ".join(map(str, p)) for p in PROMPTS))
    argv = ["generate", "--model", str(setup.root / BASE), "--dtype", "float32", "--prompt-ids-file", str(ids),
            "--max-tokens", str(STEPS), "--json", "--batch", "3", "--lora", f"sql={setup.dirs['sql']}",
            "--lora", str(setup.dirs["chat"]), "--lora-prompts", "sql,base,chat"]
    assert main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    records = sorted((r for r in lines if not r.get("summary")), key=lambda r: r["request_id"])  # finish order
    assert [r["lora"] for r in records] == ["sql", None, "chat"]
    for record, prompt, name in zip(records, PROMPTS, ("sql", None, "chat"), strict=True):
        want, got = reference(setup, name, prompt, ()), record["token_ids"]
        assert got == want[:len(got)] and (len(got) == STEPS or record["finish_reason"] == "stop"), (name, record)
    # one adapter: every prompt runs with it; a bad one is one line naming it
    one = ["generate", "--model", str(setup.root / BASE), "--dtype", "float32", "--prompt-ids", "5 17 33",
           "--max-tokens", "3", "--json", "--lora", str(setup.dirs["third"])]
    assert main(one) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[0])["lora"] == "third"
    assert main(one[:-1] + [str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"fxsched generate: --lora {tmp_path.name}: ") and len(err.splitlines()) == 1, err
    assert main(one[:-2] + ["--lora", "a=" + str(setup.dirs["sql"]), "--lora", "b=" + str(setup.dirs["chat"])]) == 2
    assert "--lora-prompts" in capsys.readouterr().err
