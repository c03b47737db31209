"""TorchDevice: the Device protocol carried out on a real model (``HybridEngine``).

The scheduler names sequences by its sequence ids and keeps its own ``seq_len``; the device maps
each id to an engine slot and keeps three things per sequence:

* the engine's *committed* state (``engine.seq_len(slot)`` tokens in the paged KV, GDN state
  folded after them);
* at most one *pending* forward: the rows of the last verify (or self-speculative draft) that are
  computed but not committed, with ``keep`` = how many of them the scheduler still counts after
  its ``truncate_sequence`` calls;
* for DFlash, the drafter context (the committed tokens' hidden rows for the internal drafter, their
  captured target-layer features for a checkpoint's drafter; the engine's ``ctx_extend`` picks).

The scheduler's length of a sequence is therefore ``committed + keep``. Commits happen at the
scheduler's explicit calls (``commit_accepted_prefix``, ``gdn_fold_accepted``, the n-gram /
self-speculative checkpoint and rollback calls), and otherwise lazily: before the next forward,
proposal, cache insert, spill or snapshot of the sequence, the pending rows are folded keeping
``keep`` rows (the "deferred fold"; the n-gram step, for one, never names a commit). Rows the
scheduler dropped need no undo: the engine writes on accept only.

Logits rows. Every forward replaces the *row table*: its logits ``[R, V]`` in the scheduler's row
order, and for each row the sequence and the row's index within that sequence's forward (so
``save_hidden_for_mtp(row)`` and ``stash_verify_hidden_rows`` find the hidden state). Verifies
answer the argmax of every row (``fxsched.kernels.row_argmax``); the device also computes its own
greedy acceptance of the drafts (``fxsched.kernels.greedy_accept``) to count accepted drafts and
to catch a commit that keeps more rows than the target agreed with (``strict`` raises).

Prefix cache. ``prefill`` (and chunk 0 of a chunked prefill) reuses cached blocks and returns how
many prompt tokens came from the cache; ``cached_tokens(request id)`` reads it back. The core does
not ask for it yet (its ``Done`` frames say ``cached=0``). Unused cached blocks are evicted on
demand when a forward needs room, so a full prefix cache never fails a forward.

Streams. Forwards named with a stream other than 0 run on that stream, ordered after the default
stream's work and before its next work (``StreamSet.use``), so sharing tensors is always safe.

Errors. Engine failures become ``DeviceError`` (out of KV blocks: ``kv_exhausted=True``; spill
files: the spill error's message). A call that does not fit the device's view of the sequence
(the scheduler and the device disagree on a length, a commit of rows that were never computed)
raises ``DeviceStateError``: that is a bug, never an answer.
"""

from __future__ import annotations

import enum

import shutil
import tempfile
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence as Seq

import structlog
import torch

from fxsched.kernels.greedy_accept import greedy_accept, row_offsets_from_counts
from fxsched.kernels.row_argmax import row_argmax
from fxsched.runtime.devices.device import DeviceError
from fxsched.runtime.devices.grammar_mask import GrammarBook, apply_bitmask
from fxsched.runtime.logs import ensure_configured
from fxsched.runtime.devices.streams import StreamError, StreamSet
from fxsched.runtime.devices.spec_sampling import verify_sample
from fxsched.runtime.devices.row_processors import RowProcessors
from fxsched.runtime.devices.torch_sampling import RowLogprobs, SampledRows, logprob_records, sample_rows
from fxsched.runtime.torch_model import HybridEngine
from fxsched.runtime.torch_model.transfers import send_ints
from fxsched.runtime.torch_model.errors import OutOfBlocksError, SpillError, TorchModelError

log = structlog.get_logger("fxsched.torch_device")

PROPOSERS = ("mtp", "dflash")
DRAFT_CAPACITY = 8  # drafts a slot can take per step (the scheduler clamps its draft count to it)
MAX_BATCH_VERIFY_ROWS = 160
BEAM_MAX_TOKENS = 16

# A drafter override (tests, benchmarks): (committed tokens of the sequence, its last token, n) -> drafts.
Drafter = Callable[[list, int, int], list]


PROMPT_LOGPROBS_CHUNK = 512  # rows of one prompt-logprobs forward (all of them get logits)

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


