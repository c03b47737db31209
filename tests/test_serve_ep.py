"""``fxsched serve MODEL --ep-ranks 2``: the server's engine on two expert-parallel ranks (the
embedded default model, dense, so rank 1 runs a replica: runtime/ep/serve.py). The answers equal
the offline single-rank greedy text (``generate()``), and after SIGTERM the server exits 0 and every
process it started (workers, forkserver, resource tracker) is gone.
"""

from __future__ import annotations

import os
import signal

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from test_serve import MODEL, PROMPTS, references  # noqa: E402, F401
from test_serve_process import start  # noqa: E402

from fxsched.runtime.text import load_tokenizer  # noqa: E402
from fxsched.runtime.torch_model.default_model import default_model_dir  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    parents[int(entry)] = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        kids = [p for p, pp in parents.items() if pp == parent]
        out.extend(kids)
        todo.extend(kids)
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_serve_on_two_ep_ranks_answers_as_one_rank_and_leaves_nothing_behind():
    tok = load_tokenizer(default_model_dir())
    proc, url = start(str(default_model_dir()), "--ep-ranks", "2", "--port", "0", "--served-model-name", MODEL)
    try:
        started = descendants(proc.pid)
        assert len(started) >= 2, started  # the forkserver and the worker at least
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        prompts = PROMPTS[:3]
        want = references(tok, [tok.encode(p) for p in prompts], 12)
        got = [client.completions.create(model=MODEL, prompt=p, max_tokens=12).choices[0].text for p in prompts]
        assert got == want
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    left = [pid for pid in started if alive(pid)]
    assert left == [], f"processes of the server still running: {left}"
