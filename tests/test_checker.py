"""The model checker: the random walk passes and replay files re-run their episodes; a hypothesis
state machine drives step (through the interpreter, event by event) with arrivals, answers,
faults, clocks, cancels, rotations and closure, checking the invariants after every rule.
(Whether the checker catches bugs is tests/test_planted.py: source mutations of core/.)"""

from __future__ import annotations

import json

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from fxsched.core import events as ev
from fxsched.core.config import ModelInfo, SchedulerConfig
from fxsched.core.state import initial_state
from fxsched.runtime.check.invariants import Monitor
from fxsched.runtime.check.replay import replay
from fxsched.runtime.check.episode import SimRequest
from fxsched.runtime.check.observers import MonitorObserver
from fxsched.runtime.check.walk import walk
from fxsched.runtime.cli.app import main
from fxsched.runtime.devices.simulated import SimDevice
from fxsched.runtime.interpreter import Host, Interpreter

BUDGET = 20_000


def test_the_walk_from_seed_7_breaks_no_invariant():
    report = walk(7, steps=BUDGET)
    assert report.violation is None, report.violation
    assert report.steps >= BUDGET
    for key in ("DecodeVerifyBatched", "GdnFoldAccepted", "MixedForwardBatch", "SaveSequenceState",
                "finish:stop", "finish:length", "finish:timeout", "finish:error", "fault:kv_exhausted",
                "fault:cancel", "LoraRotate"):
        assert report.coverage.get(key, 0) > 0, key


