"""Late drafts (specs/async.md §16.3): a proposal may answer ``LATE_DRAFT`` for drafts the device
keeps, so the verify that consumes them needs no read-back of its own; their values arrive with
that verify's ``VerifyRows.inputs``, and ``resolved`` puts them into the waiting record before its
rule runs. Every verify that can consume proposed drafts parks one of four records, and each says
where its drafts sit among the verify's inputs:

* ``AwaitKVerify``: inputs ``[L] + drafts[:k - 1]`` (drafts past ``k - 1`` are never used);
* ``AwaitDflashVerify``: inputs ``[L] + drafts``;
* ``AwaitMtpBatch`` and ``AwaitBatchedDflash``: one such run per sequence, ``ks[i]`` (or ``k``)
  inputs each, the sequence's drafts after its anchor.

Any other record never waits on late drafts (n-gram drafts are the scheduler's own): inputs sent
to it are a protocol error, as are inputs whose length does not match the query.
"""

from __future__ import annotations

from typing import Any

from fxsched.core.agenda import PhaseError
from fxsched.core.events import LATE_DRAFT
from fxsched.core.phases import AwaitBatchedDflash, AwaitDflashVerify, AwaitKVerify, AwaitMtpBatch


def _filled(drafts: tuple[int, ...], run: tuple[int, ...], what: Any) -> tuple[int, ...]:
    """``drafts`` with each late one replaced by its input (``run`` is ``[anchor] + used drafts``)."""
    used = run[1:]
    if len(used) > len(drafts):
        raise PhaseError(f"{type(what).__name__}: the verify ran {len(used)} drafts, {len(drafts)} were held")
    for held, ran in zip(drafts, used, strict=False):
        if held != LATE_DRAFT and held != ran:
            raise PhaseError(f"{type(what).__name__}: draft {held} held, the verify ran {ran}")
    return used + drafts[len(used):]


def _runs(inputs: tuple[int, ...], ks: tuple[int, ...], what: Any) -> list[tuple[int, ...]]:
    if sum(ks) != len(inputs):
        raise PhaseError(f"{type(what).__name__}: {len(inputs)} verify inputs for runs of {list(ks)}")
    runs, at = [], 0
    for k in ks:
        runs.append(inputs[at:at + k])
        at += k
    return runs


def resolved(waiting: Any, inputs: tuple[int, ...]) -> Any:
    """``waiting`` with its drafts taken from the verify's ``inputs``."""
    cls = type(waiting)
    if cls is AwaitKVerify:
        (run,) = _runs(inputs, (min(waiting.k, len(waiting.drafts) + 1),), waiting)
        return AwaitKVerify(waiting.seq_id, _filled(waiting.drafts, run, waiting), waiting.k, waiting.propose_n,
                            waiting.pre_len, waiting.dflash)
    if cls is AwaitDflashVerify:
        (run,) = _runs(inputs, (len(waiting.drafts) + 1,), waiting)
        return AwaitDflashVerify(waiting.seq_id, _filled(waiting.drafts, run, waiting), waiting.pre_len,
                                 waiting.draft_count)
    if cls is AwaitMtpBatch:
        runs = _runs(inputs, waiting.ks, waiting)
        drafts = tuple(_filled(d, r, waiting) for d, r in zip(waiting.drafts, runs, strict=True))
        return AwaitMtpBatch(waiting.seq_ids, waiting.ks, drafts, waiting.pre_lens, waiting.draft_count)
    if cls is AwaitBatchedDflash:
        runs = _runs(inputs, (waiting.k,) * len(waiting.seq_ids), waiting)
        drafts = tuple(_filled(d, r, waiting) for d, r in zip(waiting.drafts, runs, strict=True))
        return AwaitBatchedDflash(waiting.seq_ids, drafts, waiting.pre_lens, waiting.k, waiting.draft_count)
    raise PhaseError(f"{cls.__name__} takes no late drafts, but its verify answered inputs")
