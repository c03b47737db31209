"""Every bad input a new user tried (issue 16) ends in ONE line on stderr naming the input and what
is wrong, exit 2, within a second or two: never a traceback, a hang, lost output or a file left
in the temp folder. Ctrl-C during ``generate`` prints what was generated and exits 130.

Most cases run the CLI in-process (``main([...])`` with capsys) under ``TMPDIR`` pointed at a
fresh folder that must stay empty; the full disk and Ctrl-C cases run ``fxsched`` in a subprocess.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from fxsched.runtime.cli.app import main
from fxsched.runtime.scenarios.loader import load_scenario, specs_dir

LIMIT_S = 2.0  # an in-process refusal, on a loaded 2-core machine
TORCH_LIMIT_S = 5.0  # a refusal that first builds or loads the torch model
EXIT_USAGE = 2
FXSCHED = [sys.executable, "-m", "fxsched.runtime.cli"]


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> str:
    """A weights file of the internal toy model: the generate cases run it, whatever the default
    model of ``fxsched generate`` is."""
    from fxsched.runtime.torch_model import default_config
    from fxsched.runtime.torch_model.weights import init_weights, save_weights

    cfg = default_config()
    path = tmp_path_factory.mktemp("toy") / "toy.safetensors"
    save_weights(path, init_weights(cfg), cfg)
    return str(path)


@pytest.fixture(autouse=True)
def temp_folder(tmp_path, monkeypatch) -> Any:
    """TMPDIR is a fresh folder (for this process and its children); cwd another; both checked
    empty of anything new at the end."""
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.chdir(work)
    yield work
    assert sorted(p.name for p in tmp.iterdir()) == [], "files left in the temp folder"


def refused(capsys, argv: list[str], *words: str, code: int = EXIT_USAGE, limit: float = LIMIT_S) -> str:
    """Run ``fxsched argv`` in-process: exit ``code``, one stderr line holding every word, no traceback."""
    start = time.monotonic()
    rc = main(argv)
    elapsed = time.monotonic() - start
    out, err = capsys.readouterr()
    assert rc == code, (rc, out, err)
    assert "Traceback" not in err + out
    lines = err.splitlines()
    assert len(lines) == 1, err
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert elapsed < limit, f"{argv} took {elapsed:.2f}s"
    return lines[0]


def scenario(path: Path, model: str = "", options: str = "", request: str = "", tokens: str = "[10, 11, 63]",
             prompt_len: str = "5") -> str:
    path.write_text(f'name = "probe"\n[model]\n{model}\n[options]\n{options}\n'
                    f"[[requests]]\nid = 1\nprompt_len = {prompt_len}\ntokens = {tokens}\n{request}\n")
    return str(path)


# --- hangs and memory ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", [str(10**30), str(2**63 - 1)])
def test_a_huge_prompt_len_is_refused_at_load(capsys, temp_folder, value):
    path = scenario(temp_folder / "big.toml", prompt_len=value)
    refused(capsys, ["run", path], "big.toml", "prompt_len", "out of range", "1000000")


def test_a_zero_batch_size_is_refused(capsys, temp_folder):
    path = scenario(temp_folder / "b.toml", options="max_batch_size = 0")
    refused(capsys, ["run", path], "b.toml [options]", "max_batch_size", "out of range")


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0", "1_0", "٣"])
def test_check_time_must_be_a_finite_positive_number(capsys, value):
    refused(capsys, ["check", "--time", value], "--time", value)


# --- accepted although invalid ------------------------------------------------------------------


@pytest.mark.parametrize("value", ["0", "-3"])
def test_max_tokens_below_one_is_refused(capsys, temp_folder, value):
    path = scenario(temp_folder / "m.toml", request=f"max_tokens = {value}")
    refused(capsys, ["run", path], "m.toml [[requests]] #1", "max_tokens", value)


def test_script_tokens_outside_the_vocabulary_are_refused(capsys, temp_folder):
    path = scenario(temp_folder / "v.toml", tokens="[10, 999999, 63]")
    refused(capsys, ["run", path], "v.toml [[requests]] #1", "tokens", "999999", "vocabulary [0, 64)")


def test_a_zero_block_size_is_refused(capsys, temp_folder):
    path = scenario(temp_folder / "k.toml", model="block_size = 0")
    refused(capsys, ["run", path], "k.toml [model]", "block_size", "out of range")


def test_a_huge_beam_count_is_refused(capsys, temp_folder):
    path = scenario(temp_folder / "n.toml", model="supports_beam = true", request="num_beams = 100000")
    refused(capsys, ["run", path], "n.toml [[requests]] #1", "num_beams", "100000", "320")


@pytest.mark.parametrize("value", ["-1", "0"])
def test_check_steps_must_be_positive(capsys, value):
    refused(capsys, ["check", "--steps", value], "--steps", value)


@pytest.mark.parametrize("value", ["0", "-2", "x", "1.5", "1000"])
def test_check_jobs_is_a_process_count(capsys, value):
    refused(capsys, ["check", "--steps", "10", "--jobs", value], "--jobs", value)


@pytest.mark.parametrize("ids", ["1_0", "٣", "1 2 ３"])
def test_generate_prompt_ids_are_ascii_digits(capsys, toy, ids):
    refused(capsys, ["generate", "--prompt-ids", ids, "--max-tokens", "2", "--weights", toy], "--prompt-ids",
            "is not a token id",
            limit=TORCH_LIMIT_S)


# --- tracebacks instead of one-line errors --------------------------------------------------------


def test_a_non_utf8_scenario_file(capsys, temp_folder):
    path = temp_folder / "latin.toml"
    path.write_bytes(b'name = "caf\xe9"\n')
    refused(capsys, ["run", str(path)], "latin.toml", "not UTF-8")


@pytest.mark.parametrize("name", ["folder", "folder.toml"])
def test_a_directory_as_scenario(capsys, temp_folder, name):
    (temp_folder / name).mkdir()
    refused(capsys, ["run", str(temp_folder / name)], name, "is a directory")


def test_a_non_utf8_prompt_file(capsys, temp_folder, toy):
    path = temp_folder / "prompts.txt"
    path.write_bytes(b"caf\xe9\n")
    refused(capsys, ["generate", "--prompt-ids-file", str(path), "--weights", toy], "--prompt-ids-file",
            "prompts.txt", "not UTF-8",
            limit=TORCH_LIMIT_S)


def _replay_data() -> dict:
    """A real replay file's contents: an episode of the walk and its full event log."""
    from fxsched.runtime.check.replay import FORMAT
    from fxsched.runtime.check.walk import random_episode, run_episode

    episode = random_episode(random.Random(7))
    result = run_episode(episode, Counter(), keep_log=True)
    return {"format": FORMAT, "seed": 0, "invariant": "lossless", "message": "recorded", "step": 1,
            "episode_index": 0, "episode": json.loads(json.dumps(episode.to_json())), "events": list(result.events)}


