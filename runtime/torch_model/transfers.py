"""Host-device transfers of the forwards, proposers and samplers: every host list a call needs goes
over in one packed copy that does not block the host (specs/async.md §16.2 rule 1)."""

from __future__ import annotations

from array import array
from typing import Sequence, Union

import torch

# A float field: Python floats, or a host float64 tensor (a CPU generator's draws, written in place).
Floats = Union[Sequence[float], torch.Tensor]


def send_ints(fields: Sequence[Sequence[int]], device: torch.device) -> list[torch.Tensor]:
    """int64 tensors on `device` of each host list, moved in one copy: the lists are packed into
    one host buffer (pinned for CUDA, so the copy does not block the host), copied once, and each
    result is a view of the device buffer. A forward's inputs thus cost one transfer, not one per
    tensor."""
    ints, _ = send_values(fields, (), device)
    return ints


def send_values(ints: Sequence[Sequence[int]], floats: Sequence[Floats],
                device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(int64 tensors of `ints`, float64 tensors of `floats`) on `device`, all in one copy, as
    `send_ints`: the float fields travel as their float64 bits in the same int64 buffer, so every
    value arrives exactly (a float32 column rounds on the device as it would on the host). A float
    field may be a 1-D host float64 tensor, whose values are packed without reading them."""
    packed = array("q")
    for field in ints:
        if type(field) is list:
            packed.fromlist(field)  # (a list's ints in one C call)
        else:
            packed.extend(field)
    parts = [host_tensor(packed, torch.long)]
    for f in floats:
        values = f.reshape(-1) if isinstance(f, torch.Tensor) else host_tensor(array("d", f), torch.float64)
        parts.append(values.to(torch.float64).view(torch.long))
    host = parts[0] if len(parts) == 1 else torch.cat(parts)
    if device.type == "cuda":
        host = host.pin_memory()
    buf = host.to(device, non_blocking=True)
    sizes = [len(field) for field in ints]
    sizes += [part.numel() for part in parts[1:]]
    views = buf.split_with_sizes(sizes)  # every view in one call
    return list(views[:len(ints)]), [v.view(torch.float64) for v in views[len(ints):]]


def host_tensor(values: array, dtype: torch.dtype) -> torch.Tensor:
    """A host tensor over ``values``' memory, which it keeps alive (no per-element conversion: a
    quarter of ``torch.tensor(list)``'s time on a few hundred values, the size of a decode step's
    fields); ``dtype`` must match the array's typecode."""
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(values, dtype=dtype)
