"""Fuzzed front doors: hypothesis-generated scenario documents and command lines, each run in its
own process with a timeout and a fresh ``TMPDIR``. Every outcome is a normal run (exit 0; for
``check``/``replay`` also exit 1 with a VIOLATION report on stdout) or exit 2 with exactly one
line on stderr: never a traceback, a hang, a leftover file in the temp folder or a leftover process.

The processes come from a small fork server (``SERVER``, one interpreter that has imported
fxsched and torch once): each case is a ``fork`` of it in a new session that sets ``TMPDIR``,
points fds 0/1/2 at /dev/null and two files, runs ``fxsched.runtime.cli.app.main(argv)`` and
exits with its code; an exception that escapes ``main`` is printed as Python would print it. The
server never runs torch itself, so each fork starts clean; a case past its timeout is killed with
its whole session and counted as a hang. ``FXSCHED_FUZZ_EXAMPLES`` scales the example counts
(default: CI-sized), ``FXSCHED_FUZZ_RANDOM=1`` draws new examples instead of the fixed ones.
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

import attrs
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fxsched.runtime.devices.recording import DeviceConfig
from fxsched.runtime.scenarios.loader import RequestSpec, RunOptions

pytest.importorskip("torch")

SCALE = float(os.environ.get("FXSCHED_FUZZ_EXAMPLES", "1"))
TIMEOUT_S = 30.0  # a case this slow is a hang (the slowest normal case takes a few seconds)


def examples(n: int) -> settings:
    return settings(max_examples=max(1, int(n * SCALE)), deadline=None, database=None,
                    derandomize=os.environ.get("FXSCHED_FUZZ_RANDOM") != "1",
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


SERVER = r'''
import json, os, signal, sys, tempfile, time, traceback
import torch  # noqa: F401 -- imported once here, never used here
from fxsched.runtime.cli import app
import fxsched.runtime.cli.generate  # noqa: F401
import fxsched.runtime.generate  # noqa: F401

def child(case):
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    out = os.open(case["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    err = os.open(case["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(null, 0); os.dup2(out, 1); os.dup2(err, 2)
    os.environ["TMPDIR"] = case["tmpdir"]
    tempfile.tempdir = None
    os.chdir(case["cwd"])
    try:
        code = app.main(case["argv"])
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        sys.stdout.flush()
    except BaseException:
        traceback.print_exc()
        code = 120
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else 1)

for line in sys.stdin:
    case = json.loads(line)
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        child(case)
    status, hung = None, False
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() - start > case["timeout"]:
            hung = True
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            break
        time.sleep(0.005)
    left = False
    try:
        os.killpg(pid, 0)  # anything still running in the case's session?
        left = True
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    code = None if hung else os.waitstatus_to_exitcode(status)
    print(json.dumps({"code": code, "hung": hung, "left_processes": left,
                      "seconds": time.monotonic() - start}), flush=True)
'''


@attrs.frozen
class Outcome:
    argv: list
    code: Optional[int]
    hung: bool
    left_processes: bool
    seconds: float
    out: str
    err: str
    left_files: list

    def describe(self) -> str:
        return (f"fxsched {' '.join(self.argv)}: exit {self.code}, {self.seconds:.1f}s, hung={self.hung}, "
                f"left files {self.left_files}, left processes {self.left_processes}\n"
                f"stderr:\n{self.err[-3000:]}\nstdout tail:\n{self.out[-800:]}")


class ForkServer:
    """Runs command lines in forked children of one warm interpreter (see the module docstring)."""

    def __init__(self, root: Path):
        self.root = root
        self.count = 0
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, cwd=str(root))

    def run(self, argv: list[str], files: Optional[dict[str, bytes]] = None, timeout: float = TIMEOUT_S) -> Outcome:
        self.count += 1
        case = self.root / f"case{self.count}"
        tmpdir, cwd = case / "tmp", case / "cwd"
        tmpdir.mkdir(parents=True)
        cwd.mkdir()
        for name, data in (files or {}).items():
            (cwd / name).write_bytes(data)
        request = {"argv": argv, "tmpdir": str(tmpdir), "cwd": str(cwd), "out": str(case / "out"),
                   "err": str(case / "err"), "timeout": timeout}
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self.proc.stdout.readline())
        out = (case / "out").read_text(errors="replace")
        err = (case / "err").read_text(errors="replace")
        return Outcome(argv, reply["code"], reply["hung"], reply["left_processes"], reply["seconds"], out, err,
                       sorted(p.name for p in tmpdir.iterdir()))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ForkServer]:
    s = ForkServer(tmp_path_factory.mktemp("fuzz"))
    yield s
    s.close()


def assert_clean(outcome: Outcome, violation_ok: bool = False) -> None:
    """A normal run, or exit 2 with one stderr line; no traceback, hang or leftover."""
    event(f"{outcome.argv[0] if outcome.argv else '-'}: exit {outcome.code}")
    why = outcome.describe()
    assert not outcome.hung, "hang: " + why
    assert not outcome.left_processes, "processes left behind: " + why
    assert outcome.left_files == [], "files left in the temp folder: " + why
    assert "Traceback" not in outcome.err and "Exception ignored" not in outcome.err, why
    if outcome.code == 0:
        return
    if outcome.code == 1 and violation_ok and "VIOLATION" in outcome.out and outcome.err == "":
        return
    assert outcome.code == 2, why
    lines = outcome.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("fxsched"), why


# --- scenario documents ----------------------------------------------------------------------------

BIG = [0, 1, 2, 3, 7, 8, 16, 63, 64, 65, 320, 321, 1000, 4096, 10**6, 10**6 + 1, 2**31, 2**63 - 1, 10**30, -1, -2**63]
FLOAT_FIELDS = {"temperature", "top_p", "min_p", "swap_space_gb"}
STRING_FIELDS = {"lora_rotation"}


def _kind(cls, name: str) -> str:
    default = attrs.fields_dict(cls)[name].default
    if name in FLOAT_FIELDS:
        return "float"
    if name in STRING_FIELDS:
        return "str"
    if isinstance(default, bool):
        return "bool"
    if isinstance(default, tuple):
        return "ints"
    return "int"


def mostly(common: st.SearchStrategy, rare: st.SearchStrategy, percent: int) -> st.SearchStrategy:
    """``rare`` in about ``percent`` % of the draws, else ``common``."""
    return st.sampled_from(range(100)).flatmap(lambda n: rare if n >= 100 - percent else common)  # 0, the simplest: common


small_int = st.one_of(st.integers(0, 20), st.integers(-2, 70))
any_int = mostly(small_int, st.sampled_from(BIG), 15)
# values a real scenario would use, for the fields where a small integer is mostly out of range
SANE = {"vocab": st.sampled_from([64, 65, 100, 256]), "block_size": st.integers(1, 32),
        "total_blocks": st.integers(1, 2000), "max_batch_size": st.integers(1, 16), "num_drafts": st.integers(0, 6),
        "dflash_gamma": st.integers(1, 8), "ring_slots": st.integers(0, 16), "max_tokens": st.integers(1, 30),
        "num_beams": st.integers(1, 4), "max_batch_tokens": st.integers(1, 10_000),
        "swap_space_gb": st.sampled_from([0.0, 0.5, 1.0, 2.0]), "temperature": st.sampled_from([0.0, 0.0, 0.7, 1.0]),
        "top_p": st.sampled_from([1.0, 0.9, 0.5]), "min_p": st.sampled_from([0.0, 0.1]),
        "lora_rotation": st.sampled_from(["adapter-x", "b"]), "boundary_tokens": st.lists(st.integers(0, 63), max_size=3),
        "beam_hyp": st.lists(st.integers(0, 63), max_size=4)}
any_float = st.one_of(st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.0]), st.floats(allow_nan=True, allow_infinity=True))
text = st.one_of(st.sampled_from(["adapter-x", "", "a b", "é", "x\ny", "../up"]),
                 st.text(st.characters(exclude_categories=["Cs"]), max_size=8))  # TOML holds no lone surrogate
token_list = st.lists(st.one_of(st.integers(0, 62), st.integers(0, 62), st.just(63), st.sampled_from(BIG)),
                      max_size=8)
VALUES = {"int": any_int, "float": any_float, "bool": st.booleans(), "str": text, "ints": token_list}
wrong = st.one_of(st.booleans(), text, any_float, token_list, st.dictionaries(st.sampled_from(["a", "toks"]), any_int,
                                                                              max_size=2))


def _field(cls, name: str) -> st.SearchStrategy:
    right = VALUES[_kind(cls, name)]
    return mostly(mostly(SANE.get(name, right), right, 20), wrong, 8)


def table(cls, required: tuple[str, ...] = (), tokens: bool = False) -> st.SearchStrategy:
    names = sorted(attrs.fields_dict(cls))
    optional = [n for n in names if n not in required]

    @st.composite
    def build(draw):
        out: dict[str, Any] = {}
        for name in required:
            if draw(st.sampled_from(range(20))) != 19:  # now and then a required field is missing
                out[name] = draw(_field(cls, name))
        for name in draw(st.lists(st.sampled_from(optional), max_size=3, unique=True)):
            out[name] = draw(_field(cls, name))
        if tokens and "tokens" in out and draw(st.sampled_from(range(5))) == 4:
            out["tokens"] = {"toks": draw(any_int), "base": draw(any_int), "eos": draw(st.booleans())}
        if draw(st.sampled_from(range(40))) == 39:
            out["no_such_field"] = draw(any_int)
        return out

    return build()


def _numbered(requests: list[dict]) -> list[dict]:
    """Ids 1, 2, ... where the draw gave an id of 0..5 (a drawn duplicate id stays possible)."""
    return [{**r, "id": i + 1} if r.get("id") in range(6) else r for i, r in enumerate(requests)]


request = st.fixed_dictionaries({"id": st.integers(0, 5), "prompt_len": st.integers(1, 40),
                                 "tokens": st.lists(st.integers(0, 62), min_size=1, max_size=6).map(lambda t: t + [63]),
                                 }).flatmap(lambda base: table(RequestSpec, tokens=True).map(lambda extra: {**base, **extra}))
document = st.fixed_dictionaries(
    {"name": mostly(st.just("fuzz"), text, 5),
     "model": table(DeviceConfig), "options": table(RunOptions),
     "requests": mostly(st.lists(request, min_size=1, max_size=3).map(_numbered), st.just([]), 3)},
)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(value)


def to_toml(doc: dict) -> str:
    lines = [f"name = {_toml_value(doc['name'])}"]
    for section in ("model", "options"):
        lines.append(f"[{section}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in doc[section].items()]
    for req in doc["requests"]:
        lines.append("[[requests]]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in req.items()]
    return "\n".join(lines) + "\n"


@examples(50)
@given(doc=document)
def test_a_fuzzed_scenario_runs_or_is_refused_in_one_line(server, doc):
    outcome = server.run(["run", "fuzz.toml"], files={"fuzz.toml": to_toml(doc).encode()})
    assert_clean(outcome)
    if outcome.code == 0:
        assert outcome.out.startswith("# scenario ")


def test_the_document_builder_writes_valid_scenarios(server):
    """A document of the real schema with sane values runs (so the fuzz reaches the runner)."""
    doc = {"name": "fuzz", "model": {"vocab": 64}, "options": {"max_batch_size": 2},
           "requests": [{"id": 1, "prompt_len": 5, "tokens": [10, 11, 63]},
                        {"id": 2, "prompt_len": 3, "tokens": {"toks": 3, "base": 20, "eos": True}, "max_tokens": 4}]}
    outcome = server.run(["run", "fuzz.toml"], files={"fuzz.toml": to_toml(doc).encode()})
    assert outcome.code == 0, outcome.describe()
    assert "out s2: T20 T21 T22 Done(stop" in outcome.out


# --- command lines -----------------------------------------------------------------------------

NUMBERS = ["0", "1", "2", "3", "-1", "1_0", "٣", "nan", "inf", "0.5", "1e3", "x", "", "10000000000000000000000",
           "99999999999999999999999999999999999999999999"]
small = st.sampled_from(["1", "2", "3"])
number = mostly(small, st.sampled_from(NUMBERS), 30)


def _flags(spec: dict[str, Optional[st.SearchStrategy]]) -> st.SearchStrategy:
    """A random subset of ``spec``'s flags (value strategies; None: a switch), in random order."""

    @st.composite
    def build(draw):
        argv: list[str] = []
        for flag in draw(st.lists(st.sampled_from(sorted(spec)), max_size=4, unique=True)):
            argv.append(flag)
            if spec[flag] is not None:
                argv.append(draw(spec[flag]))
        return argv

    return build()


