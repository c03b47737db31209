"""The pieces of ``fxsched bench host`` (runtime/bench/host.py): an engine whose model forward and
drafters cost (almost) nothing, and the stopwatch that splits the host's time by the kind of work.

The free forward (``FreeForward``) replaces ``engine.model.forward`` on the engine's ``HybridModel``
object (an instance attribute: the class is untouched). It returns outputs of the right shapes from
tensors made once: hidden rows [B, T, D] are a slice of a zero buffer; logits are rows of a [V, V]
table indexed by the batch's tokens, whose row x peaks at (x + 1) % V, so the model "counts": the
greedy (and, at a 20-logit peak, the sampled at temperature 0.8 / top-p 0.9) next token of x is
x + 1 mod V. A decode whose GDN layers run in place gets ``GdnRows.committed()`` per GDN layer; any
other forward gets zero states [B, R, Hv, Dk, Dv] and conv windows [B, C, R, W] (R = T, or the
kept rows), which the commit folds like real ones. The KV and GDN caches are never touched.

The free drafters (``FreeDrafts``) replace ``engine.mtp_drafts`` and ``engine.dflash_drafts`` on the
engine instance: one packed copy of the last tokens (``send_ints``) plus an add on the device,
drafts (t + 1, t + 2, ...) mod V, which the counting target accepts every time; with ``accept`` < 1
each draft is wrong with probability 1 - accept (a seeded table), so verifies reject some. The DFlash
drafter's context rows (its projection of the committed rows: drafter work) are zeros, their
bookkeeping kept (``FreeDrafts.install``).

``Stopwatch`` accumulates the *own* time of labelled calls: a labelled call's seconds are its span
less the spans of the labelled calls made inside it, which go to their own labels, so nothing is
counted twice (``commit_accepted_prefix`` inside a device commit, ``prepare`` inside ``_forward``).
``instrument`` wraps the engine's and the device's methods on the instances (``PARTS_OF``).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Optional, Sequence

import torch

from fxsched.runtime.torch_model import HybridEngine
from fxsched.runtime.torch_model.attention import RopeTables
from fxsched.runtime.torch_model.config import ModelConfig, default_config
from fxsched.runtime.torch_model.gdn import GdnRows
from fxsched.runtime.torch_model.model import ForwardOutput, RowBatch
from fxsched.runtime.torch_model.transfers import send_ints
from fxsched.runtime.torch_model.weights import torch_dtype

PARTS = ("step", "batch_prep", "forward", "commit", "readback", "proposal", "interpreter")
"""The split of a tick's host time, in column order; ``interpreter`` is what no label took."""

PEAK = 20.0  # the logit of the counted token (every other logit is 0)
BUFFER_ROWS = 8  # rows per sequence the preallocated outputs hold (a verify's widest); more: expanded
GAMMA = 4  # DFlash drafts per proposal
ACCEPT_POOL = 4096  # rows of the seeded table of wrong drafts (accept < 1)


