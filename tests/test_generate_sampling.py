"""Sampling flags of ``fxsched generate`` (``--temperature``, ``--top-p``, ``--top-k``, ``--min-p``,
``--seed``, ``--logprobs``): seeded runs repeat, request i draws with seed + i * REQUEST_SEED_STRIDE, the default stays
greedy, logprobs reach the ``--json`` records, bad values are one line and exit 2, and two EP
ranks pick the same sampled tokens as one (the leader's ``sample_rows``).

References come from a plain prefill-and-decode loop on the engine (no scheduler): greedy is the
logits' argmax; a sampled token is the torch sampler's pick of that step's logits with the seed
the rule names (seed + request index * REQUEST_SEED_STRIDE + output length; without the output length for the first token),
so what is checked is that the flags and seeds reach every pick; the sampler itself is checked
against a plain reference in tests/test_torch_sampling.py.
"""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest

pytest.importorskip("torch")

import torch  # noqa: E402

from support.toy_model import toy_argv  # noqa: E402

from fxsched.effects.device_calls import HostPick  # noqa: E402
from fxsched.runtime.cli.app import build_parser  # noqa: E402
from fxsched.runtime.devices.torch_sampling import sample_rows  # noqa: E402
from fxsched.runtime.torch_model import HybridEngine, default_config  # noqa: E402
from fxsched.runtime.generate import REQUEST_SEED_STRIDE  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["1 2 3 4", "7 8 9", "20 21 22 23 24"]
MAX_TOKENS = 24


def fxsched(*argv: str) -> int:
    args = build_parser().parse_args(toy_argv(["generate", *argv]))  # the internal model unless one is named
    return args.func(args)


