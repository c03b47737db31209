"""HybridEngine's drafter calls: MTP proposals (the internal head's saved conditioning hidden, or a
checkpoint's MTP module reading the committed tokens and hidden rows) and DFlash proposals with
their per-slot context (engine.py's module docstring says which drafter is which).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .drafters import DFlashDrafter
from .engine_slots import SlotTable
from .errors import SlotError
from .hf_drafters import PublishedDFlash, PublishedMtp
from .transfers import send_ints


class Drafting(SlotTable):
    """The MTP and DFlash calls of ``HybridEngine`` (which provides the rest)."""

    # ---- drafters -----------------------------------------------------------------------------
    def save_hidden_for_mtp(self, slot: int, row: int) -> None:
        """Keep hidden row `row` (Python indexing) of the slot's last forward as the MTP conditioning."""
        hidden = self.captured_hidden(slot)
        if not -hidden.shape[0] <= row < hidden.shape[0]:
            raise ValueError(f"slot {slot}: row {row} outside the last forward's {hidden.shape[0]} rows")
        self.set_mtp_hidden(slot, hidden[row])

    def has_mtp_hidden(self, slot: int) -> bool:
        """Whether an MTP conditioning hidden state is saved for `slot`."""
        self._slot(slot)
        return self._mtp_hidden_set[slot]

    def set_mtp_hidden(self, slot: int, hidden: torch.Tensor) -> None:
        """Set the MTP conditioning hidden [D] of `slot` directly (used by restore)."""
        self._slot(slot)
        self.mtp_hidden[slot] = hidden
        self._mtp_hidden_set[slot] = True

    def set_mtp_hiddens(self, slots: Sequence[int], hiddens: Sequence[torch.Tensor] | torch.Tensor) -> None:
        """``set_mtp_hidden`` of each (slot, hidden [D]), in one write (``hiddens``: the rows, or one
        tensor [N, D] of them)."""
        if len(slots) != len(hiddens):
            raise ValueError(f"{len(slots)} slots but {len(hiddens)} hidden rows")
        if len(slots) == 1:
            self.set_mtp_hidden(slots[0], hiddens[0])
            return
        if len(set(slots)) != len(slots):
            raise SlotError(f"duplicate slots in one write: {list(slots)}")
        for slot in slots:
            self._slot(slot)
        rows = hiddens if isinstance(hiddens, torch.Tensor) else torch.stack(list(hiddens))
        self.mtp_hidden.index_copy_(0, send_ints([list(slots)], self.device)[0], rows.to(self.mtp_hidden.dtype))
        for slot in slots:
            self._mtp_hidden_set[slot] = True

    def mtp_propose(self, slots: Sequence[int], last_tokens: Sequence[int], num_drafts: int) -> list[list[int]]:
        """`mtp_drafts`, read back."""
        return self.mtp_drafts(slots, last_tokens, num_drafts).tolist()

    @torch.no_grad()
    def mtp_drafts(self, slots: Sequence[int], last_tokens: Sequence[int], num_drafts: int) -> torch.Tensor:
        """num_drafts greedy MTP drafts per slot [B, num_drafts] on the device, continuing
        last_tokens[i] (the token after the slot's committed ones). The internal head reads the saved
        hidden (save_hidden_for_mtp); a checkpoint's MTP module reads the committed tokens and hidden
        rows, catching its own KV up first."""
        if self.mtp is None:
            raise SlotError("this model has no MTP head (config mtp = false, mtp_layers = 0)")
        if len(slots) != len(last_tokens):
            raise ValueError(f"{len(slots)} slots but {len(last_tokens)} last tokens")
        states = [self._slot(slot) for slot in slots]
        if isinstance(self.mtp, PublishedMtp):
            for slot, state in zip(slots, states, strict=True):
                if not state.seq_len:
                    raise SlotError(f"slot {slot}: MTP proposals need a prefilled sequence")
            return self.mtp.propose(slots, [s.tokens for s in states], self.hidden_history,
                                    [int(t) for t in last_tokens], num_drafts)
        for slot in slots:
            if not self._mtp_hidden_set[slot]:
                raise SlotError(f"slot {slot}: no hidden saved for MTP (call save_hidden_for_mtp)")
        index, toks = send_ints([slots, [int(t) for t in last_tokens]], self.device)
        return self.mtp.propose(self.mtp_hidden.index_select(0, index), toks, num_drafts)

    def dflash_propose(self, slots: Sequence[int], last_tokens: Sequence[int]) -> list[list[int]]:
        """`dflash_drafts`, read back."""
        return self.dflash_drafts(slots, last_tokens).tolist()

    @torch.no_grad()
    def dflash_drafts(self, slots: Sequence[int], last_tokens: Sequence[int]) -> torch.Tensor:
        """dflash_gamma drafts per slot [B, gamma] on the device, from one block forward over
        [last token, MASK x gamma]."""
        drafter = self._require_dflash()
        for slot in slots:
            self._slot(slot)
        return drafter.propose(slots, [int(t) for t in last_tokens], self.device)

    @torch.no_grad()
    def commit_ctx(self, slot: int, n: int) -> None:
        """Extend the DFlash context of `slot` with the first n rows of its last forward (hidden rows
        for the internal drafter, context features for a checkpoint's drafter)."""
        self.commit_ctx_many([slot], [n])

    @torch.no_grad()
    def commit_ctx_many(self, slots: Sequence[int], counts: Sequence[int]) -> None:
        """`commit_ctx` of several slots (distinct) in one context append: one projection for all."""
        drafter = self._require_dflash()
        parts = []
        for slot, n in zip(slots, counts, strict=True):
            rows = self.captured_hidden(slot)
            if isinstance(drafter, PublishedDFlash):
                features = self._captured_features[slot]
                assert features is not None  # every forward of an engine with this drafter records them
                rows = features.rows()
            if not 0 <= n <= rows.shape[0]:
                raise ValueError(f"slot {slot}: cannot commit {n} of {rows.shape[0]} captured rows")
            parts.append(rows[:n])
        if parts:
            drafter.append_many(slots, counts, parts[0] if len(parts) == 1 else torch.cat(parts))

    @torch.no_grad()
    def ctx_extend(self, slot: int, upto: int) -> None:
        """Extend the DFlash context of `slot` over committed positions [ctx_len, upto) (their hidden
        rows, or context features for a checkpoint's drafter)."""
        self.ctx_extend_many([slot], [upto])

    @torch.no_grad()
    def ctx_extend_many(self, slots: Sequence[int], uptos: Sequence[int]) -> None:
        """`ctx_extend` of several slots (distinct) in one context append: the committed rows of every
        slot gathered from the history in one indexed read, projected once."""
        drafter = self._require_dflash()
        counts = []
        for slot, upto in zip(slots, uptos, strict=True):
            state = self._slot(slot)
            start = drafter.ctx_len[slot]
            if not start <= upto <= state.seq_len:
                raise ValueError(f"slot {slot}: cannot extend a DFlash context of {start} rows to {upto} "
                                 f"({state.seq_len} committed)")
            counts.append(upto - start)
        history = self.dflash_features if isinstance(drafter, PublishedDFlash) else self.hidden_history
        assert history is not None
        index = drafter.new_rows(slots, counts, self.device)
        drafter.append_many(slots, counts, history[index], index)

    def trim_proposer_state(self, slot: int, n_drop: int) -> None:
        """Drop the last n_drop rows of the DFlash context of `slot`."""
        self._slot(slot)
        self._require_dflash().trim(slot, n_drop)

    def ctx_len(self, slot: int) -> int:
        """Rows in the DFlash context of `slot`."""
        self._slot(slot)
        return self._require_dflash().ctx_len[slot]

    def _require_dflash(self) -> DFlashDrafter | PublishedDFlash:
        if self.dflash is None:
            raise SlotError("this model has no DFlash drafter (config dflash_gamma = 0, no draft model)")
        return self.dflash
