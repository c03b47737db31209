"""Every task and every waiting record of the engine, in one place.

A *task* is work on the agenda of the current tick; its rule either finishes at once or ends the
batch of effects with a query. A *waiting* record (``Await...``) is parked in ``state.waiting``
while that query is outstanding: it says what answer the engine waits for and carries what the rule
needs to go on. Rules hand work to another lane only by pushing one of these records, never by
calling into another rule module. ``core/table.py`` maps each type below to its rule, and each
waiting type to the answers it accepts and to what a ``DeviceFault`` there fails.

Grouped by lane, in the order a tick meets them (specs/scheduler.md §5.3).
"""

from __future__ import annotations

import enum
from typing import Any, Optional

import attrs

from fxsched.core.request import Request
from fxsched.effects.base import Effect, quick_inits

# === the loop (core/tick.py) ====================================================================


@attrs.frozen
class StartUp:
    """Task: bind the device thread and create the prefill stream and event."""


@attrs.frozen
class TickStart:
    """Task: drain the inbox, block on it when idle, admit, and lay out the tick's tasks."""


@attrs.frozen
class Admit:
    """Task: ask the adapter ids of the cohort and of this tick's new requests."""


@attrs.frozen
class Publish:
    """Task: publish the snapshot (free-block count), which opens the tick."""


@attrs.frozen
class Rotate:
    """Task: apply one pending LoRA rotation, only when nothing is in flight."""


@attrs.frozen
class IdleCheck:
    """Task: with nothing in flight and the inbox closed, shut the loop down."""


@attrs.frozen
class EmptyBatchExit:
    """Task after lane 2: with nothing active, try swap-in and requeue resume first."""


@attrs.frozen
class EmptyBatchSkip:
    """Task: still nothing active, so skip lane 3 and the end of tick."""


@attrs.frozen
class EndOfTick:
    """Task: expire deadlines, retire finished sequences, compact, swap in, resume."""


@attrs.frozen
class Shutdown:
    """Task: fail or finish everything still owed an answer and tear down."""


@attrs.frozen
class AwaitStream:
    """Waits for ``StreamCreated``: the prefill stream."""


@attrs.frozen
class AwaitEvent:
    """Waits for ``EventCreated``: the event that orders the prefill stream before decode."""


@attrs.frozen
class AwaitInput:
    """Waits for ``InputReady``: blocked on the inbox, nothing in flight and nothing pending."""


@attrs.frozen
class AwaitAdapterIds:
    """Waits for ``AdapterIds`` of the cohort slot then of each of ``new`` (this tick's
    admissions, not yet in any collection)."""

    new: tuple[Request, ...]


@attrs.frozen
class AwaitPublishBlocks:
    """Waits for ``FreeBlocks``: the snapshot publish that opens the tick."""


@attrs.frozen
class AwaitRotation:
    """Waits for ``LoraApplied`` of the rotation to adapter ``name``."""

    name: str


# === generic control flow (core/flow.py) ========================================================


@attrs.frozen
class AwaitForward:
    """Waits for ``ForwardDone`` of a forward over ``seq_ids``; ``then`` are the tasks that follow.

    ``request`` and ``slot`` name a request that is not yet a sequence anywhere (its first
    prefill), so that a fault can fail it.
    """

    seq_ids: tuple[int, ...]
    then: tuple[Any, ...] = ()
    request: Optional[Request] = None
    slot: Optional[int] = None


@attrs.frozen
class EmitEffects:
    """Task: emit ``effects`` (fire-and-forget) at this point of the agenda."""

    effects: tuple[Effect, ...]


@attrs.frozen
class AskQuery:
    """Task: ask ``query`` and park ``waiting`` (a continuation written as data)."""

    query: Effect
    waiting: Any


# === lane 1: new requests (core/prefill.py) =====================================================


@attrs.frozen
class StartRequests:
    """Task: lane 1 for this tick's new requests (beam groups first, then one by one)."""


@attrs.frozen
class StartRequest:
    """Task: allocate a sequence for ``request`` and start its prefill."""

    request: Request


@attrs.frozen
class BeamGroup:
    """Task: two or more blocking beam requests answered by one ``generate_beam_batch``."""

    requests: tuple[Request, ...]


