"""The interpreter: drives ``step``, carries out each effect on a Device, and turns answers into
events. It is the only place where effects touch the world, and ``Interpreter.run`` is the one
drive loop: the scenario runner, the model checker's walk, generation and the hypothesis machine
(step by step, through ``Interpreter.feed``) all go through it.

Order of delivery after a batch: input events that arose while it ran (the arrivals a blocking
wait returned, then the host's inputs, then scripted cancels from the device) first, then the
answer of the batch's query.

Every batch that ``step`` returns ends in exactly one query, whose answer is the next event, or in
the teardown; an input event's batch is empty. Anything else is a ``BatchError``.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable, Optional, Sequence as Seq

import structlog

from fxsched.core import events as ev
from fxsched.core.machine import step
from fxsched.core.state import SchedulerState
from fxsched.effects import device_calls as dc
from fxsched.effects import lifecycle as lc
from fxsched.effects import plans
from fxsched.effects.client import ClientOutput, RotationAck
from fxsched.effects.ep_words import RELEASE_CMD, SHUTDOWN_CMD
from fxsched.runtime.devices.device import Device, DeviceError
from fxsched.runtime.devices.sampling import decode_bf16_row, host_pick

log = structlog.get_logger("fxsched.interpreter")


class Host:
    """The world outside the device: clients and the request inbox.

    ``inputs`` collects input events that arise while a batch runs (late arrivals, clock
    readings, rotation requests); the interpreter takes them after the batch. ``send`` gets every
    client output and rotation acknowledgement; ``wait_for_input`` answers a blocking wait with
    the events that arrived (none by default). Subclasses override what they need.
    """

    def __init__(self) -> None:
        self.inputs: list[ev.Event] = []

    def take_inputs(self) -> list[ev.Event]:
        """The input events posted since the last call, in order."""
        taken, self.inputs = self.inputs, []
        return taken

    def send(self, output) -> None:
        pass

    def wait_for_input(self) -> list[ev.Event]:
        return []


class Observer:
    """Watches the drive loop; every method is a no-op here, subclasses override what they need.

    For each event: ``before_step(event)``, then ``stepped(event, state, effects)`` with what
    ``step`` returned (before any effect is carried out), then ``performed(state)`` once the batch
    has been carried out. ``output`` gets every client output (and rotation acknowledgement) when
    the host does.
    """

    def before_step(self, event: ev.Event) -> None:
        pass

    def stepped(self, event: ev.Event, state: SchedulerState, effects: Seq) -> None:
        pass

    def performed(self, state: SchedulerState) -> None:
        pass

    def output(self, output) -> None:
        pass


class RunError(Exception):
    """The run cannot go on (a wait that can never be satisfied, a fatal device error)."""


class BatchError(RunError):
    """A batch of effects from ``step`` that does not end in exactly one query (or the teardown)."""


def check_batch(event: ev.Event, effects: Seq, stopped: bool) -> None:
    """Raise ``BatchError`` unless ``effects`` is empty (an input event's batch), ends in its only
    query, or ends the run with the teardown and holds no query."""
    if not effects:
        return
    queries = [i for i, effect in enumerate(effects) if effect.QUERY]
    last = effects[-1]
    if queries == [len(effects) - 1]:
        return
    if not queries and stopped and isinstance(last, (lc.Teardown, dc.TeardownCall)):
        return
    names = [type(effects[i]).__name__ for i in queries]
    if not queries:
        shape = f"ends in {type(last).__name__} with no query" + ("" if stopped else " and the loop has not stopped")
    elif len(queries) > 1:
        shape = f"holds {len(queries)} queries ({', '.join(names)})"
    else:
        shape = f"has its query {names[0]} at position {queries[0] + 1} of {len(effects)}, not last"
    raise BatchError(f"step({type(event).__name__}) returned a batch of {len(effects)} effects that {shape}; "
                     f"a batch must end in exactly one query or in the teardown")


class Interpreter:
    def __init__(self, device: Device, host: Host, eos_ids: tuple[int, ...],
                 observer: Optional[Observer] = None):
        self.device = device
        self.host = host
        self.eos_ids = eos_ids
        self.observer = observer if observer is not None else Observer()
        self.steps = 0
        self._waited: list[ev.Event] = []  # what a blocking wait of the current batch returned
        self._take_cancels = getattr(device, "take_cancels", None)  # scripted devices' client cancels

    def run(self, state: SchedulerState, first: Iterable[ev.Event]) -> SchedulerState:
        """Feed ``first`` then every event that follows until the loop stops (or no event is left)."""
        queue = deque(first)
        while queue:
            state, follow = self.feed(state, queue.popleft())
            queue.extend(follow)
            if state.stopped:
                break
        return state

    def feed(self, state: SchedulerState, event: ev.Event) -> tuple[SchedulerState, list[ev.Event]]:
        """One step of the loop: step on ``event``, check the batch, carry it out. Returns the new
        state and the events that follow, in delivery order (inputs first, the answer last)."""
        observer = self.observer
        observer.before_step(event)
        state, effects = step(state, event)
        self.steps += 1
        check_batch(event, effects, state.stopped)
        observer.stepped(event, state, effects)
        answer = self.perform_all(effects)
        observer.performed(state)
        follow, self._waited = self._waited, []
        follow.extend(self.host.take_inputs())
        if self._take_cancels is not None:
            follow.extend(ev.Cancel(r) for r in self._take_cancels())
        if answer is not None:
            follow.append(answer)
        return state, follow

    def perform_all(self, effects) -> Optional[ev.Event]:
        answer = None
        for effect in effects:
            result = self.perform(effect)
            if result is not None:
                answer = result
        return answer

    # --- one match over every effect kind ---------------------------------------------------------

    def perform(self, effect) -> Optional[ev.Event]:
        try:
            return self._perform(effect)
        except DeviceError as err:
            if not effect.QUERY:
                raise RunError(f"device error in {type(effect).__name__}: {err.message}") from err
            log.info("device_fault", effect=type(effect).__name__, message=err.message)
            return ev.DeviceFault(err.message, err.kv_exhausted)

    def _perform(self, effect) -> Optional[ev.Event]:
        d = self.device
        if isinstance(effect, (ClientOutput, RotationAck)):
            self.host.send(effect)
            self.observer.output(effect)
            return None
        if isinstance(effect, plans.Decode):
            return self._decode_plan(effect)
        if isinstance(effect, lc.Lifecycle):
            return self._lifecycle(effect)
        match effect:
            case dc.BindGpuToThread():
                d.bind_gpu_to_thread()
            case dc.CreateStream():
                return ev.StreamCreated(d.create_stream())
            case dc.CreateEvent():
                return ev.EventCreated(d.create_event())
            case dc.NumFreeBlocks():
                return ev.FreeBlocks(d.num_free_blocks())
            case dc.SsmSnapshotOccupancy():
                d.ssm_snapshot_occupancy()
            case dc.WaitForInput():
                self._waited.extend(self.host.wait_for_input())
                return ev.InputReady()
            case dc.AllocSequence(seq=seq, session=session):
                return ev.SlotAllocated(d.alloc_sequence(seq, session))
            case dc.AllocSequenceFor(seq=seq, session=session, budget=budget):
                return ev.SlotAllocated(d.alloc_sequence_for(seq, session, budget))
            case dc.FreeSequence(seq=seq):
                d.free_sequence(seq)
            case dc.CacheSequence(seq=seq):
                d.cache_sequence(seq)
            case dc.CompactSequence(seq=seq, new_slot=slot):
                d.compact_sequence(seq, slot)
            case dc.DetachSlotForReuse(seq=seq):
                d.detach_slot_for_reuse(seq)
            case dc.SaveSequenceStateCall(seq=seq):
                d.save_sequence_state(seq)
            case dc.RestoreSequenceState(seq=seq, blocks=blocks):
                d.restore_sequence_state(seq, blocks)
                return ev.StateRestored()
            case dc.ReclaimPrefixBlocks(n=n):
                return ev.BlocksReclaimed(d.reclaim_prefix_blocks(n))
            case dc.TruncateSequence(seq=seq, seq_len=seq_len):
                d.truncate_sequence(seq, seq_len)
            case dc.AdapterIdFor(slots=slots):
                return ev.AdapterIds(tuple(d.adapter_id_for(s) for s in slots))
            case dc.AcquireAdapterSlot(slot=slot):
                d.acquire_adapter_slot(slot)
            case dc.SetActiveLora(name=name):
                d.set_active_lora(name)
                return ev.LoraApplied()
            case dc.EpBroadcastCmdForSeq(seq_slot=slot, cmd=cmd):
                d.ep_broadcast_cmd_for_seq(slot, cmd)
            case dc.EpBroadcastCmd(cmd=cmd):
                d.ep_broadcast_cmd(cmd)
            case dc.EpBroadcastTokens(tokens=tokens):
                d.ep_broadcast_tokens(tokens)
            case dc.EpSyncVisionEmbeds(n=n):
                d.ep_sync_vision_embeds(n)
            case dc.PollInnerq():
                d.poll_innerq()
            case dc.RecordEvent(event=e, stream=s):
                d.record_event(e, s)
            case dc.StreamWaitEvent(stream=s, event=e):
                d.stream_wait_event(s, e)
            case dc.Synchronize(stream=s):
                d.synchronize(s)
            case dc.SyncSecondaryCall():
                d.sync_secondary()
            case dc.TeardownCall():
                d.teardown()
            case dc.Prefill(seq=seq, tokens=tokens, stream=stream):
                return ev.ForwardDone(d.prefill(seq, tokens, stream) or 0)
            case dc.PrefillChunk(seq=seq, prompt=prompt, start=start, length=length, last=last, stream=stream):
                return ev.ForwardDone(d.prefill_chunk(seq, prompt, start, length, last, stream) or 0)
            case dc.MixedForward(decode_tokens=toks, decode_seqs=seqs, prefill=sl, stream=stream):
                d.mixed_forward(toks, seqs, sl, stream)
                return ev.ForwardDone()
            case dc.MixedForwardBatch(decode_tokens=toks, decode_seqs=seqs, prefills=sls, stream=stream):
                d.mixed_forward_batch(toks, seqs, sls, stream)
                return ev.ForwardDone()
            case dc.PrefillBatchChunk(prefills=sls, stream=stream):
                d.prefill_batch_chunk(sls, stream)
                return ev.ForwardDone()
            case dc.NormalizeSsmStates(seq=seq, stream=stream):
                d.normalize_ssm_states(seq, stream)
            case dc.DecodeCall(token=token, seq=seq, stream=stream):
                d.decode(token, seq, stream)
                return ev.ForwardDone()
            case dc.DecodeDraft(token=token, seq=seq, stream=stream):
                d.decode_draft(token, seq, stream)
                return ev.ForwardDone()
            case dc.SerialVerify(seq=seq, tokens=tokens):
                return ev.VerifyRows(getattr(d, effect.CALL)(seq, tokens))
            case dc.DecodeVerifyBatched(tokens=tokens, ks=ks, seqs=seqs, stream=stream, woa=woa):
                return ev.VerifyRows(d.decode_verify_batched(tokens, ks, seqs, stream, woa))
            case dc.ProposeMulti(token=t, pos=pos, n=n, seq=seq, stream=stream, mask=mask):
                return ev.Drafts(d.run_mtp_propose_multi(t, pos, n, seq, stream, mask))
            case dc.ProposeBatched(tokens=t, positions=p, stash=st, n=n, seqs=seqs, stream=stream):
                return ev.BatchedDrafts(d.run_mtp_propose_batched(t, p, st, n, seqs, stream))
            case dc.CatchupBatched(tokens=t, slots=slots, pos=pos):
                d.run_mtp_catchup_batched(t, slots, pos)
            case dc.GenerateBeamBatch(prompts=prompts, num_beams=beams):
                return ev.BeamHypotheses(d.generate_beam_batch(prompts, beams))
            case dc.SlotDraftCapacity(slots=slots):
                return ev.DraftCapacity(tuple(d.mtp_slot_draft_capacity(s) for s in slots))
            case dc.CanBatchVerify(ks=ks):
                return ev.BatchVerifyAllowed(d.can_batch_verify(ks))
            case dc.ArgmaxOnDevice(row=row, stream=stream):
                return ev.TokenSampled(d.argmax_on_device(row, stream))
            case dc.ArgmaxBatch(row=row, n=n, stream=stream):
                return ev.TokensSampled(d.argmax_batch(row, n, stream))
            case dc.CopyLogitsToHost(row=row, n=n, picks=picks):
                return self._host_picks(row, picks)
            case dc.GdnFoldAccepted(slots=slots, accepted=accepted, k=k):
                d.gdn_fold_accepted(slots, accepted, k)
            case dc.CommitAcceptedPrefix(seq=seq, na=na, k=k):
                d.commit_accepted_prefix(seq, na, k)
            case dc.CommitCtx(seq=seq, n=n, base=base, row=row):
                d.commit_ctx(seq, n, base, row)
            case dc.CommitCtxBatch(entries=entries):
                for seq, n, base, row in entries:
                    d.commit_ctx(seq, n, base, row)
            case dc.CommitAcceptedPrefixBatch(entries=entries):
                for seq, na, k in entries:
                    d.commit_accepted_prefix(seq, na, k)
            case dc.TrimProposerStateBatch(entries=entries, stream=stream):
                for seq, na in entries:
                    d.trim_proposer_state(seq, na, stream)
            case dc.TruncateSequences(entries=entries):
                for seq, seq_len in entries:
                    d.truncate_sequence(seq, seq_len)
            case dc.TrimProposerState(seq=seq, na=na, stream=stream):
                d.trim_proposer_state(seq, na, stream)
            case dc.SaveHiddenForMtp(row=row, stream=stream):
                d.save_hidden_for_mtp(row, stream)
            case dc.SaveHiddenForMtpFromStash(index=index, stream=stream):
                d.save_hidden_for_mtp_from_stash(index, stream)
            case dc.StashVerifyHiddenRows(rows=rows, stream=stream):
                d.stash_verify_hidden_rows(rows, stream)
            case dc.StashVerifyCatchupRows(pairs=pairs):
                d.stash_verify_catchup_rows(pairs)
            case dc.DflashEagleAcceptAppend(seq=seq):
                d.dflash_eagle_accept_append(seq)
            case dc.StartCheckpointAsync(seq=seq):
                d.start_checkpoint_async(seq)
            case dc.StartRollbackAndCheckpointAsync(seq=seq, na=na):
                d.start_rollback_and_checkpoint_async(seq, na)
            case dc.CheckpointSsmStates(seq=seq):
                d.checkpoint_ssm_states(seq)
            case dc.RollbackSsmStates(seq=seq, n=n):
                d.rollback_ssm_states(seq, n)
            case dc.DecodeMarconiCheckpoint(seq=seq):
                d.decode_marconi_checkpoint(seq)
            case dc.SaveDecodeSsmSnapshot(seq=seq, ring=ring):
                d.save_decode_ssm_snapshot(seq, ring)
            case dc.RestoreDecodeSsmSnapshot(seq=seq, ring=ring):
                d.restore_decode_ssm_snapshot(seq, ring)
            case dc.SaveHiddenForCatchupCall(row=row, pos=pos):
                d.save_hidden_for_catchup(row, pos)
            case _:
                raise RunError(f"the interpreter has no case for {type(effect).__name__}")
        return None

    def _host_picks(self, row: int, picks) -> ev.TokensSampled:
        """Tokens of ``len(picks)`` rows from ``row`` by their picks: the device's own batched
        sampler when its class defines ``sample_rows`` (the torch device; a wrapper that only
        forwards attributes does not count, so it keeps its own ``copy_logits_to_host``), else
        a host copy of the rows picked by ``sampling.host_pick`` (specs/scheduler.md §5.11)."""
        logprobs = tuple(pick.top_logprobs for pick in picks)
        if callable(getattr(type(self.device), "sample_rows", None)):
            sampled = self.device.sample_rows(row, len(picks), picks, self.eos_ids)  # type: ignore[attr-defined]
            return ev.TokensSampled(tuple(sampled.tokens), logprobs)
        vocab = self.device.vocab_size()
        slab = self.device.copy_logits_to_host(row, 0, len(picks) * vocab * 2)
        tokens = [host_pick(decode_bf16_row(slab, vocab, r), pick, self.eos_ids) for r, pick in enumerate(picks)]
        return ev.TokensSampled(tuple(tokens), logprobs)

    def _decode_plan(self, plan: plans.Decode) -> ev.Event:
        d = self.device
        d.note_fx(f"fx launch {plan.label}")
        try:
            d.decode_batch(plan.tokens, plan.seqs, 0)
        except DeviceError as err:
            return ev.DeviceFault(err.message, err.kv_exhausted)
        for row, (seq, base) in enumerate(zip(plan.seqs, plan.seq_lens, strict=True)):
            d.commit_ctx(seq, 1, base, row)
        if plan.picks:
            return self._host_picks(0, plan.picks)
        return ev.TokensSampled(d.argmax_batch(0, len(plan.seqs), 0))

    def _lifecycle(self, effect: lc.Lifecycle) -> Optional[ev.Event]:
        d = self.device
        d.note_fx(effect.fx_line)
        match effect:
            case lc.ReleaseSeq(seq=seq, slot=slot, cache=cache):
                if cache:
                    d.cache_sequence(seq)
                d.free_sequence(seq)
                d.ep_broadcast_cmd_for_seq(slot, RELEASE_CMD)
            case lc.CompactSlot(seq=seq, target=target):
                d.compact_sequence(seq, target)
            case lc.DetachSlot(seq=seq):
                d.detach_slot_for_reuse(seq)
            case lc.SaveSequenceState(seq=seq):
                d.save_sequence_state(seq)
            case lc.MarconiCheckpoint(seq=seq):
                d.decode_marconi_checkpoint(seq)
            case lc.SsmSnapshotSave(seq=seq, slot=slot):
                d.save_decode_ssm_snapshot(seq, slot)
            case lc.SsmSnapshotRestore(seq=seq, slot=slot):
                d.restore_decode_ssm_snapshot(seq, slot)
            case lc.SaveHiddenCatchup(row=row, pos=pos):
                d.save_hidden_for_catchup(row, pos)
            case lc.SyncSecondary():
                d.sync_secondary()
            case lc.EpShutdown():
                d.ep_broadcast_cmd_for_seq(0, SHUTDOWN_CMD)
            case lc.Quiesce(stream=stream):
                d.synchronize(stream)
            case lc.LoraRotate(name=name):
                try:
                    d.set_active_lora(name)
                except DeviceError as err:
                    return ev.LoraApplied(err.message)
                return ev.LoraApplied()
            case lc.Teardown():
                d.teardown()
            case lc.ReadLogits() | lc.ReserveKv() | lc.Rollback():
                raise RunError(f"{effect.label} belongs to the asynchronous router, which this interpreter is not")
            case _:
                raise RunError(f"the interpreter has no case for {type(effect).__name__}")
        return None
