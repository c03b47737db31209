"""Event logs (``generate --record``, ``fxsched replay LOG``; runtime/eventlog.py, eventlog_codec.py,
eventlog_reader.py, eventlog_replay.py, specs/event-log.md).

Runs of ``fxsched generate`` in several modes (plain, MTP, DFlash, n-gram, sampled with logprobs,
a stop string that posts a ``Cancel``) are recorded once per module; each must replay through
the CLI to identical effects, and the client outputs replay prints must be the tokens generate
returned. A deliberately changed rule (a cancel dropped, the admission order reversed) must make
replay name the first departing event, which the test finds on its own by stepping both versions
of ``step`` side by side over the recorded events and comparing the effect records themselves.
The codec must round-trip an instance of every event class (hypothesis, generated from the
classes' type hints, so a new event class is covered without touching this file), and malformed
logs must be one-line, exit-2 refusals naming the file and the line.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import types
import typing
from pathlib import Path
from typing import Any, Optional

import attrs
import pytest
from hypothesis import given, settings, strategies as st

from fxsched.core import admission, machine
from fxsched.core import events as ev
from fxsched.core.request import Request
from fxsched.core.state import initial_state
from fxsched.effects.client import DoneOut, ErrorOut, FinishReason, RotationAck, TokenOut, TokensOut
from fxsched.runtime.cli.app import main
from fxsched.runtime.scenarios.loader import load_scenario, scenario_names
from fxsched.runtime.scenarios.runner import model_info, prepare_scenario, scheduler_config
from fxsched.runtime.eventlog import EventRecorder
from fxsched.runtime.eventlog_codec import MAGIC, Decoder, Encoder
from fxsched.runtime.eventlog_reader import read_log
from support.toy_model import run_fxsched

EXIT_USAGE = 2
PROMPTS = "1 2 3 4 5 6 7 8\n9 10 11 12 1 2 3 4 9 10 11\n5 6 7 8 5 6 7 8 5 6\n"


# --- recording the runs (once per module) ---------------------------------------------------------


@attrs.frozen
class Recorded:
    path: Path
    records: list[dict]  # generate --json, one per request (the summary left out)

    @property
    def generated(self) -> int:
        return sum(r["num_generated_tokens"] for r in self.records)


def _generate(folder: Path, name: str, *argv: str, toy: bool = True) -> Recorded:
    path = folder / f"{name}.log"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = run_fxsched("generate", *argv, "--json", "--no-progress", "--record", str(path), toy=toy)
    assert code == 0, out.getvalue()
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    return Recorded(path, [r for r in lines if not r.get("summary")])


def _stop_string(text: str) -> str:
    """Three ASCII letters from the middle of a text: a stop string that ends the run part-way."""
    match = re.compile(r"[A-Za-z]{3}").search(text, len(text) // 3)
    assert match is not None, text
    return match.group(0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, one_torch_thread) -> dict[str, Recorded]:
    folder = tmp_path_factory.mktemp("eventlogs")
    prompts = folder / "prompts.txt"
    prompts.write_text(PROMPTS)
    common = ("--prompt-ids-file", str(prompts), "--batch", "2", "--max-tokens", "12")
    out = {spec: _generate(folder, spec, *common, "--spec", spec) for spec in ("none", "mtp", "dflash", "ngram")}
    out["sampled"] = _generate(folder, "sampled", *common, "--temperature", "0.9", "--top-k", "20", "--seed", "7",
                               "--logprobs", "2")
    for spec in ("mtp", "dflash", "ngram"):  # rejection-sampled verifies (specs/speculation.md §6.16)
        out[f"sampled-{spec}"] = _generate(folder, f"sampled-{spec}", *common, "--spec", spec, "--temperature", "0.9",
                                           "--top-k", "20", "--seed", "7")
    text = ("--prompt", "The quick brown fox", "--max-tokens", "24")
    plain = _generate(folder, "text", *text, toy=False)
    stop = _stop_string(plain.records[0]["text"])
    out["stop"] = _generate(folder, "stop", *text, "--stop", stop, toy=False)
    assert out["stop"].records[0]["stop_reason"] == stop
    return out


def _replay(capsys, path: Path, *flags: str) -> tuple[int, str, str]:
    code = main(["replay", str(path), *flags])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


_FRAME = re.compile(r"event (\d+): request (\d+) (.*)")
_TOKEN = re.compile(r"TL?(\d+)")


def _streamed(outputs: str) -> dict[int, tuple[list[int], Optional[int]]]:
    """Per request: the tokens streamed in the printed client outputs, and the final frame's n."""
    got: dict[int, tuple[list[int], Optional[int]]] = {}
    for line in outputs.splitlines():
        match = _FRAME.fullmatch(line)
        if match is None:
            continue
        tokens, n = got.setdefault(int(match.group(2)), ([], None))
        frame = match.group(3)
        if frame.startswith("Done("):
            n_match = re.search(r"n=(\d+)", frame)
            assert n_match is not None, frame
            got[int(match.group(2))] = (tokens, int(n_match.group(1)))
        else:
            tokens.extend(int(t) for t in _TOKEN.findall(frame))
    return got