@attrs.frozen
class AwaitSlot:
    """Waits for ``SlotAllocated`` for ``request`` as sequence ``seq_id`` (no slot held yet)."""

    request: Request
    seq_id: int


@attrs.frozen
class AwaitLaneAdapter:
    """Waits for the ``AdapterIds`` of ``request``, which holds ``slot`` as ``seq_id``."""

    request: Request
    seq_id: int
    slot: int


@attrs.frozen
class AwaitFirstToken:
    """Waits for the first token (``TokenSampled`` or ``TokensSampled``) of a whole prefill."""

    request: Request
    seq_id: int
    slot: int


@attrs.frozen
class AwaitBeam:
    """Waits for ``BeamHypotheses`` of one beam request holding ``slot``."""

    request: Request
    seq_id: int
    slot: int


@attrs.frozen
class AwaitBeamGroup:
    """Waits for ``BeamHypotheses`` of a beam group; its requests hold no slot."""

    requests: tuple[Request, ...]


@attrs.frozen
class Chunk0Done:
    """Task: chunk 0 of ``request`` ran; read its first token or keep prefilling."""

    request: Request
    seq_id: int
    slot: int
    chunk: int
    last: bool


# === lane 2: chunked prefill (core/prefill.py) ==================================================


@attrs.frozen
class ContinuePrefills:
    """Task: lane 2, the next chunk of every prefilling prompt (mixed with decode rows or not)."""


@attrs.frozen
class PickPrefillToken:
    """Task: read the first token of a prompt whose last chunk ran, from ``row`` of the forward."""

    seq_id: int
    row: int


@attrs.frozen
class AwaitPrefillToken:
    """Waits for the first token of the prefilling prompt ``seq_id``."""

    seq_id: int


@attrs.frozen
class Barrier:
    """Task: the decode stream waits for the prefill stream's work so far."""


@attrs.frozen
class MixedReadback:
    """Task: read the decode rows of a mixed step and hand each token to the plain sink."""

    seq_ids: tuple[int, ...]


@attrs.frozen
class AwaitMixedReadback:
    """Waits for ``TokensSampled`` of a mixed step's decode rows ``seq_ids``."""

    seq_ids: tuple[int, ...]


@attrs.frozen
class Promote:
    """Task: every prompt whose first token is known becomes an active sequence."""


# === lane 3: dispatch and plain decode (core/decode.py) =========================================


@attrs.frozen
class DecodeLane:
    """Task: choose the decode path of this tick (n-gram, self-spec, MTP/DFlash or plain)."""


@attrs.frozen
class PlainDecode:
    """Task: one plain decode step over every active sequence in slot order."""


@attrs.frozen
class AwaitDecode:
    """Waits for ``TokensSampled`` (or a ``DeviceFault``) of the plain decode of ``seq_ids``;
    ``resolve``: the sequences whose kept tokens the answer brings (specs/async.md §16.6)."""

    seq_ids: tuple[int, ...]
    resolve: tuple[int, ...] = ()


@attrs.frozen
class ResolveAhead:
    """Task: read back the tokens kept on the device by decodes answered ahead, before work that
    needs every sequence's last token (specs/async.md §16.6)."""


@attrs.frozen
class RetireResolved:
    """Task: retire the sequences the tokens read at a tick's start finished, before admission."""


@attrs.frozen
class AwaitAhead:
    """Waits for ``TokensSampled`` with the kept tokens of ``seq_ids`` in ``earlier``."""

    seq_ids: tuple[int, ...]


# === MTP / DFlash step (core/spec_step.py) ======================================================


class AfterProposal(enum.Enum):
    """What follows a single-sequence proposal."""

    NOTHING = "nothing"
    MARCONI = "marconi"  # a K = 2 verdict: DecodeMarconiCheckpoint
    CHECKPOINT = "checkpoint"  # an MTP bootstrap: StartCheckpointAsync


@attrs.frozen
class SpecStep:
    """Task: the MTP / DFlash step, starting with the draft-capacity clamp."""


@attrs.frozen
class AwaitCapacity:
    """Waits for ``DraftCapacity`` of the active slots; ``base`` is the unclamped draft count."""

    base: int


