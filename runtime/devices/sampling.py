"""Host-side picks from copied logits rows (specs/scheduler.md §5.11). Seeds come from the effect."""

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


def host_pick(logits: list[float], pick: HostPick, eos_ids: tuple[int, ...]) -> int:
    """Pick one token: EOS masked while ``mask_eos``; greedy takes the highest id among the maxima;
    temperature > 0 walks the softmax weights with ``u`` drawn from ``Random(pick.seed)``."""
    values = list(logits)
    if pick.mask_eos:
        for e in eos_ids:
            if 0 <= e < len(values):
                values[e] = -math.inf
    top = max(values)
    if pick.temperature <= 0:
        return max(i for i, v in enumerate(values) if v == top)
    weights = [math.exp((v - top) / pick.temperature) if v != -math.inf else 0.0 for v in values]
    total = sum(weights)
    u = random.Random(pick.seed).random()
    target = u * total
    running = 0.0
    for token, w in enumerate(weights):
        running += w
        if w > 0 and running >= target:
            return token
    return max(i for i, w in enumerate(weights) if w > 0)
