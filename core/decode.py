"""Rules of lane 3: choosing the decode path, and the plain decode step
(specs/scheduler.md §5.15–5.17).

Invariant kept: after a plain decode every row's ``seq_len`` has grown by one (the fed token) and
its ``blocks`` cover ``seq_len``; a failed batch changes no sequence it did not fail or preempt.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from fxsched.core.agenda import PhaseError, ask, batch_rows, by_id, keep_batch, push, update
from fxsched.core.ahead_columns import answered_from_columns, planned_from_columns
from fxsched.core.ahead import (any_ahead, fed_again, may_answer_ahead, pick, produced, resolve_tokens,
                                speculation_lane, went_ahead)
from fxsched.core.emit import plain_token, recipients
from fxsched.core.events import LATE_TOKEN, DeviceFault, TokensSampled
from fxsched.core.faults import fail_sequences
from fxsched.core.memory import preempt, preemption_victim
from fxsched.core.phases import AwaitAhead, AwaitDecode, DecodeLane, PlainDecode, ResolveAhead
from fxsched.core.records import replace, with_fields
from fxsched.core.rows import (by_slot, greedy_request, greedy_row, grow, host_pick, pick_for,
                              prefill_barrier, slots_increasing)
from fxsched.core.state import SchedulerState, hot_columns, hot_fields, kept_facts
from fxsched.core.token_log import extended
from fxsched.core.watchdog import snapshots_possible
from fxsched.effects import device_calls as dc
from fxsched.effects import plans
from fxsched.effects.base import Effect
from fxsched.effects.client import StreamOut
from fxsched.effects.lifecycle import MarconiCheckpoints


# the lanes' tasks, built once (frozen records without fields: one instance is as good as another)
_PLAIN_DECODE = PlainDecode()


def decode_lane(state: SchedulerState, task: DecodeLane, out: list[Effect]) -> SchedulerState:
    if state.mixed_step_ran:
        return state
    if state.prefilling:
        prefill_barrier(state, out)
    lane = speculation_lane(state)
    if lane is None or any_ahead(state):
        # plain decode is the next task: run it now (the same as pushing it). A speculative step
        # reads every token: with tokens still on the device (a tick that changed its batch after
        # its start) this tick decodes plainly, and the next settles first (specs/async.md §16.6)
        return plain_decode(update(state, out, {"last_decode_ms": state.now_ms}), _PLAIN_DECODE, out)
    return update(state, out, {"last_decode_ms": state.now_ms, "agenda": (lane,) + state.agenda})


def plain_decode(state: SchedulerState, task: PlainDecode, out: list[Effect]) -> SchedulerState:
    config = state.config
    if config.async_scheduling and (any_ahead(state) or may_answer_ahead(config, state.model, state.rows)):
        return _pipelined_decode(state, out)
    columns = hot_columns(state)
    if columns is not None and slots_increasing((facts := columns.facts()).slots):
        # the rows are in slot order already and the columns hold their newest hot fields
        picks: tuple[dc.HostPick, ...] = ()
        if not facts.all_greedy and not all(greedy_request(s.request, n)
                                            for s, n in zip(state.rows, columns.out_len, strict=True)):
            picks = tuple(map(pick_for, [s.request for s in state.rows], columns.out_len))
        plan = plans.Decode(tokens=columns.last_token, seqs=facts.ids, seq_lens=columns.seq_len, picks=picks)
        out.append(plan)
        return update(state, out, {"waiting": AwaitDecode(plan.seqs)})
    active = by_slot(state.active)
    picks = () if all(greedy_row(s) for s in active) else tuple(host_pick(s) for s in active)
    plan = plans.Decode(
        tokens=tuple([s.last_token for s in active]),
        seqs=tuple([s.seq_id for s in active]),
        seq_lens=tuple([s.seq_len for s in active]),
        picks=picks,
    )
    out.append(plan)
    return update(state, out, {"rows": active, "settled": None, "waiting": AwaitDecode(plan.seqs)})


def _pipelined_decode(state: SchedulerState, out: list[Effect]) -> SchedulerState:
    """A plain decode with async scheduling (specs/async.md §16.6): it may be answered ahead, it feeds
    each sequence that is ahead its kept token from the device (``LATE_TOKEN``) unless that token is
    its last, and its answer resolves every kept token. With no row to feed, the kept tokens are
    read alone (``ReadAhead``). Rows finished by a resolution this tick wait for the end of tick."""
    steady = planned_from_columns(state)
    if steady is not None:  # the rows as they are: the columns stay
        out.append(steady)
        return update(state, out, {"waiting": AwaitDecode(steady.seqs, steady.resolve)})
    config, model = state.config, state.model
    active = by_slot(state.active)
    fed = [s for s in active if not s.finished and (not s.ahead or fed_again(s, config))]
    resolve = tuple([s.seq_id for s in active if s.ahead])
    if not fed:
        if not resolve:  # (every row finished by a resolution: nothing to do until the end of tick)
            return update(state, out, {"rows": active, "settled": None})
        return ask(update(state, out, {"rows": active, "settled": None}), out, dc.ReadAhead(resolve),
                   AwaitAhead(resolve))
    greedy = all(greedy_request(s.request, produced(s)) for s in fed)
    plan = plans.Decode(
        tokens=tuple([LATE_TOKEN if s.ahead else s.last_token for s in fed]),
        seqs=tuple([s.seq_id for s in fed]),
        seq_lens=tuple([s.seq_len for s in fed]),
        picks=() if greedy else tuple(pick(s) for s in fed),
        ahead=may_answer_ahead(config, model, fed),
        resolve=resolve,
    )
    out.append(plan)
    return update(state, out, {"rows": active, "settled": None, "waiting": AwaitDecode(plan.seqs, resolve)})


def nothing_ahead(state: SchedulerState) -> bool:
    """``ResolveAhead`` has nothing to do: no sequence holds a token on the device."""
    return not any_ahead(state)


def resolve_ahead(state: SchedulerState, task: ResolveAhead, out: list[Effect]) -> SchedulerState:
    """Read back every kept token before work that needs the sequences' last tokens."""
    if nothing_ahead(state):
        return state
    ids = tuple([s.seq_id for s in by_slot(state.active) if s.ahead])
    return ask(state, out, dc.ReadAhead(ids), AwaitAhead(ids))


