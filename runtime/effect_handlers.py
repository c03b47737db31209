"""The effect handlers: one per effect type, and the dispatch that finds an effect's handler.

A handler carries out one effect on ``it.device`` (or the host) and returns the answer event of a
query; a fire-and-forget effect's handler is its device call, whose result ``perform`` and
``perform_all`` drop (one frame per effect fewer than a wrapper that drops it). ``_CASES`` lists
the effect classes in the order they are tried: the first case whose class the effect's type is
(a subclass of) handles it, and ``_HANDLERS`` remembers that choice per type, so dispatch is one
dictionary look-up per effect. An effect type no case covers is a ``RunError`` naming it. A
lifecycle effect's handler writes its ``fx`` line, then its device calls (specs/trace-format.md,
specs/runner.md §4.3). The interpreter (``runtime/interpreter.py``) is what calls them; a handler
sees it as a ``Performer``.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence as Seq, Union

from fxsched.core import events as ev
from fxsched.effects import device_calls as dc
from fxsched.effects import lifecycle as lc
from fxsched.effects import plans
from fxsched.effects.client import ClientOutput, RotationAck, StreamOut
from fxsched.effects.ep_words import RELEASE_CMD, SHUTDOWN_CMD
from fxsched.runtime.devices.device import Device, DeviceError
from fxsched.runtime.host import Host, Observer
from fxsched.runtime.run_errors import RunError


class Performer(Protocol):
    """What a handler uses of the interpreter that carries the effect out (``Interpreter``)."""

    device: Device
    host: Host
    observer: Observer
    _waited: list[ev.Event]

    def _host_picks(self, row: int, picks: Any) -> ev.TokensSampled: ...

    def _verify_rows(self, effect: Any, rows: Any) -> ev.VerifyRows: ...

    def _decode_plan(self, plan: plans.Decode) -> ev.Event: ...

    def _read_ahead(self, seqs: Seq[int], fed: Seq[int] = ()) -> tuple[int, ...]: ...


Handler = Callable[[Performer, Any], Any]  # a query's answer event; anything from the rest (dropped)


def _announced(act: Callable[[Any, Any], object]) -> Handler:
    """A lifecycle effect with no answer: its ``fx`` line, then ``act(device, effect)``."""

    def handler(it: Performer, e) -> None:
        d = it.device
        d.note_fx(e.fx_line)
        act(d, e)

    return handler


def _forward(act: Callable[[Any, Any], object]) -> Handler:
    """A forward answered when it is done: ``act(device, effect)``, then ``ForwardDone``."""

    def handler(it: Performer, e) -> ev.Event:
        act(it.device, e)
        return ev.ForwardDone()

    return handler


def _forward_hits(act: Callable[[Any, Any], object]) -> Handler:
    """A batched or mixed forward: ``act(device, effect)`` returns the (sequence id, prompt tokens
    found in the prefix cache) of its first chunks, or None; then ``ForwardDone`` carrying them."""

    def handler(it: Performer, e) -> ev.Event:
        hits = act(it.device, e)
        return ev.ForwardDone(0, tuple(hits)) if hits else ev.ForwardDone()  # type: ignore[arg-type]

    return handler


def _restore_sequence_state(it: Performer, e) -> ev.Event:
    it.device.restore_sequence_state(e.seq, e.blocks)
    return ev.StateRestored()


def _set_active_lora(it: Performer, e) -> ev.Event:
    it.device.set_active_lora(e.name)
    return ev.LoraApplied()


def _send(it: Performer, e) -> None:
    it.host.send(e)
    it.observer.output(e)


def _stream_out(it: Performer, e) -> None:
    """One record for a forward's rows: each client gets its own frame."""
    send, seen = it.host.send, it.observer.output
    for frame in e.split():
        send(frame)
        seen(frame)


def _wait_for_input(it: Performer, e) -> ev.Event:
    it._waited.extend(it.host.wait_for_input())
    return ev.InputReady()


def commit_ctx_rows(device, seqs: Seq[int], ns: Seq[int], bases: Seq[int],
                    rows: Seq[int]) -> None:
    """``commit_ctx(seq, n, base, row)`` for each column entry, in order: in one call where the
    device batches them (``commit_ctx_many``: the torch device appends every drafter context in one
    projection; a wrapper that hands its calls to one, an expert-parallel leader or a bench's clocked
    device, gives it too; so a wrapper that defines its own ``commit_ctx`` must define this too),
    one call each elsewhere (a recording device writes a line per call)."""
    many = getattr(device, "commit_ctx_many", None)
    if callable(many):
        many(seqs, ns, bases, rows)
        return
    commit = device.commit_ctx
    for seq, n, base, row in zip(seqs, ns, bases, rows, strict=True):
        commit(seq, n, base, row)


