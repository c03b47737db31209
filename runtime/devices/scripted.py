"""The scripted fake model: ``ScriptedDevice``, the Device protocol answered from per-request
scripts, which the recording device (a trace line per call) and the simulated device (silent,
strict, with injected faults) both are.

It is assembled from one module per concern, each a class over the shared bookkeeping
(``scripted_book.ScriptedBook``: scripts, sequences, slots, KV blocks, rows, the trace list):
``scripted_lifecycle`` (start-up, sequences, adapters, EP words, streams, teardown),
``scripted_forwards`` (forwards, verifies, logits readers) and ``scripted_speculative`` (proposers,
commits, stashes and SSM checkpoints). The answer rules are ``script_rules``
(specs/recording-device.md §3.3).
"""

from __future__ import annotations

from fxsched.runtime.devices.scripted_forwards import ScriptedForwards
from fxsched.runtime.devices.scripted_lifecycle import ScriptedLifecycle
from fxsched.runtime.devices.scripted_speculative import ScriptedSpeculative


class ScriptedDevice(ScriptedLifecycle, ScriptedForwards, ScriptedSpeculative):
    """The Device protocol answered from per-request scripts: what the recording device and the
    simulated device share (the state it keeps and what subclasses decide: ``ScriptedBook``)."""
