"""The torch device's proposers (MTP, DFlash, a drafter override) and its scratch-slot work (beam
search, prompt logprobs)."""

from __future__ import annotations

from typing import Optional, Sequence as Seq

import structlog
import torch

from fxsched.core.events import LATE_DRAFT
from fxsched.runtime.devices.device import DeviceError
from fxsched.runtime.devices.torch_sampling import RowLogprobs, logprob_records

from fxsched.runtime.devices.torch_book import DeviceBook, DeviceSeq, DeviceStateError
from fxsched.runtime.torch_model.transfers import send_ints

log = structlog.get_logger("fxsched.torch_device")

DRAFT_CAPACITY = 8  # drafts a slot can take per step (the scheduler clamps its draft count to it)
MAX_BATCH_VERIFY_ROWS = 160
BEAM_MAX_TOKENS = 16
PROMPT_LOGPROBS_CHUNK = 512  # rows of one prompt-logprobs forward (all of them get logits)


class Proposers(DeviceBook):
    """Draft proposals and scratch-slot forwards."""

    def late_proposal(self, seqs: Seq[int], n: int) -> Optional[int]:
        """How many drafts each of ``seqs`` gets when a proposal of ``n`` answers late (a
        LATE_DRAFT each, specs/async.md §16.3); None when it answers with values: late drafts off,
        a drafter override (its drafts are host values), a grammar on any of them (it masks the
        verify's rows by the drafts, so it needs them now), or no proposer."""
        if not self.late_drafts or self.drafter is not None or self.proposer not in ("mtp", "dflash"):
            return None
        if self.grammars is not None and any(self.grammars.request_of(s) is not None for s in seqs):
            return None
        return n if self.proposer == "mtp" else min(n, self.cfg.dflash_gamma)

    def _propose(self, seqs: list[DeviceSeq], tokens: list[int], n: int, what: str) -> list[list[int]]:
        """n drafts per sequence after its anchor ``tokens[i]``. A late proposal (``late_proposal``)
        keeps its drafts on the device and answers LATE_DRAFT for each; the verify that consumes
        them reads them back, and a late proposal that fails answers late all the same: its
        failure is the fault of that verify (specs/async.md §16.3)."""
        for s in seqs:
            self._late.pop(s.seq_id, None)  # a new proposal replaces one never verified
        if self.drafter is not None:
            drafts = [list(self.drafter(self.engine.tokens(s.slot), int(t), n))[:n]
                      for s, t in zip(seqs, tokens, strict=True)]
            return self._proposed(seqs, drafts, what)
        slots = [s.slot for s in seqs]
        if self.proposer not in ("mtp", "dflash"):
            raise DeviceError(f"{what}: this device was set up without a draft proposer")
        if self.proposer == "dflash":
            for s in seqs:
                self._ctx_catch_up(s)
        late = self.late_proposal([s.seq_id for s in seqs], n)
        held: Optional[torch.Tensor] = None
        failure = ""
        try:
            with self._errors(what):
                held = (self.engine.mtp_drafts(slots, tokens, n) if self.proposer == "mtp"
                        else self.engine.dflash_drafts(slots, tokens)[:, :n])
        except DeviceError as err:
            if late is None:
                raise
            failure = err.message
        if late is None:
            assert held is not None
            return self._proposed(seqs, held.tolist(), what)
        for i, s in enumerate(seqs):
            self._late[s.seq_id] = failure if held is None else held[i]
        self._late_batch = None if held is None else (held, {s.seq_id: i for i, s in enumerate(seqs)})
        return self._proposed(seqs, [[LATE_DRAFT] * late] * len(seqs), what)

    def _proposed(self, seqs: list[DeviceSeq], drafts: list[list[int]], what: str) -> list[list[int]]:
        self.stats.calls[what] += 1
        self.stats.proposals += len(drafts)
        self.stats.drafts_proposed += sum(len(d) for d in drafts)
        return [[int(t) for t in d] for d in drafts]

    def _check_position(self, s: DeviceSeq, pos: int, what: str) -> None:
        have = self.engine.seq_len(s.slot)
        if pos != have:
            raise DeviceStateError(f"{what}: sequence {s.seq_id} proposes at position {pos} but holds {have} tokens")

    def run_mtp_propose_multi(self, token: int, pos: int, n: int, seq: int, stream: int, mask: bool) -> list[int]:
        s = self._seq(seq)
        self._settle(s, "run_mtp_propose_multi")
        self._check_position(s, pos, "run_mtp_propose_multi")
        with self.streams.use(stream):
            return self._propose([s], [int(token)], n, "run_mtp_propose_multi")[0]

    def run_mtp_propose_batched(self, tokens, positions, stash, n: int, seqs, stream: int) -> list[list[int]]:
        ds = [self._seq(i) for i in seqs]
        self._settle_many(ds, "run_mtp_propose_batched")
        for s, pos in zip(ds, positions, strict=True):
            self._check_position(s, pos, "run_mtp_propose_batched")
        if self.proposer == "mtp":
            owners, rows = self._stash
            for s, index in zip(ds, stash, strict=True):
                owner = owners[index] if 0 <= index < len(owners) else None
                if owner is None or rows is None:
                    raise DeviceError(f"stash entry {index} does not exist ({len(owners)} stashed rows)")
                if owner != s.seq_id:
                    raise DeviceStateError(f"run_mtp_propose_batched: stash entry {index} belongs to sequence "
                                           f"{owner}, not {s.seq_id}")
            if rows is not None:  # (None: no sequence)
                # the stashed rows as they lie when the proposal takes them all in order (the usual case)
                picked = list(stash)
                hiddens = rows if picked == list(range(rows.shape[0])) else rows.index_select(
                    0, send_ints([picked], rows.device)[0])
                self.engine.set_mtp_hiddens([s.slot for s in ds], hiddens)
        with self.streams.use(stream):
            return self._propose(ds, [int(t) for t in tokens], n, "run_mtp_propose_batched")

    def run_mtp_catchup_batched(self, tokens, slots, pos) -> int:
        """No separate catch-up forward: the internal MTP head keeps no KV (it is conditioned on one
        saved hidden row), and a checkpoint's MTP module (``hf_drafters.PublishedMtp``) brings its
        own KV up to the committed tokens inside each proposal, from the committed hidden rows."""
        log.debug("run_mtp_catchup_batched", rows=sum(len(t) for t in tokens))
        return 0

    def generate_beam_batch(self, prompts, num_beams) -> list[list[int]]:
        """Length-normalised beam search (up to BEAM_MAX_TOKENS tokens, stopping at EOS), each
        hypothesis scored by a fresh prefill in a scratch slot."""
        return [self._beam(list(p), int(b)) for p, b in zip(prompts, num_beams, strict=True)]

    def _scratch_logprobs(self, tokens: list[int]) -> torch.Tensor:
        free = self.engine.free_slots()
        if not free:
            raise DeviceError("generate_beam_batch: no free slot for a scratch sequence")
        slot = free[-1]
        self._make_room(-(-len(tokens) // self.cfg.block_size), "generate_beam_batch")
        with self._errors("generate_beam_batch"):
            self.engine.alloc(slot)
            try:
                logits = self.engine.prefill(slot, tokens)
            finally:
                self.engine.free(slot)
        self._count("prefill", "beam_prefill")
        return torch.log_softmax(logits.float(), -1)

    def prompt_logprobs(self, tokens: Seq[int], width: int) -> tuple[list[RowLogprobs], list[int]]:
        """The logprob record of each prompt token after the first (``tokens[i + 1]`` from the row
        of ``tokens[i]``, with the ``width`` largest entries): forwards over the prompt (chunks of
        ``PROMPT_LOGPROBS_CHUNK`` rows, each committed) in a scratch slot, freed before returning
        (the rows the scheduler's forwards never compute, specs/scheduler.md §5.11), and each token's rank (1: the most likely). Raises
        ``DeviceError`` when no slot or blocks are free."""
        tokens = [int(t) for t in tokens]
        if len(tokens) < 2:
            return [], []
        free = self.engine.free_slots()
        if not free:
            raise DeviceError("prompt_logprobs: no free slot for a scratch sequence")
        slot = free[-1]
        self._make_room(-(-len(tokens) // self.cfg.block_size), "prompt_logprobs")
        parts = []
        with self._errors("prompt_logprobs"):
            self.engine.alloc(slot)
            try:  # in chunks, each committed before the next: a chunk's rows bound the forward's memory
                for start in range(0, len(tokens) - 1, PROMPT_LOGPROBS_CHUNK):
                    chunk = tokens[start:start + PROMPT_LOGPROBS_CHUNK]
                    parts.append(self.engine.verify(slot, chunk).float())
                    self.engine.commit_accepted_prefix(slot, len(chunk))
            finally:
                self.engine.free(slot)
        self._count("prefill", "prompt_logprobs")
        rows = torch.cat(parts)[:len(tokens) - 1]
        chosen = torch.tensor(tokens[1:], dtype=torch.int64, device=rows.device)[:, None]
        ranks = ((rows > rows.gather(-1, chosen)).sum(dim=-1) + 1).tolist()
        return logprob_records(rows, tokens[1:], [width] * (len(tokens) - 1)), ranks

    def _beam(self, prompt: list[int], beams: int) -> list[int]:
        eos = self.cfg.eos_id
        limit = min(BEAM_MAX_TOKENS, self.cfg.max_seq_len - len(prompt))
        live: list[tuple[list[int], float]] = [([], 0.0)]
        done: list[tuple[list[int], float]] = []
        for _ in range(max(limit, 0)):
            candidates = []
            for hyp, score in live:
                logp = self._scratch_logprobs(prompt + hyp)
                top = torch.topk(logp, min(beams, logp.shape[-1]))
                candidates += [(hyp + [int(t)], score + float(v)) for v, t in zip(top.values, top.indices, strict=True)]
            candidates.sort(key=lambda c: -c[1])
            live = []
            for hyp, score in candidates[:beams]:
                (done if hyp[-1] == eos else live).append((hyp, score))
            if not live:
                break
        pool = done + live
        if not pool:
            return []
        return max(pool, key=lambda c: c[1] / len(c[0]))[0]

    def mtp_slot_draft_capacity(self, slot: int) -> int:
        return DRAFT_CAPACITY

    def can_batch_verify(self, ks) -> bool:
        return len(ks) <= self.cfg.max_slots and sum(ks) <= MAX_BATCH_VERIFY_ROWS
