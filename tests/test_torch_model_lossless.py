"""Speculative greedy decoding (MTP, DFlash, n-gram, corrupted-oracle drafts) equals plain greedy."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from fxsched.runtime.torch_model.config import default_config  # noqa: E402
from fxsched.runtime.torch_model.drafters import ngram_propose  # noqa: E402
from fxsched.runtime.torch_model.engine import HybridEngine  # noqa: E402
from support.speculative import (  # noqa: E402
    DFlashProposer, MtpProposer, NgramProposer, speculative_generate)
from fxsched.runtime.bench.prompts import random_prompts  # noqa: E402

NUM_PROMPTS = 21  # a multiple of the batch of 3
MAX_TOKENS = 24
BATCH = 3


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engine() -> HybridEngine:
    return HybridEngine(default_config())


@pytest.fixture(scope="module")
def prompts(engine: HybridEngine) -> list[list[int]]:
    return random_prompts(seed=1234, count=NUM_PROMPTS, vocab_size=engine.cfg.vocab_size, max_len=40)


@pytest.fixture(scope="module")
def reference(engine: HybridEngine, prompts: list[list[int]]) -> list[list[int]]:
    return [engine.greedy_generate(p, MAX_TOKENS) for p in prompts]


class CorruptedOracle:
    """Drafts the true greedy continuation with random corruptions, to exercise every accept length."""

    def __init__(self, prompts: list[list[int]], reference: list[list[int]], k: int, seed: int) -> None:
        self.by_prompt = {tuple(p): r for p, r in zip(prompts, reference, strict=True)}
        self.k = k
        self.gen = torch.Generator().manual_seed(seed)
        self.prompt_len: dict[int, int] = {}

    def after_prefill(self, engine, slot, prompt_len):
        self.prompt_len[slot] = prompt_len

    def propose(self, engine, slots, pending):
        drafts = []
        for slot in slots:
            tokens = engine.tokens(slot)
            ref = self.by_prompt[tuple(tokens[:self.prompt_len[slot]])]
            done = len(tokens) - self.prompt_len[slot] + 1  # generated so far, pending included
            draft = list(ref[done:done + self.k - 1])
            for i in range(len(draft)):
                if float(torch.rand((), generator=self.gen)) < 0.2:
                    draft[i] = (draft[i] + 1) % engine.cfg.vocab_size
            drafts.append(draft)
        return drafts

    def after_commit(self, engine, slot, n_keep):
        pass


def _run_batched(engine, prompts, proposer):
    outputs, accepted = [], 0
    for i in range(0, len(prompts), BATCH):
        outs, stats = speculative_generate(engine, prompts[i:i + BATCH], MAX_TOKENS, proposer)
        outputs += outs
        accepted += stats.accepted_drafts
    return outputs, accepted


def test_reference_is_interesting(reference):
    assert len(reference) >= 20
    assert len({tok for out in reference for tok in out}) > 20
    assert len({tuple(out) for out in reference}) == len(reference)


@pytest.mark.parametrize("proposer", [MtpProposer(2), MtpProposer(3), MtpProposer(4), DFlashProposer(),
                                      NgramProposer(max_drafts=5)], ids=lambda p: repr(p))
def test_lossless_speculative_equals_greedy(engine, prompts, reference, proposer):
    outputs, _ = _run_batched(engine, prompts, proposer)
    for prompt, out, ref in zip(prompts, outputs, reference, strict=True):
        assert out == ref, f"prompt {prompt}"
    assert engine.num_free_blocks() == engine.cfg.num_blocks
    assert engine.free_slots() == list(range(engine.cfg.max_slots))


def test_lossless_ngram_accepts_some_drafts(engine, prompts, reference):
    outputs, accepted = _run_batched(engine, prompts, NgramProposer(max_drafts=5))
    assert outputs == reference
    assert accepted > 0


@pytest.mark.parametrize("k", [2, 4, 6])
def test_lossless_with_partially_correct_drafts(engine, prompts, reference, k):
    outputs, accepted = _run_batched(engine, prompts, CorruptedOracle(prompts, reference, k, seed=k))
    assert outputs == reference
    assert accepted > len(prompts)  # many multi-token accepts actually happened


def test_ngram_propose_takes_earliest_match_of_longest_suffix():
    #            0  1  2  3  4  5  6  7  8  9
    history = [1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3]
    # longest recurring suffix is [1, 2, 3] (length 3); earliest occurrence at 0, followed by 9, 1, ...
    assert ngram_propose(history, 3) == [9, 1, 2]
    assert ngram_propose([5, 6, 5, 6], 4) == [5, 6]  # suffix [5, 6] first seen at 0
    assert ngram_propose([1, 2, 3, 4], 3) == []
    assert ngram_propose([4, 4], 2, min_n=2) == []  # a suffix cannot match itself
    assert ngram_propose([1, 2, 1, 2, 1, 2], 2, min_n=2, max_n=3) == [1, 2]  # [2, 1, 2] first at 1
    # the longer suffix [9, 4, 5] (at 4) beats the earlier shorter match [4, 5] (at 1)
    assert ngram_propose([3, 4, 5, 8, 9, 4, 5, 6, 9, 4, 5], 2) == [6, 9]
    assert ngram_propose([1, 2, 1, 2], 0) == []


@pytest.mark.parametrize("pattern,mtp,gamma", [(("attn", "gdn", "gdn"), False, 3), (("attn", "attn"), True, 2),
                                               (("gdn", "gdn"), True, 0)])
def test_lossless_other_layer_patterns(pattern, mtp, gamma):
    cfg = dataclasses.replace(default_config(), num_layers=len(pattern), layer_pattern=pattern, mtp=mtp,
                              dflash_gamma=gamma, seed=3)
    engine = HybridEngine(cfg)
    prompts = random_prompts(seed=99, count=3, vocab_size=cfg.vocab_size, max_len=30)
    reference = [engine.greedy_generate(p, MAX_TOKENS) for p in prompts]
    proposers = [NgramProposer(max_drafts=3)] + ([MtpProposer(3)] if mtp else []) + \
        ([DFlashProposer()] if gamma else [])
    for proposer in proposers:
        assert speculative_generate(engine, prompts, MAX_TOKENS, proposer)[0] == reference
