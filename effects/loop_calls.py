"""The loop's own device calls: start-up, the snapshot reads, the inbox wait, streams and events,
and the teardown (specs/recording-device.md §3.8.1, §3.8.8; specs/scheduler.md §5.3).
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from .base import quick_inits
from .call_base import DeviceCall


# --- start-up, snapshot, inbox -------------------------------------------------------------


@attrs.frozen
class BindGpuToThread(DeviceCall):
    CALL: ClassVar[str] = "bind_gpu_to_thread"


@attrs.frozen
class CreateStream(DeviceCall):
    CALL: ClassVar[str] = "create_stream"
    QUERY: ClassVar[bool] = True


@attrs.frozen
class CreateEvent(DeviceCall):
    CALL: ClassVar[str] = "create_event"
    QUERY: ClassVar[bool] = True


@attrs.frozen
class NumFreeBlocks(DeviceCall):
    CALL: ClassVar[str] = "num_free_blocks"
    QUERY: ClassVar[bool] = True


@attrs.frozen
class SsmSnapshotOccupancy(DeviceCall):
    """Read of the snapshot occupancy; the recording device marks ticks with these reads."""

    CALL: ClassVar[str] = "ssm_snapshot_occupancy"


@attrs.frozen
class WaitForInput(DeviceCall):
    """Blocking wait on the request inbox; answered by the host with arrivals or closure."""

    CALL: ClassVar[str] = "wait_for_input"
    QUERY: ClassVar[bool] = True


# --- streams ---------------------------------------------------------------------------------


@attrs.frozen
class PollInnerq(DeviceCall):
    CALL: ClassVar[str] = "poll_innerq"


@attrs.frozen
class RecordEvent(DeviceCall):
    CALL: ClassVar[str] = "record_event"
    event: int
    stream: int


@attrs.frozen
class StreamWaitEvent(DeviceCall):
    CALL: ClassVar[str] = "stream_wait_event"
    stream: int
    event: int


@attrs.frozen
class Synchronize(DeviceCall):
    CALL: ClassVar[str] = "synchronize"
    stream: int


@attrs.frozen
class SyncSecondaryCall(DeviceCall):
    CALL: ClassVar[str] = "sync_secondary"


@attrs.frozen
class TeardownCall(DeviceCall):
    CALL: ClassVar[str] = "teardown"


quick_inits(globals())  # every record class above: a quicker __init__ (effects/base.py)
