"""Sampling on the device (``fxsched.runtime.devices.torch_sampling``) and the host filters.

References are independent of the sampler: greedy picks against a plain loop for the first
maximum, sampled frequencies against a plain-Python softmax with the filters applied by hand
(a chi-square bound, seeded so each run is the same and a wrong sampler fails it), logprobs
against ``math.log`` of the softmax. The full-path test drives the interpreter on the real model
with greedy and sampled requests in one batch and checks the greedy ones against an all-greedy run
and the engine's own greedy generation.
"""

from __future__ import annotations

import math
import random
import pytest

torch = pytest.importorskip("torch")

from fxsched.core import events as ev  # noqa: E402
from fxsched.core.request import Request  # noqa: E402
from fxsched.core.state import initial_state  # noqa: E402
from fxsched.effects.device_calls import HostPick  # noqa: E402
from fxsched.runtime.bench.prompts import random_prompts  # noqa: E402
from fxsched.runtime.devices.sampling import host_pick  # noqa: E402
from fxsched.runtime.devices.torch import TorchDevice  # noqa: E402
from fxsched.runtime.devices.torch_sampling import sample_rows  # noqa: E402
from fxsched.runtime.generate import GenerateHost, scheduler_setup  # noqa: E402
from fxsched.runtime.interpreter import Interpreter  # noqa: E402
from fxsched.runtime.torch_model import HybridEngine, default_config  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EOS = (5,)
# chi-square critical values at alpha = 0.001, by degrees of freedom
CHI2_CRIT = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def pick(temperature: float = 0.0, seed: int = 0, mask_eos: bool = False, top_logprobs: int = 0, **kw) -> HostPick:
    return HostPick(temperature, seed, mask_eos, top_logprobs, **kw)


def first_max(row: list[float]) -> int:
    best = 0
    for i, v in enumerate(row):
        if v > row[best]:
            best = i
    return best


# --- greedy rows -------------------------------------------------------------------------------


def tied_logits():
    """Rows whose maxima are tied at several ids (exact ties in float32 and bf16)."""
    rows = torch.zeros(5, 32)
    rows[0, [3, 7, 30]] = 2.0
    rows[1, [0, 31]] = 1.5
    rows[2] = -1.0
    rows[2, [12, 13]] = -0.25
    rows[3, [5, 9]] = 4.0  # 5 is the EOS: masked, the pick is 9
    rows[4] = torch.linspace(-1, 1, 32)
    rows[4, [20, 31]] = 1.0
    return rows


