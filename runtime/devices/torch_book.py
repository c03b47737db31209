"""The torch device's bookkeeping: sequences and slots, pending rows and their commits, the row
table of the last forward, the DFlash drafter context (the invariants are in
``fxsched.runtime.devices.torch``)."""

from __future__ import annotations

import enum
import weakref
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence as Seq

import structlog
import torch

from fxsched.kernels.row_argmax import row_argmax
from fxsched.runtime.devices.device import DeviceError
from fxsched.runtime.devices.grammar_mask import GrammarBook, apply_bitmask
from fxsched.runtime.devices.streams import StreamError, StreamSet
from fxsched.runtime.torch_model import HybridEngine
from fxsched.runtime.torch_model.config import ModelConfig
from fxsched.runtime.torch_model.errors import OutOfBlocksError, SpillError, TorchModelError

log = structlog.get_logger("fxsched.torch_device")


# A drafter override (tests, benchmarks): (committed tokens of the sequence, its last token, n) -> drafts.
Drafter = Callable[[list, int, int], list]


class DeviceStateError(RuntimeError):
    """The scheduler's calls and the device's view of a sequence disagree (a bug, not a fault)."""


class PendingKind(enum.Enum):
    """What an uncommitted forward was: a verify of drafts, or a self-speculative draft decode."""

    VERIFY = "verify"
    DRAFT = "draft"


@dataclass
class Pending:
    """An uncommitted forward of one sequence: ``tokens`` at positions committed.. ."""

    tokens: list[int]
    keep: int
    kind: PendingKind
    agreed: int  # rows the target agrees with: anchor + leading drafts equal to the argmax rows


@dataclass
class DeviceSeq:
    seq_id: int
    session: int
    slot: int
    pending: Optional[Pending] = None
    cached_tokens: int = 0
    adapter_slot: int = -1  # the LoRA slot it acquired (-1: the base model, specs/lora.md §18.5)


@dataclass
class DeviceStats:
    """Counters of one device's life (the generate summary reads them)."""

    forwards: int = 0  # target-model forward passes (a batched call counts once)
    prefill_forwards: int = 0
    decode_forwards: int = 0
    verify_forwards: int = 0
    draft_forwards: int = 0
    verifies: int = 0  # per-sequence verifies committed
    verify_rows: int = 0  # rows those verifies ran
    kept_rows: int = 0  # rows they kept (accepted drafts + the anchor)
    drafts_proposed: int = 0
    proposals: int = 0
    overaccepts: int = 0  # commits that kept more rows than the target agreed with
    cached_blocks: int = 0  # blocks newly inserted into the prefix cache
    cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    spills: int = 0
    restores: int = 0
    calls: Counter = field(default_factory=Counter)  # forward / proposer / commit calls by name
    widest_batched_verify: int = 0  # most sequences in one decode_verify_batched
    drafts_at: list[int] = field(default_factory=list)  # verified drafts by position (0: the first draft)
    accepted_at: list[int] = field(default_factory=list)  # of those, the ones kept

    def count_position(self, drafts: int, accepted: int) -> None:
        """One verify of ``drafts`` drafts that kept the first ``accepted`` of them."""
        if len(self.drafts_at) < drafts:
            grow = drafts - len(self.drafts_at)
            self.drafts_at.extend([0] * grow)
            self.accepted_at.extend([0] * grow)
        for i in range(drafts):
            self.drafts_at[i] += 1
        for i in range(min(accepted, drafts)):
            self.accepted_at[i] += 1

    @property
    def acceptance_by_position(self) -> tuple[float, ...]:
        """Per draft position, the share of verified drafts kept (vLLM's per-position acceptance)."""
        return tuple(a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafts_at, strict=True))

    @property
    def accepted_drafts(self) -> int:
        return self.kept_rows - self.verifies

    @property
    def mean_accepted_length(self) -> Optional[float]:
        """Tokens gained per verify (accepted drafts + the bonus token); None without verifies."""
        return self.kept_rows / self.verifies if self.verifies else None