scenario_name = st.sampled_from(["plain_decode", "spill_swap_out_in", "beam", "nope", "", "a.toml", ".", "-x"])
RUN = st.tuples(st.just(["run"]), st.lists(scenario_name, max_size=2),
                _flags({"--list": None, "--check": None, "--write": None, "-v": None, "--ep-ranks": number,
                        "--ep-timeout": number}))
# tiny budgets: a value the walk accepts is small; the others are refused
BAD_NUMBERS = ["-1", "0", "1_0", "٣", "nan", "inf", "1e999", "x", "", "10000000000000000000000"]
steps = mostly(st.sampled_from(["1", "50", "300"]), st.sampled_from(BAD_NUMBERS), 30)
seconds = mostly(st.sampled_from(["0.05", "0.2", ".1"]), st.sampled_from(BAD_NUMBERS), 30)
CHECK = st.tuples(st.just(["check"]),
                  st.one_of(st.tuples(st.just("--steps"), steps), st.tuples(st.just("--time"), seconds),
                            st.just(())).map(list),
                  _flags({"--seed": st.one_of(small, number), "--replay-file": st.sampled_from(
                      ["r.json", "no/such/r.json", ".", ""]), "--progress": None, "--no-progress": None,
                          "--steps": steps, "--time": seconds}))