# --- recorded runs replay to identical effects ---------------------------------------------------


@pytest.mark.parametrize("mode", ["none", "mtp", "dflash", "ngram", "sampled", "sampled-mtp", "sampled-dflash",
                                  "sampled-ngram", "stop"])
def test_a_recorded_run_replays_to_identical_effects_and_outputs(capsys, runs, mode):
    run = runs[mode]
    code, out, err = _replay(capsys, run.path, "--outputs")
    lines = out.splitlines()
    steps = sum(1 for _ in read_log(run.path).steps)
    assert (code, err) == (0, "")
    assert lines[-1] == f"replay: {steps} events, identical effects and client outputs"
    streamed = _streamed(out)
    assert sorted(streamed) == sorted(r["request_id"] for r in run.records)  # records come in finish order
    for record in run.records:
        tokens, n = streamed[record["request_id"]]
        want = record["token_ids"]
        if record["stop_reason"] is not None:  # the host cut the text at the stop string
            assert tokens[:len(want)] == want and len(want) <= len(tokens)
        else:  # the final frame counts an EOS the scheduler appends but never streams
            assert want[:len(tokens)] == tokens and n == len(want) and len(want) - len(tokens) in (0, 1)
        assert n is not None


def test_the_stop_run_records_the_cancel_the_host_posted(runs):
    events = [item.event for item in read_log(runs["stop"].path).steps]
    assert ev.Cancel(1) in events
    assert sum(isinstance(e, ev.Arrival) for e in events) == 1


def _step_bytes(path: Path) -> int:
    """Bytes of a log after its fixed costs (the header and the tag definitions)."""
    lines = path.read_bytes().splitlines(keepends=True)[1:]
    return sum(len(line) for line in lines if not line.startswith(b'["!"'))


def test_log_size_per_token(runs):
    """Bytes of log per generated token past the header and the definitions (specs/event-log.md §9.3)."""
    for mode, bound in (("none", 120), ("ngram", 120), ("sampled", 130), ("mtp", 280), ("dflash", 280)):
        run = runs[mode]
        per_token = _step_bytes(run.path) / run.generated
        assert per_token < bound, (mode, per_token)


def test_the_header_rebuilds_the_run_settings(runs):
    log = read_log(runs["mtp"].path)
    assert log.config.use_speculative and log.config.num_drafts == 3 and log.model.has_proposer
    assert log.meta["spec"] == "mtp" and log.meta["max_tokens"] == 12
    assert runs["mtp"].path.read_bytes().startswith(MAGIC)