def ahead_read(state: SchedulerState, waiting: AwaitAhead, event: TokensSampled, out: list[Effect]) -> SchedulerState:
    """The kept tokens of ``waiting.seq_ids`` arrive alone (``ReadAhead``)."""
    if event.tokens:
        raise PhaseError(f"a read of kept tokens answered {len(event.tokens)} new tokens")
    return resolve_tokens(state, waiting.seq_ids, event.earlier, event.earlier_logprobs, out)


def _decoded_ahead(state: SchedulerState, waiting: AwaitDecode, event: TokensSampled | DeviceFault,
                   out: list[Effect]) -> SchedulerState:
    """The answer of a pipelined decode (specs/async.md §16.6): first the kept tokens it resolves, as
    their own decode would have taken them; then its own rows, answered ahead (a ``LATE_TOKEN`` each:
    the sequences go ahead) or with their tokens. A row whose sequence a resolved token just
    finished was computed ahead for nothing: it is dropped, never streamed (its KV goes with the
    sequence). A fault that brings the kept tokens resolves them first; one that cannot (the decode
    that kept them failed after it was answered) fails every sequence of both decodes."""
    resolve = waiting.resolve
    if isinstance(event, DeviceFault):
        if resolve and len(event.earlier) != len(resolve):
            return fail_sequences(state, set(resolve) | set(waiting.seq_ids), event.message, out)
        if resolve:
            state = resolve_tokens(state, resolve, event.earlier, (), out)
        going = tuple(s for s in state.active if s.seq_id in set(waiting.seq_ids) and not s.finished)
        if event.kv_exhausted and len(going) > 1:
            victim = preemption_victim(going)
            if victim is not None:
                return push(preempt(state, victim, out), PlainDecode())
        return fail_sequences(state, [s.seq_id for s in going], event.message, out)
    steady = answered_from_columns(state, waiting, event, out)
    if steady is not None:
        return steady
    if resolve:
        state = resolve_tokens(state, resolve, event.earlier, event.earlier_logprobs, out)
    elif event.earlier:
        raise PhaseError(f"a decode that resolves nothing answered {len(event.earlier)} kept tokens")
    tokens = event.tokens
    if len(tokens) != len(waiting.seq_ids):
        raise PhaseError(f"a decode of {len(waiting.seq_ids)} rows answered {len(tokens)} tokens")
    late = [t == LATE_TOKEN for t in tokens]
    if any(late) and not all(late):
        raise PhaseError("a decode answered some of its rows ahead and some with their tokens")
    config, block_size = state.config, state.model.block_size
    rows = dict(zip(waiting.seq_ids, zip(tokens, event.logprobs or (0,) * len(tokens), strict=True), strict=True))
    active = []
    for seq in state.active:
        row = rows.get(seq.seq_id)
        if row is None or seq.finished:  # not in the decode, or just finished: its row is dropped
            active.append(seq)
        elif all(late):
            active.append(went_ahead(seq, block_size))
        else:
            token, size = row
            active.append(plain_token(grow(seq, seq.seq_len + 1, block_size), token, config, out, size, state.model))
    after = replace(state, active=tuple(active))
    if any(late) and not any(s.ahead and fed_again(s, config) for s in active):
        # no kept token will be fed again (each is its sequence's last): read them now, in this tick,
        # rather than in a next tick's decode with no row to run (specs/async.md §16.6 rule 2)
        return push(after, ResolveAhead())
    return after


