"""``fxsched bench linears`` (runtime/bench/linears.py): every kernel timed at every row count on a
small config's shapes, the FLOP count the shapes imply, the packed kernels' peak share where they
are built, and one line and exit 2 for a directory without a usable config.json."""

from __future__ import annotations

import json

from fxsched.kernels import cpu_amx, cpu_pairs
from fxsched.runtime.cli.app import main as cli_main

CONFIG = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "intermediate_size": 96, "vocab_size": 160}


def test_rows_give_every_kernel_and_the_shapes_flop(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    assert cli_main(["bench", "linears", "--model", str(tmp_path), "--rows", "1,3", "--repeats", "1", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["rows"] for r in rows] == [1, 3]
    per_row = 2 * (64 * 64 + 2 * 32 * 64 + 64 * 64 + 2 * 96 * 64 + 64 * 96 + 160 * 64)  # q k v o gate up down head
    for r in rows:
        assert abs(r["gflop"] * 1e9 - r["rows"] * per_row) < 1
        kernels = ({"F.linear"} | ({f"pairs {a}" for a in cpu_pairs.ARITHMETICS} if cpu_pairs.ready() else set())
                   | ({"amx"} if cpu_amx.ready() else set()))
        assert set(r["gflops"]) == kernels and all(v > 0 for v in r["gflops"].values())
        if cpu_pairs.ready():
            assert r["chosen"] == cpu_pairs.arithmetic()
            assert all(0 < r["pct_of_peak"][a] for a in cpu_pairs.ARITHMETICS)


def test_a_directory_without_a_config_is_one_line_and_exit_2(tmp_path, capsys):
    assert cli_main(["bench", "linears", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--model {tmp_path}: no usable config.json" in err
