"""Decodes answered ahead: what a pipelined plain decode may feed and what its late tokens do
(specs/async.md §16.6). Pure helpers of ``decode`` and ``tick``.

With ``async_scheduling`` a plain decode may be answered before its tokens are read: each row's
token stays on the device (the sequence is ``ahead``), the next decode feeds it from there, and
its value comes back with the answer of the query that resolves it (the next ``Decode``'s
``resolve``, or a ``ReadAhead``). Every decision a token's value drives (streaming, EOS, the
output) waits for its value; every decision its count drives (the budget, the context ceiling)
is taken at once, so a sequence whose kept token is its last is never fed again.

A resolved token is taken as the synchronous decode's sink takes a token: streamed, EOS, budget,
and a cancel asked for since its decode ends the sequence with the token untaken (nothing is
streamed after a cancel). A deadline passed while a token is on the device is judged at the end
of that tick, once the token is read (``ahead_past_deadline``). Work that needs every sequence's
last token (admission, prefill, a speculative step, memory pressure, a rotation) resolves first
(``needs_settled``, ``speculation_lane``), and the sequences a resolved token finished retire
before admission.
"""

from __future__ import annotations

from typing import Iterable, Optional

from fxsched.core.agenda import PhaseError
from fxsched.core.config import ModelInfo, SchedulerConfig
from fxsched.core.emit import plain_token
from fxsched.core.events import LATE_TOKEN
from fxsched.core.kv import blocks_for
from fxsched.core.records import replace, with_fields
from fxsched.core.phases import NgramStep, SelfSpecStep, SpecStep
from fxsched.core.rows import may_speculate, pick_for
from fxsched.core.sequence import Sequence
from fxsched.core.state import SchedulerState, hot_columns, kept_facts
from fxsched.core.watchdog import snapshots_possible
from fxsched.effects import device_calls as dc
from fxsched.effects.base import Effect

__all__ = ["ahead_past_deadline", "any_ahead", "fed_again", "kept_is_last", "may_answer_ahead", "needs_settled", "pick",
           "produced", "produced_count", "resolve_tokens", "speculation_lane", "went_ahead"]


def any_ahead(state: SchedulerState) -> bool:
    """Some active sequence holds a token on the device (the hot columns' ``last_token`` when a
    batched step left them: the records' may be older)."""
    columns = hot_columns(state)
    if columns is not None:
        return LATE_TOKEN in columns.last_token
    return any(s.ahead for s in state.rows)


def produced(seq: Sequence) -> int:
    """Output tokens the sequence has produced, the one kept on the device included."""
    return produced_count(len(seq.output), seq.last_token)


def produced_count(out_len: int, last_token: int) -> int:
    """``produced`` of a row whose output holds ``out_len`` tokens and whose last token is
    ``last_token`` (``LATE_TOKEN``: one more is kept on the device)."""
    return out_len + (1 if last_token == LATE_TOKEN else 0)


def pick(seq: Sequence) -> dc.HostPick:
    """The pick of the sequence's next decode row: its seed counts the kept token too."""
    return pick_for(seq.request, produced(seq))


def may_answer_ahead(config: SchedulerConfig, model: ModelInfo, rows: Iterable[Sequence]) -> bool:
    """Whether a plain decode of ``rows`` may be answered ahead: async scheduling on, no watchdog or
    SSM snapshot (they act on a token's value before the next is fed) and no row asking for logprob
    records. Speculation configured does not bar it: a tick whose decode is plain (the batch past
    the speculative width, a slot past the cap) pipelines as any plain decode; a tick that would
    speculate reads the kept tokens first (``needs_settled``)."""
    return (config.async_scheduling and not config.loop_watchdog and not snapshots_possible(config, model)
            and all(s.request.top_logprobs == 0 for s in rows))


def fed_again(seq: Sequence, config: SchedulerConfig) -> bool:
    """Whether a sequence that is ahead joins the next decode: not when its kept token is its last
    (the budget or the context ends with it) or when a cancel or a timeout already ends it."""
    return not kept_is_last(seq.remaining, seq.seq_len, config) and not seq.cancel_requested and seq.guard is None


def kept_is_last(remaining: int, seq_len: int, config: SchedulerConfig) -> bool:
    """Whether the token a sequence keeps on the device (``remaining`` and ``seq_len`` counted with it
    fed, not taken) is its last: the budget or the context ends with it."""
    return remaining <= 1 or seq_len + 1 >= config.max_seq_len


