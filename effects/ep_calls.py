"""The EP word broadcasts: commands, tokens and vision embeddings sent to the expert-parallel
workers (the words themselves are ``ep_words``; specs/recording-device.md §3.8.8).
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from .base import int_tuple, quick_inits
from .call_base import DeviceCall


@attrs.frozen
class EpBroadcastCmdForSeq(DeviceCall):
    CALL: ClassVar[str] = "ep_broadcast_cmd_for_seq"
    seq_slot: int
    cmd: int


@attrs.frozen
class EpBroadcastCmd(DeviceCall):
    CALL: ClassVar[str] = "ep_broadcast_cmd"
    cmd: int


@attrs.frozen
class EpBroadcastTokens(DeviceCall):
    CALL: ClassVar[str] = "ep_broadcast_tokens"
    tokens: tuple[int, ...] = attrs.field(converter=int_tuple)


@attrs.frozen
class EpSyncVisionEmbeds(DeviceCall):
    CALL: ClassVar[str] = "ep_sync_vision_embeds"
    n: int


quick_inits(globals())  # every record class above: a quicker __init__ (effects/base.py)