def decoded(state: SchedulerState, waiting: AwaitDecode, event: TokensSampled | DeviceFault,
            out: list[Effect]) -> SchedulerState:
    if waiting.resolve or (isinstance(event, TokensSampled) and LATE_TOKEN in event.tokens):
        return _decoded_ahead(state, waiting, event, out)
    if isinstance(event, DeviceFault):
        if event.kv_exhausted and len(waiting.seq_ids) > 1:
            batch = set(waiting.seq_ids)
            rows = tuple(s for s in state.active if s.seq_id in batch)
            victim = preemption_victim(rows)
            if victim is not None:
                return push(preempt(state, victim, out), PlainDecode())
        # a fatal device error fails only the sequences of its batch; the others go on
        return fail_sequences(state, waiting.seq_ids, event.message, out)
    config, block_size = state.config, state.model.block_size
    if not config.loop_watchdog and not snapshots_possible(config, state.model):
        return _decoded_batch(state, waiting.seq_ids, event, out)
    logprobs = event.logprobs or (0,) * len(event.tokens)
    active = by_id(state)
    updated = {}
    for seq_id, token, lp in zip(waiting.seq_ids, event.tokens, logprobs, strict=True):
        seq = active[seq_id]
        seq = grow(seq, seq.seq_len + 1, block_size)
        updated[seq_id] = plain_token(seq, token, config, out, lp, state.model)
    return replace(state, active=tuple(updated.get(s.seq_id, s) for s in state.active))