@attrs.frozen
class Bootstrap:
    """Task: a sequence without drafts gets its first ones (MTP decode or DFlash proposal)."""

    seq_id: int
    draft_count: int


@attrs.frozen
class Verifies:
    """Task: verify the drafts of ``seq_ids``: batched through a gate, or one by one."""

    seq_ids: tuple[int, ...]
    draft_count: int


@attrs.frozen
class AwaitProposal:
    """Waits for ``Drafts`` of one sequence; ``then`` says what follows them."""

    seq_id: int
    then: AfterProposal = AfterProposal.NOTHING


@attrs.frozen
class AwaitBatchedProposal:
    """Waits for ``BatchedDrafts`` of ``seq_ids`` (stashed verify rows)."""

    seq_ids: tuple[int, ...]


# === serial verifies (core/kverify.py) ==========================================================


@attrs.frozen
class SerialVerify:
    """Task: verify one sequence's drafts on its own (K = 2, 3, 4 or a DFlash block)."""

    seq_id: int
    draft_count: int


@attrs.frozen
class AwaitKVerify:
    """Waits for ``VerifyRows`` of a K-row verify of ``drafts`` (the first ``k - 1`` were fed);
    ``pre_len`` is the KV length before it, ``propose_n`` the drafts to propose after it."""

    seq_id: int
    drafts: tuple[int, ...]
    k: int
    propose_n: int
    pre_len: int
    dflash: bool


@attrs.frozen
class AwaitMtpDecode:
    """Waits for ``TokenSampled`` of an MTP bootstrap decode of ``seq_id``."""

    seq_id: int
    draft_count: int


# === DFlash (core/dflash.py) ====================================================================


@attrs.frozen
class AwaitDflashDrafts:
    """Waits for ``Drafts``: a DFlash bootstrap's first block."""

    seq_id: int
    draft_count: int


@attrs.frozen
class AwaitDflashVerify:
    """Waits for ``VerifyRows`` of one sequence's block verify of ``drafts`` from ``pre_len``."""

    seq_id: int
    drafts: tuple[int, ...]
    pre_len: int
    draft_count: int


@attrs.frozen
class DflashGate:
    """Task: two or more DFlash sequences to verify: ask whether they may be batched."""

    seq_ids: tuple[int, ...]
    draft_count: int


@attrs.frozen
class AwaitDflashGate:
    """Waits for ``BatchVerifyAllowed`` of ``m`` of the ``batchable`` sequences at ``k`` rows;
    ``rest`` hold another number of drafts and verify serially."""

    batchable: tuple[int, ...]
    rest: tuple[int, ...]
    k: int
    m: int
    draft_count: int


@attrs.frozen
class BatchedDflashVerify:
    """Task: one batched verify of ``seq_ids`` at ``k`` rows each."""

    seq_ids: tuple[int, ...]
    k: int
    draft_count: int


@attrs.frozen
class AwaitBatchedDflash:
    """Waits for ``VerifyRows`` of a batched DFlash verify; the sequence records still show the
    KV before it, the drafts and lengths in flight are here."""

    seq_ids: tuple[int, ...]
    drafts: tuple[tuple[int, ...], ...]
    pre_lens: tuple[int, ...]
    k: int
    draft_count: int


# === batched MTP verify (core/mtp_batch.py) =====================================================


@attrs.frozen
class MtpBatch:
    """One chunk of the batched MTP verify: sequences in batch order with their depths."""

    seq_ids: tuple[int, ...]
    ks: tuple[int, ...]
    draft_count: int


@attrs.frozen
class MtpGate:
    """Task: two or more MTP sequences to verify: split them into batched chunks and serial ones."""

    seq_ids: tuple[int, ...]
    draft_count: int


@attrs.frozen
class MtpGateCheck:
    """Task: ask whether ``batch`` may run as one verify."""

    batch: MtpBatch


@attrs.frozen
class AwaitMtpGate:
    """Waits for ``BatchVerifyAllowed`` of ``batch``."""

    batch: MtpBatch

    @property
    def seq_ids(self) -> tuple[int, ...]:
        return self.batch.seq_ids


