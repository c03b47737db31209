"""A checkpoint's engine holds as many sequences as the command asks: ``generate --batch`` and
``serve --max-num-seqs`` beyond the loader's 16 slots get their slots (they were refused)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from fxsched.runtime.cli.app import build_parser  # noqa: E402
from support.hf_tiny import build  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_generate_batch_beyond_sixteen_runs_every_sequence_at_once(tmp_path, capsys):
    ckpt = tmp_path / "qwen3"
    build("Qwen3ForCausalLM", ckpt)
    args = build_parser().parse_args(["generate", "--model", str(ckpt), "--prompt-ids", "5 6 7 8", "--batch", "20",
                                      "--max-tokens", "4", "--ignore-eos", "--json"])
    assert args.func(args) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    records, summary = lines[:-1], lines[-1]
    assert summary["batch"] == 20 and len(records) == 20
    assert len({tuple(r["token_ids"]) for r in records}) == 1  # one prompt, the same greedy tokens in every row
