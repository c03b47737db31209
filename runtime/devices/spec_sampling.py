"""Rejection-sampling verification of speculative drafts, batched in torch (specs/speculation.md
§6.16).

``verify_sample(logits [R, V], inputs, picks, eos_ids, q=None)`` answers a verify whose rows are
``inputs`` (one list per sequence, sequence-major: the anchor then the drafts, ``K_b`` rows each,
``sum K_b = R``) with one token per row, as a greedy verify answers its argmax rows, so that the
scheduler's ``accepted_prefix(drafts, rows)`` is the number of drafts accepted and
``rows[accepted]`` the token that follows them. Row ``r`` is picked by ``picks[r]`` (a
``HostPick``: temperature, filters, EOS mask, ``seed`` = the request's seed + the output position
the row fills):

* the rows a request's processors change (``row_processors``: penalties, ``logit_bias``) are
  taken processed, for every rule below: ``p`` is the processed distribution;
* temperature 0: the argmax of the (EOS-masked) logits, the greedy verify's row: a draft is
  accepted exactly when it is the argmax, whatever the batch-mates ask for;
* temperature T > 0: ``p`` is the filtered distribution a non-speculative pick draws from
  (``torch_sampling.filtered_probs``: temperature, min-p, top-k, top-p, vLLM V1's order). A row
  with a draft ``d`` (every row but the sequence's last) accepts it when ``u_acc * q(d) < p(d)``,
  i.e. with probability ``min(1, p(d) / q(d))``, and then answers ``d``; otherwise it answers a
  draw from the residual ``max(0, p - q)`` normalised, which has no mass at ``d`` (so the
  rejected draft never equals its row). The last row of a sequence (every draft accepted) answers
  a draw from ``p`` (the bonus token). ``q`` is the drafter's distribution at the draft's row
  (``[R, V]``, rows without a draft ignored); ``None`` means a deterministic drafter (MTP and
  DFlash argmax drafts, n-gram lookups): ``q`` one-hot at the draft, so the test is ``u_acc <
  p(d)`` and the residual is ``p`` without ``d``.

The uniforms are counter-based: row ``r`` draws ``(u_draw, u_acc)``, the first two float64 of a
CPU generator seeded with ``picks[r].seed``, so a row's answer depends on its logits, its draft,
its pick and the EOS ids alone, never on the batch, its position in it or the device. ``u_draw``
is the uniform a non-speculative pick with the same seed draws (``torch_sampling.uniform``).

Invariant (tested against exact distributions): for a draft distributed as ``q``, the token a
row contributes (the draft when accepted, else the residual draw) is distributed exactly as
``p``; chaining rows up to the first rejection keeps the target's joint distribution of the
output (Leviathan et al. 2023, Chen et al. 2023).
"""

from __future__ import annotations

from typing import Optional, Sequence as Seq

import torch

from fxsched.effects.device_calls import HostPick
from fxsched.runtime.devices.torch_sampling import (RowLogprobs, draws, eos_fields, filter_fields, filtered_probs,
                                                    filters_from, inverse_cdf, mask_eos, records_read)
from fxsched.runtime.torch_model.transfers import send_values


def uniforms(seed: int) -> tuple[float, float]:
    """``(u_draw, u_acc)`` of a row with this seed: the first two draws of its stream (``draws``)."""
    pair = draws([seed], 2).tolist()
    return pair[0], pair[1]