def _edit(data: dict, path: tuple, value: Any) -> dict:
    out = json.loads(json.dumps(data))
    target = out
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return out


BAD_REPLAYS = [
    (lambda d: [1, 2], "expected a JSON object"),
    (lambda d: "text", "expected a JSON object"),
    (lambda d: _edit(d, ("format",), "other"), "not an fxsched replay file"),
    (lambda d: _edit(d, ("events",), "x"), "field 'events'"),
    (lambda d: _edit(d, ("events",), [1, 2]), "field 'events'"),
    (lambda d: _edit(d, ("invariant",), 3), "field 'invariant'"),
    (lambda d: _edit(d, ("episode",), KeyError), "episode: expected an object"),
    (lambda d: _edit(d, ("episode",), []), "episode: expected an object"),
    (lambda d: _edit(d, ("episode", "max_batch_size"), "8"), "field 'max_batch_size'"),
    (lambda d: _edit(d, ("episode", "spill"), 1), "field 'spill'"),
    (lambda d: _edit(d, ("episode", "mode"), KeyError), "missing field 'mode'"),
    (lambda d: _edit(d, ("episode", "surprise"), 1), "unknown field 'surprise'"),
    (lambda d: _edit(d, ("episode", "requests"), {}), "field 'requests'"),
    (lambda d: _edit(d, ("episode", "requests", 0, "prompt_len"), 10**30), "field 'prompt_len'"),
    (lambda d: _edit(d, ("episode", "requests", 0, "tokens"), ["a"]), "field 'tokens'"),
    (lambda d: _edit(d, ("episode", "requests", 0, "deadline_ms"), "soon"), "field 'deadline_ms'"),
    (lambda d: _edit(d, ("episode", "mode"), "warp"), "cannot be run"),
    (lambda d: _edit(d, ("episode", "max_batch_size"), 0), "cannot be run"),
]


@pytest.fixture(scope="module")
def replay_data() -> dict:
    return _replay_data()


@pytest.mark.parametrize("edit, words", BAD_REPLAYS)
def test_replay_files_of_the_wrong_shape_or_types(capsys, temp_folder, replay_data, edit, words):
    path = temp_folder / "bad.json"
    path.write_text(json.dumps(edit(replay_data)))
    refused(capsys, ["replay", str(path)], "bad.json", words)