def test_check_command_prints_speed_and_coverage(capsys):
    assert main(["check", "--seed", "7", "--steps", "2000", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "steps/s" in out and "finish reasons:" in out and "no invariant broken" in out


def test_a_violation_writes_a_replay_file_that_reruns_to_it(tmp_path, capsys, monkeypatch):
    """The reporting path, with an invariant made to fail from the third tick of an episode on (the
    first tick the check runs in from then)."""
    from fxsched.runtime.check import invariants
    from fxsched.runtime.check.invariants import Violation

    real = invariants.slots_unique

    def fails_at_tick_3(state, device):
        real(state, device)
        if device.tick >= 3:
            raise Violation("slots_unique", f"made to fail at tick {device.tick}")

    monkeypatch.setattr(invariants, "slots_unique", fails_at_tick_3)
    path = tmp_path / "r.json"
    assert main(["check", "--seed", "7", "--steps", "2000", "--replay-file", str(path), "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "VIOLATION slots_unique at step" in out and "made to fail at tick " in out and str(path) in out
    data = json.loads(path.read_text())
    assert data["seed"] == 7 and data["invariant"] == "slots_unique" and data["events"]
    violation, _, diverged = replay(path)
    assert diverged is None and violation is not None and violation.message == data["message"]
    assert main(["replay", str(path)]) == 1
    assert f"VIOLATION slots_unique: {data['message']}" in capsys.readouterr().out


def test_a_replay_file_of_the_wrong_format_is_refused(tmp_path, capsys):
    path = tmp_path / "x.json"
    path.write_text('{"format": "other"}')
    assert main(["replay", str(path)]) == 2
    assert "not an fxsched replay file" in capsys.readouterr().err


# --- the hypothesis state machine ---------------------------------------------------------------------


scripts = st.tuples(st.lists(st.integers(2, 40), min_size=1, max_size=10), st.booleans())

MACHINE_MODES = dict(plain={}, mtp_k2=dict(use_speculative=True, num_drafts=1),
                     mtp_k3=dict(use_speculative=True, num_drafts=2), mtp_k4=dict(use_speculative=True, num_drafts=3),
                     dflash=dict(use_speculative=True, dflash=True, num_drafts=5), ngram=dict(ngram_speculative=True),
                     self_spec=dict(self_speculative=True, num_drafts=2))


class SchedulerMachine(RuleBasedStateMachine):
    """step + the simulated device, driven rule by rule, with every oracle of the walk armed."""

    @initialize(mode=st.sampled_from(sorted(MACHINE_MODES)), batch=st.integers(1, 4),
                chunk=st.sampled_from([0, 4, 8]), blocks=st.sampled_from([8, 20, 1000]), spill=st.booleans(),
                policy=st.sampled_from(["fifo", "slai"]))
    def boot(self, mode, batch, chunk, blocks, spill, policy):
        self.counts_acc = mode.startswith(("mtp", "dflash"))
        config = SchedulerConfig(max_batch_size=batch, max_prefill_tokens=chunk, swap_space_gb=1.0 if spill else 0.0,
                                 policy=policy, **MACHINE_MODES[mode])
        model = ModelInfo(total_blocks=blocks, has_proposer=mode.startswith(("mtp", "dflash")),
                          dflash_gamma=6 if mode == "dflash" else None, has_self_speculative=mode == "self_spec",
                          supports_beam=True)
        self.device = SimDevice({}, total_blocks=blocks, count_accepted=self.counts_acc,
                                max_prefill_tokens=chunk, max_batch_tokens=config.max_batch_tokens)
        self.monitor = Monitor((), self.device, counts_acc=self.counts_acc, config=config, model=model)
        self.interpreter = Interpreter(self.device, Host(), config.eos_ids, observer=MonitorObserver(self.monitor))
        self.state = initial_state(config, model)
        self.pending = []
        self.next_id = 1
        self.closed = False
        self.now = 0.0
        self.feed(ev.Boot())

    def feed(self, event):
        """One step of the interpreter's loop; what follows waits in ``pending`` for the rules."""
        self.state, follow = self.interpreter.feed(self.state, event)
        self.pending.extend(follow)

    @precondition(lambda self: not self.closed and self.next_id <= 8)
    @rule(script=scripts, prompt=st.integers(1, 30), budget=st.integers(1, 16), streaming=st.booleans(),
          wrong=st.integers(0, 4), deadline=st.one_of(st.none(), st.integers(10, 300)),
          beams=st.sampled_from([1, 1, 1, 2, 3]))
    def arrive(self, script, prompt, budget, streaming, wrong, deadline, beams):
        tokens, eos = script
        request = SimRequest(id=self.next_id, prompt_len=prompt, tokens=tuple(tokens) + ((63,) if eos else ()),
                             max_tokens=budget, streaming=streaming, wrong_every=wrong,
                             deadline_ms=None if deadline is None else self.now + deadline,
                             num_beams=1 if streaming else beams)
        self.next_id += 1
        self.device.scripts[request.id] = request.script()
        if streaming:
            self.device.cancel_registered.add(request.id)
        self.monitor.add_request(request)
        self.feed(ev.Arrival(request.request()))

    @precondition(lambda self: bool(self.pending) and not self.state.stopped)
    @rule(count=st.integers(1, 12))
    def deliver(self, count):
        for _ in range(count):
            if not self.pending or self.state.stopped:
                return
            self.feed(self.pending.pop(0))

    @precondition(lambda self: not self.state.stopped)
    @rule(kind=st.sampled_from(["kv", "decode", "verify"]))
    def fault(self, kind):
        if kind == "kv":
            self.device.kv_exhaust_at.add(self.device.decode_calls)
        elif kind == "decode":
            self.device.decode_fault_at.add(self.device.decode_calls)
        else:
            self.device.verify_fault_at.add(self.device.verify_calls)

    @precondition(lambda self: not self.state.stopped)
    @rule(dt=st.integers(1, 100))
    def clock(self, dt):
        self.now += dt
        self.feed(ev.Clock(self.now))

    @precondition(lambda self: not self.state.stopped and self.next_id > 1)
    @rule(data=st.data())
    def cancel(self, data):
        self.feed(ev.Cancel(data.draw(st.integers(1, self.next_id - 1))))

    @precondition(lambda self: not self.state.stopped)
    @rule()
    def rotate(self):
        self.feed(ev.RotationRequested("adapter-x"))

    @precondition(lambda self: not self.closed and not self.state.stopped)
    @rule()
    def close(self):
        self.closed = True
        self.feed(ev.InboxClosed())

    @rule()
    def observe(self):
        self.monitor.on_state(self.state)

    @invariant()
    def the_loop_never_stalls(self):
        if getattr(self, "state", None) is not None and not self.state.stopped:
            assert self.pending, "no answer is pending and the loop has not stopped"

    def teardown(self):
        if getattr(self, "state", None) is None:
            return
        if not self.closed and not self.state.stopped:
            self.closed = True
            self.feed(ev.InboxClosed())
        for _ in range(20_000):
            if self.state.stopped or not self.pending:
                break
            self.feed(self.pending.pop(0))
        assert self.state.stopped
        self.monitor.at_end(self.state)


SchedulerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=100, deadline=None)
test_scheduler_state_machine = SchedulerMachine.TestCase


REGRESSIONS = sorted((__import__("pathlib").Path(__file__).parent / "regressions").glob("*.json"))


@pytest.mark.parametrize("path", REGRESSIONS, ids=[p.stem for p in REGRESSIONS])
def test_a_fixed_checker_failure_stays_fixed(path):
    """Replay files of violations the checker found; each episode must now run clean."""
    violation, data, _ = replay(path)
    assert violation is None, f"{data['invariant']} is back: {violation}"