def accept_test(p_draft: torch.Tensor, q_draft: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Whether each draft is kept: ``u < p(d) / q(d)`` (probability ``min(1, p / q)``), written
    without the division. A module-level function so a test can swap in a wrong rule."""
    return u * q_draft < p_draft


def accepted_counts(inputs: Seq[Seq[int]], rows: Seq[int]) -> list[int]:
    """Per sequence, the leading drafts equal to their rows (the scheduler's ``accepted_prefix``)."""
    counts, offset = [], 0
    for toks in inputs:
        n = 0
        while n < len(toks) - 1 and toks[n + 1] == rows[offset + n]:
            n += 1
        counts.append(n)
        offset += len(toks)
    return counts


def verify_sample(logits: torch.Tensor, inputs: Seq[Seq[int]], picks: Seq[HostPick], eos_ids: Seq[int],
                  q: Optional[torch.Tensor] = None, processed: Optional[torch.Tensor] = None
                  ) -> tuple[list[int], list[int]]:
    """The rows of a sampled verify and the drafts each sequence accepted (see the module docstring).
    ``processed``: the rows after per-request processing (penalties, ``logit_bias``), the target
    distribution the test keeps (None: the raw rows)."""
    rows, accepted, _ = verify_sample_records(logits, inputs, picks, eos_ids, q, processed)
    return rows, accepted


def verify_sample_records(logits: torch.Tensor, inputs: Seq[Seq[int]], picks: Seq[HostPick], eos_ids: Seq[int],
                          q: Optional[torch.Tensor] = None, processed: Optional[torch.Tensor] = None,
                          record_rows: Seq[int] = ()) -> tuple[list[int], list[int], list[RowLogprobs]]:
    """``verify_sample``'s rows and accepted drafts, and the logprob records of rows ``record_rows``
    (the raw ``log_softmax`` of ``logits``, ``picks[r].top_logprobs`` entries, for the row's answer).
    The rows' host inputs (EOS rows and ids, the hot rows, their drafts, filters and uniforms, the
    record rows) go over in one packed copy; the rows and the records come back in one read
    (specs/async.md §16.2)."""
    total_rows = sum(len(t) for t in inputs)
    if logits.dim() != 2 or logits.shape[0] != total_rows or len(picks) != total_rows:
        raise ValueError(f"verify_sample: logits of shape {tuple(logits.shape)} for {total_rows} verify rows "
                         f"and {len(picks)} picks")
    vocab = logits.shape[1]
    drafts: list[int] = []
    for toks in inputs:
        drafts.extend(int(t) for t in toks[1:])
        drafts.append(-1)  # the last row has no draft
    hot = [r for r, p in enumerate(picks) if p.temperature > 0]
    hot_picks = [picks[r] for r in hot]
    f_ints, f_floats = filter_fields(hot_picks, vocab)
    (masked_t, eos_t, hot_t, d, record_t, *f_int_t), (*f_float_t, pairs) = send_values(
        [*eos_fields(picks, eos_ids, vocab), hot, [drafts[r] for r in hot], list(record_rows), *f_ints],
        [*f_floats, draws([p.seed for p in hot_picks], 2)], logits.device)
    x = (logits if processed is None else processed).to(torch.float32, copy=True)
    mask_eos(x, masked_t, eos_t)
    tokens = torch.argmax(x, dim=-1)
    if hot:
        probs = filtered_probs(x.index_select(0, hot_t), hot_picks, filters_from(f_int_t, f_float_t)).to(torch.float64)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        u = pairs.view(-1, 2)
        u_draw, u_acc = u[:, :1], u[:, 1]
        has = d >= 0
        at = d.clamp(min=0)[:, None]
        p_d = probs.gather(-1, at).squeeze(-1)
        if q is None:
            q_d = torch.ones_like(p_d)
            residual = probs.scatter(-1, at, torch.where(has[:, None], 0.0, probs.gather(-1, at)))
        else:
            qh = q.index_select(0, hot_t).to(torch.float64)
            q_d = qh.gather(-1, at).squeeze(-1)
            residual = torch.where(has[:, None], (probs - qh).clamp(min=0.0), probs)
        keep = has & accept_test(p_d, q_d, u_acc)
        empty = residual.sum(dim=-1) <= 0  # p(d) = 1 up to rounding: the draft is the only choice
        drawn = inverse_cdf(residual, u_draw)
        tokens.index_copy_(0, hot_t, torch.where(keep | (empty & has), d, drawn))
    if not record_rows:
        answer = tokens.tolist()
        return answer, accepted_counts(inputs, answer), []
    raw = torch.log_softmax(logits.index_select(0, record_t).to(torch.float32), dim=-1)
    read, records = records_read(raw, tokens.index_select(0, record_t), [picks[r].top_logprobs for r in record_rows],
                                 first=tokens)
    answer = [int(t) for t in read]
    return answer, accepted_counts(inputs, answer), records
