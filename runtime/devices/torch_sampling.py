"""Batched sampling of logits rows in torch: the device-side pick (specs/scheduler.md §5.11).

``sample_rows(logits [N, V], picks, eos_ids)`` turns row r into a token by ``picks[r]`` (a
``HostPick``), with the same row-wise operations for every row, in this order:

1. ``mask_eos``: every EOS id of the row gets −∞.
2. Temperature 0: ``torch.argmax``, the **lowest** id among the maxima: the pick of the device's
   own greedy readback (``argmax_on_device`` / ``argmax_batch``, ``fxsched.kernels.row_argmax``),
   so a greedy row gives the same token whatever its batch-mates ask for.
3. Temperature T > 0: probabilities ``softmax((x − max) / T)``; **min-p** zeroes those below
   ``min_p`` × the largest; in the order of probability (descending, stable: the lower id
   first on ties), **top-k** keeps the first ``top_k`` (0: all); **top-p** keeps each entry whose
   preceding kept mass is below ``top_p`` × the kept total (1: all); then one uniform
   ``u ∈ [0, 1)``, the first draw of the SplitMix64 stream of the row's seed (``draws``), picks, walking the ids
   in order, the first whose float64 running sum exceeds ``u`` × the total (inverse CDF; zeroed
   entries are never picked). Only rows with top-k or top-p on are sorted, and the sort only
   decides which entries are cut, so skipping it changes no token.

Invariant: nothing crosses rows and every draw is a hash of its row's seed, so a row's token depends
only on its logits, its pick and the EOS ids, never on the batch, the row's position in it, or
the device the logits live on (the uniform is drawn on the CPU everywhere).

Rows a request's processors changed (penalties, ``logit_bias``: ``row_processors``) come as
``processed`` and are picked from instead of the raw rows (step 0, before the EOS mask).

Host inputs (specs/async.md §16.2): every per-row value a call needs (the rows of each kind, the
EOS ids, the filter columns, the uniforms) goes over in one packed non-blocking copy
(``transfers.send_values``), the rows are picked out of the batch with the index tensors of that
copy (``index_select`` / ``index_copy_``, never a Python list), and the tokens come back in one read,
with the logprob records of the rows that asked for them in the same read.

Logprobs follow vLLM's default: the model's raw distribution, ``log_softmax`` of the logits
before the EOS mask and the temperature. A row with ``top_logprobs = k > 0`` gets the chosen
token's logprob and the k largest entries (ties: the lower id first); other rows get ``None``.

The module needs torch; the recording and simulated devices keep the torch-free host path of
``fxsched.runtime.devices.sampling``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence as Seq

import numpy as np
import torch

from fxsched.effects.device_calls import HostPick
from fxsched.runtime.torch_model.transfers import Floats, send_ints, send_values

SEED_MASK = (1 << 64) - 1  # seeds are taken modulo 2**64


@dataclass(frozen=True)
class RowLogprobs:
    """The logprob record of one row: the chosen token's logprob and the top entries (id, logprob)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class SampledRows:
    """One token per row, and a logprob record for each row that asked for one (else None)."""

    tokens: list[int]
    logprobs: list[Optional[RowLogprobs]]


def draws(seeds: Seq[int], count: int) -> torch.Tensor:
    """Host float64 ``[len(seeds) * count]``, row-major: the first ``count`` draws of the SplitMix64
    stream of each seed (specs/scheduler.md §5.11). Counter-based, so every row's draws are one
    vectorised hash of (seed, k), with no generator to seed per row. Written in place and never
    read on the host, so they go over with a call's other inputs (``send_values``)."""
    state = np.array([seed & SEED_MASK for seed in seeds], dtype=np.uint64)[:, None]
    z = state + np.arange(1, count + 1, dtype=np.uint64)[None, :] * _GOLDEN  # uint64: wraps modulo 2**64
    z = (z ^ (z >> _S30)) * _MIX1
    z = (z ^ (z >> _S27)) * _MIX2
    z = z ^ (z >> _S31)
    return torch.from_numpy(((z >> _S11).astype(np.float64) * _ULP).reshape(-1))


_GOLDEN, _MIX1, _MIX2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S11, _S27, _S30, _S31 = np.uint64(11), np.uint64(27), np.uint64(30), np.uint64(31)
_ULP = 2.0 ** -53  # the top 53 bits as a float in [0, 1)


def uniform(seed: int) -> float:
    """The draw of a pick with this seed: the first of its SplitMix64 stream (``draws``)."""
    return float(draws([seed], 1)[0])


@dataclass(frozen=True)
class Filters:
    """The filter columns of M rows with temperature > 0, on the device: temperature and min-p
    ``[M, 1]`` (float32), the C rows (of the M) that top-k or top-p cut with their ``top_k``
    (int64, the vocabulary for 0) and ``top_p`` (float64) columns ``[C, 1]``; ``cuts`` = C, known
    on the host."""

    temperature: torch.Tensor
    min_p: torch.Tensor
    cut: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    cuts: int


