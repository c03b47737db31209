"""The command line: traces on stdout, clear errors with exit 2 for bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fxsched.runtime.cli.app import main
from fxsched.runtime.scenarios.loader import specs_dir


def test_run_prints_the_trace(capsys):
    assert main(["run", "dflash_batched"]) == 0
    out = capsys.readouterr().out
    assert out == (specs_dir() / "goldens" / "dflash_batched.trace").read_text()


def test_run_check_reports_a_match(capsys):
    assert main(["run", "plain_decode", "--check"]) == 0
    assert "matches" in capsys.readouterr().out


def test_unknown_scenario_exits_2_and_lists_the_known_ones(capsys):
    assert main(["run", "no_such_scenario"]) == 2
    err = capsys.readouterr().err
    assert "unknown scenario 'no_such_scenario'" in err and "dflash_batched" in err


def test_list_names_every_scenario(capsys):
    assert main(["run", "--list"]) == 0
    names = capsys.readouterr().out.split()
    assert "dflash_batched" in names and len(names) == 22


@pytest.mark.parametrize("body, needle", [
    ('name = "x"\n[[requests]]\nid = 1\nprompt_len = 5\ntokens = [1]\ncolour = 3\n', "unknown field 'colour'"),
    ('name = "x"\n[[requests]]\nid = 1\nprompt_len = "five"\ntokens = [1]\n', "field 'prompt_len' expects an integer"),
    ('name = "x"\n[[requests]]\nid = 1\nprompt_len = 0\ntokens = [1]\n', "the prompt is empty"),
    ('name = "x"\n[model]\nvocab = true\n[[requests]]\nid = 1\nprompt_len = 2\ntokens = [1]\n', "[model]: field 'vocab' expects an integer"),
    ('name = "x"\n', "'requests' expects at least one"),
    ('name = "x"\n[[requests]\n', "not valid TOML"),
    ('name = "x"\n[[requests]]\nid = 1\ntokens = [1]\n', "missing field 'prompt_len'"),
])
def test_a_malformed_scenario_file_exits_2_naming_file_and_field(tmp_path, capsys, body, needle):
    path = tmp_path / "bad.toml"
    path.write_text(body)
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and needle in err


def test_the_console_script_runs_the_main_job():
    exe = Path(sys.executable).parent / "fxsched"
    if not exe.exists():
        pytest.skip("the fxsched console script is not installed in this environment")
    done = subprocess.run([str(exe), "run", "dflash_batched"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("# scenario dflash_batched\n")
