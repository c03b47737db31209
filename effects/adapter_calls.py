"""LoRA adapter calls: the adapter ids of slots, adapter slots, the active adapter
(specs/lora.md §18.5, specs/recording-device.md §3.8.8).
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from .base import int_tuple, quick_inits
from .call_base import DeviceCall


@attrs.frozen
class AdapterIdFor(DeviceCall):
    """One ``adapter_id_for`` line per slot, answered with the list of adapter ids."""

    CALL: ClassVar[str] = "adapter_id_for"
    QUERY: ClassVar[bool] = True
    slots: tuple[int, ...] = attrs.field(converter=int_tuple)


@attrs.frozen
class AcquireAdapterSlot(DeviceCall):
    CALL: ClassVar[str] = "acquire_adapter_slot"
    slot: int


@attrs.frozen
class SetActiveLora(DeviceCall):
    CALL: ClassVar[str] = "set_active_lora"
    QUERY: ClassVar[bool] = True
    name: str


quick_inits(globals())  # every record class above: a quicker __init__ (effects/base.py)
