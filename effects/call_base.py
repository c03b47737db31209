"""The base record of every device call (the Device protocol's boundary): ``CALL`` names the
device method and its trace line (specs/recording-device.md §3.8).
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from .base import Effect, quick_inits


@attrs.frozen
class DeviceCall(Effect):
    """A direct call on the device; it renders only its own line."""

    CALL: ClassVar[str] = ""


quick_inits(globals())  # every record class above: a quicker __init__ (effects/base.py)
