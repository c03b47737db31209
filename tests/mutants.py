"""The mutation suite: realistic bugs of core/, kept as data, that measure how much of the
scheduler's wrongness the model checker (``fxsched check``) and the tests can see (issue 16).

Each ``Mutant`` is one bug: an id, the file under core/, the exact original snippet (it must occur
exactly once in today's file: tests/test_mutants.py checks it in the default run, and the runner
refuses a mutant whose snippet no longer matches), its replacement, and a one-line description of
the bug it models. ``also`` holds further edits a bug needs (an import, a second site).

The bugs are the ones scheduler code really gets wrong: off-by-ones in budgets, lengths and
positions, a wrong comparison, a missing release, effects in the wrong order, a wrong finish
reason, a skipped fault-scope entry, a wrong compaction slot, a dropped cancel check, one draft
too many, a wrong chunk size, FIFO or SLAI order broken, a forgotten ``seq_len`` update, stale
drafts. None is one of the planted bugs (tests/planted_bugs.py), and none is equivalent (each can
change what the scheduler emits for some input; the closing notes of the runner's report say which
ones no oracle of the checker can see).

Run them with ``python tests/run_mutants.py`` (see its docstring).
"""

from __future__ import annotations

from dataclasses import dataclass

from support.mutation import Edit


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str
    old: str
    new: str
    description: str
    also: tuple[Edit, ...] = ()

    @property
    def module(self) -> str:
        """The core module the bug lives in (``admission``, ``tick``, ...)."""
        return self.file.removeprefix("core/").removesuffix(".py")

    @property
    def edits(self) -> tuple[Edit, ...]:
        return (Edit(self.file, self.old, self.new),) + self.also


def _m(id: str, file: str, old: str, new: str, description: str, also: tuple[Edit, ...] = ()) -> Mutant:
    return Mutant(id, f"core/{file}.py", old, new, description, also)