def _commit_ctx_batch(it: Performer, e) -> None:
    commit_ctx_rows(it.device, e.seqs, e.ns, e.bases, e.rows)


def _commit_accepted_prefix_batch(it: Performer, e) -> None:
    commit = it.device.commit_accepted_prefix
    for seq, na, k in e.entries:
        commit(seq, na, k)


def _trim_proposer_state_batch(it: Performer, e) -> None:
    trim = it.device.trim_proposer_state
    for seq, na in e.entries:
        trim(seq, na, e.stream)


def _truncate_sequences(it: Performer, e) -> None:
    truncate = it.device.truncate_sequence
    for seq, seq_len in e.entries:
        truncate(seq, seq_len)


def _marconi_checkpoints(it: Performer, e) -> None:
    d, line = it.device, e.fx_line
    for seq in e.seqs:
        d.note_fx(line)
        d.decode_marconi_checkpoint(seq)


def _release_seq(it: Performer, e) -> None:
    d = it.device
    d.note_fx(e.fx_line)
    if e.cache:
        d.cache_sequence(e.seq)
    d.free_sequence(e.seq)
    d.ep_broadcast_cmd_for_seq(e.slot, RELEASE_CMD)


def _lora_rotate(it: Performer, e) -> ev.Event:
    d = it.device
    d.note_fx(e.fx_line)
    try:
        d.set_active_lora(e.name)
    except DeviceError as err:
        return ev.LoraApplied(err.message)
    return ev.LoraApplied()


def _asynchronous_only(it: Performer, e) -> None:
    it.device.note_fx(e.fx_line)
    raise RunError(f"{e.label} belongs to the asynchronous router, which this interpreter is not")


def _no_lifecycle_case(it: Performer, e) -> None:
    it.device.note_fx(e.fx_line)
    raise RunError(f"the interpreter has no case for {type(e).__name__}")


def _no_case(it: Performer, e) -> None:
    raise RunError(f"the interpreter has no case for {type(e).__name__}")


