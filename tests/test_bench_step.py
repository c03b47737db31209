"""``fxsched bench step``: what it runs before and inside its timed windows."""

from __future__ import annotations

from fxsched.runtime.bench import step as bench_step
from fxsched.runtime.cli.app import main


def _counting(monkeypatch) -> list[tuple[int, bool]]:
    """Record each ``_run_ticks`` call as (ticks, timed)."""
    calls: list[tuple[int, bool]] = []
    real = bench_step._run_ticks

    def counting(state, stub, ticks, event, clock=None):
        calls.append((ticks, clock is not None))
        return real(state, stub, ticks, event, clock)

    monkeypatch.setattr(bench_step, "_run_ticks", counting)
    return calls


def test_the_warmup_runs_untimed_before_the_windows(monkeypatch):
    calls = _counting(monkeypatch)
    row = bench_step.measure(4, "plain", ticks=3, repeats=2, warmup=50)
    assert calls == [(50, False), (3, True), (3, True)]
    assert row["n"] == 4 and row["tokens_per_seq_tick"] == 1.0  # plain decode: one token a tick, every window


def test_a_warmup_shorter_than_admission_takes_the_floor(monkeypatch):
    calls = _counting(monkeypatch)
    bench_step.measure(4, "spec5", ticks=2, repeats=1, warmup=1)
    assert calls[0] == (bench_step.WARMUP, False)


def test_the_command_passes_the_warmup_on(monkeypatch, capsys):
    calls = _counting(monkeypatch)
    assert main(["bench", "step", "--sizes", "2", "--ticks", "2", "--repeats", "1", "--warmup", "33", "--json"]) == 0
    assert calls == [(33, False), (2, True)]
    assert '"n": 2' in capsys.readouterr().out