MUTANTS: tuple[Mutant, ...] = (
    # --- admission -------------------------------------------------------------------------------
    _m("admission_fifo_cap_plus_one", "admission",
       "    return pending[: max(cap, 0)]\n",
       "    return pending[: max(cap + 1, 0)]\n",
       "FIFO admission takes one request more than the free seats (batch-size bound broken)"),
    _m("admission_slai_sort_descending", "admission",
       "    rest = sorted(pending[1:], key=lambda r: r.prompt_len)\n",
       "    rest = sorted(pending[1:], key=lambda r: -r.prompt_len)\n",
       "SLAI seats the longest prompts first instead of the shortest"),
    _m("admission_reserve_overtakes", "admission",
       "        else:\n"
       "            return tuple(admitted), new[index:]\n"
       "    return tuple(admitted), ()\n",
       "        else:\n"
       "            deferred.append(request)\n"
       "    return tuple(admitted), tuple(deferred)\n",
       "the KV reservation skips a request that does not fit and admits later ones (overtaking)",
       (Edit("core/admission.py", "    admitted = []\n    for index, request in enumerate(new):\n",
             "    admitted: list[Request] = []\n    deferred: list[Request] = []\n"
             "    for index, request in enumerate(new):\n"),)),
    _m("admission_commitment_skips_prefilling", "admission",
       "    for p in state.prefilling:\n"
       "        total += commitment(model, config, p.request.prompt_len, p.request.max_tokens)\n",
       "",
       "the committed KV blocks forget the prompts still prefilling (over-admission)"),
    _m("admission_prompt_at_context_accepted", "admission",
       "    if request.prompt_len >= config.max_seq_len:\n",
       "    if request.prompt_len > config.max_seq_len:\n",
       "a prompt exactly as long as the context is admitted instead of refused"),
    # --- chunking --------------------------------------------------------------------------------
    _m("chunking_first_budget_swapped", "chunking",
       "    return beside_decodes(config, decoding) if anything_in_flight else config.max_batch_tokens\n",
       "    return config.max_batch_tokens if anything_in_flight else beside_decodes(config, decoding)\n",
       "chunk 0 gets the whole batch budget while others run, and one chunk when alone"),
    _m("chunking_next_over_budget", "chunking",
       "    chunk = min(prompt_len - offset, max_prefill_tokens)\n",
       "    chunk = min(prompt_len - offset, max_prefill_tokens + 1)\n",
       "a later chunk is one token over the prefill budget"),
    _m("prefill_idle_budget_while_decoding", "prefill",
       "    if config.idle_prefill_fills_budget and config.prefill_new_together and not state.rows:\n",
       "    if config.idle_prefill_fills_budget and config.prefill_new_together:\n",
       "a prompt's chunk takes the whole batch budget beside decoding streams, holding them for it"),
    _m("prefill_idle_budget_when_one_speculates", "prefill",
       "    if config.idle_prefill_fills_budget and config.prefill_new_together and not state.rows:\n",
       "    if config.idle_prefill_fills_budget and config.prefill_new_together and len(state.rows) <= 1:\n",
       "a lone decoding (or speculating) sequence waits on a whole-budget chunk"),
    _m("chunking_mixed_bound_one_stream_more", "chunking",
       "    return max(config.mixed_prefill_floor, config.mixed_prefill_per_decode * decoding)\n",
       "    return max(config.mixed_prefill_floor, config.mixed_prefill_per_decode * (decoding + 1))\n",
       "the mixed-prefill bound counts one decoding stream more than run, so its steps take too many prompt rows"),
    _m("prefill_mixed_bound_not_on_chunks", "prefill",
       "    return beside_decodes(config, len(state.rows))\n",
       "    return config.max_prefill_tokens\n",
       "a prompt's chunk beside decoding streams ignores the mixed-prefill bound"),
    _m("prefill_mixed_bound_not_on_waves", "prefill",
       "    left = min(bound, _step_rows(state, True))\n",
       "    left = _step_rows(state, True)\n",
       "a mixed step's prompts fill the step's row budget, not the mixed-prefill bound"),
    _m("prefill_mixed_bound_fill_skips_cut", "prefill",
       "        cap = min(limit, left) if group else limit\n",
       "        cap = limit\n",
       "the prompts after the first ride with whole chunks, over the rows the mixed-prefill bound leaves"),
    _m("prefill_mixed_wave_takes_the_batch_budget", "prefill",
       "    if mixed and config.idle_prefill_fills_budget:\n",
       "    if mixed and config.idle_prefill_fills_budget and len(state.prefilling) < 3:\n",
       "beside decoding streams, a queue of three or more prompts rides whole-budget waves"),
    _m("chunking_first_last_early", "chunking",
       "    return chunk, chunk == prompt_len\n",
       "    return chunk, chunk >= prompt_len - 1\n",
       "chunk 0 is marked last one token before the end of the prompt"),
    _m("chunking_no_alignment", "chunking",
       "    if not last and chunk >= 4:\n"
       "        chunk -= chunk % 4\n",
       "",
       "a non-last chunk is not cut down to a multiple of 4"),
    # --- verdict ---------------------------------------------------------------------------------
    _m("verdict_counts_all_matches", "verdict",
       "    n = 0\n"
       "    while n < limit and drafts[n] == rows[n]:\n"
       "        n += 1\n"
       "    return n\n",
       "    return sum(1 for i in range(limit) if drafts[i] == rows[i])\n",
       "the accepted prefix counts every matching draft, not only the leading run"),
    _m("verdict_width_four_with_two_drafts", "verdict",
       "    if draft_count >= 3 and keep >= 3:\n",
       "    if draft_count >= 3 and keep >= 2:\n",
       "a K = 4 verify is chosen with only two drafts kept"),
    _m("verdict_ladder_wide_batch", "verdict",
       "    ladder = 3 if active_count <= MTP_LADDER_WIDTH else 1\n",
       "    ladder = 3 if active_count <= MTP_LADDER_WIDTH + 1 else 1\n",
       "the MTP ladder keeps 3 drafts for nine active sequences"),
    # --- rows ------------------------------------------------------------------------------------
    _m("rows_two_rows_unsorted", "rows",
       "    return tuple(sorted(active, key=lambda s: s.slot)) if len(active) > 1 else active\n",
       "    return tuple(sorted(active, key=lambda s: s.slot)) if len(active) > 2 else active\n",
       "a batch of exactly two rows is not put in slot order"),
    _m("rows_block_table_shrinks", "rows",
       "    blocks = max(seq.blocks, blocks_for(seq_len, block_size))\n",
       "    blocks = blocks_for(seq_len, block_size)\n",
       "the block table shrinks with the KV length (after a rewind)"),
    _m("rows_host_pick_fixed_seed", "rows",
       "    return dc.HostPick(req.temperature, req.seed + produced, produced < req.min_tokens, req.top_logprobs,\n",
       "    return dc.HostPick(req.temperature, req.seed, produced < req.min_tokens, req.top_logprobs,\n",
       "every sampled decode row reuses the request's seed instead of seed + output length"),
    _m("rows_greedy_before_min_tokens", "rows",
       "    return req.temperature == 0 and req.top_logprobs == 0 and req.min_tokens <= produced\n",
       "    return req.temperature == 0 and req.top_logprobs == 0\n",
       "a greedy row below min_tokens takes the device argmax (EOS not masked)"),
    # --- watchdog --------------------------------------------------------------------------------
    _m("watchdog_budget_not_rewound", "watchdog",
       "remaining=seq.remaining + dropped,\n",
       "remaining=seq.remaining,\n",
       "a rollback drops tokens but does not give their budget back"),
    _m("watchdog_ring_cursor_stuck", "watchdog",
       "    return kept + ((slot, position),), (cursor + 1) % capacity, slot\n",
       "    return kept + ((slot, position),), cursor % capacity, slot\n",
       "the snapshot ring cursor never advances: every save overwrites one slot"),
    _m("watchdog_loop_due_off_by_one", "watchdog",
       "    return content_count >= CONTENT_LOOP_MIN and content_count % CONTENT_LOOP_EVERY == 0\n",
       "    return content_count > CONTENT_LOOP_MIN and content_count % CONTENT_LOOP_EVERY == 0\n",
       "the content-loop check first runs at 64 content tokens instead of 48"),
    _m("watchdog_rollback_streams", "watchdog",
       "    if not config.rollback_resteer or seq.has_cancel_flag or seq.request.streaming or not model.supports_rollback:\n",
       "    if not config.rollback_resteer or not model.supports_rollback:\n",
       "a streaming sequence is rolled back although its client has seen the dropped tokens"),
    # --- emit ------------------------------------------------------------------------------------
    _m("emit_plain_ignores_cancel", "emit",
       "    if seq.cancel_requested:\n"
       "        return replace(seq, finished=True)\n"
       "    armed = config.loop_watchdog and model is not None\n",
       "    armed = config.loop_watchdog and model is not None\n",
       "the plain decode sink drops the cancel check: a cancelled stream runs to its budget"),
    _m("emit_plain_budget_off_by_one", "emit",
       "    if remaining <= 0 or seq.seq_len + 1 >= config.max_seq_len:\n"
       "        return replace(seq, finished=True)\n",
       "    if remaining < 0 or seq.seq_len + 1 >= config.max_seq_len:\n"
       "        return replace(seq, finished=True)\n",
       "plain decode generates one token past the budget"),
    _m("emit_plain_eos_at_budget", "emit",
       "    if token in config.eos_set:\n"
       "        return replace(seq, output=seq.output.append(token), remaining=remaining,\n",
       "    if token in config.eos_set and remaining > 0:\n"
       "        return replace(seq, output=seq.output.append(token), remaining=remaining,\n",
       "an EOS on the last token of the budget is taken as a plain token (streamed, reason length)"),
    _m("emit_spec_fast_path_at_budget", "emit",
       "    if (n and not seq.cancel_requested and seq.remaining > n and seq_len + 1 < config.max_seq_len\n",
       "    if (n and not seq.cancel_requested and seq.remaining >= n and seq_len + 1 < config.max_seq_len\n",
       "the speculative fast path runs when the tokens use up the budget exactly: nothing finishes"),
    _m("emit_spec_fast_path_ignores_eos", "emit",
       "            and not config.loop_watchdog and config.eos_set.isdisjoint(tokens)):\n",
       "            and not config.loop_watchdog):\n",
       "the speculative fast path does not look for EOS among the verified tokens"),
    # --- retire ----------------------------------------------------------------------------------
    _m("retire_eos_beats_timeout", "retire",
       "    if guard == Guard.REQUEST_TIMEOUT:\n"
       "        return FinishReason.TIMEOUT\n"
       "    if last_token is not None and last_token in config.eos_set:\n"
       "        return FinishReason.STOP\n",
       "    if last_token is not None and last_token in config.eos_set:\n"
       "        return FinishReason.STOP\n"
       "    if guard == Guard.REQUEST_TIMEOUT:\n"
       "        return FinishReason.TIMEOUT\n",
       "a timed-out sequence whose last token is EOS reports stop instead of timeout"),
    _m("retire_budget_reason_stop", "retire",
       "    if remaining <= 0 or seq_len + 1 >= config.max_seq_len:\n"
       "        return FinishReason.LENGTH\n",
       "    if remaining < 0 or seq_len + 1 >= config.max_seq_len:\n"
       "        return FinishReason.LENGTH\n",
       "a sequence that used up its budget exactly reports stop instead of length"),
    _m("retire_acc_counts_first_token", "retire",
       "    return min(acc, max(completion_tokens - 1, 0))\n",
       "    return min(acc, completion_tokens)\n",
       "the reported acc may count the prefill's first token as an accepted draft"),
    _m("retire_survivor_at_n_not_moved", "retire",
       "        if slot >= n:\n"
       "            moves.append((index, free.pop()))\n",
       "        if slot > n:\n"
       "            moves.append((index, free.pop()))\n",
       "compaction leaves a survivor in slot n (just past the packed range) where it is"),
    _m("retire_finished_not_cached", "retire",
       "    out.append(ReleaseSeq(seq.seq_id, seq.slot, cache=True, reason=ReleaseReason.FINISH_SEQUENCE))\n",
       "    out.append(ReleaseSeq(seq.seq_id, seq.slot, cache=False, reason=ReleaseReason.FINISH_SEQUENCE))\n",
       "a finished sequence's blocks are freed without entering the prefix cache"),
    # --- faults ----------------------------------------------------------------------------------
    _m("faults_prefilling_slot_leaked", "faults",
       "            fail_request(entry.request, entry.seq_id, entry.slot, message, out)\n"
       "    for restoring in state.restoring:\n",
       "            fail_request(entry.request, entry.seq_id, None, message, out)\n"
       "    for restoring in state.restoring:\n",
       "a failed prompt that is still prefilling gets its Error but its slot is never released"),
    _m("faults_preempted_not_told", "faults",
       "    for held in state.preempted:\n"
       "        if held.sequence.seq_id in ids:\n"
       "            fail_request(held.sequence.request, held.sequence.seq_id, None, message, out)\n",
       "",
       "a failed sequence waiting preempted is dropped without an Error to its client"),
    _m("faults_failed_requests_still_start", "faults",
       "        return replace(state, new_requests=tuple(r for r in state.new_requests if r.id not in gone))\n",
       "        return state\n",
       "requests failed by an admission fault get their Error and still start"),
    _m("faults_error_cached", "faults",
       "        out.append(ReleaseSeq(seq_id, slot, cache=False, reason=ReleaseReason.SEND_ERROR))\n",
       "        out.append(ReleaseSeq(seq_id, slot, cache=True, reason=ReleaseReason.SEND_ERROR))\n",
       "a sequence failed by a device error is released into the prefix cache"),
    _m("faults_new_request_no_release", "faults",
       "            slot = _get(waiting, scope.slot) if scope.slot else None\n",
       "            slot = None\n",
       "a fault on a first prefill fails the request but does not release the slot it holds"),
    # --- memory ----------------------------------------------------------------------------------
    _m("memory_immunity_ignored", "memory",
       "    mortal = [s for s in active if len(s.output) >= s.immune_until] or list(active)\n",
       "    mortal = list(active)\n",
       "preemption ignores the immunity of a just-resumed sequence"),
    _m("memory_preempt_keeps_drafts", "memory",
       "    return replace(drop_drafts(state, (victim.seq_id,)), preempted=state.preempted + (entry,))\n",
       "    return replace(state, preempted=state.preempted + (entry,))\n",
       "a preempted sequence keeps its drafts, stale once it is re-prefilled"),
    _m("memory_swap_out_moves_lower_slot", "memory",
       "    if last.slot > victim.slot:\n",
       "    if last.slot != victim.slot:\n",
       "swap-out also moves the last sequence when it sits below the victim's slot"),
    _m("memory_preempt_loses_last_token", "memory",
       "    entry = Preempted(victim, victim.kv_tokens())\n",
       "    entry = Preempted(victim, victim.kv_tokens()[:-1])\n",
       "a preempted sequence is re-prefilled without the last token of its KV"),
    # --- verifying -------------------------------------------------------------------------------
    _m("verifying_k2_reject_commits_two", "verifying",
       "        out.append(dc.CommitAcceptedPrefix(seq.seq_id, 1, 2))\n",
       "        out.append(dc.CommitAcceptedPrefix(seq.seq_id, 2, 2))\n",
       "a rejected K = 2 verify commits both rows, the rejected draft's included"),
    _m("verifying_partial_forgets_anchor", "verifying",
       "        changes = settled(seq, pre_len, pre_len + k - (nd - na), out)\n",
       "        changes = settled(seq, pre_len, pre_len + k - (nd - na) - 1, out)\n",
       "a partial K = 3 / 4 accept rewinds the KV one row too far (drops the anchor)"),
    _m("verifying_full_accept_wrong_bonus", "verifying",
       "        seq = spec_tokens(seq, tuple(drafts[:nd]) + (rows[nd],), config, out, settled(seq, pre_len, pre_len + k, out))\n",
       "        seq = spec_tokens(seq, tuple(drafts[:nd]) + (rows[nd - 1],), config, out, settled(seq, pre_len, pre_len + k, out))\n",
       "a full accept emits the row of the last draft as the bonus token instead of the next row"),
    _m("verifying_propose_position_off", "verifying",
       "    query = dc.ProposeMulti(token=seq.last_token, pos=seq.seq_len, n=n, seq=seq_id)\n"
       "    return ask(state, out, query, AwaitProposal(seq_id, then), put)\n",
       "    query = dc.ProposeMulti(token=seq.last_token, pos=seq.seq_len - 1, n=n, seq=seq_id)\n"
       "    return ask(state, out, query, AwaitProposal(seq_id, then), put)\n",
       "a proposal is asked at the position of the last KV token, not after it"),
    _m("verifying_single_stash_row_zero", "verifying",
       "        out.append(dc.SaveHiddenForMtpFromStash(index))\n",
       "        out.append(dc.SaveHiddenForMtpFromStash(0))\n",
       "the lone unfinished sequence of a batched verify saves the hidden row of batch index 0"),
    _m("verifying_dflash_serial_short", "verifying",
       "    seq = grow(seq, pre + len(drafts) + 1, state.model.block_size)\n",
       "    seq = grow(seq, pre + len(drafts), state.model.block_size)\n",
       "a DFlash block verify records one row less in the KV than it feeds"),
    # --- tick ------------------------------------------------------------------------------------
    _m("tick_cap_ignores_prefilling", "tick",
       "        cap = state.config.max_batch_size - len(state.rows) - len(state.prefilling)\n",
       "        cap = state.config.max_batch_size - len(state.rows)\n",
       "admission forgets the prompts still prefilling when it counts free seats"),
    _m("tick_deferred_to_back", "tick",
       "    return replace(state, new_requests=admitted, pending=back + state.pending)\n",
       "    return replace(state, new_requests=admitted, pending=state.pending + back)\n",
       "requests deferred by the KV reservation go to the back of the queue (FIFO broken)"),
    _m("tick_arrivals_jump_queue", "tick",
       "        pending=state.pending + state.inbox,\n",
       "        pending=state.inbox + state.pending,\n",
       "new arrivals are queued ahead of the requests already waiting"),
    _m("tick_shutdown_with_new_requests", "tick",
       "    return bool(state.new_requests) or in_flight(state)\n",
       "    return in_flight(state)\n",
       "the idle check shuts a closed loop down while this tick's admitted requests have not started"),
    _m("tick_compaction_ignores_prefilling", "tick",
       "    pinned = tuple(e.slot for e in state.prefilling)\n",
       "    pinned = ()\n",
       "compaction forgets the slots of prompts still prefilling"),
    _m("tick_timeout_overrides_finish", "tick",
       "        if deadline is not None and not s.finished and deadline <= now:\n",
       "        if deadline is not None and deadline <= now:\n",
       "a sequence that already finished (EOS, budget) is relabelled a timeout at the deadline"),
    # --- flow ------------------------------------------------------------------------------------
    _m("flow_continuations_reversed", "flow",
       "    return push(state, *waiting.then) if waiting.then else state\n",
       "    return push(state, *reversed(waiting.then)) if waiting.then else state\n",
       "a forward's continuations run in reverse order"),
    _m("flow_prefix_hit_overwritten", "flow",
       "        state = replace(state, prefix_hits=state.prefix_hits + ((waiting.seq_ids[0], event.cached_tokens),))\n",
       "        state = replace(state, prefix_hits=((waiting.seq_ids[0], event.cached_tokens),))\n",
       "a prefix-cache hit replaces the hits remembered for other prompts in flight"),
    _m("flow_batched_prefix_hits_dropped", "flow",
       "        hits = tuple((seq_id, n) for seq_id, n in event.cached_by_seq if n and seq_id in waiting.seq_ids)\n",
       "        hits = ()\n",
       "the prefix-cache hits of a batched or mixed forward's first chunks are never reported"),
    _m("flow_batched_prefix_hits_first_only", "flow",
       "        hits = tuple((seq_id, n) for seq_id, n in event.cached_by_seq if n and seq_id in waiting.seq_ids)\n",
       "        hits = tuple((waiting.seq_ids[0], n) for _, n in event.cached_by_seq[:1])\n",
       "a batched forward's first hit is credited to the forward's first sequence, the rest dropped"),
    _m("flow_first_continuation_dropped", "flow",
       "    return push(state, *waiting.then) if waiting.then else state\n",
       "    return push(state, *waiting.then[1:]) if waiting.then else state\n",
       "a forward's first continuation is dropped when the forward is done"),
    # --- prefill ---------------------------------------------------------------------------------
    _m("prefill_one_token_budget_runs_on", "prefill",
       "    if is_eos or request.max_tokens <= 1:\n",
       "    if is_eos or request.max_tokens < 1:\n",
       "a request for one token becomes active and decodes past its budget"),
    _m("prefill_remembered_cancel_lost", "prefill",
       "has_cancel_flag=request.streaming, cancel_requested=cancelled, cached=cached,\n",
       "has_cancel_flag=request.streaming, cancel_requested=False, cached=cached,\n",
       "a cancel that came before the request became active is forgotten"),
    _m("prefill_batch_pick_row_skips_decode", "prefill",
       "        picks = [PickPrefillToken(e.seq_id, n + r)\n",
       "        picks = [PickPrefillToken(e.seq_id, r)\n",
       "a batched mixed step reads a finished prompt's first token from a decode row"),
    _m("prefill_mixed_pick_row_off", "prefill",
       "        pick = (PickPrefillToken(head.seq_id, len(ids)), Barrier()) if last else ()\n",
       "        pick = (PickPrefillToken(head.seq_id, len(ids) - 1), Barrier()) if last else ()\n",
       "a mixed step reads the prompt's first token from the last decode row"),
    _m("prefill_chunk0_offset_short", "prefill",
       "    entry = PrefillEntry(task.seq_id, task.request, task.slot, task.chunk)\n",
       "    entry = PrefillEntry(task.seq_id, task.request, task.slot, task.chunk - 1)\n",
       "after chunk 0 the next chunk starts one token early (re-prefills a token)"),
    _m("prefill_promote_first_to_last", "prefill",
       "    for entry in reversed(state.prefilling):\n",
       "    for entry in state.prefilling:\n",
       "finished prompts are promoted first to last instead of last to first"),
    # --- decode ----------------------------------------------------------------------------------
    _m("decode_preempts_lone_row", "decode",
       "        if event.kv_exhausted and len(waiting.seq_ids) > 1:\n",
       "        if event.kv_exhausted and len(waiting.seq_ids) >= 1:\n",
       "a KV-full decode of one row preempts it instead of failing it"),
    _m("decode_seq_len_not_advanced", "decode",
       "        seq = grow(seq, seq.seq_len + 1, block_size)\n"
       "        updated[seq_id] = plain_token(seq, token, config, out, lp, state.model)\n",
       "        updated[seq_id] = plain_token(seq, token, config, out, lp, state.model)\n",
       "a plain decode does not advance seq_len over the fed token"),
    _m("ahead_ngram_with_many", "ahead",  # (the decode lane's choice lives in ahead.speculation_lane)
       "    if config.ngram_speculative and len(active) == 1 and covered:\n",
       "    if config.ngram_speculative and len(active) >= 1 and covered:\n",
       "n-gram drafting is chosen with more than one active sequence"),
    _m("decode_forgets_decode_time", "decode",
       '        return plain_decode(update(state, out, {"last_decode_ms": state.now_ms}), _PLAIN_DECODE, out)\n',
       '        return plain_decode(state, _PLAIN_DECODE, out)\n',
       "a decode step does not reset SLAI's time since the last decode (prefills held back for good)"),
    # --- spec_step -------------------------------------------------------------------------------
    _m("spec_step_bootstrap_also_verified", "spec_step",
       "        verify = tuple(i for i in ids if i in held)\n",
       "        verify = ids\n",
       "a sequence bootstrapped this step is verified in the same step"),
    _m("spec_step_capacity_ignores_base", "spec_step",
       "    count = min((waiting.base,) + event.capacities)\n",
       "    count = min(event.capacities) if event.capacities else waiting.base\n",
       "the draft count ignores the configured count and follows the slots' capacity alone"),
    _m("spec_step_zero_capacity_speculates", "spec_step",
       "    if count < 1:  # no slot can hold a draft this step: decode plainly\n",
       "    if count < 0:  # no slot can hold a draft this step: decode plainly\n",
       "a step whose slots hold no draft still speculates (with zero drafts)"),
    _m("spec_step_checkpoint_kinds_swapped", "spec_step",
       "    if waiting.then is AfterProposal.MARCONI:\n",
       "    if waiting.then is AfterProposal.CHECKPOINT:\n",
       "the checkpoint after a proposal is the other kind (Marconi vs async)",
       (Edit("core/spec_step.py", "    elif waiting.then is AfterProposal.CHECKPOINT:\n",
             "    elif waiting.then is AfterProposal.MARCONI:\n"),)),
    # --- kverify ---------------------------------------------------------------------------------
    _m("kverify_commit_ctx_off", "kverify",
       "        out.append(dc.CommitCtx(seq.seq_id, na + 1, waiting.pre_len, 0))\n",
       "        out.append(dc.CommitCtx(seq.seq_id, na, waiting.pre_len, 0))\n",
       "a serial DFlash verify commits the drafter context without the bonus row"),
    _m("kverify_keep_ignores_count", "kverify",
       "    keep = min(len(mine), task.draft_count)\n",
       "    keep = len(mine)\n",
       "a serial MTP verify keeps more drafts than this step's draft count"),
    _m("kverify_mtp_decode_no_hidden", "kverify",
       "    out.append(dc.SaveHiddenForMtp(0))\n"
       "    return propose(state, waiting.seq_id, waiting.draft_count, out, then=AfterProposal.CHECKPOINT)\n",
       "    return propose(state, waiting.seq_id, waiting.draft_count, out, then=AfterProposal.CHECKPOINT)\n",
       "the MTP bootstrap proposes without saving the decode's hidden state"),
    _m("kverify_dflash_block_at_three", "kverify",
       "        if keep >= 4:\n",
       "        if keep >= 3:\n",
       "a serial DFlash verify of three drafts takes the block-verify path"),
    # --- dflash ----------------------------------------------------------------------------------
    _m("dflash_serial_settle_short", "dflash",
       "    changes = settled(seq, pre, pre + na + 1, out)\n",
       "    changes = settled(seq, pre, pre + na, out)\n",
       "a DFlash block verify rewinds the KV over the bonus row's input too"),
    _m("dflash_gate_mixes_gammas", "dflash",
       "        batchable = tuple(i for i in task.seq_ids if len(held[i]) == gamma)\n"
       "        rest = tuple(i for i in task.seq_ids if len(held[i]) != gamma)\n",
       "        batchable = tuple(i for i in task.seq_ids if len(held[i]) >= gamma)\n"
       "        rest = tuple(i for i in task.seq_ids if len(held[i]) < gamma)\n",
       "the DFlash gate batches sequences holding more drafts than the first one"),
    _m("dflash_gate_forgets_rest", "dflash",
       "    singles = {i for c in chunks if len(c) < 2 for i in c} | set(waiting.rest)\n",
       "    singles = {i for c in chunks if len(c) < 2 for i in c}\n",
       "sequences the DFlash gate could not batch are not verified this step"),
    _m("dflash_batched_stash_row_off", "dflash",
       "    out.append(dc.StashVerifyHiddenRows(tuple(map(add, range(0, k * count, k), nas))))\n",
       "    out.append(dc.StashVerifyHiddenRows(tuple(map(add, range(1, k * count + 1, k), nas))))\n",
       "a batched DFlash verify stashes the hidden row after the last accepted one"),
    _m("dflash_batched_reproposes_finished", "dflash",
       "        done = set(finished_rows)\n",
       "        done = set()\n",
       "a batched DFlash verify trims and re-proposes sequences that just finished"),
    _m("dflash_verified_commit_short", "dflash",
       "    out.append(dc.CommitAcceptedPrefix(seq.seq_id, na + 1, k))\n"
       "    out.append(dc.SaveHiddenForMtp(na))\n",
       "    out.append(dc.CommitAcceptedPrefix(seq.seq_id, na, k))\n"
       "    out.append(dc.SaveHiddenForMtp(na))\n",
       "a DFlash block verify commits the accepted drafts without the bonus row"),
    # --- mtp_batch -------------------------------------------------------------------------------
    _m("mtp_batch_feeds_extra_draft", "mtp_batch",
       "        mine = held_drafts.get(seq_id, ())[: k - 1]\n",
       "        mine = held_drafts.get(seq_id, ())[:k]\n",
       "a batched MTP verify feeds one draft more than its depth"),
    _m("mtp_batch_catchup_position_off", "mtp_batch",
       "            pos=tuple(active[seq_id].seq_len - len(c) for (_, seq_id), c in zip(pending, caught, strict=True)),\n",
       "            pos=tuple(active[seq_id].seq_len - len(c) - 1 for (_, seq_id), c in zip(pending, caught, strict=True)),\n",
       "the batched catch-up starts one position early"),
    _m("mtp_batch_stash_row_off", "mtp_batch",
       "    out.append(dc.StashVerifyHiddenRows(tuple(o + na for o, na in zip(offsets, nas, strict=True))))\n",
       "    out.append(dc.StashVerifyHiddenRows(tuple(o + na + 1 for o, na in zip(offsets, nas, strict=True))))\n",
       "a batched MTP verify stashes the hidden row after the accepted prefix's"),
    _m("mtp_batch_gate_short_drafts", "mtp_batch",
       "    batchable = [i for i in seq_ids if len(drafts.get(i, ())) >= draft_count]\n"
       "    serial = [i for i in seq_ids if len(drafts.get(i, ())) < draft_count]\n",
       "    batchable = [i for i in seq_ids if len(drafts.get(i, ())) >= draft_count - 1]\n"
       "    serial = [i for i in seq_ids if len(drafts.get(i, ())) < draft_count - 1]\n",
       "the MTP gate batches a sequence holding one draft fewer than the step's count"),
    _m("mtp_batch_fold_after_commits", "mtp_batch",
       "    out.append(dc.GdnFoldAccepted(tuple(active[i].slot for i in waiting.seq_ids), tuple(na + 1 for na in nas),\n"
       "                                  max(waiting.ks)))\n"
       "    for i, (seq_id, k) in enumerate(zip(waiting.seq_ids, waiting.ks, strict=True)):\n"
       "        rows = event.rows[offsets[i]:offsets[i] + k]\n"
       "        nd = min(len(waiting.drafts[i]), k - 1)\n"
       "        state = shared_verdict(state, active[seq_id], waiting.drafts[i], rows, k, nas[i], nd, waiting.pre_lens[i],\n"
       "                               waiting.draft_count, out, deferred=True)\n",
       "    for i, (seq_id, k) in enumerate(zip(waiting.seq_ids, waiting.ks, strict=True)):\n"
       "        rows = event.rows[offsets[i]:offsets[i] + k]\n"
       "        nd = min(len(waiting.drafts[i]), k - 1)\n"
       "        state = shared_verdict(state, active[seq_id], waiting.drafts[i], rows, k, nas[i], nd, waiting.pre_lens[i],\n"
       "                               waiting.draft_count, out, deferred=True)\n"
       "    out.append(dc.GdnFoldAccepted(tuple(active[i].slot for i in waiting.seq_ids), tuple(na + 1 for na in nas),\n"
       "                                  max(waiting.ks)))\n",
       "a batched MTP verify folds the GDN state after the per-sequence commits"),
    _m("mtp_batch_catches_up_finished", "mtp_batch",
       "    pending = [(i, seq_id) for i, seq_id in enumerate(waiting.seq_ids) if not active[seq_id].finished]\n",
       "    pending = [(i, seq_id) for i, seq_id in enumerate(waiting.seq_ids)]\n",
       "a batched MTP verify catches up and re-proposes sequences that just finished"),
    # --- ngram -----------------------------------------------------------------------------------
    _m("ngram_reject_seq_len_kept", "ngram",
       "        seq = replace(seq, seq_len=waiting.pre_len + 1)\n",
       "",
       "a rejected n-gram draft is cut from the device but seq_len is not rewound"),
    _m("ngram_reject_truncate_off", "ngram",
       "        out.append(dc.TruncateSequence(seq.seq_id, waiting.pre_len + 1))\n",
       "        out.append(dc.TruncateSequence(seq.seq_id, waiting.pre_len + 2))\n",
       "a rejected n-gram draft is cut one position too late (the draft stays in the KV)"),
    _m("ngram_reject_emits_bonus_row", "ngram",
       "        seq = spec_token(seq, v0, state.config, out)\n",
       "        seq = spec_token(seq, v1, state.config, out)\n",
       "a rejected n-gram draft emits the row after the draft instead of the model's token"),
    _m("ngram_decode_no_growth", "ngram",
       "        state = put_seq(state, grow(seq, seq.seq_len + 1, state.model.block_size))\n"
       "        read = AskQuery(row_query(seq), AwaitNgramDecode(seq.seq_id))\n",
       "        read = AskQuery(row_query(seq), AwaitNgramDecode(seq.seq_id))\n",
       "an n-gram step's plain decode does not advance seq_len"),
    _m("ngram_match_includes_suffix", "ngram",
       "    limit = (size - 1) * width  # a match ends before the last token: s + n <= size - 1\n",
       "    limit = size * width\n",
       "the n-gram search may match the suffix with itself"),
    # --- self_spec -------------------------------------------------------------------------------
    _m("self_spec_kept_short", "self_spec",
       "    kept = waiting.pre_len + 1 + accepted\n",
       "    kept = waiting.pre_len + accepted\n",
       "a self-spec verify keeps one row less than the first token plus the accepted drafts"),
    _m("self_spec_no_bonus", "self_spec",
       "    else:\n"
       "        emitted.append(rows[len(waiting.drafts)])\n",
       "",
       "a fully accepted self-spec verify emits no bonus token"),
    _m("self_spec_one_draft_too_many", "self_spec",
       "    if len(waiting.drafts) < waiting.draft_count:\n",
       "    if len(waiting.drafts) <= waiting.draft_count:\n",
       "self-spec drafts one token more than the draft count"),
    _m("self_spec_draft_decodes_not_rewound", "self_spec",
       "    if seq.seq_len > pre:\n"
       "        out.append(dc.TruncateSequence(seq.seq_id, pre))\n",
       "",
       "the draft decodes are not cut from the device before the verify"),
    _m("self_spec_ssm_rollback_count", "self_spec",
       "        out.append(dc.RollbackSsmStates(seq.seq_id, accepted + 1))\n",
       "        out.append(dc.RollbackSsmStates(seq.seq_id, accepted))\n",
       "a partial self-spec accept rolls the SSM state back to one step too early"),
    # --- lifecycle -------------------------------------------------------------------------------
    _m("lifecycle_swap_in_past_batch", "lifecycle",
       "    return len(state.rows) + len(state.prefilling) < state.config.max_batch_size\n",
       "    return len(state.rows) + len(state.prefilling) <= state.config.max_batch_size\n",
       "swap-in and requeue resume fill the batch one past max_batch_size"),
    _m("lifecycle_requeue_exact_fit_refused", "lifecycle",
       "    if want > state.model.total_blocks:\n",
       "    if want >= state.model.total_blocks:\n",
       "a preempted sequence that needs exactly the device's blocks is failed instead of resumed"),
    _m("lifecycle_restore_error_no_release", "lifecycle",
       "        out.append(ReleaseSeq(seq.seq_id, waiting.slot, cache=False, reason=ReleaseReason.SEND_ERROR))\n",
       "",
       "a failed restore sends the Error but never releases the slot it was given"),
    _m("lifecycle_swap_in_strict_fit", "lifecycle",
       "    fitting = next((w for w in state.swapped if w.sequence.blocks <= free), None)\n",
       "    fitting = next((w for w in state.swapped if w.sequence.blocks < free), None)\n",
       "a swapped sequence that needs exactly the free blocks is not brought back"),
    _m("lifecycle_resume_stays_preempted", "lifecycle",
       "    state = replace(state, preempted=tuple(p for p in state.preempted if p is not entry),\n"
       "                    active=state.active + (seq,))\n",
       "    state = replace(state, active=state.active + (seq,))\n",
       "a resumed sequence also stays in the preempted queue"),
    _m("lifecycle_resume_no_immunity", "lifecycle",
       "ring_cursor=0, immune_until=len(seq.output) + state.config.preemption_immunity_tokens)\n",
       "ring_cursor=0)\n",
       "a resumed sequence gets no preemption immunity"),
    # --- issue 34: timeliness, liveness, rare states, frame order, EP words ------------------------
    _m("state_next_deadline_latest", "state",
       "            if due is not None and (deadline is None or due < deadline):\n",
       "            if due is not None and (deadline is None or due > deadline):\n",
       "the batch's next deadline is the latest of its rows, so an earlier one waits for it"),
    _m("tick_deadline_strict", "tick",
       "        if deadline is not None and not s.finished and deadline <= now:\n",
       "        if deadline is not None and not s.finished and deadline < now:\n",
       "a deadline equal to the tick's clock times out one tick late"),
    _m("tick_idle_ignores_preempted", "tick",
       "    if not in_flight(state) and not state.swapped and not state.preempted and queue_idle(state):\n",
       "    if not in_flight(state) and not state.swapped and queue_idle(state):\n",
       "the loop waits for input while a preempted sequence waits to be resumed"),
    _m("tick_idle_ignores_swapped", "tick",
       "    if not in_flight(state) and not state.swapped and not state.preempted and queue_idle(state):\n",
       "    if not in_flight(state) and not state.preempted and queue_idle(state):\n",
       "the loop waits for input while a swapped sequence waits to come back"),
    _m("rows_grow_shrinks", "rows",
       "    blocks = max(seq.blocks, blocks_for(seq_len, block_size))\n",
       "    blocks = blocks_for(seq_len, block_size)\n",
       "a sequence's block count follows its length down after a rejected verify that crossed a block"),
    _m("dflash_batched_blocks_shrink", "dflash",
       "        blocks = blocks0 if blocks0 >= need else need\n",
       "        blocks = (pre + n) // block_size + 1\n",
       "the batched DFlash verify records blocks for the accepted length, not the rows it fed"),
    _m("emit_spec_min_tokens_off_by_one", "emit",
       "            if before >= req.min_tokens:\n",
       "            if count >= req.min_tokens:\n",
       "the speculative sink lets EOS finish one token before min_tokens is reached"),
    _m("rows_verify_picks_unmasked", "rows",
       "    return tuple([dc.HostPick(req.temperature, req.seed + produced + i, produced + i < req.min_tokens,\n",
       "    return tuple([dc.HostPick(req.temperature, req.seed + produced + i, produced < req.min_tokens,\n",
       "a verify masks EOS on all its rows or none by the first row's position, not each row's"),
    _m("emit_stream_before_checkpoint", "emit",
       "    out.append(MarconiCheckpoint(seq.seq_id))\n    stream_token(seq, token, out)\n",
       "    stream_token(seq, token, out)\n    out.append(MarconiCheckpoint(seq.seq_id))\n",
       "the plain sink streams a token before its checkpoint"),
    _m("decode_stream_before_checkpoints", "decode",
       "    if marked:\n        out.append(MarconiCheckpoints(tuple(marked)))\n    if to:\n"
       "        out.append(StreamOut(tuple(to), tuple(stream_tokens), logprobs=tuple(sizes) if any(sizes) else ()))\n",
       "    if to:\n        out.append(StreamOut(tuple(to), tuple(stream_tokens), logprobs=tuple(sizes) if any(sizes) else ()))\n"
       "    if marked:\n        out.append(MarconiCheckpoints(tuple(marked)))\n",
       "the batched plain sink streams the tokens before their checkpoints"),
    _m("rows_ep_preamble_chunk_is_prompt", "rows",
       "    out.append(dc.EpBroadcastCmd(chunk))\n",
       "    out.append(dc.EpBroadcastCmd(len(prompt)))\n",
       "the EP prefill preamble announces the whole prompt as the chunk of a chunked prefill"),
    _m("rows_ep_preamble_start_zero", "rows",
       "    out.append(dc.EpBroadcastCmd(start))\n",
       "    out.append(dc.EpBroadcastCmd(0))\n",
       "the EP prefill preamble announces every chunk from the prompt's start"),
    _m("table_gate_fails_batchable_only", "table",
       "    ph.AwaitDflashGate: Phase((ev.BatchVerifyAllowed,), FailSeqs((\"batchable\", \"rest\")), dflash.gate_answer),\n",
       "    ph.AwaitDflashGate: Phase((ev.BatchVerifyAllowed,), FailSeqs((\"batchable\",)), dflash.gate_answer),\n",
       "a fault of the DFlash gate fails only its batchable sequences; the rest are verified on as if nothing failed"),
    _m("table_capacity_fault_fails_nobody", "table",
       "    ph.AwaitCapacity: Phase((ev.DraftCapacity,), FailActive(), spec_step.capacity),\n",
       "    ph.AwaitCapacity: Phase((ev.DraftCapacity,), RuleTakesFault(), spec_step.capacity),\n",
       "a fault of the draft-capacity query is left to a rule that does not take it: nobody is failed"),
    # --- async scheduling: decodes answered ahead (specs/async.md §16.6) -------------------------------
    _m("ahead_fed_past_budget", "ahead",
       "    return remaining <= 1 or seq_len + 1 >= config.max_seq_len\n",
       "    return remaining <= 0 or seq_len + 1 >= config.max_seq_len\n",
       "a sequence whose kept token is its last is fed again: the device computes a token past the budget"),
    _m("ahead_fed_past_context", "ahead",
       "    return remaining <= 1 or seq_len + 1 >= config.max_seq_len\n",
       "    return remaining <= 1 or seq_len >= config.max_seq_len\n",
       "a sequence whose kept token fills the context is fed again, one row past the context ceiling"),
    _m("ahead_went_ahead_no_blocks", "ahead",
       '    changes: dict[str, object] = {"seq_len": seq_len, "blocks": max(seq.blocks, blocks_for(seq_len, block_size))}\n',
       '    changes: dict[str, object] = {"seq_len": seq_len, "blocks": seq.blocks}\n',
       "a decode answered ahead grows the sequence without growing its block count past a block boundary"),
    _m("ahead_resolve_keeps_ahead", "ahead",
       '        settled = with_fields(seq, {"last_token": seq.output.last})\n',
       '        settled = seq\n',
       "a sequence resolved to EOS still counts as ahead: a read asks for a kept token it no longer holds"),
    _m("ahead_pick_seed_without_kept", "ahead",
       "    return out_len + (1 if last_token == LATE_TOKEN else 0)\n",
       "    return out_len\n",
       "a sampled row after a kept token draws with the seed of the kept token's position (one position behind)"),
    _m("ahead_logprob_rows_ahead", "ahead",
       "            and all(s.request.top_logprobs == 0 for s in rows))\n",
       "            and True)\n",
       "rows asking for logprob records are answered ahead, their record sizes lost with the late tokens"),
    _m("ahead_settled_ignores_waiting", "ahead",
       "    return bool(state.new_requests or state.pending or state.prefilling or state.rotations or state.swapped\n",
       "    return bool(state.new_requests or state.prefilling or state.rotations or state.swapped\n",
       "requests waiting for a seat do not settle the kept tokens: the seats they free are counted a tick late"),
    _m("ahead_speculates_unsettled", "ahead",
       "                or speculation_lane(state) is not None)\n",
       "                )\n",
       "a tick that speculates does not read the kept tokens first: its step drafts from a token it does not hold",
       also=(Edit("core/decode.py", "    if lane is None or any_ahead(state):\n", "    if lane is None:\n"),)),
    _m("decode_resolve_fed_only", "decode",
       "    resolve = tuple([s.seq_id for s in active if s.ahead])\n",
       "    resolve = tuple([s.seq_id for s in fed if s.ahead])\n",
       "a pipelined decode resolves only the kept tokens it feeds: a sequence not fed again never gets its last one"),
    _m("decode_feeds_previous_token", "decode",
       "        tokens=tuple([LATE_TOKEN if s.ahead else s.last_token for s in fed]),\n",
       "        tokens=tuple([s.output.last if s.ahead else s.last_token for s in fed]),\n",
       "a pipelined decode feeds a sequence that is ahead its previous token instead of the one kept on the device"),
    _m("decode_fault_drops_resolved_tokens", "decode",
       "        if resolve:\n            state = resolve_tokens(state, resolve, event.earlier, (), out)\n",
       "        if resolve:\n            return fail_sequences(state, set(resolve) | set(waiting.seq_ids), event.message, out)\n",
       "a pipelined decode that fails at its launch fails the sequences whose kept tokens it could still read"),
    _m("decode_ahead_rows_of_finished", "decode",
       "        if row is None or seq.finished:  # not in the decode, or just finished: its row is dropped\n",
       "        if row is None:  # not in the decode\n",
       "a row computed ahead for a sequence its resolved EOS just ended is taken: the sequence goes ahead again"),
    _m("decode_late_failure_resolved_only", "decode",
       "            return fail_sequences(state, set(resolve) | set(waiting.seq_ids), event.message, out)\n",
       "            return fail_sequences(state, set(resolve), event.message, out)\n",
       "a kept decode that failed afterwards fails only the sequences it was to resolve, not the decode's own rows"),
    # --- a steady batch ahead, over the hot columns (specs/async.md §16.6 rule 7) ------------------------
    _m("ahead_columns_no_blocks", "ahead_columns",
       "        new_blocks.append(max(b0, blocks_for(s1, block_size)))\n",
       "        new_blocks.append(b0)\n",
       "a steady batch sent ahead over the columns grows seq_len past a block boundary without a new block"),
    _m("ahead_columns_offsets_kept", "ahead_columns",
       "                column[i] += 1\n",
       "                column[i] += 0\n",
       "a row sent ahead for the first time over the columns keeps its offsets: its output and budget gain a "
       "token it does not hold"),
    _m("ahead_columns_eos_goes_ahead", "ahead_columns",
       "            if token in eos:  # resolved to EOS: the record sink ends it; its row computed ahead is dropped\n",
       "            if token in eos and False:\n",
       "a row of a steady batch resolved to EOS takes it as any token: streamed, and sent ahead again"),
    _m("ahead_columns_resolved_unstreamed", "ahead_columns",
       "            if streaming[i]:\n",
       "            if streaming[i] and i % 2:\n",
       "the resolved tokens of every other streaming row of a steady batch are never streamed"),
    _m("ahead_columns_last_fed_again", "ahead_columns",
       "            if kept_is_last(end - seq_len, seq_len, config):\n                return None\n",
       "            if False:\n                return None\n",
       "a steady batch feeds again a row whose kept token is its last: a token past the budget is computed"),
    _m("tick_no_retire_after_resolve", "tick",
       "        return push(state, ResolveAhead(), RetireResolved(), TickStart())\n",
       "        return push(state, ResolveAhead(), TickStart())\n",
       "after the kept tokens are read at a tick's start, the sequences they ended keep their seats through admission"),
    _m("tick_deadline_without_resolve", "tick",
       "    if ahead_past_deadline(state):  # its token is read first, to time it out with the token taken (§16.6)\n",
       "    if False:  # its token is read first, to time it out with the token taken (§16.6)\n",
       "a sequence past its deadline while its token is on the device times out without that token"),
    # --- ledgers and the EP words that report a result (issue 52 items 3-4) -----------------------------
    _m("lifecycle_resume_skips_adapter", "lifecycle",
       "    out.append(dc.AcquireAdapterSlot(seq.request.adapter_slot))\n    ep_prefill_preamble(",
       "    ep_prefill_preamble(",
       "a requeued sequence is prefilled again without acquiring its adapter slot"),
    _m("lifecycle_resume_acquires_base_adapter", "lifecycle",
       "    out.append(dc.AcquireAdapterSlot(seq.request.adapter_slot))\n    ep_prefill_preamble(",
       "    out.append(dc.AcquireAdapterSlot(-1))\n    ep_prefill_preamble(",
       "a requeued sequence comes back on the base model instead of its request's adapter"),
    _m("lifecycle_restore_fail_releases_stale_slot", "lifecycle",
       "        out.append(ReleaseSeq(seq.seq_id, waiting.slot, cache=False, reason=ReleaseReason.SEND_ERROR))\n",
       "        out.append(ReleaseSeq(seq.seq_id, seq.slot, cache=False, reason=ReleaseReason.SEND_ERROR))\n",
       "a failed swap-in releases the slot the sequence held before its spill, not the one it was just given"),
    _m("lifecycle_swap_in_keeps_swapped", "lifecycle",
       "    state = replace(state, swapped=tuple(w for w in state.swapped if w is not fitting),\n",
       "    state = replace(state, swapped=state.swapped,\n",
       "a swapped-in sequence stays on the swapped list too: it is restored a second time later"),
    _m("ngram_accept_word_inverted", "ngram",
       "    out.append(dc.EpBroadcastCmd(1 if accepted else 0))\n",
       "    out.append(dc.EpBroadcastCmd(0 if accepted else 1))\n",
       "the n-gram verify's accept word reports the opposite of what the verify accepted (workers keep wrong rows)"),
    # --- issue 52: orders between two effects (runtime/check/orderings.py, specs/checker.md §11.7) ----------
    _m("rows_barrier_wait_before_record", "rows",
       "    out.append(dc.RecordEvent(state.prefill_event, state.prefill_stream))\n"
       "    out.append(dc.StreamWaitEvent(0, state.prefill_event))\n",
       "    out.append(dc.StreamWaitEvent(0, state.prefill_event))\n"
       "    out.append(dc.RecordEvent(state.prefill_event, state.prefill_stream))\n",
       "the prefill barrier waits for its event before recording it: the decode stream reads a chunk's rows "
       "without waiting for them"),
    _m("decode_lane_no_barrier", "decode",
       "    if state.prefilling:\n        prefill_barrier(state, out)\n",
       "",
       "lane 3 runs while a prompt still prefills without the barrier on the prefill stream"),
    _m("verifying_sync_after_words", "verifying",
       "    out.append(dc.SyncSecondaryCall())\n"
       "    out.append(dc.EpBroadcastCmdForSeq(seq.slot, VERIFY_CMD[k]))\n"
       "    for token in inputs:\n"
       "        out.append(dc.EpBroadcastCmd(token))\n",
       "    out.append(dc.EpBroadcastCmdForSeq(seq.slot, VERIFY_CMD[k]))\n"
       "    for token in inputs:\n"
       "        out.append(dc.EpBroadcastCmd(token))\n"
       "    out.append(dc.SyncSecondaryCall())\n",
       "a K verify's EP words go out before its sync_secondary"),
    _m("mtp_batch_verify_unsynced", "mtp_batch",
       "    out.append(dc.SyncSecondaryCall())\n    seqs = [active[i] for i in batch.seq_ids]\n",
       "    seqs = [active[i] for i in batch.seq_ids]\n",
       "a batched MTP verify runs without the sync_secondary before it"),
    _m("dflash_batched_unstashed", "dflash",
       "    out.append(dc.StashVerifyHiddenRows(tuple(map(add, range(0, k * count, k), nas))))\n",
       "",
       "a batched DFlash verify re-proposes without stashing its hidden rows (the proposal reads an older stash)"),
    _m("mtp_batch_catchup_before_its_rows", "mtp_batch",
       "    if pairs:\n        out.append(dc.StashVerifyCatchupRows(tuple(pairs)))\n",
       "",
       "a batched MTP verify stashes its catch-up rows after the catch-up that reads them",
       (Edit("core/mtp_batch.py",
             "            pos=tuple(active[seq_id].seq_len - len(c) for (_, seq_id), c in zip(pending, caught, strict=True)),\n"
             "        ))\n",
             "            pos=tuple(active[seq_id].seq_len - len(c) for (_, seq_id), c in zip(pending, caught, strict=True)),\n"
             "        ))\n"
             "        if pairs:\n            out.append(dc.StashVerifyCatchupRows(tuple(pairs)))\n"),)),
    _m("self_spec_checkpoint_before_rewind", "self_spec",
       "    if seq.seq_len > pre:\n"
       "        out.append(dc.TruncateSequence(seq.seq_id, pre))\n"
       "    out.append(dc.CheckpointSsmStates(seq.seq_id))\n",
       "    out.append(dc.CheckpointSsmStates(seq.seq_id))\n"
       "    if seq.seq_len > pre:\n"
       "        out.append(dc.TruncateSequence(seq.seq_id, pre))\n",
       "the self-speculative step checkpoints the SSM states before rewinding its draft decodes"),
    _m("emit_checkpoint_before_snapshot", "emit",
       "    if model is not None and snapshot_wanted(seq, token, config, model):\n"
       "        seq = save_snapshot(seq, model, out)\n"
       "    out.append(MarconiCheckpoint(seq.seq_id))\n",
       "    out.append(MarconiCheckpoint(seq.seq_id))\n"
       "    if model is not None and snapshot_wanted(seq, token, config, model):\n"
       "        seq = save_snapshot(seq, model, out)\n",
       "the plain sink checkpoints a boundary token before saving its SSM snapshot"),
    _m("tick_mixed_adapters_keeps_cohorts", "tick",
       "    if not state.config.mixed_adapters:\n        same, other = admission.cohort_split(",
       "    if True:\n        same, other = admission.cohort_split(",
       "with mixed_adapters (production) the admission still defers requests of another adapter cohort"),
    _m("lifecycle_room_ignores_prefilling", "lifecycle",
       "    return len(state.rows) + len(state.prefilling) < state.config.max_batch_size\n",
       "    return len(state.rows) < state.config.max_batch_size\n",
       "a swap-in or requeue resume counts only the active seats: with prompts prefilling the batch overfills"),
)

BY_ID = {m.id: m for m in MUTANTS}
