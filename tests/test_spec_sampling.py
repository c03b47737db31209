"""The rejection sampler of speculative verifies (``runtime/devices/spec_sampling.py``) against
exact distributions on a tiny vocabulary: over thousands of seeds in one batched call, the tokens a
verify emits (the accepted drafts, then the residual or bonus draw) follow the target's filtered
distribution, for a deterministic drafter (q one-hot) and a sampling one (q given); greedy rows keep
argmax verification; a row's answer is its seed's alone. A verifier that skips the min(1, p/q)
test fails the same check."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from fxsched.effects.device_calls import HostPick  # noqa: E402
from fxsched.runtime.devices import spec_sampling  # noqa: E402
from fxsched.runtime.devices.spec_sampling import verify_sample  # noqa: E402
from fxsched.runtime.devices.torch_sampling import filtered_probs  # noqa: E402
from support.chi2 import chi2_sf, chi2_test  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 6
SEEDS = 4000
ROW0 = [1.0, 0.2, -0.5, 1.4, 0.0, -2.0]
ROW1 = [0.3, 1.1, 0.9, -1.0, 0.5, 0.0]
ROW2 = [-0.2, 0.4, 1.2, 0.8, -0.6, 0.1]
SETTINGS = [
    dict(temperature=0.7, top_p=0.9),
    dict(temperature=1.0, top_k=4),
    dict(temperature=1.3, min_p=0.05),
]


def exact(row: list[float], settings: dict) -> list[float]:
    """The target distribution of one row: the non-speculative pick's filtered softmax, normalised."""
    pick = HostPick(settings["temperature"], 0, False, **{k: v for k, v in settings.items() if k != "temperature"})
    probs = filtered_probs(torch.tensor([row]), [pick])[0].double()
    return (probs / probs.sum()).tolist()


def picks_for(seed: int, rows: int, settings: dict) -> list[HostPick]:
    rest = {k: v for k, v in settings.items() if k != "temperature"}
    return [HostPick(settings["temperature"], seed * 16 + i, False, **rest) for i in range(rows)]


def emitted(inputs: list[list[int]], rows: list[int], accepted: list[int]) -> list[tuple[int, ...]]:
    """Per sequence, what the scheduler emits: the accepted drafts and the row after them."""
    out, offset = [], 0
    for toks, na in zip(inputs, accepted, strict=True):
        out.append(tuple(toks[1:1 + na]) + (rows[offset + na],))
        offset += len(toks)
    return out


def joint_first_two(p0: list[float], p1: list[float], d1: int) -> dict[tuple[int, ...], float]:
    """The exact law of the emitted prefix of a 3-row verify with first draft ``d1``, cut at two
    tokens: x0 ~ p0; when x0 = d1 the second token x1 ~ p1 (the row after an accepted draft)."""
    law: dict[tuple[int, ...], float] = {(x,): p for x, p in enumerate(p0) if x != d1}
    law.update({(d1, x): p0[d1] * p for x, p in enumerate(p1)})
    return law


def run_deterministic(settings: dict, d1: int, d2: int) -> list[tuple[int, ...]]:
    inputs = [[0, d1, d2] for _ in range(SEEDS)]
    logits = torch.tensor([ROW0, ROW1, ROW2] * SEEDS)
    picks = [p for s in range(SEEDS) for p in picks_for(s, 3, settings)]
    rows, accepted = verify_sample(logits, inputs, picks, ())
    return [e[:2] for e in emitted(inputs, rows, accepted)]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_one_hot_drafts_keep_the_target_joint_distribution(settings):
    p0, p1 = exact(ROW0, settings), exact(ROW1, settings)
    for d1, d2 in ((3, 1), (1, 2)):  # a likely and an unlikely first draft
        out = run_deterministic(settings, d1, d2)
        stat, df, p = chi2_test(out, joint_first_two(p0, p1, d1))
        assert p > 0.001, f"drafts {d1, d2}: chi-square {stat:.1f} (df {df}), p = {p:.2g}"


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_sampled_drafts_keep_the_target_distribution(settings):
    """A drafter that samples d ~ q (q a different, filtered distribution) and hands q over."""
    q0 = exact([0.5, 1.0, 0.0, 0.7, -0.3, 0.2], dict(temperature=1.0))
    rng = random.Random(7)
    drafts = rng.choices(range(VOCAB), weights=q0, k=SEEDS)
    inputs = [[0, d] for d in drafts]
    logits = torch.tensor([ROW0, ROW1] * SEEDS)
    q = torch.tensor([q0, [0.0] * VOCAB] * SEEDS, dtype=torch.float64)
    picks = [p for s in range(SEEDS) for p in picks_for(s, 2, settings)]
    rows, accepted = verify_sample(logits, inputs, picks, (), q=q)
    first = [e[0] for e in emitted(inputs, rows, accepted)]
    p0 = exact(ROW0, settings)
    stat, df, p = chi2_test(first, dict(enumerate(p0)))
    assert p > 0.001, f"chi-square {stat:.1f} (df {df}), p = {p:.2g}"
    rate = sum(accepted) / SEEDS
    overlap = sum(min(a, b) for a, b in zip(p0, q0, strict=True))
    assert abs(rate - overlap) < 0.03, (rate, overlap)  # acceptance is sum min(p, q)


