"""The pure core of fxsched: state records, events and ``step``.

``step(state, event) -> (state, effects)`` is the only place decisions are made (see
``machine`` for the theory of operation). This package imports only the standard library, attrs
and ``fxsched.effects``.
"""

from fxsched.core.config import ModelInfo, SchedulerConfig
from fxsched.core.machine import PhaseError, step
from fxsched.core.request import Request
from fxsched.core.state import SchedulerState, initial_state
from fxsched.core import tick as _tick  # noqa: F401  (registers every rule)

__all__ = ["ModelInfo", "SchedulerConfig", "PhaseError", "step", "Request", "SchedulerState", "initial_state"]