_CASES: tuple[tuple[Union[type, tuple[type, ...]], Handler], ...] = (
    ((ClientOutput, RotationAck), _send),
    (StreamOut, _stream_out),
    (plans.Decode, lambda it, e: it._decode_plan(e)),
    (lc.MarconiCheckpoints, _marconi_checkpoints),
    # lifecycle effects: an ``fx`` line, then their device calls
    (lc.ReleaseSeq, _release_seq),
    (lc.CompactSlot, _announced(lambda d, e: d.compact_sequence(e.seq, e.target))),
    (lc.DetachSlot, _announced(lambda d, e: d.detach_slot_for_reuse(e.seq))),
    (lc.SaveSequenceState, _announced(lambda d, e: d.save_sequence_state(e.seq))),
    (lc.MarconiCheckpoint, _announced(lambda d, e: d.decode_marconi_checkpoint(e.seq))),
    (lc.SsmSnapshotSave, _announced(lambda d, e: d.save_decode_ssm_snapshot(e.seq, e.slot))),
    (lc.SsmSnapshotRestore, _announced(lambda d, e: d.restore_decode_ssm_snapshot(e.seq, e.slot))),
    (lc.SaveHiddenCatchup, _announced(lambda d, e: d.save_hidden_for_catchup(e.row, e.pos))),
    (lc.SyncSecondary, _announced(lambda d, e: d.sync_secondary())),
    (lc.EpShutdown, _announced(lambda d, e: d.ep_broadcast_cmd_for_seq(0, SHUTDOWN_CMD))),
    (lc.Quiesce, _announced(lambda d, e: d.synchronize(e.stream))),
    (lc.LoraRotate, _lora_rotate),
    (lc.Teardown, _announced(lambda d, e: d.teardown())),
    ((lc.ReadLogits, lc.ReserveKv, lc.Rollback), _asynchronous_only),
    (lc.Lifecycle, _no_lifecycle_case),
    # direct device calls
    (dc.BindGpuToThread, lambda it, e: it.device.bind_gpu_to_thread()),
    (dc.CreateStream, lambda it, e: ev.StreamCreated(it.device.create_stream())),
    (dc.CreateEvent, lambda it, e: ev.EventCreated(it.device.create_event())),
    (dc.NumFreeBlocks, lambda it, e: ev.FreeBlocks(it.device.num_free_blocks())),
    (dc.SsmSnapshotOccupancy, lambda it, e: it.device.ssm_snapshot_occupancy()),
    (dc.WaitForInput, _wait_for_input),
    (dc.AllocSequence, lambda it, e: ev.SlotAllocated(it.device.alloc_sequence(e.seq, e.session))),
    (dc.AllocSequenceFor, lambda it, e: ev.SlotAllocated(it.device.alloc_sequence_for(e.seq, e.session, e.budget))),
    (dc.FreeSequence, lambda it, e: it.device.free_sequence(e.seq)),
    (dc.CacheSequence, lambda it, e: it.device.cache_sequence(e.seq)),
    (dc.CompactSequence, lambda it, e: it.device.compact_sequence(e.seq, e.new_slot)),
    (dc.DetachSlotForReuse, lambda it, e: it.device.detach_slot_for_reuse(e.seq)),
    (dc.SaveSequenceStateCall, lambda it, e: it.device.save_sequence_state(e.seq)),
    (dc.RestoreSequenceState, _restore_sequence_state),
    (dc.ReclaimPrefixBlocks, lambda it, e: ev.BlocksReclaimed(it.device.reclaim_prefix_blocks(e.n))),
    (dc.TruncateSequence, lambda it, e: it.device.truncate_sequence(e.seq, e.seq_len)),
    (dc.AdapterIdFor, lambda it, e: ev.AdapterIds(tuple(it.device.adapter_id_for(s) for s in e.slots))),
    (dc.AcquireAdapterSlot, lambda it, e: it.device.acquire_adapter_slot(e.slot)),
    (dc.SetActiveLora, _set_active_lora),
    (dc.EpBroadcastCmdForSeq, lambda it, e: it.device.ep_broadcast_cmd_for_seq(e.seq_slot, e.cmd)),
    (dc.EpBroadcastCmd, lambda it, e: it.device.ep_broadcast_cmd(e.cmd)),
    (dc.EpBroadcastTokens, lambda it, e: it.device.ep_broadcast_tokens(e.tokens)),
    (dc.EpSyncVisionEmbeds, lambda it, e: it.device.ep_sync_vision_embeds(e.n)),
    (dc.PollInnerq, lambda it, e: it.device.poll_innerq()),
    (dc.RecordEvent, lambda it, e: it.device.record_event(e.event, e.stream)),
    (dc.StreamWaitEvent, lambda it, e: it.device.stream_wait_event(e.stream, e.event)),
    (dc.Synchronize, lambda it, e: it.device.synchronize(e.stream)),
    (dc.SyncSecondaryCall, lambda it, e: it.device.sync_secondary()),
    (dc.TeardownCall, lambda it, e: it.device.teardown()),
    (dc.Prefill, lambda it, e: ev.ForwardDone(it.device.prefill(e.seq, e.tokens, e.stream) or 0)),
    (dc.PrefillChunk, lambda it, e: ev.ForwardDone(
        it.device.prefill_chunk(e.seq, e.prompt, e.start, e.length, e.last, e.stream) or 0)),
    (dc.MixedForward, _forward_hits(lambda d, e: d.mixed_forward(e.decode_tokens, e.decode_seqs, e.prefill,
                                                                  e.stream))),
    (dc.MixedForwardBatch, _forward_hits(lambda d, e: d.mixed_forward_batch(e.decode_tokens, e.decode_seqs,
                                                                            e.prefills, e.stream))),
    (dc.PrefillBatchChunk, _forward_hits(lambda d, e: d.prefill_batch_chunk(e.prefills, e.stream))),
    (dc.NormalizeSsmStates, lambda it, e: it.device.normalize_ssm_states(e.seq, e.stream)),
    (dc.DecodeCall, _forward(lambda d, e: d.decode(e.token, e.seq, e.stream))),
    (dc.DecodeDraft, _forward(lambda d, e: d.decode_draft(e.token, e.seq, e.stream))),
    (dc.SerialVerify, lambda it, e: it._verify_rows(e, it.device.serial_verify(e.CALL, e.seq, e.tokens))),
    (dc.DecodeVerifyBatched, lambda it, e: it._verify_rows(
        e, it.device.decode_verify_batched(e.tokens, e.ks, e.seqs, e.stream, e.woa))),
    (dc.ProposeMulti, lambda it, e: ev.Drafts(
        it.device.run_mtp_propose_multi(e.token, e.pos, e.n, e.seq, e.stream, e.mask))),
    (dc.ProposeBatched, lambda it, e: ev.BatchedDrafts(
        it.device.run_mtp_propose_batched(e.tokens, e.positions, e.stash, e.n, e.seqs, e.stream))),
    (dc.CatchupBatched, lambda it, e: it.device.run_mtp_catchup_batched(e.tokens, e.slots, e.pos)),
    (dc.GenerateBeamBatch, lambda it, e: ev.BeamHypotheses(it.device.generate_beam_batch(e.prompts, e.num_beams))),
    (dc.SlotDraftCapacity, lambda it, e: ev.DraftCapacity(
        tuple(it.device.mtp_slot_draft_capacity(s) for s in e.slots))),
    (dc.CanBatchVerify, lambda it, e: ev.BatchVerifyAllowed(it.device.can_batch_verify(e.ks))),
    (dc.ArgmaxOnDevice, lambda it, e: ev.TokenSampled(it.device.argmax_on_device(e.row, e.stream))),
    (dc.ArgmaxBatch, lambda it, e: ev.TokensSampled(it.device.argmax_batch(e.row, e.n, e.stream))),
    (dc.ReadAhead, lambda it, e: ev.TokensSampled((), (), it._read_ahead(e.seqs))),
    (dc.CopyLogitsToHost, lambda it, e: it._host_picks(e.row, e.picks)),
    (dc.GdnFoldAccepted, lambda it, e: it.device.gdn_fold_accepted(e.slots, e.accepted, e.k)),
    (dc.CommitAcceptedPrefix, lambda it, e: it.device.commit_accepted_prefix(e.seq, e.na, e.k)),
    (dc.CommitCtx, lambda it, e: it.device.commit_ctx(e.seq, e.n, e.base, e.row)),
    (dc.CommitCtxBatch, _commit_ctx_batch),
    (dc.CommitAcceptedPrefixBatch, _commit_accepted_prefix_batch),
    (dc.TrimProposerStateBatch, _trim_proposer_state_batch),
    (dc.TruncateSequences, _truncate_sequences),
    (dc.TrimProposerState, lambda it, e: it.device.trim_proposer_state(e.seq, e.na, e.stream)),
    (dc.SaveHiddenForMtp, lambda it, e: it.device.save_hidden_for_mtp(e.row, e.stream)),
    (dc.SaveHiddenForMtpFromStash, lambda it, e: it.device.save_hidden_for_mtp_from_stash(e.index, e.stream)),
    (dc.StashVerifyHiddenRows, lambda it, e: it.device.stash_verify_hidden_rows(e.rows, e.stream)),
    (dc.StashVerifyCatchupRows, lambda it, e: it.device.stash_verify_catchup_rows(e.pairs)),
    (dc.DflashEagleAcceptAppend, lambda it, e: it.device.dflash_eagle_accept_append(e.seq)),
    (dc.StartCheckpointAsync, lambda it, e: it.device.start_checkpoint_async(e.seq)),
    (dc.StartRollbackAndCheckpointAsync, lambda it, e: it.device.start_rollback_and_checkpoint_async(e.seq, e.na)),
    (dc.CheckpointSsmStates, lambda it, e: it.device.checkpoint_ssm_states(e.seq)),
    (dc.RollbackSsmStates, lambda it, e: it.device.rollback_ssm_states(e.seq, e.n)),
    (dc.DecodeMarconiCheckpoint, lambda it, e: it.device.decode_marconi_checkpoint(e.seq)),
    (dc.SaveDecodeSsmSnapshot, lambda it, e: it.device.save_decode_ssm_snapshot(e.seq, e.ring)),
    (dc.RestoreDecodeSsmSnapshot, lambda it, e: it.device.restore_decode_ssm_snapshot(e.seq, e.ring)),
    (dc.SaveHiddenForCatchupCall, lambda it, e: it.device.save_hidden_for_catchup(e.row, e.pos)),
)
"""Every effect class the interpreter carries out, in the order they are tried, with its handler."""

_HOST_SIDE = frozenset({_send, _stream_out, _wait_for_input})
"""The handlers that touch the host only: with a lane they run on the host's thread."""


class _OnHost(dict[type, bool]):
    """Whether the handler of each effect type met so far is one of ``_HOST_SIDE``."""

    def __missing__(self, cls: type) -> bool:
        self[cls] = on_host = _HANDLERS[cls] in _HOST_SIDE
        return on_host


_ON_HOST = _OnHost()


class _Handlers(dict[type, Handler]):
    """The handler of each effect type met so far: a type met for the first time is looked up in
    ``_CASES`` (``_handler_for``) and remembered."""

    def __missing__(self, cls: type) -> Handler:
        return _handler_for(cls)


_HANDLERS = _Handlers()
"""The handler of each effect type met so far (filled by ``_handler_for``)."""


def _handler_for(cls: type) -> Handler:
    """The handler of effect type ``cls``: that of the first case it is a subclass of (remembered)."""
    handler = next((h for pattern, h in _CASES if issubclass(cls, pattern)), _no_case)
    _HANDLERS[cls] = handler
    return handler
