"""The speculative steps' tasks and waiting records: the MTP / DFlash step (``core/spec_step.py``),
serial verifies (``core/kverify.py``), DFlash (``core/dflash.py``), the batched MTP verify
(``core/mtp_batch.py``), the n-gram step (``core/ngram.py``) and self-speculation
(``core/self_spec.py``) (specs/speculation.md §6.2-§6.15).

``core/phases.py`` is the namespace of every task and waiting record; ``core/table.py`` maps
each to its rule.
"""

from __future__ import annotations

import enum

import attrs

from fxsched.effects.base import quick_inits


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


quick_inits(globals())  # every record class above: a quicker __init__ (effects/base.py)
