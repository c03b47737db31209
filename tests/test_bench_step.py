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


def test_the_vllm_anchor_passes_its_warmup_to_the_fxsched_cells(monkeypatch):
    """The anchor's fxsched cell runs ``fxsched bench step`` with the anchor's ``--warmup`` and reads
    its CPU time per tick (the process is faked: what it was asked to run is the point)."""
    import subprocess

    from fxsched.runtime.bench import vllm_anchor

    ran: list[list[str]] = []

    def fake_run(cmd, **kwargs):
        ran.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout='{"n": 64, "us_per_tick": 123.5}\n', stderr="")

    monkeypatch.setattr(vllm_anchor.subprocess, "run", fake_run)
    assert vllm_anchor._fxsched_cell("spec5", 64, 48, 10.0, warmup=400) == 123.5
    (cmd,) = ran
    assert cmd[cmd.index("--warmup") + 1] == "400" and cmd[cmd.index("--mode") + 1] == "spec5"
    assert vllm_anchor._fxsched_cell("plain", 64, 48, 10.0) == 123.5
    assert ran[1][ran[1].index("--warmup") + 1] == str(bench_step.WARMUP)


def test_the_vllm_anchor_refuses_a_short_warmup_in_one_line(tmp_path, capsys):
    from fxsched.runtime.bench import vllm_anchor

    script = tmp_path / "bench.py"
    script.write_text("")
    code = vllm_anchor.main(["--vllm-python", str(script), "--vllm-bench", str(script), "--warmup", "5"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--warmup 5" in err and str(bench_step.WARMUP) in err