REPLAY: st.SearchStrategy = st.tuples(st.just(["replay"]), st.lists(st.sampled_from(["good.json", "broken.json", "nope.json", "."]),
                                                 max_size=2), st.just([]))
BENCH = st.tuples(st.just(["bench"]), st.lists(st.sampled_from(["step", "check", "nope"]), min_size=0, max_size=1),
                  _flags({"--sizes": st.sampled_from(["1", "1,2", "0", "a", "", "1,,2", "5000"]),
                          "--ticks": st.one_of(small, number), "--repeats": st.one_of(small, number)}))
GENERATE = st.tuples(
    st.just(["generate"]),
    mostly(st.just(("--prompt-ids", "1 2 3")), st.one_of(
              st.tuples(st.just("--prompt-ids"), st.sampled_from(["1,2", "1_0", "٣", "", "70", "-1", "5 " * 600])),
              st.tuples(st.just("--prompt"), st.just("hello")),
              st.tuples(st.just("--prompt-ids-file"), st.sampled_from(["ids.txt", "latin.txt", "empty.txt", "nope"])),
              st.just(())), 40).map(list),
    _flags({"--max-tokens": st.one_of(small, number), "--batch": st.one_of(small, number),
            "--spec": st.sampled_from(["none", "mtp", "dflash", "ngram", "warp"]),
            "--temperature": st.one_of(st.sampled_from(["0", "0.7"]), number), "--top-p": number, "--top-k": number,
            "--min-p": number, "--seed": number, "--logprobs": st.one_of(small, number), "--json": None,
            "--ignore-eos": None, "--stop": st.sampled_from(["x", ""]), "--device": st.sampled_from(["cpu", "tpu"]),
            "--threads": st.one_of(small, number), "--dtype": st.sampled_from(["float32", "fp4"]),
            "--max-seq-len": number, "--weights": st.sampled_from(["nope.safetensors", "."]),
            "--model": st.sampled_from(["nope", "."]), "--chat": None, "--no-progress": None,
            "--ep-ranks": st.sampled_from(["1", "0", "x", "65"]), "--ep-timeout": number}),
)


