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
   ``u ∈ [0, 1)`` from a CPU ``torch.Generator`` seeded with the row's seed picks, walking the ids
   in order, the first whose float64 running sum exceeds ``u`` × the total (inverse CDF; zeroed
   entries are never picked). Only rows with top-k or top-p on are sorted, and the sort only
   decides which entries are cut, so skipping it changes no token.

Invariant: nothing crosses rows and every draw has its own generator, so a row's token depends
only on its logits, its pick and the EOS ids, never on the batch, the row's position in it, or
the device the logits live on (the uniform is drawn on the CPU everywhere).

Rows a request's processors changed (penalties, ``logit_bias``: ``row_processors``) come as
``processed`` and are picked from instead of the raw rows (step 0, before the EOS mask).

Logprobs follow vLLM's default: the model's raw distribution, ``log_softmax`` of the logits
before the EOS mask and the temperature. A row with ``top_logprobs = k > 0`` gets the chosen
token's logprob and the k largest entries (ties: the lower id first); other rows get ``None``.

The module needs torch; the recording and simulated devices keep the torch-free host path of
``fxsched.runtime.devices.sampling``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence as Seq

import torch

from fxsched.effects.device_calls import HostPick

SEED_MASK = (1 << 64) - 1  # torch.Generator.manual_seed takes seeds modulo 2**64


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


def uniform(seed: int) -> float:
    """The draw of a pick with this seed: the first float64 of a CPU generator seeded with it."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed & SEED_MASK)
    return float(torch.rand((), generator=gen, dtype=torch.float64))


def _column(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)[:, None]


def _draw(x: torch.Tensor, picks: Seq[HostPick]) -> torch.Tensor:
    """Tokens ``[M]`` for rows ``x [M, V]`` (float32, EOS already masked) with temperature > 0."""
    probs = filtered_probs(x, picks)
    u = _column([uniform(p.seed) for p in picks], torch.float64, x.device)
    return inverse_cdf(probs, u)


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of ``weights [M, V]`` (unnormalised, >= 0), the first id whose float64 running sum
    exceeds ``u [M, 1]`` times the row's total (zero weights are never picked)."""
    running = weights.to(torch.float64).cumsum(dim=-1)
    pos = torch.searchsorted(running, u * running[:, -1:], right=True).clamp_(max=weights.shape[1] - 1)
    return pos.squeeze(-1)


def filtered_probs(x: torch.Tensor, picks: Seq[HostPick]) -> torch.Tensor:
    """The temperature-scaled softmax of rows ``x [M, V]`` (float32, EOS already masked), with the
    entries min-p, top-k and top-p cut set to 0 (not renormalised): what a pick draws from."""
    device = x.device
    temps = _column([p.temperature for p in picks], torch.float32, device)
    probs = torch.softmax((x - x.max(dim=-1, keepdim=True).values) / temps, dim=-1)
    min_p = _column([p.min_p for p in picks], torch.float32, device)
    probs = torch.where(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0, probs)
    cut = [i for i, p in enumerate(picks) if p.top_k > 0 or p.top_p < 1]
    if cut:
        rows = torch.tensor(cut, device=device)
        probs[rows] = _top_k_top_p(probs[rows], [picks[i] for i in cut])
    return probs


def _top_k_top_p(probs: torch.Tensor, picks: Seq[HostPick]) -> torch.Tensor:
    """``probs [M, V]`` with the entries top-k and top-p cut set to 0 (order: stable descending)."""
    device = probs.device
    vocab = probs.shape[1]
    ranked, order = probs.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(vocab, device=device)[None, :]
    in_k = ranks < _column([p.top_k if p.top_k > 0 else vocab for p in picks], torch.int64, device)
    mass = torch.where(in_k, ranked, 0.0).to(torch.float64)
    running = mass.cumsum(dim=-1)
    top_p = _column([p.top_p for p in picks], torch.float64, device)
    keep = in_k & ((running - mass < top_p * running[:, -1:]) | (top_p >= 1))
    kept = torch.zeros_like(keep).scatter_(-1, order, keep)
    return torch.where(kept, probs, 0.0)


def sample_rows(logits: torch.Tensor, picks: Seq[HostPick], eos_ids: Seq[int],
                processed: Optional[torch.Tensor] = None) -> SampledRows:
    """One token per row of ``logits [N, V]`` by ``picks[r]``, batched (see the module docstring).
    ``processed`` (``[N, V]``, float32): the rows after per-request processing
    (``row_processors``), which the picks draw from; the logprob records stay ``logits``'."""
    if logits.dim() != 2 or logits.shape[0] != len(picks):
        raise ValueError(f"sample_rows: logits of shape {tuple(logits.shape)} for {len(picks)} picks")
    device = logits.device
    vocab = logits.shape[1]
    x = logits.to(torch.float32, copy=True)
    asked = [r for r, p in enumerate(picks) if p.top_logprobs > 0]
    raw = torch.log_softmax(x[asked], dim=-1) if asked else None
    if processed is not None:
        x = processed.to(torch.float32, copy=True)
    eos = [e for e in dict.fromkeys(eos_ids) if 0 <= e < vocab]
    masked = [r for r, p in enumerate(picks) if p.mask_eos]
    if eos and masked:
        x[torch.tensor(masked, device=device)[:, None], torch.tensor(eos, device=device)[None, :]] = -torch.inf
    tokens = torch.argmax(x, dim=-1)
    hot = [r for r, p in enumerate(picks) if p.temperature > 0]
    if hot:
        rows = torch.tensor(hot, device=device)
        tokens[rows] = _draw(x[rows], [picks[r] for r in hot])
    chosen = tokens.tolist()
    records: list[Optional[RowLogprobs]] = [None] * len(picks)
    if raw is not None:
        width = min(max(picks[r].top_logprobs for r in asked), vocab)
        values, ids = raw.sort(dim=-1, descending=True, stable=True)
        picked = raw.gather(-1, tokens[torch.tensor(asked, device=device)][:, None]).squeeze(-1).tolist()
        top_values, top_ids = values[:, :width].tolist(), ids[:, :width].tolist()
        for i, r in enumerate(asked):
            k = picks[r].top_logprobs
            records[r] = RowLogprobs(chosen[r], picked[i], tuple(zip(top_ids[i][:k], top_values[i][:k], strict=True)))
    return SampledRows(chosen, records)


def logprob_records(logits: torch.Tensor, tokens: Seq[int], widths: Seq[int]) -> list[RowLogprobs]:
    """The logprob record of each row of ``logits [M, V]`` for its chosen ``tokens[m]`` with the
    ``widths[m]`` largest entries (ties: the lower id first): the raw ``log_softmax``, as
    ``sample_rows`` gives them."""
    if not tokens:
        return []
    raw = torch.log_softmax(logits.to(torch.float32), dim=-1)
    width = min(max(widths), raw.shape[1])
    values, ids = raw.sort(dim=-1, descending=True, stable=True)
    chosen = torch.tensor(list(tokens), dtype=torch.int64, device=raw.device)[:, None]
    picked = raw.gather(-1, chosen).squeeze(-1).tolist()
    top_values, top_ids = values[:, :width].tolist(), ids[:, :width].tolist()
    return [RowLogprobs(int(t), picked[m], tuple(zip(top_ids[m][:k], top_values[m][:k], strict=True)))
            for m, (t, k) in enumerate(zip(tokens, widths, strict=True))]
