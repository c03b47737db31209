"""The pure core of fxsched: state records, events and ``step``.

``step(state, event) -> (state, effects)`` is the only place decisions are made (see
``machine`` for the theory of operation and the module layers, ``table`` for the transition
table). This package imports only the standard library, attrs and ``fxsched.effects``.
"""

from fxsched.core.agenda import PhaseError
from fxsched.core.config import ModelInfo, SchedulerConfig
from fxsched.core.machine import step
from fxsched.core.request import Request
from fxsched.core.state import SchedulerState, initial_state

__all__ = ["ModelInfo", "PhaseError", "Request", "SchedulerConfig", "SchedulerState", "initial_state", "step"]