def run_json(capsys, tmp_path: Path, *flags: str) -> list[dict]:
    """``fxsched generate --json`` on the three prompts; the per-request records in order."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    code = fxsched("--prompt-ids-file", str(prompts), "--batch", "3", "--max-tokens", str(MAX_TOKENS),
                   "--ignore-eos", "--json", *flags)
    out = capsys.readouterr().out
    assert code == 0, out
    records = [json.loads(line) for line in out.splitlines()]
    assert records[-1]["summary"] is True
    return sorted(records[:-1], key=lambda r: r["index"])


def reference(prompt: list[int], pick_for=None) -> tuple[list[int], list[torch.Tensor]]:
    """Tokens of a prefill-and-decode loop (argmax, or ``pick_for(step)``'s pick) and each step's logits."""
    engine = HybridEngine(default_config())
    engine.alloc(0, 0)
    tokens: list[int] = []
    logits: list[torch.Tensor] = []
    with torch.no_grad():
        row = engine.prefill(0, prompt)
        while True:
            row = row.float().reshape(-1)
            logits.append(row)
            if pick_for is None:
                token = int(row.argmax())
            else:
                token = sample_rows(row[None, :], [pick_for(len(tokens))], ()).tokens[0]
            tokens.append(token)
            if len(tokens) == MAX_TOKENS:
                return tokens, logits
            row = engine.decode_batch([0], [token])[0]


def ids(prompt: str) -> list[int]:
    return [int(t) for t in prompt.split()]


# --- greedy stays greedy ----------------------------------------------------------------------------


def test_the_default_is_greedy_and_unchanged_by_a_seed_or_neutral_filters(capsys, tmp_path):
    default = run_json(capsys, tmp_path)
    for i, record in enumerate(default):
        assert record["token_ids"] == reference(ids(PROMPTS[i]))[0]
        assert "logprobs" not in record
    neutral = run_json(capsys, tmp_path, "--temperature", "0", "--seed", "99", "--top-p", "1", "--top-k", "0",
                       "--min-p", "0")
    assert [r["token_ids"] for r in neutral] == [r["token_ids"] for r in default]


# --- seeded sampling ------------------------------------------------------------------------------------


SAMPLED = ("--temperature", "1.5", "--top-k", "40", "--top-p", "0.95", "--min-p", "0.01", "--seed", "11")


def test_a_seeded_sampled_run_repeats_exactly_and_follows_the_seed_rule(capsys, tmp_path):
    first = run_json(capsys, tmp_path, *SAMPLED)
    again = run_json(capsys, tmp_path, *SAMPLED)
    assert [r["token_ids"] for r in again] == [r["token_ids"] for r in first]
    greedy = [reference(ids(p))[0] for p in PROMPTS]
    assert [r["token_ids"] for r in first] != greedy  # the flags did reach the picks
    for i, record in enumerate(first):
        def pick(step: int, i: int = i) -> HostPick:
            return HostPick(1.5, 11 + i * REQUEST_SEED_STRIDE + step, False, 0, top_p=0.95, top_k=40, min_p=0.01)

        assert record["token_ids"] == reference(ids(PROMPTS[i]), pick)[0], f"request {i + 1}"
    other = run_json(capsys, tmp_path, *SAMPLED[:-1], "12")
    assert [r["token_ids"] for r in other] != [r["token_ids"] for r in first]


def test_logprobs_are_the_models_log_softmax_for_every_token_the_first_included(capsys, tmp_path):
    records = run_json(capsys, tmp_path, "--logprobs", "3")
    for i, record in enumerate(records):
        tokens, logits = reference(ids(PROMPTS[i]))
        assert record["token_ids"] == tokens  # logprobs do not change a greedy pick
        entries = record["logprobs"]
        assert len(entries) == len(tokens)
        for step in range(len(tokens)):  # the first token's record comes from its prefill row
            want = torch.log_softmax(logits[step].double(), dim=-1)
            entry = entries[step]
            assert entry["token_id"] == tokens[step]
            assert entry["logprob"] == pytest.approx(float(want[tokens[step]]), abs=1e-4)
            top = [e["token_id"] for e in entry["top_logprobs"]]
            assert top == want.topk(3).indices.tolist()
            assert [e["logprob"] for e in entry["top_logprobs"]] == pytest.approx(want.topk(3).values.tolist(),
                                                                                  abs=1e-4)


# --- bad values ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flags, says", [
    (("--temperature", "-0.5"), "--temperature -0.5: temperature = -0.5 is out of range"),
    (("--temperature", "nan"), "--temperature nan: temperature = nan is out of range"),
    (("--temperature", "hot"), "--temperature hot: not a number"),
    (("--top-p", "0"), "--top-p 0.0: top_p = 0.0 is out of range (0 < top_p <= 1)"),
    (("--top-p", "1.5"), "--top-p 1.5: top_p = 1.5 is out of range"),
    (("--top-k", "-1"), "--top-k -1: must be at least 0"),
    (("--top-k", "2.5"), "--top-k 2.5: not an integer"),
    (("--min-p", "1.1"), "--min-p 1.1: min_p = 1.1 is out of range (0 <= min_p <= 1)"),
    (("--seed", "x"), "--seed x: not an integer"),
    (("--logprobs", "-2", "--json"), "--logprobs -2: must be at least 0"),
    (("--logprobs", "2"), "--logprobs 2: needs --json"),
])
def test_a_bad_sampling_value_is_one_line_and_exit_2(capsys, flags, says):
    assert fxsched("--prompt-ids", "1 2 3", "--max-tokens", "4", *flags) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"fxsched generate: {says}"), captured.err


# --- expert parallelism: the leader samples on the device as one rank does ---------------------------------


def test_two_ep_ranks_pick_the_same_sampled_tokens_and_logprobs_as_one(capsys, tmp_path):
    pytest.importorskip("torch.distributed")
    flags = (*SAMPLED, "--logprobs", "2")
    single = run_json(capsys, tmp_path, *flags)
    try:
        ranks = run_json(capsys, tmp_path, *flags, "--ep-ranks", "2")
    finally:
        left = multiprocessing.active_children()
        for p in left:
            p.kill()
            p.join(5)
    assert left == [], f"processes left behind: {left}"
    assert [r["token_ids"] for r in ranks] == [r["token_ids"] for r in single]
    assert [r["logprobs"] for r in ranks] == [r["logprobs"] for r in single]