@attrs.frozen
class AwaitMtpBatch:
    """Waits for ``VerifyRows`` of a batched MTP verify (``ks`` rows per sequence)."""

    seq_ids: tuple[int, ...]
    ks: tuple[int, ...]
    drafts: tuple[tuple[int, ...], ...]
    pre_lens: tuple[int, ...]
    draft_count: int


# === n-gram (core/ngram.py) =====================================================================


@attrs.frozen
class NgramStep:
    """Task: the n-gram step of the single active sequence (decode, or K = 2 verify of a draft)."""


@attrs.frozen
class AwaitNgramDecode:
    """Waits for ``TokenSampled`` of an n-gram step's plain decode."""

    seq_id: int


@attrs.frozen
class AwaitNgramVerify:
    """Waits for ``VerifyRows`` of the K = 2 verify of ``draft`` from ``pre_len``."""

    seq_id: int
    draft: int
    pre_len: int


# === self-speculation (core/self_spec.py) =======================================================


@attrs.frozen
class SelfSpecStep:
    """Task: the self-speculative step of the single active sequence."""


@attrs.frozen
class AwaitSelfCapacity:
    """Waits for ``DraftCapacity`` of the active slot."""


@attrs.frozen
class AwaitSelfToken:
    """Waits for ``TokenSampled`` of the step's decode (``first`` unset) or of a draft decode."""

    seq_id: int
    draft_count: int
    pre_len: int = 0
    first: int = -1
    drafts: tuple[int, ...] = ()


@attrs.frozen
class AwaitSelfVerify:
    """Waits for ``VerifyRows`` of the verify of ``first`` and ``drafts`` from ``pre_len``."""

    seq_id: int
    first: int
    drafts: tuple[int, ...]
    pre_len: int


# === memory pressure (core/lifecycle.py) ========================================================


class SwapOutStage(enum.Enum):
    """Where an admission-time swap-out is: reclaiming prefix blocks, or spilling victims."""

    RECLAIM = "reclaim"
    SWAP = "swap"


@attrs.frozen
class SwapOutRoom:
    """Task: before lane 1, with a spill pool, make room for each new request's prompt."""


@attrs.frozen
class SwapOutFor:
    """Task: make ``need`` blocks free (reclaim first, then spill victims)."""

    need: int


@attrs.frozen
class AwaitSwapOutFree:
    """Waits for ``FreeBlocks`` while making ``need`` blocks free at ``stage``."""

    need: int
    stage: SwapOutStage


@attrs.frozen
class AwaitSwapOutReclaim:
    """Waits for ``BlocksReclaimed`` while making ``need`` blocks free."""

    need: int


@attrs.frozen
class SwapIn:
    """Task: bring back the first spilled sequence whose blocks fit."""


@attrs.frozen
class AwaitSwapInFree:
    """Waits for ``FreeBlocks`` before a swap-in."""


@attrs.frozen
class AwaitSwapInReclaim:
    """Waits for ``BlocksReclaimed`` (or ``FreeBlocks``) until the ``smallest`` spilled table fits."""

    smallest: int


@attrs.frozen
class AwaitSwapInSlot:
    """Waits for ``SlotAllocated`` of the restoring sequence ``seq_id`` (no slot held yet)."""

    seq_id: int


@attrs.frozen
class AwaitRestore:
    """Waits for ``StateRestored`` (or a ``DeviceFault``) of ``seq_id`` into ``slot``."""

    seq_id: int
    slot: int


@attrs.frozen
class RequeueResume:
    """Task: re-prefill the preempted sequence with the smallest history, when it fits."""


@attrs.frozen
class AwaitResumeFree:
    """Waits for ``FreeBlocks`` before resuming ``seq_id``, which wants ``want`` blocks."""

    seq_id: int
    want: int
    reclaimed: bool = False


@attrs.frozen
class AwaitResumeReclaim:
    """Waits for ``BlocksReclaimed`` before resuming ``seq_id``."""

    seq_id: int
    want: int


@attrs.frozen
class AwaitResumeSlot:
    """Waits for ``SlotAllocated`` of the preempted sequence ``seq_id``."""

    seq_id: int


quick_inits(globals())  # every record class above: a quicker __init__ (effects/base.py)
