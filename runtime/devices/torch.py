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

Parts. ``TorchDevice`` is assembled from one module per concern, each a class over the shared
bookkeeping (``torch_book.DeviceBook``: sequences, pending rows, the row table, the drafter
context): ``torch_lifecycle`` (start-up, sequences, spills, streams, teardown), ``torch_forwards``
(forwards, verifies, the readers of their rows), ``torch_proposers`` (drafts, beam search, prompt
logprobs) and ``torch_speculative`` (commits, stashes and snapshots around speculative steps).
Host synchronisation follows specs/async.md §16.2.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Callable, Mapping, Optional

import torch

from fxsched.runtime.devices.grammar_mask import GrammarBook
from fxsched.runtime.devices.streams import StreamSet
from fxsched.runtime.devices.torch_book import DeviceSeq, DeviceStateError, DeviceStats, Drafter
from fxsched.runtime.devices.torch_forwards import Forwards
from fxsched.runtime.devices.torch_lifecycle import Lifecycle, fx_logger
from fxsched.runtime.devices.torch_proposers import Proposers
from fxsched.runtime.devices.torch_speculative import Speculative
from fxsched.runtime.logs import ensure_configured
from fxsched.runtime.torch_model import HybridEngine

__all__ = ["DeviceStateError", "Drafter", "PROPOSERS", "TorchDevice"]

PROPOSERS = ("mtp", "dflash")


class TorchDevice(Lifecycle, Forwards, Proposers, Speculative):
    """Implements every call of ``fxsched.runtime.devices.device.Device`` on a ``HybridEngine``."""

    def __init__(self, engine: HybridEngine, proposer: Optional[str] = None, drafter: Optional[Drafter] = None,
                 strict: bool = False, spill_dir: Optional[str | Path] = None,
                 on_tick: Optional[Callable[[int], None]] = None, grammars: Optional[GrammarBook] = None,
                 late_drafts: bool = False, decode_ahead: bool = False,
                 adapters: Optional[Mapping[str, str | Path]] = None) -> None:
        if proposer is not None and proposer not in PROPOSERS:
            raise ValueError(f"proposer must be one of {PROPOSERS} or None, got {proposer!r}")
        if proposer == "mtp" and engine.mtp is None and drafter is None:
            raise ValueError("proposer 'mtp' needs a model with an MTP head (config mtp = true)")
        if proposer == "dflash" and engine.dflash is None and drafter is None:
            raise ValueError("proposer 'dflash' needs a model with a DFlash drafter (config dflash_gamma > 0)")
        if adapters and engine.lora is None:
            raise ValueError("LoRA adapters need an engine with a LoRA pool (max_loras > 0)")
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
        self._stash: tuple[list[int], Optional[torch.Tensor]] = ([], None)
        self._ring: dict[tuple[int, int], tuple[int, list]] = {}
        self._spill_cleanup: Optional[weakref.finalize] = None  # set when the device makes its own directory
        self._spill_dir: Optional[Path] = Path(spill_dir) if spill_dir is not None else None  # made on first spill
        self._spills: dict[int, Path] = {}
        self._cached_by_session: dict[int, int] = {}
        self._closed = False
        self.grammars = grammars  # structured output: the rows of a request with a grammar are masked
        self.late_drafts = late_drafts
        self._late: dict[int, torch.Tensor | str] = {}
        self._late_batch: Optional[tuple[torch.Tensor, dict[int, int]]] = None
        self.decode_ahead = decode_ahead  # keep plain decodes' tokens on the device (specs/async.md §16.6)
        self._ahead_init()
        self._fx_log = fx_logger()  # None unless debug events are on: fx lines cost nothing then
        self._verify_inputs: list[int] = []
        self._lora_init(adapters)