@pytest.mark.parametrize("content, words", [(b"{\"format\": ", "not valid JSON"), (b"\xff\xfe", "not UTF-8"),
                                            (b"[" * 100_000, "JSON")])
def test_replay_files_that_are_not_json(capsys, temp_folder, content, words):
    path = temp_folder / "bad.json"
    path.write_bytes(content)
    refused(capsys, ["replay", str(path)], "bad.json", words)


def test_a_missing_or_directory_replay_file(capsys, temp_folder):
    refused(capsys, ["replay", str(temp_folder / "nope.json")], "nope.json", "no such replay file")
    refused(capsys, ["replay", str(temp_folder)], "is a directory")


def test_check_replay_file_into_a_missing_folder_is_refused_before_the_walk(capsys, temp_folder):
    target = temp_folder / "no" / "such" / "r.json"
    refused(capsys, ["check", "--steps", "100000000", "--replay-file", str(target)], "--replay-file",
            "no such folder")


def test_a_replay_file_that_cannot_be_written_still_prints_the_violation(capsys, monkeypatch, temp_folder):
    from fxsched.runtime.check import walk as walk_module
    from fxsched.runtime.check.walk import WalkReport

    folder = temp_folder / "gone"
    folder.mkdir()
    violation = {"invariant": "lossless", "message": "made up", "step": 3, "episode_index": 0}

    def fake_walk(seed, steps=None, seconds=None, progress=None, jobs=1):
        folder.rmdir()
        return WalkReport(seed, 3, 1, 0.01, {}, violation)

    monkeypatch.setattr(walk_module, "walk", fake_walk)
    assert main(["check", "--steps", "3", "--replay-file", str(folder / "r.json")]) == 1
    out, err = capsys.readouterr()
    assert "VIOLATION lossless at step 3 of episode 0: made up" in out  # printed before the write failed
    assert "Traceback" not in err
    assert err.splitlines() == [f"fxsched check: --replay-file {folder / 'r.json'}: cannot write it "
                                f"(No such file or directory)"]


@pytest.mark.parametrize("argv, words", [
    (["bench", "step", "--sizes", "a,b"], "--sizes"),
    (["bench", "step", "--sizes", ""], "--sizes"),
    (["bench", "step", "--sizes", "1,,2"], "--sizes"),
    (["bench", "step", "--sizes", "0"], "--sizes"),
    (["bench", "step", "--sizes", "-4"], "--sizes"),
    (["bench", "step", "--sizes", "1_0"], "--sizes"),
    (["bench", "step", "--sizes", "100000"], "--sizes"),
    (["bench", "step", "--ticks", "0"], "--ticks"),
    (["bench", "step", "--ticks", "x"], "--ticks"),
    (["bench", "step", "--repeats", "0"], "--repeats"),
    (["bench", "step", "--repeats", "-2"], "--repeats"),
    (["bench", "step", "--warmup", "19"], "--warmup"),
    (["bench", "step", "--warmup", "2e3"], "--warmup"),
    (["bench", "check", "--ticks", "-1"], "--ticks"),
    (["bench", "check", "--ticks", "1.5"], "--ticks"),
    (["bench", "check", "--repeats", "0"], "--repeats"),
    (["bench", "check", "--repeats", "nan"], "--repeats"),
    (["bench", "nope"], "invalid choice"),
])
def test_every_bad_bench_value(capsys, argv, words):
    refused(capsys, argv, words)


@pytest.mark.parametrize("argv", [[], ["run", "--bogus"], ["check", "--seed"], ["check", "--seed", "x"],
                                  ["nope"], ["run", "a", "b"], ["replay"], ["run", "plain_decode", "--check", "--write"]])
def test_argument_errors_are_one_line(capsys, argv):
    refused(capsys, argv)


def test_stdout_on_a_full_disk():
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system (Linux only)")
    with open("/dev/full", "w") as full:
        proc = subprocess.run(FXSCHED + ["run", "plain_decode"], stdout=full, stderr=subprocess.PIPE, text=True,
                              timeout=60)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr
    assert proc.stderr.splitlines() == ["fxsched run: cannot write the output (No space left on device)"]


# --- Ctrl-C during generate ------------------------------------------------------------------------