class DeviceBook:
    """The torch device's bookkeeping, shared by its parts (``TorchDevice`` sets every attribute):
    sequences and their slots, pending rows and their commits, the row table of the last forward,
    the DFlash drafter context. See ``fxsched.runtime.devices.torch`` for the invariants."""

    engine: HybridEngine
    cfg: ModelConfig
    proposer: Optional[str]
    drafter: Optional[Drafter]
    strict: bool
    streams: StreamSet
    stats: DeviceStats
    on_tick: Callable[[int], None]
    tick: int
    grammars: Optional[GrammarBook]
    _occupancy_reads: int
    _seqs: dict[int, DeviceSeq]
    _by_slot: dict[int, int]
    _logits: Optional[torch.Tensor]
    _owners: list[tuple[int, int]]
    _argmax: Optional[list[int]]
    _stash: tuple[list[int], Optional[torch.Tensor]]  # the stashed rows' owners and the rows [N, D]
    _ring: dict[tuple[int, int], tuple[int, list]]
    _spill_cleanup: Optional[weakref.finalize]
    _spill_dir: Optional[Path]
    _spills: dict[int, Path]
    _cached_by_session: dict[int, int]
    _closed: bool
    late_drafts: bool  # proposals answer LATE_DRAFT and keep their drafts here (specs/async.md §16.3)
    _late: dict[int, torch.Tensor | str]  # by sequence: its last late proposal's drafts [n] on the device, or its failure
    # the last late proposal's drafts [B, n] and each of its sequences' row (its ``_late`` entry is that
    # row while the sequence holds a tensor there: every proposal sets both)
    _late_batch: Optional[tuple[torch.Tensor, dict[int, int]]]
    _verify_inputs: list[int]  # the last verify's inputs as they ran

    @property
    def uses_dflash_context(self) -> bool:
        return self.proposer == "dflash" and self.engine.dflash is not None

    def _seq(self, seq_id: int) -> DeviceSeq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise DeviceError(f"unknown sequence {seq_id} (not allocated on this device)") from None

    def _seq_in_slot(self, slot: int) -> DeviceSeq:
        try:
            return self._seqs[self._by_slot[slot]]
        except KeyError:
            raise DeviceError(f"slot {slot} holds no sequence") from None

    def seq_len(self, seq_id: int) -> int:
        """The scheduler's view of the sequence's length: committed plus kept pending rows."""
        s = self._seq(seq_id)
        return self.engine.seq_len(s.slot) + (s.pending.keep if s.pending else 0)

    def slot_of(self, seq_id: int) -> int:
        return self._seq(seq_id).slot

    def cached_tokens(self, session: int) -> int:
        """Prompt tokens of request ``session`` served from the prefix cache at its last prefill."""
        for s in self._seqs.values():
            if s.session == session:
                return s.cached_tokens
        return self._cached_by_session.get(session, 0)

    @contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        """Engine failures as DeviceError naming the call."""
        try:
            yield
        except OutOfBlocksError as err:
            raise DeviceError(f"KV cache exhausted in {what}: {err}", kv_exhausted=True) from err
        except SpillError as err:
            raise DeviceError(f"{what}: {err}") from err
        except StreamError as err:
            raise DeviceError(f"{what}: {err}") from err
        except (TorchModelError, ValueError) as err:
            raise DeviceError(f"{what}: {err}") from err
        except OSError as err:
            raise DeviceError(f"{what}: {type(err).__name__}: {err}") from err

    def _make_room(self, need: int, what: str) -> None:
        """Evict unused prefix-cache blocks (least recently used first) when a forward needs more
        blocks than are free: cached blocks are a cache, never a reason to fail."""
        free = self.engine.num_free_blocks()
        if need > free:
            got = self.engine.reclaim(need - free)
            log.debug("prefix_cache_evicted", call=what, need=need, free=free, evicted=got)

    def _room_for(self, pairs: list[tuple[int, int]], what: str) -> None:
        self._make_room(sum(self.engine.blocks_needed(slot, rows) for slot, rows in pairs), what)

    def _set_rows(self, logits: torch.Tensor, owners: list[tuple[int, int]],
                  argmax: Optional[list[int]] = None) -> None:
        self._logits = logits if argmax is not None else self._constrain(logits, owners)
        self._owners = owners
        self._argmax = argmax

    def _constrain(self, logits: torch.Tensor, owners: list[tuple[int, int]]) -> torch.Tensor:
        """The rows of requests with a grammar masked to the tokens it allows after the row's path:
        the committed tokens, then the pending forward's inputs up to the row (a committed forward's
        rows are the last of their inputs). See ``grammar_mask``."""
        book = self.grammars
        if not book:
            return logits
        rows: list[tuple[int, int, list[int]]] = []
        committed: dict[int, list[int]] = {}
        for r, (seq_id, local) in enumerate(owners):
            s = self._seqs.get(seq_id)
            rid = book.request_of(seq_id)
            if s is None or rid is None:
                continue
            if seq_id not in committed:
                committed[seq_id] = self.engine.tokens(s.slot)
            tail = s.pending.tokens[:local + 1] if s.pending is not None else []
            rows.append((r, rid, committed[seq_id] + tail))
        masked, masks = book.masks(rows)
        return apply_bitmask(logits, masked, masks)

    def _row_tokens(self) -> list[int]:
        if self._logits is None:
            raise DeviceError("no forward has produced logits rows yet")
        if self._argmax is None:
            self._argmax = row_argmax(self._logits).tolist()
        return self._argmax

    def _check_rows(self, row: int, n: int) -> None:
        have = 0 if self._logits is None else self._logits.shape[0]
        if n < 0 or row < 0 or row + n > have:
            raise DeviceError(f"rows {row}..{row + n - 1} were not produced by the last forward ({have} rows)")

    def _owner(self, row: int) -> tuple[DeviceSeq, int]:
        self._check_rows(row, 1)
        seq_id, local = self._owners[row]
        return self._seq(seq_id), local

    def _commit(self, s: DeviceSeq, n: int, what: str) -> None:
        """Fold n rows of the pending forward of ``s`` into its committed state."""
        pending = s.pending
        assert pending is not None
        self._account(s, pending, n, what)
        with self._errors(what):
            self.engine.commit_accepted_prefix(s.slot, n)
        s.pending = None

    def _account(self, s: DeviceSeq, pending: Pending, n: int, what: str) -> None:
        if pending.kind is not PendingKind.VERIFY:
            return
        self.stats.verifies += 1
        self.stats.verify_rows += len(pending.tokens)
        self.stats.kept_rows += n
        self.stats.count_position(len(pending.tokens) - 1, n - 1)
        if n > pending.agreed:
            self.stats.overaccepts += 1
            message = (f"{what}: sequence {s.seq_id} keeps {n} verify rows but the target agreed with "
                       f"only {pending.agreed} (inputs {pending.tokens})")
            if self.strict:
                raise DeviceStateError(message)
            log.warning("overaccept", seq=s.seq_id, kept=n, agreed=pending.agreed)

    def _settle(self, s: DeviceSeq, what: str) -> None:
        """The deferred fold: commit the rows the scheduler still counts."""
        if s.pending is not None:
            self._commit(s, s.pending.keep, what)

    def _settle_many(self, seqs: Seq[DeviceSeq], what: str) -> None:
        """Deferred folds of several sequences in one batched state write."""
        todo = [(s, s.pending) for s in seqs if s.pending is not None]
        if not todo:
            return
        keeps = [pending.keep for _, pending in todo]
        for s, pending in todo:
            self._account(s, pending, pending.keep, what)
        with self._errors(what):
            self.engine.gdn_fold_accepted([s.slot for s, _ in todo], keeps)
        for s, _ in todo:
            s.pending = None

    def _resolve_keep(self, s: DeviceSeq, n: int, what: str) -> None:
        """An explicit commit of n rows: it sets ``keep`` unless a truncation already set another."""
        pending = s.pending
        if pending is None:
            raise DeviceStateError(f"{what}: sequence {s.seq_id} has no uncommitted rows")
        if not 0 <= n <= len(pending.tokens):
            raise DeviceStateError(f"{what}: sequence {s.seq_id} cannot keep {n} of {len(pending.tokens)} rows")
        if pending.keep != len(pending.tokens) and pending.keep != n:
            raise DeviceStateError(f"{what}: sequence {s.seq_id} keeps {n} rows but was truncated to "
                                   f"{pending.keep} of {len(pending.tokens)}")
        pending.keep = n

    def _ctx_catch_up(self, s: DeviceSeq, upto: Optional[int] = None) -> None:
        """Extend the drafter context over committed rows it lacks (up to ``upto``)."""
        self._ctx_catch_up_many([s], [upto])

    def _ctx_catch_up_many(self, seqs: Seq[DeviceSeq], uptos: Seq[Optional[int]]) -> None:
        """`_ctx_catch_up` of several sequences: a context past its mark is trimmed, and the ones
        short of it grow in one engine append (one projection for all their rows)."""
        if not self.uses_dflash_context:
            return
        engine = self.engine
        grow: list[int] = []
        grow_to: list[int] = []
        for s, upto in zip(seqs, uptos, strict=True):
            slot = s.slot
            committed = engine.seq_len(slot)
            upto = committed if upto is None else upto
            if upto > committed:
                raise DeviceStateError(f"sequence {s.seq_id}: drafter context up to {upto} but only {committed} "
                                       f"committed")
            ctx = engine.ctx_len(slot)
            if ctx > upto:
                engine.trim_proposer_state(slot, ctx - upto)
            elif ctx < upto:
                grow.append(slot)
                grow_to.append(upto)
        if grow:
            with self._errors("drafter context"):
                engine.ctx_extend_many(grow, grow_to)

    def _forget_ahead(self, seq_id: int) -> None:
        """A freed sequence's tokens kept on the device go with it (``torch_ahead``)."""

    def _count(self, kind: str, what: str) -> None:
        self.stats.calls[what] += 1
        self.stats.forwards += 1
        setattr(self.stats, f"{kind}_forwards", getattr(self.stats, f"{kind}_forwards") + 1)

    def _stash_entry(self, index: int) -> tuple[int, torch.Tensor]:
        owners, rows = self._stash
        if not 0 <= index < len(owners) or rows is None:
            raise DeviceError(f"stash entry {index} does not exist ({len(owners)} stashed rows)")
        return owners[index], rows[index]
