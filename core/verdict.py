"""Pure pieces of every verify: the accepted prefix and the draft count (specs/speculation.md §6.2, §6.7)."""

from __future__ import annotations

from typing import Sequence as Seq

from fxsched.core.config import ModelInfo, SchedulerConfig

MTP_LADDER_WIDTH = 8


def accepted_prefix(drafts: Seq[int], rows: Seq[int]) -> int:
    """Number of leading drafts equal to the verify row at the same index.

    Row ``i`` is the model's answer after input ``i`` (the anchor is input 0), so draft ``i`` (input
    ``i + 1``) is accepted when it equals row ``i``. Never more than ``len(rows) - 1`` (the last row
    is the bonus token).
    """
    limit = min(len(drafts), len(rows) - 1)
    n = 0
    while n < limit and drafts[n] == rows[n]:
        n += 1
    return n


def base_draft_count(config: SchedulerConfig, model: ModelInfo, active_count: int) -> int:
    """The step's draft count before the capacity clamp.

    DFlash: ``num_drafts``. MTP: 3 while at most 8 sequences are active, else 1, clamped to
    ``[1, num_drafts]``.
    """
    if config.dflash:
        return config.num_drafts
    ladder = 3 if active_count <= MTP_LADDER_WIDTH else 1
    return max(1, min(ladder, config.num_drafts))


def verify_width(draft_count: int, keep: int) -> int:
    """Rows of a serial MTP verify (anchor + drafts): 4, 3 or 2 (specs/speculation.md §6.5)."""
    if draft_count >= 3 and keep >= 3:
        return 4
    if draft_count >= 2 and keep >= 2:
        return 3
    return 2


def acc_gain(seq_len_before: int, seq_len_after: int) -> int:
    """Accepted drafts a step added: the KV kept them plus the anchor."""
    return max(seq_len_after - seq_len_before - 1, 0)