def _interrupt_generate(folder: Path, toy: str, *extra: str) -> tuple[int, list[str], str]:
    """Start a long ``generate --json``, press Ctrl-C (SIGINT to its process group) once the first
    request has finished; (exit code, stdout lines, stderr)."""
    prompts = folder / "prompts.txt"
    prompts.write_text("".join(f"1 2 3 {i}\n" for i in range(40)))
    proc = subprocess.Popen(FXSCHED + ["generate", "--prompt-ids-file", str(prompts), "--batch", "1",
                                       "--max-tokens", "400", "--json", "--no-progress", "--weights", toy, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        first = proc.stdout.readline() if proc.stdout else ""
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, [first] + out.splitlines(), err


def _check_interrupted(code: int, lines: list[str], err: str) -> None:
    assert code == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.splitlines() == ["fxsched generate: interrupted (Ctrl-C); the output is what was generated until then"]
    records = [json.loads(line) for line in lines if line.strip()]
    summary = records[-1]
    requests = records[:-1]
    assert summary["summary"] is True and summary["requests"] == 40
    assert sorted(r["index"] for r in requests) == list(range(40))  # every request is reported once
    assert requests[0]["finish_reason"] in ("length", "stop") and len(requests[0]["token_ids"]) > 0
    assert any(r["finish_reason"] == "interrupted" for r in requests)
    assert summary["generated_tokens"] == sum(len(r["token_ids"]) for r in requests)


def test_ctrl_c_during_generate_prints_what_was_generated(temp_folder, toy):
    _check_interrupted(*_interrupt_generate(temp_folder, toy))


def test_ctrl_c_during_generate_with_two_ep_ranks(temp_folder, toy):
    pytest.importorskip("torch.distributed")
    code, lines, err = _interrupt_generate(temp_folder, toy, "--ep-ranks", "2")
    _check_interrupted(code, lines, err)


# --- fault fields and spill traces ---------------------------------------------------------------


SPILL = """name = "spill_probe"
[model]
total_blocks = 10
held_blocks = 4
{fault}
[options]
swap_space_gb = 1
[[requests]]
id = 1
prompt_len = 32
tokens = [10, 11, 12, 13, 14, 15, 63]
[[requests]]
id = 2
prompt_len = 96
tokens = [20, 21, 22, 63]
arrive_at_tick = 2
"""


@pytest.mark.parametrize("fault, words", [("spill_corrupt_for = [1]", "checksum mismatch"),
                                          ("spill_missing_for = [1]", "is missing")])
def test_spill_faults_from_a_scenario_file_give_the_same_trace_every_run(capsys, temp_folder, monkeypatch,
                                                                         fault, words):
    path = temp_folder / "spill.toml"
    path.write_text(SPILL.format(fault=fault))
    traces = []
    base = Path(os.environ["TMPDIR"])
    for other in ("a", "b"):  # two different temp folders: the trace must not name them
        tmp = base / other
        tmp.mkdir()
        monkeypatch.setattr(tempfile, "tempdir", str(tmp))
        assert main(["run", str(path)]) == 0
        traces.append(capsys.readouterr().out)
        assert list(tmp.iterdir()) == []  # the spill folder is gone
        tmp.rmdir()
    assert traces[0] == traces[1]
    assert "-> ERR spill file seq-1.spill " in traces[0] and words in traces[0]
    assert "out s1: T10 T11 T12 Error(spill file seq-1.spill" in traces[0]


def test_decode_fault_at_from_a_scenario_file(capsys, temp_folder):
    path = scenario(temp_folder / "f.toml", model="decode_fault_at = [0]", tokens="[10, 11, 12, 63]")
    assert main(["run", path]) == 0
    assert "out s1: T10 Error(scripted device fault)" in capsys.readouterr().out


@pytest.mark.parametrize("field", ["decode_fault_at", "spill_corrupt_for", "spill_missing_for", "kv_exhaust_at"])
def test_a_fault_field_given_as_an_integer_is_refused(capsys, temp_folder, field):
    path = scenario(temp_folder / "f.toml", model=f"{field} = 1", options="swap_space_gb = 1")
    refused(capsys, ["run", path], "f.toml [model]", field, "a list of integers")


def test_a_failed_run_leaves_no_spill_file(monkeypatch):
    from fxsched.runtime.devices import recording
    from fxsched.runtime.interpreter import RunError
    from fxsched.runtime.scenarios.runner import run_scenario

    def broken(self, seq, blocks):
        raise KeyError("boom")  # a crash after the spill file was written

    monkeypatch.setattr(recording.RecordingDevice, "restore_sequence_state", broken)
    with pytest.raises(RunError, match="KeyError"):
        run_scenario(load_scenario("spill_swap_out_in"))
    # the autouse fixture checks the temp folder is empty


# --- misleading messages ----------------------------------------------------------------------


class _Store:
    """A rendezvous store where no answer ever comes."""

    def check(self, keys) -> bool:
        return False


def test_a_dead_worker_is_reported_dead_not_late():
    from fxsched.runtime.ep.link import LinkError, TorchLeaderLink

    link = TorchLeaderLink(None, _Store(), 2, 30.0, exitcode=lambda rank: 3)
    start = time.monotonic()
    with pytest.raises(LinkError) as info:
        link.collect("sync/1", 30.0)
    assert time.monotonic() - start < LIMIT_S  # it did not wait the 30 s
    assert str(info.value) == "EP worker 1 died (its process exited with code 3)"


def test_a_late_worker_is_still_a_timeout():
    from fxsched.runtime.ep.link import LinkError, TorchLeaderLink

    link = TorchLeaderLink(None, _Store(), 2, 0.05, exitcode=lambda rank: None)
    with pytest.raises(LinkError, match=r"^EP worker 1 did not answer within 0.05s$"):
        link.collect("sync/1", 0.05)


def test_a_truncated_replay_is_called_truncated(capsys, temp_folder, replay_data):
    path = temp_folder / "short.json"
    events = replay_data["events"]
    path.write_text(json.dumps(dict(replay_data, events=events[:3])))
    main(["replay", str(path)])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    assert (f"short.json: the file records 3 events and the run has {len(events)}: the file is truncated "
            f"(shorter than the run)") in out
    assert "code" not in out.splitlines()[0]


def test_weights_given_a_directory_suggests_model(capsys, temp_folder):
    refused(capsys, ["generate", "--prompt-ids", "1 2", "--weights", str(temp_folder)], "--weights",
            "is a directory", f"--model {temp_folder}", limit=TORCH_LIMIT_S)


def test_nan_weights_are_refused_naming_the_tensor(capsys, temp_folder):
    import torch

    from fxsched.runtime.torch_model import default_config
    from fxsched.runtime.torch_model.weights import init_weights, save_weights

    cfg = default_config()
    weights = init_weights(cfg)
    weights["final_norm"] = torch.full_like(weights["final_norm"], float("nan"))
    path = temp_folder / "nan.safetensors"
    save_weights(path, weights, cfg)
    refused(capsys, ["generate", "--prompt-ids", "1 2", "--weights", str(path)], "--weights", "nan.safetensors",
            "tensor 'final_norm'", "NaN or infinite", limit=TORCH_LIMIT_S)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny Qwen3.5 checkpoint, built before the temp folder is watched (building it with
    transformers leaves a torch cache folder there; loading it leaves nothing)."""
    from support.hf_tiny import build

    path = tmp_path_factory.mktemp("bad_inputs") / "ckpt"
    build("Qwen3_5ForCausalLM", path)
    return path


def test_nan_in_a_checkpoint_tensor_is_refused_naming_it(tmp_path, checkpoint):
    import torch
    from support.hf_tiny import rewrite_tensors

    from fxsched.runtime.torch_model import ModelDirError, load_pretrained

    path = tmp_path / "ckpt"
    shutil.copytree(checkpoint, path)
    name = "model.layers.3.self_attn.q_proj.weight"
    rewrite_tensors(path, lambda t: {**t, name: torch.full_like(t[name], float("inf"))})
    with pytest.raises(ModelDirError, match=rf"model.safetensors: tensor '{name}' holds NaN or infinite values"):
        load_pretrained(path, max_seq_len=32, max_slots=2, block_size=4)


def test_run_path_write_never_overwrites_a_shipped_golden(capsys, temp_folder):
    shipped = specs_dir() / "goldens" / "plain_decode.trace"
    before = shipped.read_bytes()
    copy = temp_folder / "mine.toml"
    shutil.copy(specs_dir() / "scenarios" / "plain_decode.toml", copy)
    assert main(["run", str(copy), "--write"]) == 0
    assert capsys.readouterr().err.strip() == f"wrote {temp_folder / 'mine.trace'}"
    assert shipped.read_bytes() == before
    assert (temp_folder / "mine.trace").read_bytes() == before  # the same scenario gives the same trace
    assert main(["run", str(copy), "--check"]) == 0
    assert "matches mine.trace" in capsys.readouterr().out


def test_a_shipped_scenario_by_path_uses_its_golden(capsys):
    assert main(["run", str(specs_dir() / "scenarios" / "plain_decode.toml"), "--check"]) == 0
    assert "matches plain_decode.trace" in capsys.readouterr().out