def filter_fields(picks: Seq[HostPick], vocab: int) -> tuple[list[list[int]], list[list[float]]]:
    """The host lists of ``Filters`` for rows picked by ``picks``: ints (cut rows, top-k), floats
    (temperature, min-p, top-p), for ``send_values``."""
    cut = [i for i, p in enumerate(picks) if p.top_k > 0 or p.top_p < 1]
    top_k = [picks[i].top_k if picks[i].top_k > 0 else vocab for i in cut]
    return ([cut, top_k], [[p.temperature for p in picks], [p.min_p for p in picks], [picks[i].top_p for i in cut]])


def filters_from(ints: Seq[torch.Tensor], floats: Seq[torch.Tensor]) -> Filters:
    """``Filters`` of the device tensors ``filter_fields``' lists became (in its order)."""
    cut, top_k = ints
    temperature, min_p, top_p = floats
    return Filters(temperature.to(torch.float32)[:, None], min_p.to(torch.float32)[:, None], cut, top_k[:, None],
                   top_p[:, None], cut.shape[0])


def eos_fields(picks: Seq[HostPick], eos_ids: Seq[int], vocab: int) -> list[list[int]]:
    """[the rows whose EOS ids are masked, those ids] (both empty when nothing is masked)."""
    eos = [e for e in dict.fromkeys(eos_ids) if 0 <= e < vocab]
    masked = [r for r, p in enumerate(picks) if p.mask_eos]
    return [masked, eos] if eos and masked else [[], []]


def mask_eos(x: torch.Tensor, masked: torch.Tensor, eos: torch.Tensor) -> None:
    """Set ``x[r, e]`` to -inf for every row r of ``masked`` and id e of ``eos`` (device tensors)."""
    if masked.shape[0] and eos.shape[0]:
        x[masked[:, None], eos[None, :]] = -torch.inf


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of ``weights [M, V]`` (unnormalised, >= 0), the first id whose float64 running sum
    exceeds ``u [M, 1]`` times the row's total (zero weights are never picked)."""
    running = weights.to(torch.float64).cumsum(dim=-1)
    pos = torch.searchsorted(running, u * running[:, -1:], right=True).clamp_(max=weights.shape[1] - 1)
    return pos.squeeze(-1)


def filtered_probs(x: torch.Tensor, picks: Seq[HostPick], filters: Optional[Filters] = None) -> torch.Tensor:
    """The temperature-scaled softmax of rows ``x [M, V]`` (float32, EOS already masked), with the
    entries min-p, top-k and top-p cut set to 0 (not renormalised): what a pick draws from.
    ``filters``: the picks' columns already on the device (else they are sent in one copy)."""
    if filters is None:
        ints, floats = filter_fields(picks, x.shape[1])
        filters = filters_from(*send_values(ints, floats, x.device))
    probs = torch.softmax((x - x.max(dim=-1, keepdim=True).values) / filters.temperature, dim=-1)
    # the steps a row's settings make no-ops are skipped as a whole when every row's are (the host
    # knows the picks): no min-p (nothing is below 0), no top-k (every rank is in), every row cut
    if any(p.min_p > 0 for p in picks):
        probs = torch.where(probs < filters.min_p * probs.max(dim=-1, keepdim=True).values, 0.0, probs)
    top_k = any(p.top_k > 0 for p in picks)
    if filters.cuts == len(picks):
        probs = _top_k_top_p(probs, filters, top_k)
    elif filters.cuts:
        probs.index_copy_(0, filters.cut, _top_k_top_p(probs.index_select(0, filters.cut), filters, top_k))
    return probs


def _top_k_top_p(probs: torch.Tensor, filters: Filters, top_k: bool = True) -> torch.Tensor:
    """``probs [C, V]`` with the entries top-k and top-p cut set to 0 (order: stable descending);
    ``top_k`` False: no row has a top-k (every rank is in)."""
    vocab = probs.shape[1]
    ranked, order = probs.sort(dim=-1, descending=True, stable=True)
    if top_k:
        in_k = torch.arange(vocab, device=probs.device)[None, :] < filters.top_k
        mass = torch.where(in_k, ranked, 0.0).to(torch.float64)
    else:
        mass = ranked.to(torch.float64)
    running = mass.cumsum(dim=-1)
    top_p = filters.top_p
    keep = (running - mass < top_p * running[:, -1:]) | (top_p >= 1)
    if top_k:
        keep &= in_k
    kept = torch.zeros_like(keep).scatter_(-1, order, keep)
    return torch.where(kept, probs, 0.0)


def records_read(raw: torch.Tensor, chosen: torch.Tensor, widths: Seq[int],
                 first: Optional[torch.Tensor] = None) -> tuple[list[float], list[RowLogprobs]]:
    """One read of ``first`` (if any, as float64) and the logprob records of rows ``raw [M, V]``
    (log-softmaxed) for their ``chosen [M]`` tokens with ``widths[m]`` top entries: (``first``'s
    values, the records). Ids and tokens travel as float64, exact below 2**53."""
    width = min(max(widths), raw.shape[1])
    values, ids = raw.sort(dim=-1, descending=True, stable=True)
    picked = raw.gather(-1, chosen[:, None]).squeeze(-1)
    parts = [chosen, picked, values[:, :width].reshape(-1), ids[:, :width].reshape(-1)]
    if first is not None:
        parts.insert(0, first)
    read = torch.cat([p.to(torch.float64) for p in parts]).tolist()
    head, at = (read[:first.shape[0]], first.shape[0]) if first is not None else ([], 0)
    m = raw.shape[0]
    tokens, logps, tops = read[at:at + m], read[at + m:at + 2 * m], read[at + 2 * m:]
    records = []
    for i, k in enumerate(widths):
        top_values = tops[i * width:i * width + k]
        top_ids = tops[(m + i) * width:(m + i) * width + k]
        records.append(RowLogprobs(int(tokens[i]), logps[i], tuple(zip(map(int, top_ids), top_values, strict=True))))
    return head, records