class TorchDevice:
    """Implements every call of ``fxsched.runtime.devices.device.Device`` on a ``HybridEngine``."""

    def __init__(self, engine: HybridEngine, proposer: Optional[str] = None, drafter: Optional[Drafter] = None,
                 strict: bool = False, spill_dir: Optional[str | Path] = None,
                 on_tick: Optional[Callable[[int], None]] = None, grammars: Optional[GrammarBook] = None) -> None:
        if proposer is not None and proposer not in PROPOSERS:
            raise ValueError(f"proposer must be one of {PROPOSERS} or None, got {proposer!r}")
        if proposer == "mtp" and engine.mtp is None and drafter is None:
            raise ValueError("proposer 'mtp' needs a model with an MTP head (config mtp = true)")
        if proposer == "dflash" and engine.dflash is None and drafter is None:
            raise ValueError("proposer 'dflash' needs a model with a DFlash drafter (config dflash_gamma > 0)")
        ensure_configured()
        self.engine = engine
        self.cfg = engine.cfg
        self.proposer = proposer
        self.drafter = drafter
        self.strict = strict
        self.streams = StreamSet(engine.device)
        self.stats = DeviceStats()
        self.on_tick = on_tick or (lambda tick: None)
        self.tick = 0
        self._occupancy_reads = 0
        self._seqs: dict[int, DeviceSeq] = {}
        self._by_slot: dict[int, int] = {}
        self._logits: Optional[torch.Tensor] = None
        self._owners: list[tuple[int, int]] = []
        self._argmax: Optional[list[int]] = None
        self._stash: list[tuple[int, torch.Tensor]] = []
        self._ring: dict[tuple[int, int], tuple[int, list]] = {}
        self._own_spill_dir = spill_dir is None
        self._spill_dir: Optional[Path] = Path(spill_dir) if spill_dir is not None else None  # made on first spill
        self._spills: dict[int, Path] = {}
        self._cached_by_session: dict[int, int] = {}
        self._closed = False
        self.grammars = grammars  # structured output: the rows of a request with a grammar are masked

    # ======================================================================================
    # bookkeeping
    # ======================================================================================

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

    # --- pending rows and commits ------------------------------------------------------------

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

    # --- the DFlash drafter context -----------------------------------------------------------

    def _ctx_catch_up(self, s: DeviceSeq, upto: Optional[int] = None) -> None:
        """Extend the drafter context over committed rows it lacks (up to ``upto``)."""
        if not self.uses_dflash_context:
            return
        engine, slot = self.engine, s.slot
        committed = engine.seq_len(slot)
        upto = committed if upto is None else upto
        if upto > committed:
            raise DeviceStateError(f"sequence {s.seq_id}: drafter context up to {upto} but only {committed} committed")
        ctx = engine.ctx_len(slot)
        if ctx > upto:
            engine.trim_proposer_state(slot, ctx - upto)
        elif ctx < upto:
            with self._errors("drafter context"):
                engine.ctx_extend(slot, upto)

    # ======================================================================================
    # start-up and snapshot
    # ======================================================================================

    def bind_gpu_to_thread(self) -> None:
        if self.engine.device.type == "cuda":
            torch.cuda.set_device(self.engine.device)

    def create_stream(self) -> int:
        return self.streams.create_stream()

    def create_event(self) -> int:
        return self.streams.create_event()

    def num_free_blocks(self) -> int:
        return self.engine.num_free_blocks()

    def ssm_snapshot_occupancy(self) -> None:
        """Nothing to report (no snapshot ring); every first read of a pair marks a tick."""
        self._occupancy_reads += 1
        if self._occupancy_reads % 2 == 1:
            self.tick += 1
            self.on_tick(self.tick)

    # ======================================================================================
    # sequences
    # ======================================================================================

    def alloc_sequence(self, seq: int, session: int) -> int:
        if seq in self._seqs:
            raise DeviceStateError(f"sequence {seq} is already allocated (slot {self._seqs[seq].slot})")
        free = self.engine.free_slots()
        if not free:
            raise DeviceError(f"no free slot for sequence {seq}: all {self.cfg.max_slots} slots hold sequences")
        slot = free[0]
        with self._errors("alloc_sequence"):
            self.engine.alloc(slot)
        if self.grammars is not None:
            self.grammars.bind(seq, session)
        self._seqs[seq] = DeviceSeq(seq, session, slot)
        self._by_slot[slot] = seq
        return slot

    def alloc_sequence_for(self, seq: int, session: int, budget: int) -> int:
        if budget > self.cfg.max_seq_len:
            log.debug("alloc_budget_over_context", seq=seq, budget=budget, max_seq_len=self.cfg.max_seq_len)
        return self.alloc_sequence(seq, session)

    def free_sequence(self, seq: int) -> None:
        s = self._seq(seq)
        with self._errors("free_sequence"):
            self.engine.free(s.slot)
        self._cached_by_session[s.session] = s.cached_tokens
        del self._by_slot[s.slot]
        del self._seqs[seq]

    def cache_sequence(self, seq: int) -> None:
        s = self._seq(seq)
        self._settle(s, "cache_sequence")
        with self._errors("cache_sequence"):
            self.stats.cached_blocks += self.engine.cache_sequence(s.slot)

    def compact_sequence(self, seq: int, new_slot: int) -> None:
        s = self._seq(seq)
        if new_slot == s.slot:
            return
        if new_slot in self._by_slot:
            raise DeviceStateError(f"compact_sequence: slot {new_slot} still holds sequence {self._by_slot[new_slot]}")
        with self._errors("compact_sequence"):
            self.engine.compact(s.slot, new_slot)
        del self._by_slot[s.slot]
        s.slot = new_slot
        self._by_slot[new_slot] = seq

    def detach_slot_for_reuse(self, seq: int) -> None:
        """The engine keeps the sequence in its slot until it is moved or freed: nothing to do."""
        log.debug("detach_slot_for_reuse", seq=seq, slot=self._seq(seq).slot)

    def save_sequence_state(self, seq: int) -> None:
        """Spill the committed state of the sequence to a file of the device's spill directory."""
        s = self._seq(seq)
        self._settle(s, "save_sequence_state")
        if self._spill_dir is None:
            self._spill_dir = Path(tempfile.mkdtemp(prefix="fxsched-spill-"))
        path = self._spill_dir / f"seq-{seq}.spill"
        with self._errors(f"save_sequence_state(seq {seq}, {path})"):
            self.engine.save_sequence_state(s.slot, path)
        self._spills[seq] = path
        self.stats.spills += 1

    def restore_sequence_state(self, seq: int, blocks: int) -> None:
        """Load a spilled sequence into its freshly allocated (empty) slot, on fresh KV blocks."""
        s = self._seq(seq)
        path = self._spills.get(seq)
        if path is None:
            raise DeviceError(f"restore_sequence_state: sequence {seq} has no spilled state")
        self._make_room(blocks, "restore_sequence_state")
        with self._errors(f"restore_sequence_state(seq {seq}, {path})"):
            self.engine.restore_sequence_state(s.slot, path)
        del self._spills[seq]
        path.unlink(missing_ok=True)
        held = len(self.engine.block_table(s.slot))
        if held != blocks:
            log.debug("restore_blocks", seq=seq, scheduler_blocks=blocks, engine_blocks=held)
        self.stats.restores += 1

    def reclaim_prefix_blocks(self, n: int) -> int:
        return self.engine.reclaim(n)

    def truncate_sequence(self, seq: int, seq_len: int) -> None:
        """The scheduler's rewind: drop pending rows beyond ``seq_len`` (they are never committed)."""
        s = self._seq(seq)
        committed = self.engine.seq_len(s.slot)
        rows = len(s.pending.tokens) if s.pending else 0
        if committed <= seq_len <= committed + rows:
            if s.pending is not None:
                s.pending.keep = seq_len - committed
            return
        if seq_len < committed:
            raise DeviceStateError(f"truncate_sequence: sequence {seq} would rewind committed tokens "
                                   f"({committed} -> {seq_len}); HybridEngine cannot rewind a committed state")
        raise DeviceStateError(f"truncate_sequence: sequence {seq} has {committed} committed + {rows} pending "
                               f"rows, cannot grow to {seq_len}")

    # ======================================================================================
    # adapters, EP (single rank: nothing to broadcast)
    # ======================================================================================

    def adapter_id_for(self, slot: int) -> int:
        """0 for the active (base) adapter, slot -1; no LoRA adapter is loaded, so any other slot
        is unknown (-1)."""
        return 0 if slot == -1 else -1

    def acquire_adapter_slot(self, slot: int) -> int:
        return slot

    def set_active_lora(self, name: str) -> None:
        raise DeviceError(f"LoRA adapter {name!r}: the torch model has no LoRA adapters")

    def ep_broadcast_cmd_for_seq(self, seq_slot: int, cmd: int) -> None:
        log.debug("ep_broadcast_cmd_for_seq", slot=seq_slot, cmd=hex(cmd))

    def ep_broadcast_cmd(self, cmd: int) -> None:
        log.debug("ep_broadcast_cmd", cmd=hex(cmd))

    def ep_broadcast_tokens(self, tokens) -> None:
        log.debug("ep_broadcast_tokens", n=len(tokens))

    def ep_sync_vision_embeds(self, n: int) -> None:
        log.debug("ep_sync_vision_embeds", n=n)

    # ======================================================================================
    # streams
    # ======================================================================================

    def poll_innerq(self) -> None:
        pass

    def record_event(self, event: int, stream: int) -> None:
        with self._errors("record_event"):
            self.streams.record_event(event, stream)

    def stream_wait_event(self, stream: int, event: int) -> None:
        with self._errors("stream_wait_event"):
            self.streams.stream_wait_event(stream, event)

    def synchronize(self, stream: int) -> None:
        with self._errors("synchronize"):
            self.streams.synchronize(stream)

    def sync_secondary(self) -> None:
        self.streams.sync_secondary()

    def teardown(self) -> None:
        self.streams.synchronize_all()
        self.close()

    def release_all(self) -> None:
        """Free every sequence still on the device (after a failed run), so the engine's slots
        and blocks are usable again."""
        for seq in list(self._seqs):
            self.free_sequence(seq)

    def close(self) -> None:
        """Remove the spill directory (if the device made it)."""
        if self._own_spill_dir and self._spill_dir is not None and not self._closed:
            shutil.rmtree(self._spill_dir, ignore_errors=True)
        self._closed = True

    # ======================================================================================
    # forwards
    # ======================================================================================

    def _count(self, kind: str, what: str) -> None:
        self.stats.calls[what] += 1
        self.stats.forwards += 1
        setattr(self.stats, f"{kind}_forwards", getattr(self.stats, f"{kind}_forwards") + 1)

    def prefill(self, seq: int, tokens, stream: int) -> int:
        """Prefill the whole prompt (reusing prefix-cache blocks). Returns the prompt tokens served
        from the cache (the interpreter ignores it today; see the module notes on ``cached=``)."""
        s = self._seq(seq)
        self._settle(s, "prefill")
        self._make_room(-(-len(tokens) // self.cfg.block_size), "prefill")
        with self._errors("prefill"), self.streams.use(stream):
            logits = self.engine.prefill(s.slot, list(tokens))
        s.cached_tokens = self.engine.cached_prompt_tokens(s.slot)
        self.stats.cached_prompt_tokens += s.cached_tokens
        self._count("prefill", "prefill")
        self._set_rows(logits[None], [(seq, len(tokens) - 1)])
        self._ctx_catch_up(s)
        return s.cached_tokens

    def prefill_chunk(self, seq: int, prompt, start: int, length: int, last: bool, stream: int) -> int:
        s = self._seq(seq)
        self._settle(s, "prefill_chunk")
        chunk = list(prompt[start:start + length])
        engine = self.engine
        self._room_for([(s.slot, len(chunk))], "prefill_chunk")
        with self._errors("prefill_chunk"), self.streams.use(stream):
            if start == 0 and engine.seq_len(s.slot) == 0 and not engine.block_table(s.slot):
                logits = engine.prefill(s.slot, chunk)  # chunk 0 may start from the prefix cache
                s.cached_tokens = engine.cached_prompt_tokens(s.slot)
                self.stats.cached_prompt_tokens += s.cached_tokens
            else:
                logits = engine.prefill_chunk(s.slot, chunk, start)
        self._count("prefill", "prefill_chunk")
        self._set_rows(logits[None], [(seq, len(chunk) - 1)])
        self._ctx_catch_up(s)
        return s.cached_tokens if start == 0 else 0

    def _batched_commit_forward(self, rows: list[tuple[DeviceSeq, list[int]]], what: str, stream: int,
                                kind: str) -> None:
        """One forward over several sequences' rows, all committed; the row table holds each
        sequence's last row, in order."""
        seqs = [s for s, _ in rows]
        self._settle_many(seqs, what)
        slots = [s.slot for s in seqs]
        lists = [toks for _, toks in rows]
        self._room_for(list(zip(slots, map(len, lists), strict=True)), what)
        with self._errors(what), self.streams.use(stream):
            logits = self.engine.commit_forward(slots, lists)
        self._count(kind, what)
        self._set_rows(logits, [(s.seq_id, len(t) - 1) for s, t in rows])
        for s in seqs:
            self._ctx_catch_up(s)

    def _slice_rows(self, sl) -> tuple[DeviceSeq, list[int]]:
        s = self._seq(sl.seq)
        committed = self.engine.seq_len(s.slot) + (s.pending.keep if s.pending else 0)
        if sl.start != committed:
            raise DeviceStateError(f"prefill slice of sequence {sl.seq} starts at {sl.start} but the sequence "
                                   f"holds {committed} tokens")
        return s, list(sl.prompt[sl.start:sl.start + sl.length])

    def mixed_forward(self, decode_tokens, decode_seqs, prefill, stream: int) -> None:
        self.mixed_forward_batch(decode_tokens, decode_seqs, (prefill,), stream)

    def mixed_forward_batch(self, decode_tokens, decode_seqs, prefills, stream: int) -> None:
        rows = [(self._seq(i), [int(t)]) for t, i in zip(decode_tokens, decode_seqs, strict=True)]
        rows += [self._slice_rows(sl) for sl in prefills]
        self._batched_commit_forward(rows, "mixed_forward", stream, "decode")

    def prefill_batch_chunk(self, prefills, stream: int) -> None:
        self._batched_commit_forward([self._slice_rows(sl) for sl in prefills], "prefill_batch_chunk", stream,
                                     "prefill")

    def normalize_ssm_states(self, seq: int, stream: int) -> None:
        """GDN states are kept in fp32 and never drift: nothing to normalize."""
        self._seq(seq)

    def decode_batch(self, tokens, seqs, stream: int) -> None:
        ds = [self._seq(i) for i in seqs]
        self._settle_many(ds, "decode_batch")
        self._room_for([(s.slot, 1) for s in ds], "decode_batch")
        with self._errors("decode_batch"), self.streams.use(stream):
            logits = self.engine.decode_batch([s.slot for s in ds], [int(t) for t in tokens])
        self._count("decode", "decode_batch")
        self._set_rows(logits, [(s.seq_id, 0) for s in ds])

    def decode(self, token: int, seq: int, stream: int) -> None:
        self.decode_batch([token], [seq], stream)

    def decode_draft(self, token: int, seq: int, stream: int) -> None:
        """A self-speculative draft step: the draft chain stays uncommitted (re-run from the
        committed state with every draft so far), so the scheduler's rewind to the anchor needs
        no undo of a committed state."""
        s = self._seq(seq)
        if s.pending is not None and s.pending.kind is PendingKind.DRAFT:
            tail = s.pending.tokens[:s.pending.keep]
        else:
            self._settle(s, "decode_draft")
            tail = []
        tokens = tail + [int(token)]
        self._room_for([(s.slot, len(tokens))], "decode_draft")
        with self._errors("decode_draft"), self.streams.use(stream):
            logits = self.engine.verify(s.slot, tokens)
        self._count("draft", "decode_draft")
        s.pending = Pending(tokens, len(tokens), PendingKind.DRAFT, len(tokens))
        self._set_rows(logits[-1:], [(seq, len(tokens) - 1)])

    # --- verifies ----------------------------------------------------------------------------

    def _verify_many(self, seqs: list[DeviceSeq], lists: list[list[int]], what: str) -> list[int]:
        self._settle_many(seqs, what)
        self._room_for([(s.slot, len(t)) for s, t in zip(seqs, lists, strict=True)], what)
        with self._errors(what):
            outs = self.engine.verify_batched([s.slot for s in seqs], lists)
        self._count("verify", what)
        logits = outs[0] if len(outs) == 1 else torch.cat(outs)
        owners = []
        for s, toks in zip(seqs, lists, strict=True):
            s.pending = Pending(list(toks), len(toks), PendingKind.VERIFY, len(toks))
            owners += [(s.seq_id, t) for t in range(len(toks))]
        logits = self._constrain(logits, owners)  # a draft the grammar refuses is never the row's answer
        answers = row_argmax(logits)
        ks, drafts = send_ints([[len(t) for t in lists], [t for toks in lists for t in toks[1:]]], logits.device)
        accepted, _ = greedy_accept(answers, drafts, row_offsets_from_counts(ks))
        both = torch.cat([answers, accepted]).tolist()  # the verify's one read: rows, then agreements
        rows = both[:len(answers)]
        for s, agreed in zip(seqs, both[len(answers):], strict=True):
            assert s.pending is not None
            s.pending.agreed = agreed + 1
        self._set_rows(logits, owners, rows)
        return rows

    def _verify(self, seq: int, tokens, what: str) -> list[int]:
        return self._verify_many([self._seq(seq)], [[int(t) for t in tokens]], what)

    def decode_verify(self, seq: int, tokens) -> list[int]:
        return self._verify(seq, tokens, "decode_verify")

    def decode_verify_graphed(self, seq: int, tokens) -> list[int]:
        return self._verify(seq, tokens, "decode_verify_graphed")

    def decode_verify_graphed_k3(self, seq: int, tokens) -> list[int]:
        return self._verify(seq, tokens, "decode_verify_graphed_k3")

    def decode_verify_graphed_k4(self, seq: int, tokens) -> list[int]:
        return self._verify(seq, tokens, "decode_verify_graphed_k4")

    def decode_verify_dflash(self, seq: int, tokens) -> list[int]:
        return self._verify(seq, tokens, "decode_verify_dflash")

    def decode_and_verify_fused(self, seq: int, tokens) -> list[int]:
        return self._verify(seq, tokens, "decode_and_verify_fused")

    def decode_verify_batched(self, tokens, ks, seqs, stream: int, woa: bool) -> list[int]:
        if sum(ks) != len(tokens) or len(ks) != len(seqs):
            raise DeviceStateError(f"decode_verify_batched: {len(tokens)} tokens, ks={list(ks)}, {len(seqs)} seqs")
        self.stats.widest_batched_verify = max(self.stats.widest_batched_verify, len(seqs))
        lists, offset = [], 0
        for k in ks:
            lists.append([int(t) for t in tokens[offset:offset + k]])
            offset += k
        with self.streams.use(stream):
            return self._verify_many([self._seq(i) for i in seqs], lists, "decode_verify_batched")

    def sample_verify(self, picks, eos_ids) -> list[int]:
        """The last verify's rows redone by rejection sampling (``spec_sampling.verify_sample``, one
        pick per row in the verify's row order): the pending rows each sequence may keep become its
        accepted drafts + 1, as the greedy verify's agreement did."""
        if self._logits is None or not self._owners:
            raise DeviceError("sample_verify: no verify has produced rows")
        seqs: list[DeviceSeq] = []
        for seq_id, local in self._owners:
            if local == 0:
                seqs.append(self._seq(seq_id))
        inputs = []
        for s in seqs:
            if s.pending is None or s.pending.kind is not PendingKind.VERIFY:
                raise DeviceError(f"sample_verify: sequence {s.seq_id} has no pending verify")
            inputs.append(s.pending.tokens)
        self.stats.calls["sample_verify"] += 1
        rows, accepted = verify_sample(self._logits, inputs, picks, eos_ids,
                                       processed=self._processed(0, self._logits.shape[0]))
        records: list[tuple[int, list[RowLogprobs]]] = []
        offset = 0
        for s, n, toks in zip(seqs, accepted, inputs, strict=True):
            assert s.pending is not None
            s.pending = Pending(s.pending.tokens, s.pending.keep, PendingKind.VERIFY, n + 1)
            widths = [picks[offset + i].top_logprobs for i in range(n + 1)]
            if any(widths):  # the rows it emits: the kept drafts and the row after them
                records.append((s.seq_id, logprob_records(self._logits[offset:offset + n + 1],
                                                          rows[offset:offset + n + 1], widths)))
            offset += len(toks)
        self.last_verify = records
        self._argmax = rows
        return rows

    last_verify: Optional[list[tuple[int, list[RowLogprobs]]]] = None  # the last sample_verify's records
    last_sample_row: int = 0  # the first row of the last sample_rows

    def row_record(self, row: int, token: int, width: int) -> RowLogprobs:
        """The logprob record of ``token`` at row ``row`` of the last forward (the first token's,
        whose pick the scheduler makes without one)."""
        self._check_rows(row, 1)
        assert self._logits is not None
        return logprob_records(self._logits[row:row + 1], [token], [width])[0]

    # ======================================================================================
    # proposers
    # ======================================================================================

    def _propose(self, seqs: list[DeviceSeq], tokens: list[int], n: int, what: str) -> list[list[int]]:
        if self.drafter is not None:
            drafts = [list(self.drafter(self.engine.tokens(s.slot), int(t), n))[:n]
                      for s, t in zip(seqs, tokens, strict=True)]
        elif self.proposer == "mtp":
            with self._errors(what):
                drafts = self.engine.mtp_propose([s.slot for s in seqs], tokens, n)
        elif self.proposer == "dflash":
            for s in seqs:
                self._ctx_catch_up(s)
            with self._errors(what):
                drafts = [d[:n] for d in self.engine.dflash_propose([s.slot for s in seqs], tokens)]
        else:
            raise DeviceError(f"{what}: this device was set up without a draft proposer")
        self.stats.calls[what] += 1
        self.stats.proposals += len(drafts)
        self.stats.drafts_proposed += sum(len(d) for d in drafts)
        return [[int(t) for t in d] for d in drafts]

    def _check_position(self, s: DeviceSeq, pos: int, what: str) -> None:
        have = self.engine.seq_len(s.slot)
        if pos != have:
            raise DeviceStateError(f"{what}: sequence {s.seq_id} proposes at position {pos} but holds {have} tokens")

    def run_mtp_propose_multi(self, token: int, pos: int, n: int, seq: int, stream: int, mask: bool) -> list[int]:
        s = self._seq(seq)
        self._settle(s, "run_mtp_propose_multi")
        self._check_position(s, pos, "run_mtp_propose_multi")
        with self.streams.use(stream):
            return self._propose([s], [int(token)], n, "run_mtp_propose_multi")[0]

    def run_mtp_propose_batched(self, tokens, positions, stash, n: int, seqs, stream: int) -> list[list[int]]:
        ds = [self._seq(i) for i in seqs]
        self._settle_many(ds, "run_mtp_propose_batched")
        for s, pos in zip(ds, positions, strict=True):
            self._check_position(s, pos, "run_mtp_propose_batched")
        if self.proposer == "mtp":
            for s, index in zip(ds, stash, strict=True):
                owner, hidden = self._stash_entry(index)
                if owner != s.seq_id:
                    raise DeviceStateError(f"run_mtp_propose_batched: stash entry {index} belongs to sequence "
                                           f"{owner}, not {s.seq_id}")
                self.engine.set_mtp_hidden(s.slot, hidden)
        with self.streams.use(stream):
            return self._propose(ds, [int(t) for t in tokens], n, "run_mtp_propose_batched")

    def run_mtp_catchup_batched(self, tokens, slots, pos) -> int:
        """No separate catch-up forward: the internal MTP head keeps no KV (it is conditioned on one
        saved hidden row), and a checkpoint's MTP module (``hf_drafters.PublishedMtp``) brings its
        own KV up to the committed tokens inside each proposal, from the committed hidden rows."""
        log.debug("run_mtp_catchup_batched", rows=sum(len(t) for t in tokens))
        return 0

    def generate_beam_batch(self, prompts, num_beams) -> list[list[int]]:
        """Length-normalised beam search (up to BEAM_MAX_TOKENS tokens, stopping at EOS), each
        hypothesis scored by a fresh prefill in a scratch slot."""
        return [self._beam(list(p), int(b)) for p, b in zip(prompts, num_beams, strict=True)]

    def _scratch_logprobs(self, tokens: list[int]) -> torch.Tensor:
        free = self.engine.free_slots()
        if not free:
            raise DeviceError("generate_beam_batch: no free slot for a scratch sequence")
        slot = free[-1]
        self._make_room(-(-len(tokens) // self.cfg.block_size), "generate_beam_batch")
        with self._errors("generate_beam_batch"):
            self.engine.alloc(slot)
            try:
                logits = self.engine.prefill(slot, tokens)
            finally:
                self.engine.free(slot)
        self._count("prefill", "beam_prefill")
        return torch.log_softmax(logits.float(), -1)

    def prompt_logprobs(self, tokens: Seq[int], width: int) -> tuple[list[RowLogprobs], list[int]]:
        """The logprob record of each prompt token after the first (``tokens[i + 1]`` from the row
        of ``tokens[i]``, with the ``width`` largest entries): forwards over the prompt (chunks of
        ``PROMPT_LOGPROBS_CHUNK`` rows, each committed) in a scratch slot, freed before returning
        (the rows the scheduler's forwards never compute, specs/scheduler.md §5.11), and each token's rank (1: the most likely). Raises
        ``DeviceError`` when no slot or blocks are free."""
        tokens = [int(t) for t in tokens]
        if len(tokens) < 2:
            return [], []
        free = self.engine.free_slots()
        if not free:
            raise DeviceError("prompt_logprobs: no free slot for a scratch sequence")
        slot = free[-1]
        self._make_room(-(-len(tokens) // self.cfg.block_size), "prompt_logprobs")
        parts = []
        with self._errors("prompt_logprobs"):
            self.engine.alloc(slot)
            try:  # in chunks, each committed before the next: a chunk's rows bound the forward's memory
                for start in range(0, len(tokens) - 1, PROMPT_LOGPROBS_CHUNK):
                    chunk = tokens[start:start + PROMPT_LOGPROBS_CHUNK]
                    parts.append(self.engine.verify(slot, chunk).float())
                    self.engine.commit_accepted_prefix(slot, len(chunk))
            finally:
                self.engine.free(slot)
        self._count("prefill", "prompt_logprobs")
        rows = torch.cat(parts)[:len(tokens) - 1]
        chosen = torch.tensor(tokens[1:], dtype=torch.int64, device=rows.device)[:, None]
        ranks = ((rows > rows.gather(-1, chosen)).sum(dim=-1) + 1).tolist()
        return logprob_records(rows, tokens[1:], [width] * (len(tokens) - 1)), ranks

    def _beam(self, prompt: list[int], beams: int) -> list[int]:
        eos = self.cfg.eos_id
        limit = min(BEAM_MAX_TOKENS, self.cfg.max_seq_len - len(prompt))
        live: list[tuple[list[int], float]] = [([], 0.0)]
        done: list[tuple[list[int], float]] = []
        for _ in range(max(limit, 0)):
            candidates = []
            for hyp, score in live:
                logp = self._scratch_logprobs(prompt + hyp)
                top = torch.topk(logp, min(beams, logp.shape[-1]))
                candidates += [(hyp + [int(t)], score + float(v)) for v, t in zip(top.values, top.indices, strict=True)]
            candidates.sort(key=lambda c: -c[1])
            live = []
            for hyp, score in candidates[:beams]:
                (done if hyp[-1] == eos else live).append((hyp, score))
            if not live:
                break
        pool = done + live
        if not pool:
            return []
        return max(pool, key=lambda c: c[1] / len(c[0]))[0]

    def mtp_slot_draft_capacity(self, slot: int) -> int:
        return DRAFT_CAPACITY

    def can_batch_verify(self, ks) -> bool:
        return len(ks) <= self.cfg.max_slots and sum(ks) <= MAX_BATCH_VERIFY_ROWS

    # ======================================================================================
    # logits readers
    # ======================================================================================

    def argmax_on_device(self, row: int, stream: int) -> int:
        self._check_rows(row, 1)
        return self._row_tokens()[row]

    def argmax_batch(self, row: int, n: int, stream: int) -> list[int]:
        self._check_rows(row, n)
        return self._row_tokens()[row:row + n]

    def copy_logits_to_host(self, row: int, off: int, nbytes: int) -> bytes:
        """BF16 little-endian logits of rows ``row``.. (``vocab * 2`` bytes per row), from byte ``off``."""
        width = self.cfg.vocab_size * 2
        n = -(-(off + nbytes) // width)
        self._check_rows(row, n)
        if self._logits is None:
            raise DeviceError("no forward has produced logits rows yet")
        slab = self._logits[row:row + n].to(torch.bfloat16).contiguous().view(torch.uint8).cpu().numpy().tobytes()
        return slab[off:off + nbytes]

    last_sample: Optional[SampledRows] = None  # the last sample_rows answer, logprob records included
    row_processors: Optional[RowProcessors] = None  # per-request logits processing (penalties, logit_bias)

    def _processed(self, row: int, n: int) -> Optional[torch.Tensor]:
        """Rows ``row``.. of the last forward after their requests' processors (None: none has any).
        A row's context is its sequence's committed tokens, then (a verify or draft row) the
        pending inputs up to and including the row's own."""
        processors = self.row_processors
        if not processors or self._logits is None:
            return None
        owners = self._owners[row:row + n]
        seqs = [self._seqs.get(seq_id) for seq_id, _ in owners]

        def context(r: int) -> list[int]:
            s = seqs[r]
            assert s is not None
            committed = self.engine.tokens(s.slot)
            return committed + (s.pending.tokens[:owners[r][1] + 1] if s.pending is not None else [])

        sessions = [s.session if s is not None else None for s in seqs] + [None] * (n - len(seqs))
        return processors.process(self._logits[row:row + n], sessions, context)

    def sample_rows(self, row: int, n: int, picks, eos_ids) -> SampledRows:
        """Pick rows ``row``.. ``row + n - 1`` on the device by their ``HostPick`` (batched, in torch:
        ``fxsched.runtime.devices.torch_sampling``); the interpreter uses it instead of a host copy."""
        self._check_rows(row, n)
        if self._logits is None:
            raise DeviceError("no forward has produced logits rows yet")
        self.stats.calls["sample_rows"] += 1
        self.last_sample = sample_rows(self._logits[row:row + n], picks, eos_ids, self._processed(row, n))
        self.last_sample_row = row
        return self.last_sample

    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    # ======================================================================================
    # speculative bookkeeping
    # ======================================================================================

    def gdn_fold_accepted(self, slots, accepted, k: int) -> bool:
        """Commit accepted[i] rows (the anchor included) of each slot's verify, in one state write."""
        seqs = [self._seq_in_slot(slot) for slot in slots]
        for s, n in zip(seqs, accepted, strict=True):
            if s.pending is None:
                raise DeviceStateError(f"gdn_fold_accepted: sequence {s.seq_id} (slot {s.slot}) has no verify rows")
            if len(s.pending.tokens) > k:
                raise DeviceStateError(f"gdn_fold_accepted: sequence {s.seq_id} verified {len(s.pending.tokens)} "
                                       f"rows, more than k={k}")
            self._resolve_keep(s, int(n), "gdn_fold_accepted")
        self._settle_many(seqs, "gdn_fold_accepted")
        self.stats.calls["gdn_fold_accepted"] += 1
        return True

    def commit_accepted_prefix(self, seq: int, na: int, k: int) -> None:
        """Commit the first ``na`` rows (anchor included) of the sequence's k-row verify. After a
        ``gdn_fold_accepted`` of the same verify there is nothing left to do."""
        s = self._seq(seq)
        if s.pending is None:
            return
        if len(s.pending.tokens) != k:
            raise DeviceStateError(f"commit_accepted_prefix: sequence {seq} verified {len(s.pending.tokens)} rows, "
                                   f"not k={k}")
        self._resolve_keep(s, na, "commit_accepted_prefix")
        self._commit(s, na, "commit_accepted_prefix")

    def commit_ctx(self, seq: int, n: int, base: int, row: int) -> None:
        """DFlash: the drafter context covers positions [0, base + n) — the committed rows below
        ``base`` and the first n rows of the forward that started at ``base``."""
        if not self.uses_dflash_context:
            return
        s = self._seq(seq)
        engine, slot = self.engine, s.slot
        committed = engine.seq_len(slot)
        if base + n <= committed:
            self._ctx_catch_up(s, base + n)
        elif s.pending is not None and base == committed and n <= len(s.pending.tokens):
            self._ctx_catch_up(s, base)
            with self._errors("commit_ctx"):
                engine.commit_ctx(slot, n)
        else:
            raise DeviceStateError(f"commit_ctx: sequence {seq} has {committed} committed tokens; cannot take "
                                   f"{n} context rows at {base}")

    def trim_proposer_state(self, seq: int, na: int, stream: int) -> None:
        """Drop drafter context rows beyond the sequence's length (a rejected branch)."""
        if not self.uses_dflash_context:
            return
        s = self._seq(seq)
        length = self.seq_len(seq)
        ctx = self.engine.ctx_len(s.slot)
        if ctx > length:
            self.engine.trim_proposer_state(s.slot, ctx - length)

    def save_hidden_for_mtp(self, row: int, stream: int) -> None:
        s, local = self._owner(row)
        with self._errors("save_hidden_for_mtp"):
            self.engine.save_hidden_for_mtp(s.slot, local)

    def _stash_entry(self, index: int) -> tuple[int, torch.Tensor]:
        if not 0 <= index < len(self._stash):
            raise DeviceError(f"stash entry {index} does not exist ({len(self._stash)} stashed rows)")
        return self._stash[index]

    def save_hidden_for_mtp_from_stash(self, index: int, stream: int) -> None:
        owner, hidden = self._stash_entry(index)
        self.engine.set_mtp_hidden(self._seq(owner).slot, hidden)

    def stash_verify_hidden_rows(self, rows, stream: int) -> None:
        stash = []
        for row in rows:
            s, local = self._owner(row)
            stash.append((s.seq_id, self.engine.captured_hidden(s.slot)[local].clone()))
        self._stash = stash

    def stash_verify_catchup_rows(self, pairs) -> None:
        """Rows for an MTP KV catch-up: nothing to keep (the internal head keeps no KV; a checkpoint's
        MTP module catches up from the committed hidden rows when it proposes)."""
        for _, row in pairs:
            self._check_rows(row, 1)

    def dflash_eagle_accept_append(self, seq: int) -> None:
        s = self._seq(seq)
        self._settle(s, "dflash_eagle_accept_append")
        self._ctx_catch_up(s)

    def start_checkpoint_async(self, seq: int) -> None:
        self._settle(self._seq(seq), "start_checkpoint_async")

    def start_rollback_and_checkpoint_async(self, seq: int, na: int) -> None:
        self._rollback(seq, na, "start_rollback_and_checkpoint_async")

    def checkpoint_ssm_states(self, seq: int) -> None:
        self._settle(self._seq(seq), "checkpoint_ssm_states")

    def rollback_ssm_states(self, seq: int, n: int) -> None:
        self._rollback(seq, n, "rollback_ssm_states")

    def _rollback(self, seq: int, n: int, what: str) -> None:
        """Keep n rows of the pending forward (write-on-accept: the state after row n - 1)."""
        s = self._seq(seq)
        if s.pending is None:
            return
        self._resolve_keep(s, n, what)
        self._commit(s, n, what)

    def decode_marconi_checkpoint(self, seq: int) -> None:
        self._settle(self._seq(seq), "decode_marconi_checkpoint")

    def save_decode_ssm_snapshot(self, seq: int, ring: int) -> None:
        s = self._seq(seq)
        self._settle(s, "save_decode_ssm_snapshot")
        self._ring[(seq, ring)] = (self.engine.seq_len(s.slot), self.engine.gdn_state(s.slot))

    def restore_decode_ssm_snapshot(self, seq: int, ring: int) -> None:
        s = self._seq(seq)
        self._settle(s, "restore_decode_ssm_snapshot")
        try:
            length, snapshot = self._ring[(seq, ring)]
        except KeyError:
            raise DeviceError(f"restore_decode_ssm_snapshot: no snapshot {ring} of sequence {seq}") from None
        if length != self.engine.seq_len(s.slot):
            raise DeviceError(f"restore_decode_ssm_snapshot: snapshot {ring} of sequence {seq} is at {length} "
                              f"tokens, the sequence at {self.engine.seq_len(s.slot)}; HybridEngine cannot rewind "
                              f"committed KV")
        self.engine.gdn.load(s.slot, snapshot)

    def save_hidden_for_catchup(self, row: int, pos: int) -> None:
        self._check_rows(row, 1)

    # --- fx lines ------------------------------------------------------------------------------

    def note_fx(self, line: str) -> None:
        log.debug("fx", line=line)
