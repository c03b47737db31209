"""Small generic pieces of control flow used by the rules.

Every forward is a query: the scheduler learns that a prefill, a mixed step or a decode is done
(``ForwardDone``), or that it failed (``DeviceFault``) and on which sequences, before it goes on.
``AwaitForward`` carries what to do next as tasks; ``EmitEffects`` and ``AskQuery`` let a rule
write a continuation as data.
"""

from __future__ import annotations

from typing import Any, Optional

import attrs

from fxsched.core.events import ForwardDone
from fxsched.core.machine import answer_rule, ask, push, task_rule
from fxsched.core.records import replace
from fxsched.core.request import Request
from fxsched.core.state import SchedulerState


@attrs.frozen
class AwaitForward:
    """A forward over ``seq_ids`` is in flight; ``then`` runs once it is done.

    ``request`` and ``slot`` name a request that is not yet a sequence anywhere (its first
    prefill), so a fault can fail it.
    """

    seq_ids: tuple[int, ...]
    then: tuple[Any, ...] = ()
    request: Optional[Request] = None
    slot: Optional[int] = None


@attrs.frozen
class EmitEffects:
    effects: tuple[Any, ...]


@attrs.frozen
class AskQuery:
    query: Any
    waiting: Any


def forward(state: SchedulerState, out: list, query, seq_ids, *then, request: Optional[Request] = None,
            slot: Optional[int] = None) -> SchedulerState:
    """Run a forward and continue with ``then`` when it is done."""
    return ask(state, out, query, AwaitForward(tuple(seq_ids), tuple(then), request, slot))


@answer_rule(AwaitForward, ForwardDone)
def _forward_done(state, waiting: AwaitForward, event: ForwardDone, out):
    if event.cached_tokens and waiting.seq_ids:
        # a first prefill found prompt tokens in the prefix cache: remembered until the sequence
        # becomes active, then reported in its final frame
        state = replace(state, prefix_hits=state.prefix_hits + ((waiting.seq_ids[0], event.cached_tokens),))
    return push(state, *waiting.then) if waiting.then else state


@task_rule(EmitEffects)
def _emit_effects(state: SchedulerState, task: EmitEffects, out: list) -> SchedulerState:
    out.extend(task.effects)
    return state


@task_rule(AskQuery)
def _ask_query(state: SchedulerState, task: AskQuery, out: list) -> SchedulerState:
    return ask(state, out, task.query, task.waiting)