def picked_tokens(logits: torch.Tensor, picks: Seq[HostPick], eos_ids: Seq[int],
                  processed: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``sample_rows``' tokens, left on the device (int64 ``[N]``, nothing read back): what a decode
    answered ahead keeps (specs/async.md §16.6). No row may ask for logprob records."""
    if any(p.top_logprobs > 0 for p in picks):
        raise ValueError("picked_tokens: a row asks for logprob records, which need a read")
    return _picks(logits, picks, eos_ids, processed)[0]


def sample_rows(logits: torch.Tensor, picks: Seq[HostPick], eos_ids: Seq[int],
                processed: Optional[torch.Tensor] = None) -> SampledRows:
    """One token per row of ``logits [N, V]`` by ``picks[r]``, batched (see the module docstring).
    ``processed`` (``[N, V]``, float32): the rows after per-request processing
    (``row_processors``), which the picks draw from; the logprob records stay ``logits``'."""
    tokens, raw, asked, asked_t = _picks(logits, picks, eos_ids, processed)
    if raw is None:
        return SampledRows(tokens.tolist(), [None] * len(picks))
    read, asked_records = records_read(raw, tokens.index_select(0, asked_t), [picks[r].top_logprobs for r in asked],
                                       first=tokens)
    records: list[Optional[RowLogprobs]] = [None] * len(picks)
    for r, record in zip(asked, asked_records, strict=True):
        records[r] = record
    return SampledRows([int(t) for t in read], records)


def _picks(logits: torch.Tensor, picks: Seq[HostPick], eos_ids: Seq[int], processed: Optional[torch.Tensor]
           ) -> tuple[torch.Tensor, Optional[torch.Tensor], list[int], torch.Tensor]:
    """(the tokens on the device, the raw log-softmax of the rows asking for records or None, those
    rows, their index on the device): the picks of ``sample_rows`` before anything is read."""
    if logits.dim() != 2 or logits.shape[0] != len(picks):
        raise ValueError(f"sample_rows: logits of shape {tuple(logits.shape)} for {len(picks)} picks")
    vocab = logits.shape[1]
    asked = [r for r, p in enumerate(picks) if p.top_logprobs > 0]
    hot = [r for r, p in enumerate(picks) if p.temperature > 0]
    hot_picks = [picks[r] for r in hot]
    f_ints, f_floats = filter_fields(hot_picks, vocab)
    u: Floats = draws([p.seed for p in hot_picks], 1)
    (asked_t, masked_t, eos_t, hot_t, *f_int_t), (*f_float_t, u_t) = send_values(
        [asked, *eos_fields(picks, eos_ids, vocab), hot, *f_ints], [*f_floats, u], logits.device)
    masking = bool(masked_t.shape[0] and eos_t.shape[0])  # only EOS masking writes into x
    x = logits.to(torch.float32, copy=masking)
    raw = torch.log_softmax(x.index_select(0, asked_t), dim=-1) if asked else None
    if processed is not None:
        x = processed.to(torch.float32, copy=masking)
    mask_eos(x, masked_t, eos_t)
    if len(hot) == len(picks):  # every row draws: no argmax, no rows picked out
        return inverse_cdf(filtered_probs(x, hot_picks, filters_from(f_int_t, f_float_t)), u_t[:, None]), raw, asked, \
            asked_t
    tokens = torch.argmax(x, dim=-1)
    if hot:
        probs = filtered_probs(x.index_select(0, hot_t), hot_picks, filters_from(f_int_t, f_float_t))
        tokens.index_copy_(0, hot_t, inverse_cdf(probs, u_t[:, None]))
    return tokens, raw, asked, asked_t


def logprob_records(logits: torch.Tensor, tokens: Seq[int], widths: Seq[int],
                    rows: Optional[Seq[int]] = None) -> list[RowLogprobs]:
    """The logprob record of each row of ``logits [M, V]`` (or of its rows ``rows``, in that order)
    for its chosen ``tokens[m]`` with the ``widths[m]`` largest entries (ties: the lower id first):
    the raw ``log_softmax``, as ``sample_rows`` gives them. One packed copy in, one read out."""
    if not tokens:
        return []
    chosen, at = send_ints([list(tokens), [] if rows is None else list(rows)], logits.device)
    picked = logits if rows is None else logits.index_select(0, at)
    return records_read(torch.log_softmax(picked.to(torch.float32), dim=-1), chosen, widths)[1]
