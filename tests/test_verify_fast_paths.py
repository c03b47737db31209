"""The verify tick's fast paths against the general ones they stand for.

- ``Forwards._agreed``: the leading drafts each sequence's target rows agree with, one comparison
  over [B, K - 1] when every sequence verifies the same K, the ragged kernel otherwise: equal to
  ``greedy_accept_reference`` (an independent scatter-min formulation) on random rows.
- ``HybridEngine.gdn_fold_accepted`` of a verify with one live entry copies that entry's rows as
  views; a verify with several entries goes through ``gdn_fold_rows`` and writes the accepted hidden
  rows in one indexed copy: the same committed GDN states, lengths, block tables and hidden history
  for the slot both ways, and the state a forward of exactly the kept rows leaves.
- ``HybridEngine.captured_rows`` (one gather) equals each slot's ``captured_hidden`` row, and
  ``set_mtp_hiddens`` (one write) equals ``set_mtp_hidden`` slot by slot.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

torch = pytest.importorskip("torch")

from fxsched.kernels.greedy_accept import greedy_accept_reference, row_offsets_from_counts  # noqa: E402
from fxsched.runtime.devices.torch_forwards import Forwards  # noqa: E402
from fxsched.runtime.torch_model.config import default_config  # noqa: E402
from fxsched.runtime.torch_model.engine import HybridEngine  # noqa: E402
from fxsched.runtime.torch_model.weights import init_weights  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _reference(answers: list[int], lists: list[list[int]]) -> list[int]:
    ks = torch.tensor([len(t) for t in lists])
    drafts = torch.tensor([t for toks in lists for t in toks[1:]], dtype=torch.int64)
    accepted, _ = greedy_accept_reference(torch.tensor(answers), drafts, row_offsets_from_counts(ks))
    return accepted.tolist()


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("late", [False, True])
def test_agreed_counts_the_leading_matches_as_the_reference(ragged, late, kernels, monkeypatch):
    # "triton": the device opted in, so a ragged batch takes greedy_accept (its Triton kernel where
    # Triton runs, else its reference); "torch": the padded comparison
    monkeypatch.setenv("FXSCHED_KERNELS", kernels)
    rng = random.Random(7 + 2 * ragged + late)
    for _ in range(60):
        batch = rng.randint(1, 9)
        ks = [rng.randint(1, 5) for _ in range(batch)] if ragged else [rng.randint(1, 5)] * batch
        lists, answers = [], []
        for k in ks:
            toks = [rng.randrange(6) for _ in range(k)]
            rows = [rng.randrange(6) for _ in range(k)]
            agree = rng.randint(0, k - 1)  # make some prefixes match on purpose
            rows[:agree] = toks[1:agree + 1]
            lists.append(toks)
            answers += rows
        inputs = torch.tensor([t for toks in lists for t in toks]) if late else None
        host_lists = [[toks[0]] + [0] * (len(toks) - 1) for toks in lists] if late else lists
        got = Forwards._agreed(torch.tensor(answers), host_lists, inputs).tolist()
        assert got == _reference(answers, lists), (ks, lists, answers)


def _engine() -> HybridEngine:
    cfg = dataclasses.replace(default_config(), block_size=4, gdn_snapshot_every=1, max_slots=4, max_seq_len=64,
                              num_blocks=64)
    torch.manual_seed(0)
    return HybridEngine(cfg, init_weights(cfg, torch.device("cpu")))


PROMPTS = ([1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11], [5, 5, 5])


def _seated() -> HybridEngine:
    engine = _engine()
    for slot, prompt in enumerate(PROMPTS):
        engine.alloc(slot)
        engine.prefill(slot, prompt)
    return engine


@pytest.mark.parametrize("keep", [1, 2, 4])
def test_one_entry_fold_commits_what_the_batched_fold_commits(keep):
    alone, batched = _seated(), _seated()
    rows = [3, 1, 4, 1]
    alone.verify_batched([0], [rows])
    alone.gdn_fold_accepted([0], [keep])
    batched.verify_batched([0, 1], [rows, [2, 7, 1]])
    batched_rows = torch.stack([batched.captured_hidden(0)[:3], batched.captured_hidden(1)[:3]])
    batched.gdn_fold_accepted([0, 1], [keep, 2])
    a, b = alone.slot_state(0), batched.slot_state(0)
    assert (a.seq_len, a.tokens, a.block_table) == (b.seq_len, b.tokens, b.block_table)
    assert a.seq_len == len(PROMPTS[0]) + keep
    torch.testing.assert_close(alone.hidden_rows(0, 0, a.seq_len), batched.hidden_rows(0, 0, b.seq_len),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batched.hidden_rows(1, len(PROMPTS[1]), len(PROMPTS[1]) + 2),
                               batched_rows[1, :2], rtol=0, atol=0)
    for x, y in zip(alone.gdn_state(0), batched.gdn_state(0), strict=True):
        for p, q in zip(x, y, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)
    # and the state is the one a forward of exactly the kept rows leaves
    exact = _seated()
    exact.verify_batched([0], [rows[:keep]])
    exact.gdn_fold_accepted([0], [keep])
    for x, y in zip(alone.gdn_state(0), exact.gdn_state(0), strict=True):
        for p, q in zip(x, y, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)


def test_captured_rows_and_mtp_hiddens_in_one_copy_equal_slot_by_slot():
    engine = _seated()
    engine.verify_batched([0, 1, 2], [[3, 1, 4, 1], [2, 7], [1, 8, 2]])
    slots, rows = [2, 0, 1], [2, 3, 0]
    got = engine.captured_rows(slots, rows)
    want = torch.stack([engine.captured_hidden(s)[r] for s, r in zip(slots, rows, strict=True)])
    assert torch.equal(got, want)
    hiddens = [torch.randn(engine.cfg.hidden_size) for _ in slots]
    engine.set_mtp_hiddens(slots, hiddens)
    one_by_one = _seated()
    for slot, hidden in zip(slots, hiddens, strict=True):
        one_by_one.set_mtp_hidden(slot, hidden)
    for slot in slots:
        assert engine.has_mtp_hidden(slot)
        assert torch.equal(engine.mtp_hidden[slot], one_by_one.mtp_hidden[slot])
    with pytest.raises(Exception, match="duplicate"):
        engine.set_mtp_hiddens([0, 0], hiddens[:2])
