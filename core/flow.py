"""Rules of generic control flow: a forward's continuation and continuations written as data.

Every forward is a query: the scheduler learns that a prefill, a mixed step or a decode is done
(``ForwardDone``), or that it failed (``DeviceFault``) and on which sequences, before it goes on.
"""

from __future__ import annotations

from fxsched.core.agenda import ask, push
from fxsched.core.events import ForwardDone
from fxsched.core.phases import AskQuery, AwaitForward, EmitEffects
from fxsched.core.records import replace
from fxsched.core.state import SchedulerState
from fxsched.effects.base import Effect


def forward_done(state: SchedulerState, waiting: AwaitForward, event: ForwardDone,
                 out: list[Effect]) -> SchedulerState:
    if event.cached_tokens and waiting.seq_ids:
        # a first prefill found prompt tokens in the prefix cache: remembered until the sequence
        # becomes active, then reported in its final frame
        state = replace(state, prefix_hits=state.prefix_hits + ((waiting.seq_ids[0], event.cached_tokens),))
    if event.cached_by_seq:
        # first chunks of a batched or mixed forward: each sequence of that forward its own count
        hits = tuple((seq_id, n) for seq_id, n in event.cached_by_seq if n and seq_id in waiting.seq_ids)
        state = replace(state, prefix_hits=state.prefix_hits + hits)
    return push(state, *waiting.then) if waiting.then else state


def emit_effects(state: SchedulerState, task: EmitEffects, out: list[Effect]) -> SchedulerState:
    out.extend(task.effects)
    return state


def ask_query(state: SchedulerState, task: AskQuery, out: list[Effect]) -> SchedulerState:
    return ask(state, out, task.query, task.waiting)