def test_torch_argmax_takes_the_lowest_index_among_ties():
    assert torch.argmax(torch.tensor([0.0, 2.0, 1.0, 2.0, 2.0])).item() == 1
    assert torch.argmax(torch.zeros(3, 100), dim=-1).tolist() == [0, 0, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_rows_take_the_lowest_tied_id_whatever_the_batch_mates(dtype):
    logits = tied_logits()
    picks = [pick(), pick(), pick(), pick(mask_eos=True), pick()]
    want = [3, 0, 12, 9, 20]
    masked = logits.clone()
    masked[3, 5] = -math.inf
    assert [first_max(r) for r in masked.tolist()] == want
    assert sample_rows(logits.to(dtype), picks, EOS).tokens == want
    # interleave sampled rows (hot, filtered, logprob-asking) and permute the batch
    noise = torch.randn(4, 32, generator=torch.Generator().manual_seed(0)) * 3
    sampled = [pick(1.0, 11), pick(0.5, 12, top_k=4), pick(2.0, 13, True, 3, top_p=0.5), pick(0.9, 14, min_p=0.2)]
    rows = list(range(5)) + [5, 6, 7, 8]
    for trial in range(6):
        order = rows[:]
        random.Random(trial).shuffle(order)
        batch = torch.cat([logits, noise])[order].to(dtype)
        got = sample_rows(batch, [(picks + sampled)[r] for r in order], EOS).tokens
        assert [got[order.index(r)] for r in range(5)] == want, order


def test_greedy_rows_match_the_device_argmax_kernel():
    from fxsched.kernels.row_argmax import row_argmax

    logits = torch.cat([tied_logits(), torch.randn(6, 32, generator=torch.Generator().manual_seed(1))])
    picks = [pick()] * len(logits)
    assert sample_rows(logits, picks, EOS).tokens == row_argmax(logits).tolist()


# --- sampled rows ------------------------------------------------------------------------------


def random_logits(rows: int, vocab: int, seed: int):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2


def test_a_sampled_token_depends_only_on_its_logits_and_seed():
    logits = random_logits(8, 40, seed=2)
    picks = [pick(1.0, 100 + r, top_k=r * 3, top_p=1.0 - r * 0.05) for r in range(8)]
    alone = [sample_rows(logits[r:r + 1], [picks[r]], EOS).tokens[0] for r in range(8)]
    assert sample_rows(logits, picks, EOS).tokens == alone
    order = [5, 2, 7, 0, 1, 6, 4, 3]
    permuted = sample_rows(logits[order], [picks[r] for r in order], EOS).tokens
    assert [permuted[order.index(r)] for r in range(8)] == alone
    # the seed is what varies a draw: one row, many seeds, several different tokens
    flat = torch.zeros(64, 40)
    assert len(set(sample_rows(flat, [pick(1.0, s) for s in range(64)], EOS).tokens)) > 10


def test_top_k_one_and_a_tiny_top_p_are_greedy():
    logits = torch.cat([tied_logits(), random_logits(20, 32, seed=3)])
    want = [first_max(r) for r in logits.tolist()]
    for make in (lambda s: pick(1.3, s, top_k=1), lambda s: pick(0.7, s, top_p=1e-6)):
        picks = [make(s) for s in range(len(logits))]
        assert sample_rows(logits, picks, ()).tokens == want


def test_eos_is_never_picked_while_masked():
    logits = torch.zeros(200, 16)
    logits[:, EOS[0]] = 8.0  # the EOS dwarfs everything
    masked = sample_rows(logits, [pick(1.0, s, True) for s in range(200)], EOS).tokens
    assert EOS[0] not in masked and len(set(masked)) > 5
    assert sample_rows(logits[:2], [pick(), pick(mask_eos=True)], EOS).tokens == [EOS[0], 0]
    unmasked = sample_rows(logits, [pick(1.0, s) for s in range(200)], EOS).tokens
    assert unmasked.count(EOS[0]) > 150


def reference_probs(logits: list[float], temperature: float, top_k: int = 0, top_p: float = 1.0,
                    min_p: float = 0.0) -> list[float]:
    """softmax(l / T), then min-p, top-k, top-p (vLLM's order), renormalised: plain Python."""
    top = max(logits)
    w = [math.exp((v - top) / temperature) for v in logits]
    total = sum(w)
    p = [x / total for x in w]
    p = [x if x >= min_p * max(p) else 0.0 for x in p]
    order = sorted(range(len(p)), key=lambda i: (-p[i], i))
    if top_k > 0:
        for i in order[top_k:]:
            p[i] = 0.0
    total = sum(p)
    kept, mass = [0.0] * len(p), 0.0
    for i in order:
        if mass < top_p * total or top_p >= 1:
            kept[i] = p[i]
        mass += p[i]
    total = sum(kept)
    return [x / total for x in kept]


def chi_square(tokens: list[int], probs: list[float]) -> tuple[float, int]:
    n = len(tokens)
    counts = [tokens.count(i) for i in range(len(probs))]
    assert all(c == 0 for c, p in zip(counts, probs, strict=True) if p == 0), (counts, probs)
    cells = [(c, n * p) for c, p in zip(counts, probs, strict=True) if p > 0]
    return sum((c - e) ** 2 / e for c, e in cells), len(cells) - 1


LOGITS6 = [1.0, 0.2, -0.5, 1.4, 0.0, -2.0]
FILTERS = [
    dict(temperature=1.0),
    dict(temperature=0.6),
    dict(temperature=1.5, top_k=3),
    dict(temperature=1.0, top_p=0.7),
    dict(temperature=1.0, min_p=0.3),
    dict(temperature=0.8, top_k=4, top_p=0.8, min_p=0.05),
]
DRAWS = 3000


@pytest.mark.parametrize("params", FILTERS, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_sampled_frequencies_follow_the_filtered_softmax(params):
    probs = reference_probs(LOGITS6, **params)
    t = params["temperature"]
    filters = {k: v for k, v in params.items() if k != "temperature"}
    picks = [pick(t, 1000 + s, **filters) for s in range(DRAWS)]
    device = sample_rows(torch.tensor([LOGITS6] * DRAWS), picks, ()).tokens
    host = [host_pick(LOGITS6, p, ()) for p in picks]
    for name, tokens in (("device", device), ("host", host)):
        stat, df = chi_square(tokens, probs)
        assert stat < CHI2_CRIT[df], f"{name}: chi-square {stat:.1f} (df {df}) for {params}"


def test_a_sampler_that_ignored_the_temperature_fails_the_frequency_check():
    """The bound is tight enough to tell temperature 0.6 from 1.0."""
    picks = [pick(1.0, 1000 + s) for s in range(DRAWS)]
    tokens = sample_rows(torch.tensor([LOGITS6] * DRAWS), picks, ()).tokens
    stat, df = chi_square(tokens, reference_probs(LOGITS6, 0.6))
    assert stat > CHI2_CRIT[df]


def test_min_p_drops_every_token_below_its_floor():
    logits = torch.tensor([[2.0, 1.9, 0.0, -1.0, 1.5, -3.0]] * 400)
    probs = torch.softmax(logits[0], -1)
    allowed = {i for i, p in enumerate(probs.tolist()) if p >= 0.5 * probs.max().item()}
    assert allowed == {0, 1, 4}
    tokens = sample_rows(logits, [pick(1.0, s, min_p=0.5) for s in range(400)], ()).tokens
    assert set(tokens) == allowed


# --- logprobs ------------------------------------------------------------------------------------


def test_logprob_records_are_the_raw_log_softmax():
    logits = random_logits(3, 12, seed=5)
    picks = [pick(0.5, 1, True, 3), pick(), pick(0.0, 0, False, 12)]
    out = sample_rows(logits, picks, EOS)
    assert out.logprobs[1] is None
    for r in (0, 2):
        row = logits[r].tolist()
        norm = math.log(sum(math.exp(v) for v in row))
        record = out.logprobs[r]
        assert record is not None and record.token == out.tokens[r]
        assert record.logprob == pytest.approx(row[out.tokens[r]] - norm, abs=1e-5)
        want = sorted(range(12), key=lambda i: (-row[i], i))[:picks[r].top_logprobs]
        assert [i for i, _ in record.top] == want
        assert [v for _, v in record.top] == pytest.approx([row[i] - norm for i in want], abs=1e-5)


# --- request fields ------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("min_p", -0.1),
                                          ("min_p", 1.01), ("temperature", -0.5), ("temperature", math.inf),
                                          ("temperature", math.nan)])