def went_ahead(seq: Sequence, block_size: int) -> Sequence:
    """``seq`` after a decode answered ahead fed it: one more token in the KV, one kept on the
    device. A cancel already asked for ends it now, the kept token untaken (as the synchronous
    decode's sink would)."""
    seq_len = seq.seq_len + 1
    changes: dict[str, object] = {"seq_len": seq_len, "blocks": max(seq.blocks, blocks_for(seq_len, block_size))}
    if seq.cancel_requested:
        changes["finished"] = True
    else:
        changes["last_token"] = LATE_TOKEN
    return with_fields(seq, changes)


def resolve_tokens(state: SchedulerState, seq_ids: tuple[int, ...], tokens: tuple[int, ...],
                   logprobs: tuple[int, ...], out: list[Effect]) -> SchedulerState:
    """The kept tokens of ``seq_ids`` arrive: each sequence takes its token as the synchronous
    decode's sink takes one (streamed, EOS, budget; a cancel asked for since ends it, the token
    untaken: nothing is streamed after a cancel)."""
    if len(tokens) != len(seq_ids) or (logprobs and len(logprobs) != len(seq_ids)):
        raise PhaseError(f"{len(tokens)} kept tokens (and {len(logprobs)} logprob sizes) answered for the "
                         f"{len(seq_ids)} sequences to resolve")
    config, model = state.config, state.model
    taken = dict(zip(seq_ids, zip(tokens, logprobs or (0,) * len(tokens), strict=True), strict=True))
    active = []
    for seq in state.active:
        got = taken.pop(seq.seq_id, None)
        if got is None:
            active.append(seq)
            continue
        if not seq.ahead:
            raise PhaseError(f"sequence {seq.seq_id} holds no token on the device, but one was resolved")
        token, size = got
        settled = with_fields(seq, {"last_token": seq.output.last})
        active.append(plain_token(settled, token, config, out, size, model))
    if taken:
        raise PhaseError(f"kept tokens resolved for sequences {sorted(taken)}, which are not active")
    return replace(state, active=tuple(active))


def ahead_past_deadline(state: SchedulerState) -> bool:
    """Some sequence that is ahead has passed its deadline: the end of tick reads its token first,
    so that it times out in this tick with the token taken, as the synchronous run's would."""
    now, columns = state.now_ms, hot_columns(state)
    lasts = columns.last_token if columns is not None else [s.last_token for s in state.rows]
    return any(last == LATE_TOKEN and s.request.deadline_ms is not None and s.request.deadline_ms <= now
               for s, last in zip(state.rows, lasts, strict=True))


def needs_settled(state: SchedulerState) -> bool:
    """Whether this tick may do work that needs every sequence's last token, so that the tokens
    kept on the device are read first: anything but a plain decode of the running batch (a
    speculative step reads every token: ``speculation_lane``)."""
    return bool(state.new_requests or state.pending or state.prefilling or state.rotations or state.swapped
                or state.preempted or not may_answer_ahead(state.config, state.model, ())
                or speculation_lane(state) is not None)


# the speculative lanes' tasks, built once (frozen records without fields)
_NGRAM_STEP, _SELF_SPEC_STEP, _SPEC_STEP = NgramStep(), SelfSpecStep(), SpecStep()


def speculation_lane(state: SchedulerState) -> Optional[object]:
    """The speculative task this tick's decode takes (n-gram or self-speculative while one sequence
    runs, MTP / DFlash up to ``mtp_width_limit`` sequences, every slot under the cap, no guard), or
    None: a plain decode."""
    config, model = state.config, state.model
    if config.base_draft_count(model) == 0:
        return None
    active = state.rows  # slots and guards: exact in the records (state.settled holds only hot fields)
    cap = config.speculation_slot_cap
    facts = kept_facts(state)
    covered = max(facts.slots, default=-1) < cap if facts is not None else all(s.slot < cap for s in active)
    if config.ngram_speculative and len(active) == 1 and covered:
        return _NGRAM_STEP
    if config.self_speculative and model.has_self_speculative and len(active) == 1 and covered:
        return _SELF_SPEC_STEP
    if (config.uses_mtp(model) and len(active) <= config.mtp_width_limit and covered
            and (facts.all_unguarded if facts is not None else all(map(may_speculate, active)))):
        return _SPEC_STEP
    return None