def bench_config(max_slots: int, max_seq_len: int, num_blocks: int, bare: bool = False) -> ModelConfig:
    """The default model's sizes (hidden 64, vocab 64) in bfloat16 with an attention head dim of 32,
    as a real checkpoint runs on the CPU (the row kernel serves its decodes: the decode plan a bf16
    engine builds), with the internal MTP head and a DFlash drafter of ``GAMMA`` drafts (``bare``:
    neither, so no hidden rows are kept), and caches sized by the caller."""
    cfg = default_config()
    bs = cfg.block_size
    max_seq_len = -(-max_seq_len // bs) * bs
    return dataclasses.replace(cfg, dtype="bfloat16", head_dim=32, mtp=not bare, dflash_gamma=0 if bare else GAMMA, max_slots=max_slots,
                               max_seq_len=max_seq_len, num_blocks=max(num_blocks, max_seq_len // bs))


class FreeForward:
    """``HybridModel.forward``'s signature, answered from preallocated tensors (module docstring)."""

    def __init__(self, cfg: ModelConfig, device: torch.device) -> None:
        dtype = torch_dtype(cfg)
        v, b, r = cfg.vocab_size, cfg.max_slots, BUFFER_ROWS
        ids = torch.arange(v, device=device)
        self.vocab = v
        self.table = torch.zeros(v, v, dtype=dtype, device=device)
        self.table[ids, (ids + 1) % v] = PEAK
        self.hidden = torch.zeros(b, r, cfg.hidden_size, dtype=dtype, device=device)
        self.states = torch.zeros(b, r, cfg.gdn_v_heads, cfg.gdn_key_dim, cfg.gdn_value_dim, dtype=dtype,
                                  device=device)
        self.windows = torch.zeros(b, cfg.gdn_conv_channels, r, cfg.conv_width, dtype=dtype, device=device)
        self.gdn_layers = len(cfg.gdn_layers)
        self.committed = [GdnRows.committed() for _ in range(self.gdn_layers)]
        self.forwards = 0
        self.verifies = 0  # forwards of several rows per sequence left pending (verifies)
        self.clock: Optional[DeviceClock] = None  # each forward takes the clock's device time

    def __call__(self, batch: RowBatch, kv: Any, gdn: Any, capture_layers: tuple[int, ...] = ()) -> ForwardOutput:
        b, t = batch.tokens.shape
        self.forwards += 1
        if self.clock is not None:
            self.clock.launch()
        if t > 1 and batch.logit_rows is None and batch.gdn_keep_rows is None:
            self.verifies += 1
        small = b <= self.hidden.shape[0] and t <= BUFFER_ROWS
        hidden = self.hidden[:b, :t] if small else self.hidden[:1, :1].expand(b, t, -1)
        tokens = batch.tokens.reshape(-1)
        if batch.logit_rows is not None:
            logits = self.table.index_select(0, tokens.index_select(0, batch.logit_rows))
        else:
            logits = self.table.index_select(0, tokens).view(b, t, self.vocab)
        if batch.gdn_in_place:
            rows = self.committed
        else:
            keep = batch.gdn_keep_rows
            r = t if keep is None else len(keep)
            if b <= self.states.shape[0] and r <= BUFFER_ROWS:
                states, windows = self.states[:b, :r], self.windows[:b, :, :r]
            else:
                states = self.states[:1, :1].expand(b, r, -1, -1, -1)
                windows = self.windows[:1, :, :1].expand(b, -1, r, -1)
            rows = [GdnRows(states, windows, keep)] * self.gdn_layers
        return ForwardOutput(hidden, logits, rows, {i: hidden for i in capture_layers})

    def untouched(self) -> bool:
        """Whether the shared output buffers are still zero (nothing wrote into a forward's outputs)."""
        return not (self.hidden.any() or self.states.any() or self.windows.any())


class FreeDrafts:
    """``mtp_drafts`` / ``dflash_drafts`` of the counting model: one packed copy, one add."""

    def __init__(self, vocab: int, device: torch.device, accept: float = 1.0, seed: int = 0) -> None:
        self.vocab, self.device = vocab, device
        self.steps = torch.arange(1, 2 * BUFFER_ROWS + 1, device=device)
        self.wrong: Optional[torch.Tensor] = None
        self.at = 0
        if accept < 1.0:
            draws = torch.rand(ACCEPT_POOL, self.steps.numel(), generator=torch.Generator().manual_seed(seed))
            self.wrong = (draws >= accept).long().to(device)

    def drafts(self, last_tokens: Sequence[int], n: int) -> torch.Tensor:
        (anchors,) = send_ints([list(last_tokens)], self.device)
        drafts = anchors[:, None] + self.steps[:n]
        if self.wrong is not None:  # a wrong draft is one more than the right one
            b = len(last_tokens)
            if self.at + b > ACCEPT_POOL:
                self.at = 0
            drafts = drafts + self.wrong[self.at:self.at + b, :n]
            self.at += b
        return drafts % self.vocab

    def install(self, engine: HybridEngine) -> None:
        """Answer the engine's MTP and DFlash proposals (instance attributes), and make the DFlash
        drafter's context rows free too: its projection of the committed rows is the drafter's
        forward, so their K/V are zeros (a broadcast view) while the context's bookkeeping (the
        rows' indices, the indexed writes, the lengths) runs as it does on a real drafter."""
        gamma = engine.cfg.dflash_gamma
        engine.mtp_drafts = lambda slots, last_tokens, num_drafts: self.drafts(last_tokens, num_drafts)  # type: ignore[method-assign]
        engine.dflash_drafts = lambda slots, last_tokens: self.drafts(last_tokens, gamma)  # type: ignore[method-assign]
        drafter = engine.dflash
        if drafter is not None and drafter.ctx_k:
            zero = torch.zeros(1, *drafter.ctx_k[0].shape[2:], dtype=drafter.ctx_k[0].dtype, device=self.device)
            no_rope = RopeTables(zero, zero)  # (never read: the free K/V are not roped)
            drafter.context_input = lambda rows: rows  # type: ignore[method-assign]
            drafter.context_rope = lambda positions, dtype: no_rope  # type: ignore[method-assign]
            drafter.context_kv = (  # type: ignore[method-assign]
                lambda x, layer, positions, rope: (zero.expand(x.shape[0], -1, -1),) * 2)


def free_engine(cfg: ModelConfig, device: str = "cpu", accept: float = 1.0, seed: int = 0,
                static: bool = False) -> tuple[HybridEngine, FreeForward]:
    """A ``HybridEngine`` (random weights, no CUDA graphs) whose forward and drafters are free;
    ``static`` runs decodes and uniform verifies over the static forwards' inputs (graphs.py,
    nothing recorded), so their input load is measured too."""
    engine = HybridEngine(cfg, device=device, cuda_graphs=False)
    forward = FreeForward(cfg, engine.device)
    engine.model.forward = forward  # type: ignore[method-assign]
    FreeDrafts(cfg.vocab_size, engine.device, accept, seed).install(engine)
    if static:
        engine.use_graphs(capture=False)
    return engine, forward


class DeviceClock:
    """A device that works after the host launches, as a GPU's stream does: each forward launched
    takes ``forward_ms`` of device time, starting when the device is free (or now); a read of a
    forward's results waits until that forward is done. The waits sleep, which releases the GIL
    as a host blocked on a GPU read would."""

    def __init__(self, forward_ms: float) -> None:
        self.seconds = forward_ms / 1e3
        self.done: list[float] = [0.0, 0.0]  # completion times of the last two forwards launched

    def launch(self) -> None:
        start = max(time.perf_counter(), self.done[-1])
        self.done = [self.done[-1], start + self.seconds]

    def wait_last(self) -> None:
        """Until the last forward launched is done."""
        self._until(self.done[-1])

    def wait_before_last(self) -> None:
        """Until the forward launched before the last is done (a read of kept tokens, specs/async.md
        §16.6, made after the next forward was launched)."""
        self._until(self.done[-2])

    @staticmethod
    def _until(when: float) -> None:
        left = when - time.perf_counter()
        if left > 0:
            time.sleep(left)


class ClockedDevice:
    """A ``TorchDevice`` whose reads wait for the ``DeviceClock``: every call that reads a forward's
    results back (argmax, picks, a verify's rows, drafts answered with values, kept tokens) waits
    until that forward is done; everything else passes through at once."""

    def __init__(self, device: Any, clock: DeviceClock) -> None:
        self._device, self._clock = device, clock

    def __getattr__(self, name: str) -> Any:
        return getattr(self._device, name)

    def argmax_batch(self, *args: Any) -> Any:
        self._clock.wait_last()
        return self._device.argmax_batch(*args)

    def argmax_on_device(self, *args: Any) -> Any:
        self._clock.wait_last()
        return self._device.argmax_on_device(*args)

    def sample_rows(self, *args: Any) -> Any:
        self._clock.wait_last()
        return self._device.sample_rows(*args)

    def sample_verify(self, *args: Any) -> Any:
        self._clock.wait_last()
        return self._device.sample_verify(*args)

    def copy_logits_to_host(self, *args: Any) -> Any:
        self._clock.wait_last()
        return self._device.copy_logits_to_host(*args)

    def serial_verify(self, *args: Any) -> Any:
        rows = self._device.serial_verify(*args)
        self._clock.wait_last()
        return rows

    def decode_verify_batched(self, *args: Any) -> Any:
        rows = self._device.decode_verify_batched(*args)
        self._clock.wait_last()
        return rows

    def run_mtp_propose_multi(self, *args: Any) -> Any:
        return self._drafts(self._device.run_mtp_propose_multi(*args), [])

    def run_mtp_propose_batched(self, *args: Any) -> Any:
        answer = self._device.run_mtp_propose_batched(*args)
        return self._drafts(answer, [t for row in answer for t in row])

    def _drafts(self, answer: Any, flat: list[int]) -> Any:
        from fxsched.core.events import LATE_DRAFT

        if any(t != LATE_DRAFT for t in (flat or answer)):  # drafts read back: their forward is done
            self._clock.wait_last()
        return answer

    def keep_ahead(self, *args: Any) -> bool:
        keep: bool = self._device.keep_ahead(*args)
        return keep

    def read_ahead(self, seqs: Any, fed: Any = ()) -> Any:
        # inside a decode's answer the kept tokens are the previous forward's: it runs on meanwhile
        (self._clock.wait_before_last if fed else self._clock.wait_last)()
        return self._device.read_ahead(seqs, fed)


class Stopwatch:
    """Own seconds per label (module docstring)."""

    def __init__(self, labels: Sequence[str] = PARTS) -> None:
        self.labels = tuple(labels)
        self.seconds = [0.0] * len(self.labels)
        self._inner: list[float] = []  # per open labelled call: the seconds its labelled callees took

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` with its own time added to ``label``."""
        i = self.labels.index(label)
        seconds, inner, clock = self.seconds, self._inner, time.perf_counter

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            inner.append(0.0)
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                span = clock() - start
                seconds[i] += span - inner.pop()
                if inner:
                    inner[-1] += span
        return timed


PARTS_OF: dict[str, dict[str, tuple[str, ...]]] = {
    "engine": {
        "batch_prep": ("_prepared", "decode_batch"),
        "forward": (),  # the model's forward: wrapped on engine.model
        "commit": ("_forward", "gdn_fold_accepted", "commit_accepted_prefix", "commit_ctx", "commit_ctx_many",
                   "ctx_extend", "ctx_extend_many", "trim_proposer_state", "set_pending_tokens", "save_hidden_for_mtp",
                   "set_mtp_hidden"),
        "readback": ("verify_batched",),
        "proposal": ("mtp_drafts", "dflash_drafts"),
    },
    "device": {
        "batch_prep": ("_room_for", "_late_inputs"),
        "commit": ("_settle_many", "_commit", "gdn_fold_accepted", "commit_accepted_prefix", "commit_ctx",
                   "commit_ctx_many", "trim_proposer_state", "truncate_sequence", "save_hidden_for_mtp",
                   "save_hidden_for_mtp_from_stash", "stash_verify_hidden_rows", "stash_verify_catchup_rows",
                   "_ctx_catch_up", "_ctx_catch_up_many", "start_checkpoint_async", "start_rollback_and_checkpoint_async",
                   "decode_marconi_checkpoint", "dflash_eagle_accept_append"),
        "readback": ("_row_tokens", "sample_rows", "sample_verify", "_verify_many"),
        "proposal": ("_propose", "run_mtp_propose_batched", "run_mtp_propose_multi", "run_mtp_catchup_batched"),
    },
}
"""Which methods' own time goes to which part: the engine's (``_forward``'s own time is its
pending-row records; ``decode_batch``'s its row lists; ``verify_batched``'s its per-sequence logits
slices) and the device's (``_verify_many``'s own time is the verify's argmax, agreement and packed
read; ``_propose``'s the late drafts kept per sequence)."""

OPTIONAL_PARTS: dict[str, tuple[str, ...]] = {"readback": ("keep_ahead", "read_ahead")}
"""Device methods wrapped when the device has them (tokens kept on the device, specs/async.md §16.6)."""


def instrument(watch: Stopwatch, engine: HybridEngine, device: Any) -> None:
    """Wrap the methods of ``PARTS_OF`` on the engine and device instances (and the static
    forwards' input loads, when the engine has them) with ``watch``."""
    for owner, obj in (("engine", engine), ("device", device)):
        for label, names in PARTS_OF[owner].items():
            for name in names:
                setattr(obj, name, watch.wrap(label, getattr(obj, name)))
    for label, names in OPTIONAL_PARTS.items():
        for name in names:
            if hasattr(device, name):
                setattr(device, name, watch.wrap(label, getattr(device, name)))
    engine.model.forward = watch.wrap("forward", engine.model.forward)  # type: ignore[method-assign]
    if engine.graphs is not None:
        for static in engine.graphs.forwards.values():
            static.load = watch.wrap("batch_prep", static.load)  # type: ignore[method-assign]
