"""Penalties and ``logit_bias`` (specs/serve-fields.md §13.3): the processed rows against a hand
computation in plain Python (vLLM's rules written out), and a rejection-sampled verify over
processed rows keeping the exact law of the penalised target (chi-square against the law computed
by hand, specs/speculation.md §6.16).
"""

from __future__ import annotations

import math
import random

import pytest

torch = pytest.importorskip("torch")

from support.chi2 import chi2_test  # noqa: E402

from fxsched.effects.device_calls import HostPick  # noqa: E402
from fxsched.runtime.devices.row_processors import Penalties, RowProcessors  # noqa: E402
from fxsched.runtime.devices.spec_sampling import verify_sample  # noqa: E402
from fxsched.runtime.devices.torch_sampling import sample_rows  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 6
SEEDS = 4000
ROW0 = [1.0, 0.2, -0.5, 1.4, 0.0, -2.0]
ROW1 = [0.3, 1.1, 0.9, -1.0, 0.5, 0.0]
ROW2 = [-0.2, 0.4, 1.2, 0.8, -0.6, 0.1]
PROMPT = [2, 4, 4]


def hand(row: list[float], prompt: list[int], output: list[int], presence: float = 0.0, frequency: float = 0.0,
         repetition: float = 1.0, bias: dict[int, float] | None = None) -> list[float]:
    out = list(row)
    for t, b in (bias or {}).items():
        out[t] += b
    for t in set(prompt) | set(output):
        out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
    for t in set(output):
        out[t] -= frequency * output.count(t) + presence
    return out


def softmax(row: list[float], temperature: float) -> list[float]:
    top = max(row)
    w = [math.exp((v - top) / temperature) for v in row]
    return [x / sum(w) for x in w]


CASES = [
    dict(repetition=1.7),
    dict(presence=0.8, frequency=0.6),
    dict(bias={1: 2.5, 3: -4.0}),
    dict(presence=0.3, frequency=1.1, repetition=1.4, bias={5: 3.0}),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_penalties_equal_the_hand_computation(case):
    rng = random.Random(3)
    for _ in range(20):
        row = [rng.uniform(-3, 3) for _ in range(VOCAB)]
        output = [rng.randrange(VOCAB) for _ in range(rng.randrange(5))]
        got = torch.tensor([row])
        Penalties(case.get("presence", 0.0), case.get("frequency", 0.0), case.get("repetition", 1.0),
                  tuple(sorted(case.get("bias", {}).items())))(got[0], len(PROMPT), PROMPT + output)
        assert got[0].tolist() == pytest.approx(hand(row, PROMPT, output, **case), abs=1e-5)


def test_processors_touch_only_their_requests_rows_and_sampling_reads_them():
    book = RowProcessors()
    book.set(7, len(PROMPT), [Penalties(logit_bias=((0, -100.0),))])
    logits = torch.tensor([ROW0, ROW0])  # token 0 is not the argmax; bias it away anyway, then force it
    assert book.process(logits, [None, None], lambda r: PROMPT) is None
    book.set(8, len(PROMPT), [Penalties(logit_bias=((2, 100.0),))])
    processed = book.process(logits, [7, 8], lambda r: PROMPT)
    assert processed is not None and processed[0, 0] == ROW0[0] - 100 and processed[1, 2] == ROW0[2] + 100
    greedy = [HostPick(0.0, 1, False, 2), HostPick(0.0, 1, False, 2)]
    got = sample_rows(logits, greedy, (), processed)
    assert got.tokens == [3, 2]
    raw = torch.log_softmax(logits[1], -1)
    rec = got.logprobs[1]
    assert rec is not None and rec.logprob == pytest.approx(float(raw[2]))  # records stay the raw model's
    book.drop(8)
    book.drop(7)
    assert not book


@pytest.mark.parametrize("case", CASES[1:], ids=str)
def test_a_verify_over_processed_rows_keeps_the_penalised_law(case):
    """3-row verifies (anchor 0, drafts d1, d2) at temperature 0.9: the emitted prefix cut at two
    tokens follows x0 ~ p0 = softmax(penalised ROW0 | output []), and after an accepted d1,
    x1 ~ p1 = softmax(penalised ROW1 | output [0, d1]): the processors see the drafts as output."""
    temperature = 0.9
    book = RowProcessors()
    d1, d2 = 3, 1
    book.set(1, len(PROMPT), [Penalties(case.get("presence", 0.0), case.get("frequency", 0.0),
                                        case.get("repetition", 1.0), tuple(sorted(case.get("bias", {}).items())))])
    inputs = [[0, d1, d2] for _ in range(SEEDS)]
    logits = torch.tensor([ROW0, ROW1, ROW2] * SEEDS)
    # the context of verify row i: the prompt, the anchor (an output token already), the drafts before row i
    contexts = [PROMPT + [0], PROMPT + [0, d1], PROMPT + [0, d1, d2]]
    processed = book.process(logits, [1] * len(logits), lambda r: contexts[r % 3])
    picks = [HostPick(temperature, s * 16 + i, False) for s in range(SEEDS) for i in range(3)]
    rows, accepted = verify_sample(logits, inputs, picks, (), processed=processed)
    out = []
    for s, na in enumerate(accepted):
        emitted = tuple(inputs[s][1:1 + na]) + (rows[3 * s + na],)
        out.append(emitted[:2])
    p0 = softmax(hand(ROW0, PROMPT, [0], **case), temperature)
    p1 = softmax(hand(ROW1, PROMPT, [0, d1], **case), temperature)
    law: dict[tuple[int, ...], float] = {(x,): p for x, p in enumerate(p0) if x != d1}
    law.update({(d1, x): p0[d1] * p for x, p in enumerate(p1)})
    stat, df, p = chi2_test(out, law)
    assert p > 0.001, f"chi-square {stat:.1f} (df {df}), p = {p:.2g}"
    raw = softmax(ROW0, temperature)
    assert max(abs(a - b) for a, b in zip(raw, p0, strict=True)) > 0.02  # the case changes the law