class _Collecting(EventRecorder):
    """A recorder that also keeps every client frame the interpreter delivered."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.frames: list[str] = []
        super().__init__(*args, **kwargs)

    def output(self, output: Any) -> None:
        who = f"rotation {output.name}" if isinstance(output, RotationAck) else f"request {output.request_id}"
        self.frames.append(f"{who} {output.render()}")


def _record_scenario(name: str, path: Path) -> _Collecting:
    scenario = load_scenario(name)
    with _Collecting(path, scheduler_config(scenario), model_info(scenario), {"scenario": name}) as recorder:
        setup = prepare_scenario(scenario, observer=recorder)
        try:
            setup.interpreter.run(setup.state, setup.first_events())
        finally:
            setup.device.spill.close()
    return recorder


@pytest.mark.parametrize("name", scenario_names())
def test_every_shipped_scenario_replays_from_its_log(capsys, tmp_path, name):
    """The scenarios bring what generate has not: late arrivals, rotations, device faults,
    blocking requests, beams. The frames replay prints are those the host was sent."""
    path = tmp_path / f"{name}.log"
    recorder = _record_scenario(name, path)
    code, out, err = _replay(capsys, path, "--outputs")
    assert (code, err) == (0, ""), out
    lines = out.splitlines()
    assert lines[-1] == f"replay: {recorder.events} events, identical effects and client outputs"
    assert recorder.frames and [line.split(": ", 1)[1] for line in lines[:-1]] == recorder.frames


def test_the_scenarios_bring_every_input_event_but_the_clock(tmp_path):
    seen: set[str] = set()
    for name in scenario_names():
        path = tmp_path / f"{name}.log"
        _record_scenario(name, path)
        seen |= {type(item.event).__name__ for item in read_log(path).steps}
    assert {"Arrival", "Cancel", "InboxClosed", "RotationRequested", "DeviceFault"} <= seen, seen


# --- a changed rule departs, at the right event ------------------------------------------------


def _first_difference(path: Path, changed: Any, monkeypatch, target: Any, name: str) -> int:
    """The first event whose effects differ between ``step`` and ``step`` with ``target.name``
    replaced by ``changed``, both fed the recorded events side by side."""
    original = getattr(target, name)
    log = read_log(path)
    before = after = initial_state(log.config, log.model)
    for item in log.steps:
        monkeypatch.setattr(target, name, original)
        before, want = machine.step(before, item.event)
        monkeypatch.setattr(target, name, changed)
        after, got = machine.step(after, item.event)
        if want != got:
            return item.index
    raise AssertionError("the changed rule never changes the effects")


def _departure(capsys, path: Path) -> tuple[int, list[str]]:
    code, out, err = _replay(capsys, path)
    assert (code, err) == (1, ""), out + err
    lines = out.splitlines()
    match = re.match(r"replay: departs at event (\d+) \(line \d+\): ", lines[0])
    assert match is not None, out
    return int(match.group(1)), lines


def test_replay_reports_where_a_scheduler_that_drops_cancels_departs(capsys, monkeypatch, runs):
    original = machine._take_input

    def drop_cancels(state, event):
        return state if isinstance(event, ev.Cancel) else original(state, event)

    path = runs["stop"].path
    first = _first_difference(path, drop_cancels, monkeypatch, machine, "_take_input")
    cancel_at = next(item.index for item in read_log(path).steps if isinstance(item.event, ev.Cancel))
    assert first > cancel_at  # the cancel's own batch is empty either way
    index, lines = _departure(capsys, path)
    assert index == first
    assert lines[1].startswith("  recorded: ") and lines[2].startswith("  re-run: ")
    assert lines[3].startswith("  first differing effect #")


def test_replay_reports_where_a_reversed_admission_order_departs(capsys, monkeypatch, runs):
    def last_first(pending, cap):
        return tuple(reversed(pending))[: max(cap, 0)]

    path = runs["none"].path
    first = _first_difference(path, last_first, monkeypatch, admission, "select_fifo")
    index, lines = _departure(capsys, path)
    assert index == first
    assert "AllocSequence" in lines[1] or "AdapterIdFor" in lines[1] or "first differing" in lines[3]


def test_an_unchanged_scheduler_never_departs_when_stepped_side_by_side(runs, monkeypatch):
    """The independent check above cannot report a difference that is not there."""
    with pytest.raises(AssertionError, match="never changes"):
        _first_difference(runs["none"].path, admission.select_fifo, monkeypatch, admission, "select_fifo")


# --- cut-short and malformed logs ---------------------------------------------------------------


def test_a_log_cut_mid_line_replays_its_prefix_and_says_so(capsys, runs, tmp_path):
    data = runs["none"].path.read_bytes()
    cut = data.index(b"\n", len(data) // 2) + 5  # a few bytes into a line
    path = tmp_path / "cut.log"
    path.write_bytes(data[:cut])
    line = data[:cut].count(b"\n") + 1
    code, out, err = _replay(capsys, path)
    assert (code, err) == (0, "")
    match = re.fullmatch(r"replay: (\d+) events, identical effects and client outputs; the log was cut short: "
                         rf"line {line} is incomplete \(the run was cut short mid-record\)\n", out)
    assert match is not None, out
    assert 0 < int(match.group(1)) < sum(1 for _ in read_log(runs["none"].path).steps)


def test_a_log_without_its_end_record_is_called_cut_short(capsys, runs, tmp_path):
    lines = runs["ngram"].path.read_bytes().splitlines(keepends=True)
    assert lines[-1].startswith(b'[".",')
    path = tmp_path / "open.log"
    path.write_bytes(b"".join(lines[:-1]))
    code, out, _ = _replay(capsys, path)
    assert code == 0 and "the log has no end record" in out


def _log(tmp_path: Path, *lines: bytes | str, header: Optional[str] = None) -> Path:
    head = header if header is not None else _header()
    path = tmp_path / "bad.log"
    path.write_bytes(b"".join((x.encode() if isinstance(x, str) else x) + b"\n" for x in (head, *lines)))
    return path


def _header(**changes: Any) -> str:
    from fxsched.core.config import ModelInfo, SchedulerConfig
    from fxsched.runtime.eventlog_codec import header

    head = header(SchedulerConfig(), ModelInfo())
    for key, value in changes.items():
        section, _, name = key.partition("__")
        if name:
            head[section][name] = value
        else:
            head[section] = value
    return json.dumps(head, separators=(",", ":"))


CANCEL = '["!","a","Cancel",["request_id"]]'
BAD_LOGS = [
    ((b'["\xff"]',), None, "line 2: not UTF-8"),
    (("[1,",), None, "line 2: not valid JSON"),
    (('["zz"]',), None, "line 2: unknown tag 'zz'"),
    ((CANCEL, '["a","x"]'), None, "line 3: Cancel.request_id: expected an integer"),
    ((CANCEL, '["a",1,2]'), None, "line 3: Cancel: 2 fields"),
    (('["!","a","NoSuchEvent",[]]',), None, "unknown record class 'NoSuchEvent'"),
    (('["!","a","Cancel",["who"]]',), None, "Cancel has no field 'who'"),
    (('["=","a.00000000"]',), None, "line 2: an effects record without its event"),
    ((CANCEL, '["a",1]', '["a",2]'), None, "line 4: an event where the effects"),
    (('["!","a","Request",["id"]]', '["a",1]'), None, "names Request, not an event"),
    (('{"a":1}',), None, "line 2: expected a record"),
    ((CANCEL, '["a",1]', '["="]', '[".",5]'), None, "does not count the 1 events"),
    ((), _header(version=7), "line 1: event log version 7"),
    ((), _header(config__max_batch_size="8"), "header config.max_batch_size: expected an integer"),
    ((), _header(model__vocab=0), "header model: ModelInfo.vocab = 0"),
    ((), _header(config__no_such=1), "header config has field 'no_such'"),
    ((), '{"format":"fxsched-eventlog","version":1,"extra":1}', "unknown header field 'extra'"),
]


@pytest.mark.parametrize("lines,head,words", BAD_LOGS, ids=[w for _, _, w in BAD_LOGS])
def test_a_malformed_log_is_one_line_naming_the_file_and_the_line(capsys, tmp_path, lines, head, words):
    path = _log(tmp_path, *lines, header=head)
    code, out, err = _replay(capsys, path)
    assert code == EXIT_USAGE and out == ""
    assert len(err.splitlines()) == 1 and err.startswith(f"fxsched replay: {path}: line "), err
    assert words in err, err


def test_a_header_cut_short_is_refused(capsys, tmp_path):
    path = tmp_path / "head.log"
    path.write_bytes(MAGIC)
    code, _, err = _replay(capsys, path)
    assert code == EXIT_USAGE and "line 1: the header is missing or cut short" in err


def test_outputs_is_only_for_an_event_log(capsys, tmp_path):
    path = tmp_path / "r.json"
    path.write_text("{}")
    code, _, err = _replay(capsys, path, "--outputs")
    assert code == EXIT_USAGE and "--outputs: only for an event log" in err


# --- generate --record: bad paths ------------------------------------------------------------------


def _no_model(*args, **kwargs):
    raise AssertionError("the model was loaded before the --record path was checked")


@pytest.mark.parametrize("where,words", [("missing/x.log", "no such folder"), ("", "is a directory")])
def test_an_unwritable_record_path_is_refused_before_the_model_loads(capsys, monkeypatch, tmp_path, where, words):
    import fxsched.runtime.cli.generate_run as cli

    monkeypatch.setattr(cli, "_engine", _no_model)
    target = tmp_path / where if where else tmp_path
    assert run_fxsched("generate", "--prompt-ids", "1 2", "--record", str(target)) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.splitlines() == [f"fxsched generate: --record {target}: {err.split(': ', 3)[-1].strip()}"]
    assert words in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_bad_input_leaves_no_log_behind(capsys, tmp_path, one_torch_thread):
    target = tmp_path / "run.log"
    assert run_fxsched("generate", "--prompt-ids", "1 999", "--record", str(target)) == EXIT_USAGE
    assert "outside the vocabulary" in capsys.readouterr().err
    assert not target.exists()


# --- the recorder and the codec ------------------------------------------------------------------


def test_the_recorder_closes_once_and_a_crash_in_step_keeps_the_event(tmp_path, capsys):
    from fxsched.core.config import ModelInfo, SchedulerConfig

    path = tmp_path / "crash.log"
    with EventRecorder(path, SchedulerConfig(), ModelInfo(), {"why": "test"}) as recorder:
        recorder.before_step(ev.Boot())  # step raised here: no effects record follows
    recorder.close()
    lines = path.read_text().splitlines()
    assert lines[-1] == '[".",1]' and lines.count('[".",1]') == 1
    items = list(read_log(path).steps)
    assert [(i.event, i.effects) for i in items] == [(ev.Boot(), None)]
    code, out, _ = _replay(capsys, path)
    assert code == 0 and out.startswith("replay: 1 events, identical")


def _strategy(hint: Any) -> st.SearchStrategy:
    """Values of a field's type; a type this does not know fails loudly (extend it)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is bool:
        return st.booleans()
    if hint is int:
        return st.integers(-(2**62), 2**62)
    if hint is float:
        return st.floats(allow_nan=False)
    if hint is str:
        return st.text(max_size=12)
    if hint is type(None):
        return st.none()
    if origin is typing.Union or origin is types.UnionType:
        return st.one_of(*(_strategy(a) for a in args))
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return st.lists(_strategy(args[0]), max_size=5).map(tuple)
    if origin is tuple and Ellipsis not in args:
        return st.tuples(*(_strategy(a) for a in args))
    if hint is Request:
        return _requests()
    raise AssertionError(f"no strategy for a field of type {hint!r}: extend _strategy")