def _argv(parts: tuple) -> list[str]:
    return [word for part in parts for word in part]


@functools.lru_cache(maxsize=1)
def _replay_files() -> dict[str, bytes]:
    import random
    from collections import Counter

    from fxsched.runtime.check.replay import FORMAT
    from fxsched.runtime.check.walk import random_episode, run_episode

    episode = random_episode(random.Random(3))
    events = list(run_episode(episode, Counter(), keep_log=True).events)
    good = {"format": FORMAT, "seed": 0, "invariant": "lossless", "message": "m", "step": 1, "episode_index": 0,
            "episode": episode.to_json(), "events": events}
    return {"good.json": json.dumps(good).encode(), "broken.json": json.dumps(good).encode()[:200]}


FILES = {"ids.txt": b"1 2 3\n4 5\n", "latin.txt": b"caf\xe9\n", "empty.txt": b"\n"}


@examples(40)
@given(parts=st.one_of(RUN, CHECK, REPLAY, BENCH))
def test_fuzzed_command_lines_run_or_are_refused_in_one_line(server, parts):
    argv = _argv(parts)
    if "--ep-ranks" in argv and argv[argv.index("--ep-ranks") + 1] not in ("0", "1", "x", "", "-1"):
        argv[argv.index("--ep-ranks") + 1] = "1"  # real worker processes belong to test_ep_distributed
    outcome = server.run(argv, files={**FILES, **_replay_files()})
    assert_clean(outcome, violation_ok=argv[0] in ("check", "replay"))


@functools.lru_cache(maxsize=1)
def _toy_weights() -> bytes:
    """The internal toy model's weights file (the generate cases run it, whatever the default model is)."""
    import tempfile

    from fxsched.runtime.torch_model import default_config
    from fxsched.runtime.torch_model.weights import init_weights, save_weights

    cfg = default_config()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "toy.safetensors"
        save_weights(path, init_weights(cfg), cfg)
        return path.read_bytes()


@examples(12)
@given(parts=GENERATE)
def test_fuzzed_generate_command_lines_run_or_are_refused_in_one_line(server, parts):
    argv = _argv(parts)
    if "--weights" not in argv and "--model" not in argv:
        argv += ["--weights", "toy.safetensors"]
    outcome = server.run(argv, files={**FILES, "toy.safetensors": _toy_weights()})
    assert_clean(outcome)
