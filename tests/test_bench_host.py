"""``fxsched bench host`` (runtime/bench/host.py) on tiny rows: batch 2, a few ticks, one round.

The free forward must count (every output continues its prompt by +1, MTP drafts all accepted),
must leave its shared buffers alone, the row must carry every column with parts that are
non-negative and add up to at most the total, and the CLI's ``--json`` must print one parseable
object per row. Timings themselves are not checked (this machine is shared and noisy).
"""

from __future__ import annotations

import json
import time

import pytest

from fxsched.runtime.bench import host
from fxsched.runtime.bench.host_free import PARTS
from fxsched.runtime.cli.app import main as cli_main

TINY = dict(ticks=4, warm=1, prompt_len=80)


@pytest.mark.parametrize("mode", ["none", "mtp"])
def test_the_free_forward_counts(mode):
    run = host.run_once(mode, 2, stop=False, **TINY)
    vocab = 64
    want_first = 80 % vocab  # the prompt counts 0..79 (mod 64): the model continues with 80 mod 64
    for out in run["outputs"]:
        assert out == [(want_first + i) % vocab for i in range(len(out))]
        assert len(out) >= TINY["ticks"]
    stopped = host.run_once(mode, 2, **TINY)  # ended with the window: counted on the scheduler's outputs
    assert stopped["outputs"] is None and stopped["counting"] and stopped["total"] > 0
    assert run["counting"] and run["untouched"]
    if mode == "none":  # one token per sequence and tick
        assert run["tokens_per_tick"] == 2.0
    else:  # every draft accepted: more than one token per sequence and tick
        assert run["tokens_per_tick"] > 2.0


def test_cli_json_rows(capsys):
    code = cli_main(["bench", "host", "--batches", "2", "--modes", "none,mtp", "--ticks", "4", "--warm", "1",
                     "--rounds", "1", "--prompt-len", "80", "--json"])
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [(r["mode"], r["batch"]) for r in rows] == [("none", 2), ("mtp", 2)]
    for r in rows:
        for column in host.COLUMNS + ("drafts", "engine", "counting", "untouched", "device", "rounds"):
            assert column in r, column
        assert r["ticks"] == 4
        parts = [r[p] for p in PARTS]
        assert all(p >= 0 for p in parts)
        assert sum(parts) <= r["us_per_tick"] * (1 + 1e-9)
        assert r["us_per_tick"] > 0 and r["target_us"] > 0 and isinstance(r["pass"], bool)
        assert r["counting"] and r["untouched"]
    plain, mtp = rows
    assert plain["target_us"] == pytest.approx(host.plain_target(2))
    assert mtp["target_us"] == pytest.approx(2 * plain["us_per_tick"])
    assert mtp["verifies_per_tick"] == pytest.approx(1.0) and mtp["drafts"] == "all right"


def test_table_and_bad_input(capsys):
    rows = [{**{c: 1.0 for c in host.COLUMNS}, "mode": "none", "batch": 1, "ticks": 4, "pass": True,
             "drafts": "-", "engine": "drafters", "counting": True, "untouched": True}]
    table = host.format_table(rows)
    assert "PASS" in table and "every output counts: yes" in table
    assert cli_main(["bench", "host", "--modes", "none,beam"]) == 2
    assert "unknown mode 'beam'" in capsys.readouterr().err
    assert host.plain_target(1) == 250 and host.plain_target(64) == 1000 and host.plain_target(256) == 3000


def test_the_clock_keeps_async_outputs_and_sync_outputs_equal():
    """Behind the device clock, async scheduling changes when tokens are read, never which."""
    runs = {a: host.run_once("none", 2, stop=False, forward_ms=0.5, async_scheduling=a, **TINY) for a in (False, True)}
    assert runs[True]["counting"] and runs[False]["counting"]
    assert runs[True]["outputs"] == runs[False]["outputs"]


def test_the_clock_waits_for_the_forward_it_reads():
    from fxsched.runtime.bench.host_free import DeviceClock

    clock = DeviceClock(20.0)
    start = time.perf_counter()
    clock.launch()
    clock.launch()  # queued behind the first: done 40 ms after start
    clock.wait_before_last()
    first = time.perf_counter() - start
    clock.wait_last()
    second = time.perf_counter() - start
    assert 0.019 <= first < second and second >= 0.039


def test_overlap_rows_and_bad_forward_ms(capsys):
    from fxsched.runtime.bench.host_overlap import format_overlap, measure_overlap

    row = measure_overlap("none", 2, 0.5, ticks=4, rounds=1, warm=1, prompt_len=80)
    assert row["counting"] and row["device_us"] == pytest.approx(500.0)
    assert row["tick_us_off"] > 0 and row["tick_us_on"] > 0 and row["host_us"] > 0
    assert "every output counts: yes" in format_overlap([row])
    code = cli_main(["bench", "host", "--batches", "2", "--forward-ms", "abc"])
    err = capsys.readouterr().err
    assert code == 2 and "--forward-ms abc" in err and len(err.strip().splitlines()) == 1
