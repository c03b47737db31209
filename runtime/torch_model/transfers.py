"""Host-device transfers of the forwards and proposers: every host list a call needs goes over in
one packed copy that does not block the host (specs/async.md §16.2)."""

from __future__ import annotations

from typing import Sequence

import torch


def send_ints(fields: Sequence[Sequence[int]], device: torch.device) -> list[torch.Tensor]:
    """int64 tensors on `device` of each host list, moved in one copy: the lists are packed into
    one host buffer (pinned for CUDA, so the copy does not block the host), copied once, and each
    result is a view of the device buffer. A forward's inputs thus cost one transfer, not one per
    tensor."""
    flat = [v for f in fields for v in f]
    host = torch.tensor(flat, dtype=torch.long)
    if device.type == "cuda":
        host = host.pin_memory()
    buf = host.to(device, non_blocking=True)
    out, at = [], 0
    for f in fields:
        out.append(buf[at:at + len(f)])
        at += len(f)
    return out