def test_accepting_without_the_ratio_test_fails_the_same_check(monkeypatch):
    """The negative control: keep every draft the target can produce (p(d) > 0)."""
    monkeypatch.setattr(spec_sampling, "accept_test", lambda p_d, q_d, u: p_d > 0)
    settings = SETTINGS[0]
    out = run_deterministic(settings, 3, 1)
    stat, df, p = chi2_test(out, joint_first_two(exact(ROW0, settings), exact(ROW1, settings), 3))
    assert p < 1e-6, (stat, df, p)


def test_greedy_rows_keep_argmax_verification_beside_sampled_rows():
    hot = picks_for(1, 3, SETTINGS[1])
    cold = [HostPick(0.0, 99 + i, False) for i in range(3)]
    logits = torch.tensor([ROW0, ROW1, ROW2, ROW0, ROW1, ROW2])
    inputs = [[0, 3, 2], [0, 3, 1]]  # argmax rows: 3, 1, 2
    rows, accepted = verify_sample(logits, inputs, hot + cold, ())
    assert rows[3:] == [3, 1, 2] and accepted[1] == 2
    rows, accepted = verify_sample(logits[3:], [[0, 3, 4]], cold, ())
    assert rows == [3, 1, 2] and accepted == [1]


def test_eos_is_masked_where_the_pick_says_so():
    eos = (3,)
    pick = HostPick(1.0, 5, True, top_k=1)  # top-k 1 over the masked row: the runner-up, 0
    rows, accepted = verify_sample(torch.tensor([ROW0, ROW1]), [[0, 3]], [pick, pick], eos)
    assert rows[0] == 0 and accepted == [0]


def test_a_rows_answer_depends_only_on_its_logits_draft_and_seed():
    settings = SETTINGS[2]
    base_inputs = [[0, 3, 1], [0, 1, 2], [0, 2, 2]]
    logits = torch.tensor([ROW0, ROW1, ROW2] * 3)
    picks = [p for s in range(3) for p in picks_for(s, 3, settings)]
    rows, accepted = verify_sample(logits, base_inputs, picks, ())
    # the second sequence alone, and the batch in another order, give it the same answer
    alone, acc_alone = verify_sample(logits[3:6], base_inputs[1:2], picks[3:6], ())
    assert alone[:acc_alone[0] + 1] == rows[3:3 + accepted[1] + 1]
    order = [2, 0, 1]
    shuffled = verify_sample(torch.cat([logits[3 * i:3 * i + 3] for i in order]), [base_inputs[i] for i in order],
                             [p for i in order for p in picks[3 * i:3 * i + 3]], ())[0]
    assert shuffled[6:9][:accepted[1] + 1] == rows[3:6][:accepted[1] + 1]


def test_chi2_tail_matches_known_quantiles():
    assert chi2_sf(3.841, 1) == pytest.approx(0.05, abs=5e-4)
    assert chi2_sf(18.307, 10) == pytest.approx(0.05, abs=5e-4)
    assert chi2_sf(6.635, 1) == pytest.approx(0.01, abs=2e-4)
    assert chi2_sf(0.0, 3) == 1.0
