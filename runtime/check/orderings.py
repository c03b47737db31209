"""Orders between two effects that the rule book states and no other check sees (specs/checker.md
§11.7, where the table says which check holds each order the rule book states, and why the others
are not checked).

Each rule is a small function over one batch of effects (what one ``step`` returned) that raises
``Violation``; one order spans batches (the prefill stream's barrier) and keeps its state in
``Orderings``, which ``invariants.Monitor.on_effects`` calls once per batch. They stay cheap the way
``roles.py`` does: a batch's signature (its effect types, in order) is worked out once into a
``_Plan`` (``PLANS``), which says which rules have anything to read in it and where; a batch none
of the rules reads (a steady decode step) costs a dict look-up. The orders that hold by the types
alone (``sync_before_verify``, ``stash_before_use``) are judged once per signature.

These are orders of what the scheduler (core/) emits. The device calls an interpreter makes of a
plan or a lifecycle record (``ReleaseSeq``: cache, free, the release word) are the interpreter's
order, not judged here.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

from fxsched.effects import device_calls as dc
from fxsched.effects import lifecycle as lc
from fxsched.effects import plans
from fxsched.runtime.check.roles import BATCH_ROLES, _Memo
from fxsched.runtime.check.violation import Violation

# --- which types take part in which rule ------------------------------------------------------------------

SYNCED_VERIFIES: tuple[type, ...] = (dc.DecodeVerifyGraphed, dc.DecodeVerifyGraphedK3, dc.DecodeVerifyGraphedK4,
                                     dc.DecodeVerifyDflash, dc.DecodeAndVerifyFused, dc.DecodeVerifyBatched)
"""The verifies a ``sync_secondary`` must precede: every verify of the MTP, DFlash and n-gram steps
(the self-speculative step's ``decode_verify`` has none, specs/speculation.md §6.15)."""

STASH_READERS: tuple[type, ...] = (dc.ProposeBatched, dc.SaveHiddenForMtpFromStash)
"""What reads the verify's stashed hidden rows (specs/speculation.md §6.12 step 7)."""

PREFILL_STREAM_WORK: tuple[type, ...] = (dc.Prefill, dc.PrefillChunk, dc.PrefillBatchChunk, dc.MixedForward,
                                         dc.MixedForwardBatch, dc.NormalizeSsmStates)
"""Work that may run on the prefill stream (it does when its ``stream`` is not 0, the decode stream)."""

DECODE_STREAM_READS: tuple[type, ...] = (dc.ArgmaxOnDevice, dc.ArgmaxBatch, dc.CopyLogitsToHost, plans.Decode,
                                         dc.DecodeCall, dc.DecodeDraft, dc.SerialVerify, dc.DecodeVerifyBatched)
"""What must not run before the decode stream waited for the prefill stream's work: a read of
logits rows (a first token, a mixed step's decode rows), and the forwards of lane 3."""

# the codes of ``_Plan.stream_ops``
WORK, RECORD, WAIT, SYNC, RELEASE, READ = 1, 2, 3, 4, 5, 6


def _stream_code(cls: type) -> int:
    if issubclass(cls, PREFILL_STREAM_WORK):
        return WORK
    if issubclass(cls, dc.RecordEvent):
        return RECORD
    if issubclass(cls, dc.StreamWaitEvent):
        return WAIT
    if issubclass(cls, dc.SyncSecondaryCall):
        return SYNC
    if issubclass(cls, lc.ReleaseSeq):
        return RELEASE
    if issubclass(cls, DECODE_STREAM_READS):
        return READ
    return 0


def _worked_on(effect) -> tuple[int, ...]:
    """The sequences a forward (or ``normalize_ssm_states``) of ``PREFILL_STREAM_WORK`` works on."""
    kind = type(effect)
    if kind is dc.PrefillBatchChunk:
        return tuple(sl.seq for sl in effect.prefills)
    if kind is dc.MixedForward:
        return effect.decode_seqs + (effect.prefill.seq,)
    if kind is dc.MixedForwardBatch:
        return effect.decode_seqs + tuple(sl.seq for sl in effect.prefills)
    return (effect.seq,)


class _Plan(NamedTuple):
    """What the rules read in a batch of one signature."""

    stream_ops: tuple[tuple[int, int], ...]  # (index, code) of each effect the barrier rule reads, in order
    work: bool  # the batch holds work that may run on the prefill stream
    synced_verify: bool  # it ends in a verify that a sync_secondary must precede
    stash: bool  # it reads a stash (a proposal from it, a catch-up)
    self_verify: bool  # it ends in a self-speculative verify
    snapshot: bool  # it saves an SSM snapshot
    capacity: bool  # it asks a draft capacity (a speculative step begins)
    decode_call: bool  # it holds a one-sequence ``decode`` (in an MTP step: a bootstrap's)
    trim_commit: bool  # it holds both a serial commit of an accepted prefix and a proposer trim


def _plan(kinds: tuple[type, ...]) -> _Plan:
    ops = tuple((at, code) for at, code in ((at, _stream_code(cls)) for at, cls in enumerate(kinds)) if code)
    last = kinds[-1] if kinds else None
    return _Plan(
        stream_ops=ops,
        work=any(code == WORK for _, code in ops),
        synced_verify=last is not None and issubclass(last, SYNCED_VERIFIES),
        stash=any(issubclass(cls, STASH_READERS + (dc.CatchupBatched,)) for cls in kinds),
        self_verify=last is not None and issubclass(last, dc.DecodeVerify),
        snapshot=any(issubclass(cls, lc.SsmSnapshotSave) for cls in kinds),
        capacity=any(issubclass(cls, dc.SlotDraftCapacity) for cls in kinds),
        decode_call=any(issubclass(cls, dc.DecodeCall) for cls in kinds),
        trim_commit=dc.CommitAcceptedPrefix in kinds and dc.TrimProposerState in kinds,
    )


PLANS: dict[tuple, _Plan] = _Memo(_plan)
"""A batch's signature -> its ``_Plan``, worked out once per signature."""


class Signature:
    """What the checks read of a batch's signature, looked up once per batch: the signature itself
    (``kinds``), its ``roles.BATCH_ROLES`` entry and its ``_Plan``. (One object per signature, so
    it hashes and compares by identity: cheap to count.)"""

    __slots__ = ("kinds", "roles", "plan")

    def __init__(self, kinds: tuple[type, ...]) -> None:
        self.kinds = kinds
        self.roles: int = BATCH_ROLES[kinds]
        self.plan: _Plan = PLANS[kinds]


SIGNATURES: dict[tuple, Signature] = _Memo(Signature)
"""A batch's signature -> its ``Signature``, worked out once per signature."""


def _kinds(effects: Sequence, kinds: Optional[tuple]) -> tuple:
    return tuple(map(type, effects)) if kinds is None else kinds


# --- the rules of one batch ---------------------------------------------------------------------------------


def _sync_verdict(kinds: tuple[type, ...]) -> Optional[str]:
    if not kinds or not issubclass(kinds[-1], SYNCED_VERIFIES):
        return None
    sync = max((at for at, cls in enumerate(kinds) if issubclass(cls, dc.SyncSecondaryCall)), default=-1)
    if sync < 0:
        return f"{kinds[-1].__name__} runs with no sync_secondary before it"
    words = max((at for at, cls in enumerate(kinds) if issubclass(cls, dc.EpBroadcastCmdForSeq)), default=-1)
    if 0 <= words < sync:
        return f"the EP words announcing {kinds[-1].__name__} go out before its sync_secondary"
    return None


_SYNC_VERDICTS: dict[tuple, Optional[str]] = _Memo(_sync_verdict)


def sync_before_verify(effects: Sequence, kinds: Optional[tuple] = None) -> None:
    """sync before verify (specs/speculation.md §6.6 step 1, §6.8 step 1, §6.9 step 1, §6.11 step 1,
    §6.12 step 1, §6.14; specs/async.md §16.2): a verify of the MTP, DFlash or n-gram steps (a
    query: the last effect of its batch) comes after a ``sync_secondary`` in its batch, so that the
    decode stream waits for the prefill stream's queued work before the verify reads the KV, and
    the EP words that announce it (``ep_broadcast_cmd_for_seq`` with the verify word, then its
    inputs) go out after that sync. (Within a batch an ``ep_broadcast_cmd_for_seq`` always
    announces the batch's closing forward: every announced forward is a query.)"""
    verdict = _SYNC_VERDICTS[_kinds(effects, kinds)]
    if verdict is not None:
        raise Violation("sync_before_verify", verdict)


def _stash_verdict(kinds: tuple[type, ...]) -> Optional[str]:
    rows = catchup = False
    for cls in kinds:
        if issubclass(cls, dc.StashVerifyHiddenRows):
            rows = True
        elif issubclass(cls, dc.StashVerifyCatchupRows):
            catchup = True
        elif issubclass(cls, STASH_READERS) and not rows:
            return f"{cls.__name__} reads the stash before stash_verify_hidden_rows wrote it"
        elif issubclass(cls, dc.CatchupBatched) and not catchup:
            return "run_mtp_catchup_batched runs before stash_verify_catchup_rows wrote its rows"
    return None


_STASH_VERDICTS: dict[tuple, Optional[str]] = _Memo(_stash_verdict)


def stash_before_use(effects: Sequence, kinds: Optional[tuple] = None) -> None:
    """stash before use (specs/speculation.md §6.11 steps 4, 5, 9, 10; §6.12 steps 6, 7): after a
    batched verify, the proposal from its rows (``run_mtp_propose_batched``, or
    ``save_hidden_for_mtp_from_stash`` for a single pending sequence) comes after
    ``stash_verify_hidden_rows`` wrote them, and the catch-up (``run_mtp_catchup_batched``) after
    ``stash_verify_catchup_rows`` wrote its rows; all in the batch that takes the verify's answer
    (the catch-up is fire-and-forget, the proposal the batch's query). A proposal before its stash
    conditions the drafts on the rows of an older verify."""
    verdict = _STASH_VERDICTS[_kinds(effects, kinds)]
    if verdict is not None:
        raise Violation("stash_before_use", verdict)


def checkpoint_before_self_verify(effects: Sequence) -> None:
    """checkpoint before the self-speculative verify (specs/speculation.md §6.15 steps 3, 4): the
    ``decode_verify`` of a sequence comes after ``checkpoint_ssm_states`` of that sequence in its
    batch, and that checkpoint after the rewind of the draft decodes (``truncate_sequence`` to the
    length before them): the checkpoint is the state ``rollback_ssm_states`` goes back to after the
    verify, so it must hold the SSM state at the rewound length, the drafts not yet in it."""
    if not effects or type(effects[-1]) is not dc.DecodeVerify:
        return
    seq = effects[-1].seq
    checkpoint = -1
    for at, effect in enumerate(effects):
        kind = type(effect)
        if kind is dc.CheckpointSsmStates and effect.seq == seq:
            checkpoint = at
        elif kind is dc.TruncateSequence and effect.seq == seq and at > checkpoint >= 0:
            raise Violation("checkpoint_before_self_verify", f"sequence {seq} is rewound after its "
                                                             f"checkpoint_ssm_states, before its decode_verify")
    if checkpoint < 0:
        raise Violation("checkpoint_before_self_verify", f"decode_verify of sequence {seq} with no "
                                                         f"checkpoint_ssm_states before it in its batch")


def snapshot_before_checkpoint(effects: Sequence) -> None:
    """snapshot before checkpoint (specs/watchdog.md §7.4, specs/scheduler.md §5.17 step 4): the plain
    sink saves a boundary token's SSM snapshot (``SsmSnapshotSave``) before that token's Marconi
    checkpoint: in one batch (one token per sequence), no Marconi checkpoint of a sequence comes
    before a snapshot save of that sequence."""
    checkpointed: set[int] = set()
    for effect in effects:
        kind = type(effect)
        if kind is lc.MarconiCheckpoint:
            checkpointed.add(effect.seq)
        elif kind is lc.MarconiCheckpoints:
            checkpointed.update(effect.seqs)
        elif kind is lc.SsmSnapshotSave and effect.seq in checkpointed:
            raise Violation("snapshot_before_checkpoint", f"sequence {effect.seq}'s SSM snapshot is saved after "
                                                          f"its Marconi checkpoint")


K_VERIFIES: tuple[type, ...] = (dc.DecodeVerifyGraphed, dc.DecodeVerifyGraphedK3, dc.DecodeVerifyGraphedK4,
                                dc.DecodeAndVerifyFused)
"""The K = 2, 3 and 4 verifies, whose verdicts fix the order of a commit and a trim (the DFlash
block verify and the batched verifies commit first whatever they accept: §6.9 step 6, §6.11)."""


def trim_then_partial_commit(effects: Sequence) -> None:
    """a partial accept trims before it commits, a full accept commits before it trims
    (specs/speculation.md §6.6 step 4, §6.7), in the batch that takes a K = 2, 3 or 4 verify's
    answer: of a sequence's ``commit_accepted_prefix`` (na of k rows) and ``trim_proposer_state``,
    the trim comes first when na < k (a draft was rejected: the proposer drops its state of the
    rejected drafts before the commit folds the rest) and last when na = k."""
    trimmed: set[int] = set()
    committed: dict[int, bool] = {}  # sequence -> whether its commit was a full accept
    for effect in effects:
        kind = type(effect)
        if kind is dc.TrimProposerState:
            if committed.get(effect.seq) is False:
                raise Violation("trim_then_partial_commit", f"sequence {effect.seq} trims its proposer after the "
                                                            f"commit of a partial accept")
            trimmed.add(effect.seq)
        elif kind is dc.CommitAcceptedPrefix:
            full = effect.na == effect.k
            if full and effect.seq in trimmed:
                raise Violation("trim_then_partial_commit", f"sequence {effect.seq} trims its proposer before the "
                                                            f"commit of a full accept")
            committed[effect.seq] = full


# --- the order across batches -------------------------------------------------------------------------------


class PrefillBarrier:
    """barrier before read (specs/scheduler.md §5.10 step 5, §5.13, §5.15; specs/async.md §16.2): work
    on the prefill stream (a chunk, a batched or mixed forward, ``normalize_ssm_states``: any of these
    with a stream other than 0) is waited for by the decode stream before anything on the decode
    stream reads results, while the sequences it worked on are still held. The wait is the barrier
    ``record_event(event=E, stream=<prefill>)`` then ``stream_wait_event(stream=0, event=E)`` (it
    covers the work recorded before it), or a ``sync_secondary`` (the decode stream waits for all
    of the secondary streams' work). The reads are a first token's or a mixed step's rows
    (``argmax_on_device``, ``argmax_batch``, ``copy_logits_to_host``) and the forwards of lane 3 (a
    plain decode, a speculative step's decodes and verifies), which the rule book gives the barrier
    first while a prompt still prefills. A wait before its record, or a read with such work not
    waited for, breaks it. Work for a sequence released since (a failed prompt: faults.md §8.1)
    need not be waited for, and a forward on the prefill stream that failed (its answer a
    ``DeviceFault``) queued nothing. The order spans batches: the barrier of lane 3 goes out in the
    batch that asks the draft capacities, its forwards in later ones."""

    def __init__(self) -> None:
        self.unsynced: set[int] = set()  # sequences with prefill-stream work the decode stream has not waited for
        self.recorded: Optional[tuple[int, frozenset[int]]] = None  # the event last recorded on the prefill
        # stream, and the sequences whose work it covers (the work queued before it)
        self.before_query: Optional[tuple[set[int], Optional[tuple[int, frozenset[int]]]]] = None
        # the state before the last batch's query, when that query was prefill-stream work (restored if its
        # answer is a fault)

    def step(self, effects: Sequence, ops: tuple[tuple[int, int], ...], fault: bool) -> None:
        """One batch (``ops``: its ``_Plan.stream_ops``; ``fault``: the batch answers a fault)."""
        if fault and self.before_query is not None:
            self.unsynced, self.recorded = self.before_query
        self.before_query = None
        last = len(effects) - 1
        unsynced = self.unsynced
        for at, code in ops:
            if code == READ:
                if unsynced:
                    raise Violation("barrier_before_read", f"{type(effects[at]).__name__} runs on the decode stream "
                                                           f"before it waited for the prefill stream's work on "
                                                           f"sequences {sorted(unsynced)}")
                continue
            effect = effects[at]
            if code == WORK:
                if effect.stream:
                    if at == last:
                        self.before_query = (set(unsynced), self.recorded)
                    worked = _worked_on(effect)
                    unsynced.update(worked)
                    if self.recorded is not None:  # an event recorded before this work does not cover it
                        self.recorded = (self.recorded[0], self.recorded[1].difference(worked))
            elif code == RECORD:
                if effect.stream:
                    self.recorded = (effect.event, frozenset(unsynced))
            elif not unsynced:
                continue
            elif code == RELEASE:
                unsynced.discard(effect.seq)
            elif code == SYNC:
                unsynced.clear()
            elif effect.stream == 0 and self.recorded is not None and effect.event == self.recorded[0]:  # WAIT
                unsynced.difference_update(self.recorded[1])


class Orderings:
    """The rules of this module over one run: ``check`` takes every batch of effects. ``mtp``: the
    run speculates with an MTP head (the order of bootstraps and verifies is checked there)."""

    def __init__(self, mtp: bool = False) -> None:
        self.barrier = PrefillBarrier()
        self.mtp = mtp
        self.verified = False  # the speculative step under way has run a verify
        self.last_verify: Optional[type] = None  # the type of the last verify (a batch's closing query)

    def _bootstraps_first(self, plan: _Plan) -> None:
        """bootstraps before verifies (specs/speculation.md §6.2 steps 4-5): in an MTP step every
        bootstrap (its ``decode`` of the last token: §6.3 step 2, the step's only one-sequence
        decode) comes before the step's first verify. A step begins with its capacity queries."""
        if plan.capacity:
            self.verified = False
        if plan.decode_call and self.verified:
            raise Violation("bootstraps_before_verifies", "an MTP bootstrap's decode runs after a verify of the "
                                                          "same speculative step")
        if plan.synced_verify:
            self.verified = True

    def check(self, effects: Sequence, kinds: tuple, fault: bool, plan: Optional[_Plan] = None) -> None:
        """One batch of effects before it is carried out (``kinds``: their types, in order; ``fault``:
        the batch is the answer to a ``DeviceFault``; ``plan``: ``PLANS[kinds]``, when the caller has it)."""
        if plan is None:
            plan = PLANS[kinds]
        barrier = self.barrier
        if plan.work or barrier.unsynced or barrier.before_query is not None:
            barrier.step(effects, plan.stream_ops, fault)
        if plan.synced_verify:
            sync_before_verify(effects, kinds)
        if plan.stash:
            stash_before_use(effects, kinds)
        if plan.self_verify:
            checkpoint_before_self_verify(effects)
        if plan.trim_commit and self.last_verify in K_VERIFIES:
            trim_then_partial_commit(effects)
        if plan.synced_verify or plan.self_verify:
            self.last_verify = kinds[-1]
        if plan.snapshot:
            snapshot_before_checkpoint(effects)
        if self.mtp and (plan.capacity or plan.decode_call or plan.synced_verify):
            self._bootstraps_first(plan)
