"""An oracle drafter for tests of the torch device: it drafts the known greedy continuation."""

from __future__ import annotations

from typing import Sequence as Seq

import torch


class OracleDrafter:
    """Drafts the known greedy continuation (from a reference run), corrupting each draft with
    probability ``noise``: exercises every acceptance length through the real verifies."""

    def __init__(self, prompts: Seq[Seq[int]], outputs: Seq[Seq[int]], vocab: int, noise: float = 0.2,
                 seed: int = 0) -> None:
        self.reference = [(list(p), list(o)) for p, o in zip(prompts, outputs, strict=True)]
        self.vocab = vocab
        self.noise = noise
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, tokens: list[int], last: int, n: int) -> list[int]:
        for prompt, out in self.reference:
            full = prompt + out
            if len(tokens) < len(full) and full[:len(tokens)] == tokens and full[len(tokens)] == last:
                draft = full[len(tokens) + 1:len(tokens) + 1 + n]
                break
        else:
            draft = []
        draft = draft + [0] * (n - len(draft))
        for i in range(len(draft)):
            if float(torch.rand((), generator=self.gen)) < self.noise:
                draft[i] = (draft[i] + 1) % self.vocab
        return draft