def _requests() -> st.SearchStrategy:
    small = st.integers(0, 2**31)
    return st.builds(
        Request, id=small, prompt=st.lists(small, min_size=1, max_size=8).map(tuple), max_tokens=st.integers(1, 2**20),
        min_tokens=st.integers(0, 64), streaming=st.booleans(), temperature=st.floats(0, 10),
        top_logprobs=st.integers(0, 20), num_beams=st.integers(1, 4), adapter_slot=st.integers(-1, 8), seed=small,
        deadline_ms=st.none() | st.floats(0, 1e9), top_p=st.floats(0, 1, exclude_min=True),
        top_k=st.integers(0, 100), min_p=st.floats(0, 1))


EVENT_CLASSES = sorted((c for c in vars(ev).values() if isinstance(c, type) and issubclass(c, ev.Event)
                        and attrs.has(c)), key=lambda c: c.__name__)


def _instances(cls: type) -> st.SearchStrategy:
    hints = typing.get_type_hints(cls)
    return st.builds(cls, **{f.name: _strategy(hints[f.name]) for f in attrs.fields(cls) if f.init})


def _round_trip(records: list[Any]) -> list[Any]:
    """Write records as a log's lines would be (JSON text) and read them back."""
    encoder, decoder = Encoder(), Decoder()
    lines: list[str] = []
    for record in records:
        encoded = encoder.record(record)
        lines.extend(json.dumps(d) for d in encoder.pending)
        encoder.pending.clear()
        lines.append(json.dumps(encoded, separators=(",", ":"), ensure_ascii=False))
    out = []
    for line in lines:
        assert "\n" not in line
        value = json.loads(line)
        if value[0] == "!":
            decoder.define(value)
        else:
            out.append(decoder.build(value[0], value[1:]))
    return out