def test_a_request_refuses_out_of_range_sampling_fields(field, value):
    with pytest.raises(ValueError, match=f"request 3: {field} = "):
        Request(id=3, prompt=(1, 2), max_tokens=4, **{field: value})


def test_sampling_fields_reach_the_pick_and_scenarios_accept_them():
    from fxsched.core.rows import host_pick as pick_of
    from fxsched.core.sequence import Sequence
    from fxsched.runtime.scenarios.loader import parse_scenario

    scenario = parse_scenario({"name": "s", "requests": [dict(id=1, prompt_len=3, tokens=[4, 63], temperature=0.5,
                                                              top_p=0.9, top_k=7, min_p=0.1)]}, "test")
    req = scenario.requests[0].request()
    assert (req.top_p, req.top_k, req.min_p) == (0.9, 7, 0.1)
    seq = Sequence(seq_id=1, request=req, slot=0, seq_len=3, blocks=1, output=(4,), last_token=4, remaining=1)
    assert pick_of(seq) == HostPick(0.5, 43, False, 0, top_p=0.9, top_k=7, min_p=0.1)


# --- the full path: interpreter -> TorchDevice.sample_rows ----------------------------------------


MAX_TOKENS = 10


def run_requests(engine: HybridEngine, requests: list[Request]) -> tuple[dict[int, list[int]], TorchDevice]:
    config, model, _ = scheduler_setup(engine.cfg, "none", len(requests))
    device = TorchDevice(engine, strict=True)
    host = GenerateHost(requests, engine.cfg.eos_id)
    interpreter = Interpreter(device, host, config.eos_ids)
    try:
        with torch.no_grad():
            interpreter.run(initial_state(config, model), [ev.Arrival(r) for r in requests] + [ev.Boot()])
    finally:
        device.release_all()
        device.close()
    return {r.id: host.results[r.id].tokens for r in requests}, device


def request(i: int, prompt: list[int], temperature: float = 0.0, seed: int = 42, **kw) -> Request:
    return Request(id=i, prompt=tuple(prompt), max_tokens=MAX_TOKENS, temperature=temperature, seed=seed, **kw)


def test_greedy_requests_keep_their_tokens_in_a_batch_with_sampled_ones():
    cfg = default_config()
    prompts = random_prompts(seed=77, count=6, vocab_size=cfg.vocab_size, max_len=24)
    sampled: dict[int, dict] = {2: dict(temperature=1.0, seed=7), 4: dict(temperature=0.8, top_k=20, top_p=0.9),
                                5: dict(temperature=1.2, min_p=0.05, top_logprobs=3)}
    mixed = [request(i + 1, p, **sampled.get(i + 1, {})) for i, p in enumerate(prompts)]
    plain = [request(i + 1, p) for i, p in enumerate(prompts)]
    got, device = run_requests(HybridEngine(cfg), mixed)
    want, _ = run_requests(HybridEngine(cfg), plain)
    assert device.stats.calls["sample_rows"] > 0  # the mixed batch was picked on the device
    reference = HybridEngine(cfg)
    for rid in (1, 3, 6):
        assert got[rid] == want[rid], f"greedy request {rid} changed in a batch with sampled requests"
        assert got[rid] == reference.greedy_generate(prompts[rid - 1], MAX_TOKENS)[:len(got[rid])]
    assert any(got[rid] != want[rid] for rid in sampled)  # the sampled ones did sample
    # same seeds, same tokens: a second mixed run repeats every request
    again, _ = run_requests(HybridEngine(cfg), mixed)
    assert again == got
