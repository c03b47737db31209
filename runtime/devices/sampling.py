"""Host-side picks from copied logits rows (specs/scheduler.md §5.11). Seeds come from the effect.

This is the fallback for devices that do not sample themselves (the recording device, whose
reference traces depend on it): plain Python, no torch. A device that offers ``sample_rows`` (the
torch device, ``fxsched.runtime.devices.torch_sampling``; the simulated device, by ``host_pick``
over its own rows) picks instead.

Invariants: with the filters at their defaults (``top_p = 1``, ``top_k = 0``, ``min_p = 0``) a
pick is exactly the rule of §5.11 (greedy: the highest id among the maxima; temperature > 0:
one ``Random(seed)`` draw walking the weights in id order). The filters only zero weights.
"""

from __future__ import annotations

import math
import random
import struct

from fxsched.effects.device_calls import HostPick


def decode_bf16_row(slab: bytes, vocab: int, row: int) -> list[float]:
    """Row ``row`` of a BF16 slab (little-endian), as floats."""
    start = row * vocab * 2
    raw = slab[start:start + vocab * 2]
    return [struct.unpack("<f", b"\x00\x00" + raw[i:i + 2])[0] for i in range(0, len(raw), 2)]


def filter_weights(weights: list[float], pick: HostPick) -> list[float]:
    """Zero the weights that min-p, top-k and top-p (in that order) cut; the largest always stays.

    ``weights`` are the temperature-scaled softmax weights (unnormalised, the largest is 1.0).
    min-p drops weights below ``min_p`` times the largest; top-k keeps the ``top_k`` largest
    (ties: the lower id first); top-p keeps, in that order, each weight whose preceding mass is
    below ``top_p`` of the total.
    """
    out = list(weights)
    if pick.min_p > 0:
        floor = pick.min_p * max(out)
        out = [w if w >= floor else 0.0 for w in out]
    if pick.top_k <= 0 and pick.top_p >= 1:
        return out
    order = sorted(range(len(out)), key=lambda i: (-out[i], i))
    if pick.top_k > 0:
        for i in order[pick.top_k:]:
            out[i] = 0.0
    if pick.top_p < 1:
        total = sum(out)
        before = 0.0
        for i in order:
            if before >= pick.top_p * total:
                out[i] = 0.0
            before += out[i]
    return out


def host_pick(logits: list[float], pick: HostPick, eos_ids: tuple[int, ...]) -> int:
    """Pick one token: EOS masked while ``mask_eos``; greedy takes the highest id among the maxima;
    temperature > 0 walks the filtered softmax weights with ``u`` drawn from ``Random(pick.seed)``."""
    weights = pick_weights(logits, pick, eos_ids)
    return weights if isinstance(weights, int) else draw(weights, pick.seed)


def pick_weights(logits: list[float], pick: HostPick, eos_ids: tuple[int, ...]) -> int | list[float]:
    """What ``host_pick`` makes of a row before its draw: the token of a greedy pick, else the
    filtered weights (neither depends on the pick's seed)."""
    values = list(logits)
    if pick.mask_eos:
        for e in eos_ids:
            if 0 <= e < len(values):
                values[e] = -math.inf
    top = max(values)
    if pick.temperature <= 0:
        return max(i for i, v in enumerate(values) if v == top)
    weights = [math.exp((v - top) / pick.temperature) if v != -math.inf else 0.0 for v in values]
    return filter_weights(weights, pick)


def draw(weights: list[float], seed: int) -> int:
    """``host_pick``'s draw over filtered weights: ``u`` from ``Random(seed)``, walked in id order."""
    total = sum(weights)
    u = random.Random(seed).random()
    target = u * total
    running = 0.0
    for token, w in enumerate(weights):
        running += w
        if w > 0 and running >= target:
            return token
    return max(i for i, w in enumerate(weights) if w > 0)