def _decoded_batch(state: SchedulerState, seq_ids: tuple[int, ...], event: TokensSampled,
                   out: list[Effect]) -> SchedulerState:
    """``plain_token`` for every row at once, when no watchdog or SSM snapshot can fire: the rows'
    checkpoints and streamed tokens go out as one ``MarconiCheckpoints`` and one ``StreamOut``
    (the same frames and device calls, row by row, as the per-row sink). When the batch is every
    active sequence and no row finishes or records a logprob, the records stay and the hot fields
    go to columns (``state.settled``, specs/scheduler.md §5.2); otherwise each sequence is copied
    once. The state's active order is the rows' order unless a fault moved a sequence. With the
    columns' ``RowFacts`` at hand and no row finished or cancelled, no record is read for a row
    that goes on the common way (specs/scheduler.md §5.2)."""
    config = state.config
    block_size = state.model.block_size
    eos = config.eos_set
    seq_limit = config.max_seq_len - 1
    ordered, rows, hot = batch_rows(state, seq_ids)
    facts = kept_facts(state) if ordered else None
    # every row goes on and no logprob was sampled: which rows checkpoint and stream, and to whom,
    # is the RowFacts' (less any row that took EOS); no record or request is read
    quiet = facts if facts is not None and facts.all_going and not any(event.logprobs) else None
    streaming = quiet.streaming if quiet is not None else None
    logprobs = event.logprobs or (0,) * len(seq_ids)
    checkpoints: list[int] = []
    stream_ids: list[int] = []
    stream_tokens: list[int] = []
    stream_logprobs: list[int] = []
    new_len: list[int] = []
    new_blocks: list[int] = []
    new_buf: list[Any] = []  # each row's output array (its length is the new seq_len less ``out_base``)
    new_last: list[int] = []
    cold: dict[int, dict[str, Any]] = {}  # rows whose other fields change too (finished, logprob records)
    ended: list[int] = []  # (quiet) the rows that took EOS: no checkpoint, nothing streamed
    # a row that takes its token grows its output and content count and spends its budget by one, as
    # its seq_len: its offsets (``out_base``, ``end``, ``content_base``) stay
    for i, (token, lp, seq_len0, blocks0, buf0, out_base, end) in enumerate(
            zip(event.tokens, logprobs, hot[0], hot[1], hot[3], hot[4], hot[5], strict=True)):
        seq_len = seq_len0 + 1
        blocks = seq_len // block_size + 1  # kv.blocks_for: room for the next token included
        if blocks < blocks0:
            blocks = blocks0
        new_len.append(seq_len)
        new_blocks.append(blocks)
        if streaming is None and rows[i].cancel_requested:  # fed, but takes no token: the rest as it was
            cold[i] = {**hot_fields(*[column[i] for column in hot]), "seq_len": seq_len, "blocks": blocks,
                       "finished": True}
            new_buf.append(buf0)
            new_last.append(hot[7][i])
            continue
        new_buf.append(extended(buf0, seq_len0 - out_base, (token,)))
        if lp:
            cold[i] = {"logprob_records": rows[i].logprob_records + 1}
        if token in eos:
            cold.setdefault(i, {})["finished"] = True
            new_last.append(hot[7][i])
            ended.append(i)
            continue
        new_last.append(token)
        if streaming is not None:
            if streaming[i]:
                stream_tokens.append(token)
        else:
            fields = rows[i].__dict__
            checkpoints.append(fields["seq_id"])
            request = fields["request"]
            if request.streaming:
                stream_ids.append(request.id)
                stream_tokens.append(token)
                stream_logprobs.append(request.top_logprobs if fields["logprob_records"] or lp else 0)
        if seq_len >= end or seq_len >= seq_limit:  # the budget is spent (remaining 0) or the context is full
            cold.setdefault(i, {})["finished"] = True
    marked: Seq[int] = checkpoints
    to: Seq[int] = stream_ids
    sizes: Seq[int] = stream_logprobs
    if quiet is not None:
        if not ended:
            marked, to, sizes = quiet.ids, quiet.stream_ids, quiet.stream_logprobs
        else:  # the rows that took EOS neither checkpoint nor stream
            took_eos = set(ended)
            going = [seq for i, seq in enumerate(rows) if i not in took_eos]
            marked = [seq.seq_id for seq in going]
            to, sizes = recipients([seq for seq in going if seq.request.streaming])
    if marked:
        out.append(MarconiCheckpoints(tuple(marked)))
    if to:
        out.append(StreamOut(tuple(to), tuple(stream_tokens), logprobs=tuple(sizes) if any(sizes) else ()))
    columns: tuple[Seq[Any], ...] = (new_len, new_blocks, hot[2], new_buf, hot[4], hot[5], hot[6], new_last)
    rebuilt = {i: with_fields(rows[i], {**hot_fields(*[column[i] for column in columns]), **changes})
               for i, changes in cold.items()}
    return keep_batch(state, ordered, rows, columns, rebuilt)
