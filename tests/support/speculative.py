"""Speculative greedy decoding written directly against HybridEngine (no scheduler): a second,
independent speculative engine that tests of the torch model compare with plain greedy decoding.

Each step verifies [pending token, drafts...] for every active sequence in one batched verify,
accepts the longest draft prefix that matches the target's greedy choices, commits
(accepted drafts + 1) rows via gdn_fold_accepted, and takes the target's choice after the last
accepted row as the next pending token. Invariant: the output equals HybridEngine.greedy_generate
token for token, whatever the proposer drafts (drafts only change how many steps it takes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from fxsched.runtime.torch_model.drafters import ngram_propose
from fxsched.runtime.torch_model.engine import HybridEngine


class Proposer(Protocol):
    """Draft source for speculative_generate."""

    def after_prefill(self, engine: HybridEngine, slot: int, prompt_len: int) -> None:
        """Update drafter state after the prompt of `slot` was prefilled."""

    def propose(self, engine: HybridEngine, slots: Sequence[int], pending: Sequence[int]) -> list[list[int]]:
        """Drafts per slot continuing its pending (not yet verified) token."""

    def after_commit(self, engine: HybridEngine, slot: int, n_keep: int) -> None:
        """Update drafter state after n_keep verify rows of `slot` were committed."""


@dataclass(frozen=True)
class MtpProposer:
    """MTP drafting with K verify rows (K - 1 drafts), conditioned on the last committed row's hidden."""

    k: int

    def after_prefill(self, engine: HybridEngine, slot: int, prompt_len: int) -> None:
        engine.save_hidden_for_mtp(slot, prompt_len - 1)

    def propose(self, engine: HybridEngine, slots: Sequence[int], pending: Sequence[int]) -> list[list[int]]:
        return engine.mtp_propose(slots, pending, self.k - 1)

    def after_commit(self, engine: HybridEngine, slot: int, n_keep: int) -> None:
        engine.save_hidden_for_mtp(slot, n_keep - 1)


@dataclass(frozen=True)
class DFlashProposer:
    """DFlash block drafting (gamma drafts, gamma + 1 verify rows); context extended on accept."""

    def after_prefill(self, engine: HybridEngine, slot: int, prompt_len: int) -> None:
        engine.commit_ctx(slot, prompt_len)

    def propose(self, engine: HybridEngine, slots: Sequence[int], pending: Sequence[int]) -> list[list[int]]:
        return engine.dflash_propose(slots, pending)

    def after_commit(self, engine: HybridEngine, slot: int, n_keep: int) -> None:
        engine.commit_ctx(slot, n_keep)


@dataclass(frozen=True)
class NgramProposer:
    """Prompt-lookup drafting over the committed tokens plus the pending one (suffix lengths min_n..max_n)."""

    max_drafts: int = 5
    min_n: int = 2
    max_n: int = 16

    def after_prefill(self, engine: HybridEngine, slot: int, prompt_len: int) -> None:
        pass

    def propose(self, engine: HybridEngine, slots: Sequence[int], pending: Sequence[int]) -> list[list[int]]:
        return [ngram_propose(engine.tokens(s) + [p], self.max_drafts, self.min_n, self.max_n)
                for s, p in zip(slots, pending, strict=True)]

    def after_commit(self, engine: HybridEngine, slot: int, n_keep: int) -> None:
        pass


@dataclass
class SpecStats:
    """Counters of one speculative_generate call."""

    steps: int = 0
    verified_rows: int = 0
    proposed_drafts: int = 0
    accepted_drafts: int = 0


def accept_greedy(drafts: Sequence[int], targets: Sequence[int]) -> int:
    """Number of leading drafts equal to the target's greedy choices (targets[i] follows row i)."""
    n = 0
    while n < len(drafts) and drafts[n] == targets[n]:
        n += 1
    return n


def speculative_generate(engine: HybridEngine, prompts: Sequence[Sequence[int]], max_tokens: int,
                         proposer: Proposer, adapter_id: int = 0) -> tuple[list[list[int]], SpecStats]:
    """Generate up to max_tokens per prompt, all prompts concurrently in free slots; returns
    (outputs, stats). Stops a sequence after eos_id or at max_seq_len, exactly like greedy_generate."""
    cfg, stats = engine.cfg, SpecStats()
    free = engine.free_slots()
    if len(free) < len(prompts):
        raise ValueError(f"{len(prompts)} prompts but only {len(free)} free slots")
    slots = free[:len(prompts)]
    outputs: list[list[int]] = [[] for _ in prompts]
    active: dict[int, int] = {}  # slot -> prompt index
    if max_tokens <= 0:
        return outputs, stats
    try:
        for i, (slot, prompt) in enumerate(zip(slots, prompts, strict=True)):
            engine.alloc(slot, adapter_id)
            outputs[i].append(int(engine.prefill(slot, prompt).argmax()))
            proposer.after_prefill(engine, slot, len(prompt))
            active[slot] = i
        active = {s: i for s, i in active.items() if not _finished(engine, s, outputs[i], max_tokens)}
        while active:
            order = list(active)
            pending = [outputs[active[s]][-1] for s in order]
            drafts = proposer.propose(engine, order, pending)
            rows = []
            for slot, token, draft in zip(order, pending, drafts, strict=True):
                out = outputs[active[slot]]
                budget = min(max_tokens - len(out), cfg.max_seq_len - engine.seq_len(slot)) - 1
                rows.append([token, *draft[:max(budget, 0)]])
            logits = engine.verify_batched(order, rows)
            keeps = []
            for slot, row, row_logits in zip(order, rows, logits, strict=True):
                targets = row_logits.argmax(-1).tolist()
                n_acc = accept_greedy(row[1:], targets)
                keeps.append(n_acc + 1)
                out = outputs[active[slot]]
                for token in targets[:n_acc + 1]:
                    out.append(token)
                    if token == cfg.eos_id:
                        break
                stats.proposed_drafts += len(row) - 1
                stats.accepted_drafts += n_acc
                stats.verified_rows += len(row)
            stats.steps += 1
            engine.gdn_fold_accepted(order, keeps)
            for slot, n_keep in zip(order, keeps, strict=True):
                proposer.after_commit(engine, slot, n_keep)
            active = {s: i for s, i in active.items() if not _finished(engine, s, outputs[i], max_tokens)}
    finally:
        for slot in slots:
            if engine.is_allocated(slot):
                engine.free(slot)
    return outputs, stats


def _finished(engine: HybridEngine, slot: int, out: list[int], max_tokens: int) -> bool:
    return len(out) >= max_tokens or out[-1] == engine.cfg.eos_id or engine.seq_len(slot) >= engine.cfg.max_seq_len