def _same(a: Any, b: Any) -> bool:
    """Equal, field for field of the same type (an int never comes back as a float)."""
    if attrs.has(type(a)):
        return type(a) is type(b) and all(_same(getattr(a, f.name), getattr(b, f.name)) for f in attrs.fields(type(a)))
    if isinstance(a, tuple):
        return type(b) is tuple and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def test_the_event_classes_are_all_there():
    names = {c.__name__ for c in EVENT_CLASSES}
    assert {"Arrival", "Cancel", "Clock", "TokensSampled", "BatchedDrafts", "DeviceFault"} <= names
    assert len(EVENT_CLASSES) >= 25


@pytest.mark.parametrize("cls", EVENT_CLASSES, ids=lambda c: c.__name__)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_every_event_class_round_trips(cls, data):
    events = data.draw(st.lists(_instances(cls), min_size=1, max_size=3))
    back = _round_trip(events)
    assert len(back) == len(events) and all(_same(a, b) for a, b in zip(events, back, strict=True)), (events, back)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.one_of(*(_instances(c) for c in EVENT_CLASSES)), min_size=1, max_size=12))
def test_mixed_events_round_trip_with_one_tag_per_class(events):
    back = _round_trip(events)
    assert all(_same(a, b) for a, b in zip(events, back, strict=True))


def test_client_outputs_round_trip_with_their_enums():
    outputs = [TokenOut(1, 5), TokensOut(2, (3, 4), 2), DoneOut(1, FinishReason.LENGTH, 7, 0, 2, 1, 'say "hi"'),
               ErrorOut(3, "bad\nline", False), RotationAck("lora-a", None)]
    back = _round_trip(outputs)
    assert all(_same(a, b) for a, b in zip(outputs, back, strict=True))
    assert back[2].reason is FinishReason.LENGTH


def test_trailing_defaults_are_left_out():
    encoder = Encoder()
    assert encoder.record(ev.ForwardDone()) == ["a"]
    assert encoder.record(ev.ForwardDone(3)) == ["a", 3]
    assert encoder.record(ev.TokensSampled((4, 5))) == ["b", [4, 5]]
    assert encoder.record(ev.Clock(0.0)) == ["c", 0.0]  # a field without a default is always written
