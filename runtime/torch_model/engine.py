"""HybridEngine: the model plus its caches and per-slot bookkeeping, exposing per-sequence operations.

Vocabulary: a *slot* holds one sequence. Its committed length `seq_len` counts the tokens whose
K/V are in the paged cache and whose effect is folded into the slot's GDN state; `tokens(slot)`
lists exactly those tokens. Every forward (prefill, decode, verify) writes K/V for its rows at
positions >= seq_len and records the per-row GDN states as *pending*; a commit (fold) advances
seq_len by the accepted prefix and copies in the GDN state after the last accepted row
(write-on-accept). Rejected rows need no undo: their K/V sit beyond seq_len and get overwritten.

Invariants after every public call:
  * a slot holds exactly ceil(seq_len / block_size) blocks, except between a verify and its commit;
  * the GDN state of a slot equals (up to fp32 rounding) the state after running tokens(slot) from zero;
  * boundary_states[k] is the GDN state when seq_len was k * block_size, for every k that is a
    multiple of cfg.gdn_snapshot_blocks (for the prefix cache);
  * hidden_history[slot, :seq_len] are the target's final hidden rows (pre-norm) of tokens(slot),
    where a drafter reads them (`keeps_hidden`: a checkpoint MTP module, the internal MTP head or
    DFlash drafter); an engine without such a drafter keeps none (a [slots, 0, D] tensor: at real
    sizes the history is slots x context x hidden, 128 MB for Qwen3-0.6B at 16 x 4096);
  * with a checkpoint DFlash drafter (`draft_model`), dflash_features[slot, :seq_len] are its context
    features of tokens(slot), and every cached prefix block has its rows in _block_features.

Drafters (hf_drafters.py for checkpoints, drafters.py for the internal model): `mtp` is the internal
head (cfg.mtp) or a checkpoint's MTP module (cfg.mtp_layers == 1), `dflash` the internal drafter
(cfg.dflash_gamma > 0) or the `draft_model` directory's; with the latter, cfg.dflash_gamma is set to
its block_size - 1, so cfg.dflash_gamma always counts the drafts of one DFlash proposal.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Iterator, Sequence

import structlog
import torch

from fxsched.kernels.gdn_fold import gdn_fold, gdn_fold_rows

from .config import ModelConfig, default_config
from .decode_path import DecodePath
from .drafters import DFlashDrafter, MtpHead
from .errors import OutOfBlocksError, SlotError
from .gdn import GdnSnapshot, GdnStateCache
from .gdn_chunked import KeepPlan
from .hf_drafters import PublishedDFlash, PublishedMtp, load_dflash_drafter
from .kernel_paths import attention_kernels_apply, gdn_fold_kernel_applies, kernels_opted_in
from .lora import DEFAULT_MAX_LORA_RANK, LoraPool
from .lora import load_adapter as read_adapter
from .attn_plan import plan_keys
from .batch_groups import forward_rows, row_groups
from .graphs import CudaGraphRecorder, ForwardGraphs, Recorder, buckets, cuda_graphs_wanted
from .model import ForwardOutput, HybridModel, RowBatch
from .moe import fuse_shared_experts
from .ops import rms_norm
from .packing import pack_for_cpu
from .paged_kv import BlockPool, PagedKVCache, blocks_for, flat_indices
from .prefix_cache import CachedBlock, PrefixCache
from .sequence_io import check_sequence, export_sequence, import_sequence
from .spill import read_spill, write_spill
from .slots import Captured, PendingRows, SlotState, in_cache
from .transfers import send_ints
from .weights import Weights, init_weights, load_weights, torch_dtype

log = structlog.get_logger("fxsched.torch_model")


@contextlib.contextmanager
def _subnormals_flushed(device: torch.device) -> Iterator[None]:
    """Flush subnormal floats to zero on this thread while a CPU forward runs. GDN decays drive
    states and chunk terms through them (exp of a large negative log-decay sum), which x86 computes
    ~100x slower: flushing took a 512-token Qwen3.5 prefill from 7.6 to 4.2 s. Values below 1e-38
    change no logit. Scoped, because the mode is the thread's (Python floats included)."""
    if device.type != "cpu":
        yield
        return
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


class HybridEngine(DecodePath):
    """Hybrid GDN/attention model with paged KV cache, per-slot GDN state, drafters and prefix cache."""

    def __init__(self, cfg: ModelConfig | None = None, weights: Weights | None = None,
                 device: str | torch.device = "cpu", draft_model: str | Path | None = None,
                 cuda_graphs: bool | None = None, max_loras: int = 0,
                 max_lora_rank: int = DEFAULT_MAX_LORA_RANK) -> None:
        self.cfg = cfg = cfg or default_config()
        self.device = torch.device(device)
        dtype = torch_dtype(cfg)  # KV / GDN caches and hidden rows are kept in the model's dtype
        if self.device.type == "cuda" and dtype == torch.float32:
            torch.backends.cuda.matmul.allow_tf32 = True

        weights = weights if weights is not None else init_weights(cfg, self.device)
        self.model = HybridModel(cfg, {n: t.to(self.device) for n, t in weights.items()})
        self.pool = BlockPool(cfg.num_blocks)
        # one block past the pool's: the scratch block padding rows of a static forward write to
        self.scratch_block = cfg.num_blocks
        self.kv = PagedKVCache(len(cfg.attn_layers), cfg.num_blocks + 1, cfg.block_size, cfg.num_kv_heads,
                               cfg.head_dim, self.device, dtype)
        self.gdn = GdnStateCache(cfg, self.device, dtype)
        # the most padded rows (sequences x longest) one committed forward takes (None: no limit)
        self.forward_rows: int | None = forward_rows(cfg) if self.device.type == "cpu" else None
        self.prefix = PrefixCache(self.pool, cfg.block_size)
        self.mtp: MtpHead | PublishedMtp | None = None
        if cfg.mtp:
            self.mtp = MtpHead(cfg, self.model.w)
        elif cfg.mtp_layers == 1:
            self.mtp = PublishedMtp(cfg, self.model.w, self.device)
        elif cfg.mtp_layers:
            log.warning("mtp_disabled", mtp_layers=cfg.mtp_layers, reason="only one published MTP layer is supported")
        self.dflash: DFlashDrafter | PublishedDFlash | None = None
        self.dflash_features: torch.Tensor | None = None  # [slots, max_seq_len, F]: committed context features
        self._block_features: dict[int, torch.Tensor] = {}  # prefix-cache block id -> its context features
        if draft_model is not None:
            self.dflash = load_dflash_drafter(draft_model, cfg, self.model.w, self.device)
            # cfg.dflash_gamma counts the drafts of a DFlash proposal, whichever drafter makes them
            self.cfg = cfg = dataclasses.replace(cfg, dflash_gamma=self.dflash.gamma)
            self.dflash_features = torch.zeros(cfg.max_slots, cfg.max_seq_len, self.dflash.feature_size,
                                               device=self.device, dtype=dtype)
        elif cfg.dflash_gamma > 0:
            self.dflash = DFlashDrafter(cfg, self.model.w, self.device)
        self.keeps_hidden = self.mtp is not None or isinstance(self.dflash, DFlashDrafter)
        self.hidden_history = torch.zeros(cfg.max_slots, cfg.max_seq_len if self.keeps_hidden else 0,
                                          cfg.hidden_size, device=self.device,
                                          dtype=dtype)
        self.mtp_hidden = torch.zeros(cfg.max_slots, cfg.hidden_size, device=self.device, dtype=dtype)
        self._mtp_hidden_set = [False] * cfg.max_slots
        self._slots: list[SlotState | None] = [None] * cfg.max_slots
        self._pending: list[PendingRows | None] = [None] * cfg.max_slots
        self._captured: list[Captured | None] = [None] * cfg.max_slots
        self._captured_features: list[Captured | None] = [None] * cfg.max_slots
        # LoRA adapters (specs/lora.md §18.1): max_loras slots of at most max_lora_rank, or none
        self.lora: LoraPool | None = (LoraPool(cfg, max_loras, max_lora_rank, self.device, dtype)
                                      if max_loras else None)
        self.graphs: ForwardGraphs | None = None
        if cuda_graphs_wanted(self.device, cuda_graphs):
            self.use_graphs(capture=True)

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """The decoder layers whose outputs a forward returns: a checkpoint DFlash drafter's target
        layers (its context features), else none."""
        return tuple(self.dflash.target_layer_ids) if isinstance(self.dflash, PublishedDFlash) else ()

    def use_graphs(self, capture: bool, recorder: Recorder | None = None) -> ForwardGraphs | None:
        """Decodes and uniform verifies through static forwards (graphs.py, specs/async.md §16.4), of
        every bucket of batch sizes and every row count a decode (1) or verify (2-4, the DFlash
        block) takes; with ``capture`` each is recorded now, by ``recorder`` (default: captured as a
        CUDA graph). A capture that fails leaves every forward eager, with a warning."""
        rows = {1, 2, 3, 4} | ({self.cfg.dflash_gamma + 1} if self.dflash is not None else set())
        if self._slots[0] is None:  # the padding entries read GDN slot 0: finite before any sequence sits
            self.gdn.reset(0)  # there, or padding rows write NaN into the scratch block and real rows,
            # which read it at weight 0, get 0 x NaN (graphs.py)
        try:
            if capture and recorder is None:
                recorder = CudaGraphRecorder(self.device)
            with torch.no_grad():
                self.graphs = ForwardGraphs(self, buckets(self.cfg.max_slots), sorted(rows), self.scratch_block,
                                            self.capture_layers, recorder=recorder if capture else None)
        except RuntimeError as err:  # CUDA's errors are RuntimeErrors
            log.warning("cuda_graphs_off", reason=str(err))
            self.graphs = None
        return self.graphs

    @classmethod
    def from_weights_file(cls, path: str | Path, cfg: ModelConfig | None = None,
                          device: str | torch.device = "cpu") -> "HybridEngine":
        """Engine over weights read by load_weights(path, cfg) (config taken from the file if cfg is None)."""
        weights, cfg = load_weights(path, cfg, device)
        return cls(cfg, weights, device)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, *, device: str | torch.device = "cpu", dtype: str | None = None,
                        max_seq_len: int | None = None, max_slots: int = 16, num_blocks: int | None = None,
                        block_size: int = 16, draft_model: str | Path | None = None,
                        expert_shard: tuple[int, int] | None = None,
                        kv_cache_memory: int | None = None, cuda_graphs: bool | None = None,
                        max_loras: int = 0, max_lora_rank: int = DEFAULT_MAX_LORA_RANK) -> "HybridEngine":
        """Engine over a Hugging Face checkpoint directory (see hf_checkpoint.load_pretrained, whose
        arguments these are; a bad directory raises ModelDirError). draft_model: a DFlash drafter
        directory (public format, see hf_drafters.load_dflash_drafter) to draft with. expert_shard:
        (rank, world) of an expert-parallel run: only rank's experts are loaded, and the MoE layers
        need the run's group bound to them (runtime/ep/experts.py) before a forward. kv_cache_memory:
        the cache budget in bytes, KV blocks and GDN states (hf_checkpoint.cache_sizes), instead of
        num_blocks. cuda_graphs: capture decodes and uniform verifies as CUDA graphs at start-up
        (CUDA only; None: unless FXSCHED_CUDA_GRAPHS=0). max_loras, max_lora_rank: the LoRA pool
        (specs/lora.md §18.1; 0 slots: none)."""
        from .hf_checkpoint import load_pretrained

        cfg, weights = load_pretrained(model_dir, device=device, dtype=dtype, max_seq_len=max_seq_len,
                                       max_slots=max_slots, num_blocks=num_blocks, block_size=block_size,
                                       expert_shard=expert_shard, kv_cache_memory=kv_cache_memory)
        # packed here, consuming the loader's dict, so the model is never held twice (ops.pack_for_cpu)
        weights = fuse_shared_experts(weights, cfg)
        weights = pack_for_cpu(weights, cfg, consume=True)
        return cls(cfg, weights, device, draft_model=draft_model, cuda_graphs=cuda_graphs, max_loras=max_loras,
                   max_lora_rank=max_lora_rank)

    # ---- slots --------------------------------------------------------------------------------
    def _slot(self, slot: int) -> SlotState:
        if not 0 <= slot < self.cfg.max_slots:
            raise SlotError(f"slot {slot} out of range [0, {self.cfg.max_slots})")
        state = self._slots[slot]
        if state is None:
            raise SlotError(f"slot {slot} is not allocated")
        return state

    def is_allocated(self, slot: int) -> bool:
        """Whether `slot` currently holds a sequence (possibly empty)."""
        return 0 <= slot < self.cfg.max_slots and self._slots[slot] is not None

    def free_slots(self) -> list[int]:
        """Unallocated slots in increasing order."""
        return [s for s in range(self.cfg.max_slots) if self._slots[s] is None]

    def alloc(self, slot: int, adapter_id: int = 0, lora_slot: int = -1) -> None:
        """Make `slot` hold an empty sequence (seq_len 0, zero GDN state) for adapter `adapter_id`, or
        with lora_slot >= 0 for the LoRA adapter in that pool slot (its id: `bind_adapter`)."""
        if not 0 <= slot < self.cfg.max_slots:
            raise SlotError(f"slot {slot} out of range [0, {self.cfg.max_slots})")
        if self._slots[slot] is not None:
            raise SlotError(f"slot {slot} is already allocated")
        if lora_slot >= 0:
            adapter_id = self._lora_id(lora_slot)
        self._slots[slot] = SlotState(adapter_id=adapter_id, lora_slot=lora_slot)
        self._clear_slot_tensors(slot)

    # ---- LoRA adapters (specs/lora.md §18.1) ------------------------------------------------------
    def _lora_pool(self) -> LoraPool:
        if self.lora is None:
            raise SlotError("this engine has no LoRA pool (max_loras = 0)")
        return self.lora

    def _lora_id(self, lora_slot: int) -> int:
        pool = self._lora_pool()
        if not 0 <= lora_slot < pool.max_loras:
            raise SlotError(f"adapter slot {lora_slot} out of range [0, {pool.max_loras})")
        adapter_id = pool.adapter_id(lora_slot)
        if not adapter_id:
            raise SlotError(f"adapter slot {lora_slot} holds no adapter")
        return adapter_id

    def load_adapter(self, lora_slot: int, adapter_dir: str | Path) -> int:
        """Load the PEFT adapter in `adapter_dir` into pool slot `lora_slot` (AdapterError for a bad
        adapter, the slot unchanged); returns its id. SlotError while a sequence runs with the
        adapter the slot holds."""
        pool = self._lora_pool()
        if not 0 <= lora_slot < pool.max_loras:
            raise SlotError(f"adapter slot {lora_slot} out of range [0, {pool.max_loras})")
        self._check_unused(lora_slot)
        return pool.load(lora_slot, adapter_dir)

    def check_adapter(self, adapter_dir: str | Path) -> None:
        """Read and check the PEFT adapter in `adapter_dir` against this model and pool (AdapterError
        naming the file, §18.4) without loading it: the pool is unchanged."""
        pool = self._lora_pool()
        read_adapter(adapter_dir, self.cfg, pool.max_rank)

    def unload_adapter(self, lora_slot: int) -> None:
        """Empty pool slot `lora_slot` (SlotError while a sequence runs with its adapter)."""
        self._lora_id(lora_slot)
        self._check_unused(lora_slot)
        self._lora_pool().clear(lora_slot)

    def _check_unused(self, lora_slot: int) -> None:
        users = [s for s, state in enumerate(self._slots) if state is not None and state.lora_slot == lora_slot]
        if users:
            raise SlotError(f"adapter slot {lora_slot}: slots {users} run with its adapter")

    def bind_adapter(self, slot: int, lora_slot: int) -> int:
        """Make the sequence in `slot` run with the adapter in pool slot `lora_slot` (-1: the base
        model); returns the adapter id. A sequence that already holds tokens keeps its adapter id
        (its KV was computed with it): SlotError if the slot's adapter is another (a restored
        sequence whose adapter was replaced while it was spilled)."""
        state = self._slot(slot)
        adapter_id = self._lora_id(lora_slot) if lora_slot >= 0 else 0
        if (state.seq_len or state.block_table) and adapter_id != state.adapter_id:
            raise SlotError(f"slot {slot} holds {state.seq_len} tokens of adapter id {state.adapter_id}, "
                            f"cannot run them with adapter id {adapter_id} (adapter slot {lora_slot})")
        state.adapter_id, state.lora_slot = adapter_id, lora_slot
        return adapter_id

    def free(self, slot: int) -> None:
        """Release `slot`: drop its block references (cached blocks stay in the prefix cache)."""
        state = self._slot(slot)
        for block in state.block_table:
            self.pool.decref(block)
        self._slots[slot] = None
        self._clear_slot_tensors(slot)

    def _clear_slot_tensors(self, slot: int) -> None:
        self.gdn.reset(slot)
        if self.dflash is not None:
            self.dflash.reset(slot)
        if isinstance(self.mtp, PublishedMtp):
            self.mtp.reset(slot)
        self._mtp_hidden_set[slot] = False
        self._pending[slot] = None
        self._captured[slot] = None
        self._captured_features[slot] = None

    def seq_len(self, slot: int) -> int:
        """Committed length of the sequence in `slot`."""
        return self._slot(slot).seq_len

    def tokens(self, slot: int) -> list[int]:
        """Copy of the committed tokens of `slot` (len == seq_len)."""
        return list(self._slot(slot).tokens)

    def block_table(self, slot: int) -> list[int]:
        """Copy of the block table of `slot`."""
        return list(self._slot(slot).block_table)

    def cached_prompt_tokens(self, slot: int) -> int:
        """How many prompt tokens of the last `prefill` of `slot` were served from the prefix cache."""
        return self._slot(slot).cached_prompt_tokens

    def slot_state(self, slot: int) -> SlotState:
        """The live bookkeeping record of allocated `slot` (package-internal; do not mutate)."""
        return self._slot(slot)

    def gdn_state(self, slot: int) -> GdnSnapshot:
        """Copies of the committed GDN state of `slot`: per GDN layer (recurrent, conv)."""
        self._slot(slot)
        return self.gdn.snapshot(slot)

    def captured_hidden(self, slot: int) -> torch.Tensor:
        """Final hidden rows [rows, D] (pre-norm) of the last forward of `slot` (prefill: whole prompt)."""
        self._slot(slot)
        captured = self._captured[slot]
        if captured is None:
            raise SlotError(f"slot {slot} has no forward yet")
        return captured.rows()

    def captured_rows(self, slots: Sequence[int], rows: Sequence[int]) -> torch.Tensor:
        """Hidden row rows[i] of the last forward of slots[i], copied, [N, D]: one gather when every
        slot's rows come from the same batched forward."""
        for slot in slots:
            self._slot(slot)
        caps = [self._captured[slot] for slot in slots]
        first = caps[0] if caps else None
        if first is not None and first.b is not None:
            same = [c.b for c, r in zip(caps, rows, strict=True)
                    if c is not None and c.batched is first.batched and c.b is not None and 0 <= r < c.n]
            if len(same) == len(caps):
                b_t, row_t = send_ints([same, list(rows)], self.device)
                return first.batched[b_t, row_t]
        return torch.stack([self.captured_hidden(slot)[row] for slot, row in zip(slots, rows, strict=True)])

    # ---- blocks -------------------------------------------------------------------------------
    def num_free_blocks(self) -> int:
        """Blocks in the free pool (cached-but-unused blocks are not free until reclaimed)."""
        return self.pool.num_free()

    def num_cached_blocks(self) -> int:
        """Blocks held by the prefix cache."""
        return len(self.prefix)

    def num_evictable_blocks(self) -> int:
        """Cached blocks no sequence uses: the most `reclaim` can free."""
        return self.prefix.num_evictable()

    def blocks_needed(self, slot: int, num_rows: int) -> int:
        """New blocks a forward of num_rows rows on `slot` would allocate."""
        state = self._slot(slot)
        return max(0, blocks_for(state.seq_len + num_rows, self.cfg.block_size) - len(state.block_table))

    def reclaim(self, n: int) -> int:
        """Evict up to n unused prefix-cache blocks into the free pool; returns how many were freed."""
        return self.prefix.reclaim(n)

    # ---- forward ------------------------------------------------------------------------------
    def prepare(self, slots: Sequence[int], token_lists: Sequence[Sequence[int]], *, commit_all: bool = False,
                in_place: bool = False, static: bool = False, device_tokens: torch.Tensor | None = None,
                packed: bool = False) -> RowBatch:
        """Validate a forward's rows, allocate their blocks (all or nothing) and build its batch
        (see _forward for commit_all and in_place, _packed_forward for packed). static leaves out
        the host-built attention plan, so the forward takes only shape-static paths: the form a CUDA graph or
        torch.compile(fullgraph=True) captures whole (tests/test_traceable_forward.py)."""
        if len(slots) != len(token_lists):
            raise ValueError(f"{len(slots)} slots but {len(token_lists)} token lists")
        if not slots:
            raise ValueError("empty batch: no slots given")
        if len(set(slots)) != len(slots):
            raise SlotError(f"duplicate slots in one batch: {list(slots)}")
        states = [self._slot(s) for s in slots]
        need = 0
        for slot, state, toks in zip(slots, states, token_lists, strict=True):
            self._check_rows(slot, state.seq_len, toks)
            need += self.blocks_needed(slot, len(toks))
        if need > self.pool.num_free():
            raise OutOfBlocksError(f"forward needs {need} new KV blocks, only {self.pool.num_free()} free; "
                                   f"reclaim cached blocks or free a slot")
        for slot, state, toks in zip(slots, states, token_lists, strict=True):
            last = state.block_table[-1] if state.block_table else None
            state.block_table.extend(self.pool.allocate(self.blocks_needed(slot, len(toks)), after=last))
        keep = self._commit_rows(states, token_lists) if commit_all else None
        batch = self._row_batch(slots, states, token_lists, keep, last_logits=commit_all, device_tokens=device_tokens,
                                packed=packed)
        batch.gdn_in_place = in_place
        if static:
            batch.attn = None
        return batch

    def _forward(self, slots: Sequence[int], token_lists: Sequence[Sequence[int]],
                 commit_all: bool = False, in_place: bool = False,
                 device_tokens: torch.Tensor | None = None) -> ForwardOutput:
        """Validate, allocate blocks (all or nothing), run the model; records pending + captured rows.

        commit_all promises that every row will be committed (a prefill chunk, a mixed or batched
        prefill): the GDN layers then keep only the states a commit can read (each sequence's block
        boundaries and last row, see _commit_rows) and run the chunked form, never T per-row states.
        in_place (one row per slot, committed by the caller right after: a decode) lets the GDN
        layers update the slots' states in the cache as they run (RowBatch.gdn_in_place).
        """
        batch = self.prepare(slots, token_lists, commit_all=commit_all, in_place=in_place, device_tokens=device_tokens)
        states = [self._slot(s) for s in slots]
        out, features = self._run(batch)
        for b, (slot, state, toks) in enumerate(zip(slots, states, token_lists, strict=True)):
            rows = features[b, :len(toks)] if features is not None else None
            self._pending[slot] = PendingRows(state.seq_len, [int(t) for t in toks], out, b, rows)
            self._captured[slot] = Captured(out.hidden, b, len(toks))
            self._captured_features[slot] = Captured(rows) if rows is not None else None
        return out

    def _run(self, batch: RowBatch) -> tuple[ForwardOutput, torch.Tensor | None]:
        """The model's forward of ``batch`` (its static form where one takes it), and a checkpoint
        DFlash drafter's context features of it [B, T, F] (None without one)."""
        with _subnormals_flushed(self.device):
            out = self.graphs.forward(batch) if self.graphs is not None else None
            if out is None:
                out = self.model.forward(batch, self.kv, self.gdn, capture_layers=self.capture_layers)
        drafter = self.dflash if isinstance(self.dflash, PublishedDFlash) else None
        return out, self._context_features(drafter, out) if drafter is not None else None

    def _context_features(self, drafter: PublishedDFlash, out: ForwardOutput) -> torch.Tensor:
        """A checkpoint DFlash drafter's context features [B, T, F] of a forward: its captured target
        layers, the last one final-normed (transformers' hidden_states[l + 1] convention)."""
        last = self.cfg.num_layers - 1
        layers = [rms_norm(out.layer_hidden[i], self.model.w["final_norm"], self.cfg.rms_norm_eps) if i == last
                  else out.layer_hidden[i] for i in drafter.target_layer_ids]
        return drafter.features(layers)

    @property
    def _attention_kernels(self) -> bool:
        """Whether attention runs as the Triton kernels on this engine's caches (kernel_paths.py; read
        per forward: FXSCHED_KERNELS may change at run time)."""
        return bool(self.kv.k) and attention_kernels_apply(self.kv.k[0], self.kv.v[0])

    def _check_rows(self, slot: int, start: int, tokens: Sequence[int]) -> None:
        cfg = self.cfg
        if not len(tokens):
            raise ValueError(f"slot {slot}: empty token list")
        bad = [t for t in tokens if not 0 <= int(t) < cfg.vocab_size]
        if bad:
            raise ValueError(f"slot {slot}: token ids {bad} outside [0, {cfg.vocab_size})")
        if start + len(tokens) > cfg.max_seq_len:
            raise SlotError(f"slot {slot}: {start} + {len(tokens)} rows exceed max_seq_len={cfg.max_seq_len}")

    def _commit_rows(self, states: Sequence[SlotState], token_lists: Sequence[Sequence[int]]) -> tuple[int, ...] | None:
        """The rows of a fully committed forward whose GDN states a commit reads: per sequence, the
        rows that end a block (boundary_states for the prefix cache) and its last row (the slot's new
        state); None (every row) when the forward is a single row per sequence anyway."""
        if max(len(toks) for toks in token_lists) <= 1:
            return None
        bs, every = self.cfg.block_size, self.cfg.gdn_snapshot_blocks
        rows: set[int] = set()
        for state, toks in zip(states, token_lists, strict=True):
            start, n = state.seq_len, len(toks)
            rows.add(n - 1)
            rows.update(k * bs - start - 1 for k in range(start // bs + 1, (start + n) // bs + 1) if k % every == 0)
        return tuple(sorted(rows))

    def _row_batch(self, slots: Sequence[int], states: Sequence[SlotState],
                   token_lists: Sequence[Sequence[int]], keep_rows: tuple[int, ...] | None = None,
                   last_logits: bool = False, device_tokens: torch.Tensor | None = None,
                   packed: bool = False) -> RowBatch:
        """The forward's batch, built from host lists in one pass and moved to the device in one
        packed copy (`send_ints`), the GDN layers' kept-state indices included (gdn_chunked.KeepPlan:
        no layer copies its own, specs/async.md §16.2); with last_logits only each entry's last row
        gets logits (a committed forward: the caller reads nothing else). device_tokens (int64, the
        rows of every list in order, on the device) replaces the lists' tokens on the device: tokens
        the host has not read (late drafts, specs/async.md §16.3). packed: the rows of every entry one
        after another in a [1, N] batch, no padding (_packed_forward)."""
        lengths = [len(toks) for toks in token_lists]
        seqs = len(slots)
        b, t = (1, sum(lengths)) if packed else (seqs, max(lengths))
        nb = max(len(s.block_table) for s in states)
        bs = self.cfg.block_size
        tokens, positions, tables = [0] * (b * t), [0] * (b * t), [0] * (seqs * nb)
        valid_rows: list[int] = []
        write: list[int] = []
        firsts: list[int] = []  # each entry's first flat row
        at = 0
        for i, (state, toks) in enumerate(zip(states, token_lists, strict=True)):
            n, start, table = len(toks), state.seq_len, state.block_table
            at = at if packed else i * t
            firsts.append(at)
            tokens[at:at + n] = [int(x) for x in toks]
            positions[at:at + n] = range(start, start + n)
            tables[i * nb:i * nb + len(table)] = table
            valid_rows.extend(range(at, at + n))
            write += flat_indices(table, start, n, bs)
            at += n
        dev = self.device
        uniform = not packed and all(n == t for n in lengths)
        fields = [tokens, positions, tables, write, list(slots), lengths]
        lora_slots = [s.lora_slot for s in states] if self.lora is not None else []
        lora_fields = self.lora.row_fields(lora_slots, lengths, t) if self.lora is not None else None
        if lora_fields is not None:
            fields += lora_fields
        if not uniform:
            fields.append(valid_rows)
        if last_logits:
            fields.append([first + n - 1 for first, n in zip(firsts, lengths, strict=True)])
        keep = KeepPlan.of(keep_rows, t) if keep_rows is not None else None  # the GDN layers' state indices
        if keep is not None:
            fields += keep.fields
        sent = send_ints(fields, dev)
        tokens_t, positions_t, tables_t, write_t, slots_t, lengths_t = sent[:6]
        extra = iter(sent[6:])
        lora = None
        if lora_fields is not None:
            assert self.lora is not None
            rows_t, ends_t = next(extra), next(extra)
            lora = self.lora.batch_rows(lora_slots, lora_fields[1], rows_t, ends_t)
        valid_t = None if uniform else next(extra)
        logit_rows = next(extra) if last_logits else None
        keep_index = keep.index([next(extra) for _ in keep.fields]) if keep is not None else None
        if device_tokens is not None:  # the rows in order: every grid position when uniform
            if valid_t is None:
                tokens_t.copy_(device_tokens)
            else:
                tokens_t[valid_t] = device_tokens
        valid = (torch.ones(1, t, dtype=torch.bool, device=dev) if packed
                 else torch.arange(t, device=dev)[None, :] < lengths_t[:, None])
        # the Triton kernels read every row's keys through the block tables, ragged rows included
        # (specs/gpu-kernels.md §17.5): no host plan of where each sequence's keys lie
        plan = None if self._attention_kernels else plan_keys(
            [s.block_table for s in states], [s.seq_len for s in states], lengths, bs, dev,
            row_kernel=dev.type == "cpu" and bool(self.kv.k) and self.kv.k[0].dtype == torch.bfloat16, firsts=firsts)
        return RowBatch(tokens_t.view(b, t), positions_t.view(b, t), valid, write_t, tables_t.view(seqs, nb), slots_t,
                        uniform, keep_rows, valid_rows=valid_t, attn=plan, logit_rows=logit_rows, gdn_keep=keep_index,
                        lora=lora)

    @torch.no_grad()
    def prefill(self, slot: int, tokens: Sequence[int]) -> torch.Tensor:
        """Prefill an empty slot with a prompt, reusing prefix-cache blocks; returns last-row logits [V].

        At most (len(tokens) - 1) // block_size full blocks are reused, so at least one token is
        recomputed; `cached_prompt_tokens(slot)` reports how many were reused. Afterwards
        captured_hidden(slot) covers the whole prompt (cached rows included).
        """
        cached = self.attach_prefix(slot, tokens)
        logits = self.prefill_chunk(slot, tokens[cached:], cached)
        self.capture_prompt(slot, len(tokens))
        return logits

    def attach_prefix(self, slot: int, tokens: Sequence[int]) -> int:
        """Start an empty slot's prompt `tokens` from the prefix cache: the deepest run of cached
        full blocks that ends at a GDN snapshot (at most (len(tokens) - 1) // block_size, so one
        token at least is left to compute) becomes the slot's first blocks, with their GDN state,
        hidden rows and drafter features; returns the tokens attached (0 on a miss). The caller
        then commits tokens[returned:] (one slot alone, or beside other slots' rows in a batched
        forward) and calls `capture_prompt`."""
        state = self._slot(slot)
        if state.seq_len or state.block_table:
            raise SlotError(f"slot {slot}: prefill needs an empty slot (seq_len={state.seq_len}); use prefill_chunk")
        self._check_rows(slot, 0, tokens)
        bs = self.cfg.block_size
        hits = self.prefix.lookup(state.adapter_id, tokens, (len(tokens) - 1) // bs)
        if self.dflash_features is not None:  # a cached block is usable only with its context features
            hits = hits[:next((i for i, e in enumerate(hits) if e.block_id not in self._block_features), len(hits))]
        # resume from the deepest hit with a GDN snapshot (cache_sequence keeps them every few blocks)
        hits = hits[:next((i + 1 for i in range(len(hits) - 1, -1, -1) if hits[i].gdn_state is not None), 0)]
        need = blocks_for(len(tokens), bs) - len(hits)
        if need > self.pool.num_free():
            raise OutOfBlocksError(f"prefill of {len(tokens)} tokens needs {need} new KV blocks, "
                                   f"only {self.pool.num_free()} free")
        cached = len(hits) * bs
        for i, entry in enumerate(hits):
            self.pool.incref(entry.block_id)
            state.block_table.append(entry.block_id)
            if entry.gdn_state is not None:
                state.boundary_states[i + 1] = entry.gdn_state
            if self.keeps_hidden:
                self.hidden_history[slot, i * bs:(i + 1) * bs] = entry.hidden
            if self.dflash_features is not None:
                self.dflash_features[slot, i * bs:(i + 1) * bs] = self._block_features[entry.block_id]
        if hits:
            resume = hits[-1].gdn_state
            assert resume is not None  # the hits end at a snapshotted block
            self.gdn.load(slot, resume)
            state.tokens = [int(t) for t in tokens[:cached]]
            state.seq_len = cached
        state.cached_prompt_tokens = cached
        return cached

    def capture_prompt(self, slot: int, n: int) -> int:
        """After a prompt's first `n` tokens are committed (some from the prefix cache): the slot's
        captured rows become all `n` (cached rows included) where hidden rows or drafter features
        are kept. Returns the index of the last row in the slot's captured rows."""
        if self.keeps_hidden:  # the whole prompt's rows, cached ones included (MTP reads the last)
            self._captured[slot] = Captured(self.hidden_history[slot, :n].clone())
        if self.dflash_features is not None:
            self._captured_features[slot] = Captured(self.dflash_features[slot, :n].clone())
        captured = self._captured[slot]
        return captured.rows().shape[0] - 1 if captured is not None else n - 1

    @torch.no_grad()
    def prefill_chunk(self, slot: int, tokens: Sequence[int], start: int) -> torch.Tensor:
        """Append and commit `tokens` at position start (== seq_len); returns last-row logits [V]."""
        state = self._slot(slot)
        if start != state.seq_len:
            raise SlotError(f"slot {slot}: prefill_chunk at start={start} but seq_len={state.seq_len}")
        return self.commit_forward([slot], [tokens])[0]

    @torch.no_grad()
    def commit_forward(self, slots: Sequence[int], token_lists: Sequence[Sequence[int]]) -> torch.Tensor:
        """Append and commit every row of each slot's tokens; returns each slot's last-row logits
        [B, V] (the only rows computed). The GDN layers run the chunked form (no per-row states, see
        _forward). One forward, or with `forward_rows` set several over groups of sequences of
        similar length (batch_groups.row_groups), each committed before the next runs."""
        lengths = [len(toks) for toks in token_lists]
        groups = [list(range(len(slots)))]
        # on the CPU a batch is padded to its longest row count: rows of unlike lengths (a mixed
        # step's decode rows beside a prompt chunk) run as groups of like lengths instead
        if self.forward_rows is not None and (len(lengths) * max(lengths, default=0) > self.forward_rows
                                              or min(lengths, default=0) * 2 < max(lengths, default=0)):
            if self._packs(lengths):
                return self._packed_forward(slots, token_lists)
            groups = row_groups(lengths, self.forward_rows)
        parts = []
        for group in groups:
            group_slots = [slots[i] for i in group]
            out = self._forward(group_slots, [token_lists[i] for i in group], commit_all=True)
            self.gdn_fold_accepted(group_slots, [lengths[i] for i in group])
            parts.append(out.logits)
        if len(parts) == 1:
            return parts[0]
        rows: list[torch.Tensor] = [parts[0][0]] * len(slots)  # each sequence's row, back in order (no index copy)
        for group, part in zip(groups, parts, strict=True):
            for j, i in enumerate(group):
                rows[i] = part[j]
        return torch.stack(rows)

    def _packs(self, lengths: Sequence[int]) -> bool:
        """Whether a committed forward of rows of unlike lengths (a mixed step's decode rows beside a
        prompt chunk) runs as one packed forward (`_packed_forward`) rather than as groups of like
        lengths: on a model whose every layer takes packed rows (attention and MLPs: no GDN layer,
        whose recurrence reads a [B, T] grid) with nothing kept per row (no adapters, no hidden
        history for a drafter, no captured layers), and rows within `forward_rows`."""
        return (self.forward_rows is not None and not self.cfg.gdn_layers and self.lora is None
                and not self.keeps_hidden and self.dflash_features is None and not self.capture_layers
                and sum(lengths) <= self.forward_rows)

    def _packed_forward(self, slots: Sequence[int], token_lists: Sequence[Sequence[int]]) -> torch.Tensor:
        """``commit_forward`` of every slot in one forward over their rows one after another (a
        [1, N] batch: no padding, each weight read once; specs/cpu-kernels.md §15.12): each row's
        products, norms and rotation are those of the grouped forwards, and attention reads each
        entry's keys as its own forward would (the row kernel's rows, SDPA per prompt chunk)."""
        batch = self.prepare(slots, token_lists, commit_all=True, packed=True)
        out, _ = self._run(batch)
        first = 0
        for slot, toks in zip(slots, token_lists, strict=True):
            n = len(toks)
            self._pending[slot] = PendingRows(self._slot(slot).seq_len, [int(t) for t in toks], out, 0)
            self._captured[slot] = Captured(out.hidden[0, first:first + n])
            self._captured_features[slot] = None
            first += n
        self.gdn_fold_accepted(slots, [len(toks) for toks in token_lists])
        return out.logits

    def fill_token(self, slot: int, position: int, token: int) -> None:
        """The value of a committed token fed from the device (``decode_batch``'s device_tokens)."""
        self.fill_tokens([slot], [position], [token])

    def fill_tokens(self, slots: Sequence[int], positions: Sequence[int], tokens: Sequence[int]) -> None:
        """``fill_token`` of each (slot, position, token)."""
        table_of, count = self._slots, self.cfg.max_slots
        for slot, position, token in zip(slots, positions, tokens, strict=True):
            state = table_of[slot] if 0 <= slot < count else None
            if state is None:
                state = self._slot(slot)  # raises the slot's error
            if not 0 <= position < len(state.tokens):
                raise SlotError(f"slot {slot}: no committed token at position {position}")
            state.tokens[position] = int(token)

    @torch.no_grad()
    def verify(self, slot: int, tokens: Sequence[int]) -> torch.Tensor:
        """Run K rows (anchor + drafts) without committing; returns logits [K, V] (row i predicts
        the token after tokens[i]). Follow with commit_accepted_prefix."""
        return self.verify_batched([slot], [tokens])[0]

    @torch.no_grad()
    def verify_batched(self, slots: Sequence[int], tokens_per_slot: Sequence[Sequence[int]],
                       device_tokens: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Batched `verify` with per-slot row counts; returns per slot logits [K_b, V]. With
        device_tokens the rows run those tokens instead (see _row_batch); the host lists are then
        placeholders until `set_pending_tokens` names what ran."""
        out = self._forward(slots, tokens_per_slot, device_tokens=device_tokens)
        return [out.logits[b, :len(toks)] for b, toks in enumerate(tokens_per_slot)]

    def set_pending_tokens(self, slot: int, tokens: Sequence[int]) -> None:
        """The tokens the slot's pending rows ran (once read back), so a commit records them."""
        pending = self._pending[slot]
        if pending is None or len(pending.tokens) != len(tokens):
            raise SlotError(f"slot {slot}: no pending forward of {len(tokens)} rows")
        pending.tokens = [int(t) for t in tokens]

    def commit_accepted_prefix(self, slot: int, n_keep: int) -> None:
        """Commit the first n_keep rows of the slot's pending forward (see gdn_fold_accepted)."""
        self.gdn_fold_accepted([slot], [n_keep])

    @torch.no_grad()
    def gdn_fold_accepted(self, slots: Sequence[int], accepted: Sequence[int]) -> None:
        """Commit accepted[i] leading rows of each slot's pending forward, in one batched state write.

        seq_len grows by accepted[i]; the GDN state becomes the state after the last accepted row
        (unchanged if 0; copied by the `gdn_fold` kernel, see _fold_gdn_states); blocks wholly
        beyond the new seq_len return to the pool; the pending rows are consumed.
        """
        if len(slots) != len(accepted):
            raise ValueError(f"{len(slots)} slots but {len(accepted)} accept counts")
        if len(set(slots)) != len(slots):
            raise SlotError(f"duplicate slots in one commit: {list(slots)}")
        pendings = []
        for slot, n in zip(slots, accepted, strict=True):
            self._slot(slot)
            pending = self._pending[slot]
            if pending is None:
                raise SlotError(f"slot {slot}: nothing to commit (no pending forward)")
            if not 0 <= n <= len(pending.tokens):
                raise ValueError(f"slot {slot}: cannot accept {n} of {len(pending.tokens)} rows")
            pendings.append(pending)
        self._fold_gdn_states(slots, accepted, pendings)
        per_slot_hidden = self.keeps_hidden and not self._hidden_rows_at_once(slots, accepted, pendings)
        bs = self.cfg.block_size
        for slot, n, pending in zip(slots, accepted, pendings, strict=True):
            state = self._slot(slot)
            old = state.seq_len
            b = pending.batch_index
            state.tokens.extend(pending.tokens[:n])
            state.seq_len = old + n
            if per_slot_hidden:
                self.hidden_history[slot, old:old + n] = pending.out.hidden[b, :n]
            if self.dflash_features is not None and pending.features is not None:
                self.dflash_features[slot, old:old + n] = pending.features[:n]
            for k in range(old // bs + 1, (old + n) // bs + 1):
                if k % self.cfg.gdn_snapshot_blocks:  # snapshots are kept every gdn_snapshot_blocks blocks
                    continue
                if in_cache(pending.out):  # a one-row forward: the boundary state is the slot's own
                    state.boundary_states[k] = self.gdn.snapshot(slot)
                    continue
                state.boundary_states[k] = [(r.clone(), c.clone()) for r, c in
                                            (rows.row(b, k * bs - old - 1) for rows in pending.out.gdn_rows)]
            keep = blocks_for(state.seq_len, bs)
            for block in state.block_table[keep:]:
                self.pool.decref(block)
            del state.block_table[keep:]
            self._pending[slot] = None

    def _hidden_rows_at_once(self, slots: Sequence[int], accepted: Sequence[int],
                             pendings: Sequence[PendingRows]) -> bool:
        """The accepted hidden rows of several slots' pending rows of one forward written to the
        history in one indexed copy (before their lengths grow); False when there is one slot or the
        rows come from several forwards (the caller writes slot by slot)."""
        out = pendings[0].out if pendings else None
        if len(slots) < 2 or out is None or any(p.out is not out for p in pendings):
            return False
        at_slot: list[int] = []
        at_pos: list[int] = []
        from_b: list[int] = []
        from_row: list[int] = []
        for slot, n, pending in zip(slots, accepted, pendings, strict=True):
            old = self._slot(slot).seq_len
            at_slot += [slot] * n
            at_pos += range(old, old + n)
            from_b += [pending.batch_index] * n
            from_row += range(n)
        if at_slot:
            slot_t, pos_t, b_t, row_t = send_ints([at_slot, at_pos, from_b, from_row], self.device)
            self.hidden_history.index_put_((slot_t, pos_t), out.hidden[b_t, row_t].to(self.hidden_history.dtype))
        return True

    def _fold_gdn_states(self, slots: Sequence[int], accepted: Sequence[int],
                         pendings: Sequence[PendingRows]) -> None:
        """Set each slot's GDN state (every layer) to the state after its last accepted row (none: kept).

        One `fxsched.kernels.gdn_fold` call per (GDN layer, forward the pending rows come from), on the
        forward's own state tensors: batch entry b keeps row accepted - 1 (where that forward kept it,
        GdnRows.index) into its slot; entries
        not committed here carry slot -1 (padding) and write nothing. The Triton kernel where
        kernel_paths allows it, `gdn_fold_rows` on the live entries otherwise (both copy exactly).
        """
        groups: dict[int, tuple[ForwardOutput, list[int], list[int]]] = {}
        for slot, n, pending in zip(slots, accepted, pendings, strict=True):
            if n <= 0 or not pending.out.gdn_rows or in_cache(pending.out):  # no GDN layer, or states in place
                continue
            out = pending.out
            if id(out) not in groups:
                batch = out.hidden.shape[0]
                groups[id(out)] = (out, [-1] * batch, [0] * batch)
            _, slot_ids, rows = groups[id(out)]
            slot_ids[pending.batch_index] = slot
            rows[pending.batch_index] = out.gdn_rows[0].index(n - 1) if out.gdn_rows else n - 1
        for out, slot_ids, rows in groups.values():
            live = [b for b, s in enumerate(slot_ids) if s >= 0]
            if len(live) == 1 and not kernels_opted_in(out.hidden):  # one entry on the torch path: its rows copied as views
                b = live[0]
                slot, row = slot_ids[b], rows[b]
                for layer, gdn_rows in enumerate(out.gdn_rows):
                    self.gdn.recurrent[layer][slot].copy_(gdn_rows.states[b, row])
                    self.gdn.conv[layer][slot].copy_(gdn_rows.windows[b, :, row, 1:])
                continue
            slot_t, rows_t, live_t, live_rows_t, live_slots_t = send_ints(
                [slot_ids, rows, live, [rows[b] for b in live], [slot_ids[b] for b in live]], self.device)
            for layer, gdn_rows in enumerate(out.gdn_rows):
                args = (gdn_rows.states, gdn_rows.conv_rows(), rows_t, slot_t,
                        self.gdn.recurrent[layer], self.gdn.conv[layer])
                if gdn_fold_kernel_applies(*args):
                    gdn_fold(*args)
                else:  # the live entries alone, picked on the host: no boolean mask on the device
                    gdn_fold_rows(gdn_rows.states, gdn_rows.conv_rows(), live_t, live_rows_t, live_slots_t,
                                  self.gdn.recurrent[layer], self.gdn.conv[layer])

    def hidden_rows(self, slot: int, start: int, end: int) -> torch.Tensor:
        """The committed hidden rows [end - start, D] of `slot` (zeros where the engine keeps no
        history: nothing reads them then, and spill files and cache entries keep their shape)."""
        if self.keeps_hidden:
            return self.hidden_history[slot, start:end]
        return torch.zeros(end - start, self.cfg.hidden_size, device=self.device, dtype=self.hidden_history.dtype)

    # ---- drafters -----------------------------------------------------------------------------
    def save_hidden_for_mtp(self, slot: int, row: int) -> None:
        """Keep hidden row `row` (Python indexing) of the slot's last forward as the MTP conditioning."""
        hidden = self.captured_hidden(slot)
        if not -hidden.shape[0] <= row < hidden.shape[0]:
            raise ValueError(f"slot {slot}: row {row} outside the last forward's {hidden.shape[0]} rows")
        self.set_mtp_hidden(slot, hidden[row])

    def has_mtp_hidden(self, slot: int) -> bool:
        """Whether an MTP conditioning hidden state is saved for `slot`."""
        self._slot(slot)
        return self._mtp_hidden_set[slot]

    def set_mtp_hidden(self, slot: int, hidden: torch.Tensor) -> None:
        """Set the MTP conditioning hidden [D] of `slot` directly (used by restore)."""
        self._slot(slot)
        self.mtp_hidden[slot] = hidden
        self._mtp_hidden_set[slot] = True

    def set_mtp_hiddens(self, slots: Sequence[int], hiddens: Sequence[torch.Tensor]) -> None:
        """``set_mtp_hidden`` of each (slot, hidden [D]), in one write."""
        if len(slots) != len(hiddens):
            raise ValueError(f"{len(slots)} slots but {len(hiddens)} hidden rows")
        if len(slots) == 1:
            self.set_mtp_hidden(slots[0], hiddens[0])
            return
        if len(set(slots)) != len(slots):
            raise SlotError(f"duplicate slots in one write: {list(slots)}")
        for slot in slots:
            self._slot(slot)
        self.mtp_hidden.index_copy_(0, send_ints([list(slots)], self.device)[0],
                                    torch.stack(list(hiddens)).to(self.mtp_hidden.dtype))
        for slot in slots:
            self._mtp_hidden_set[slot] = True

    def mtp_propose(self, slots: Sequence[int], last_tokens: Sequence[int], num_drafts: int) -> list[list[int]]:
        """`mtp_drafts`, read back."""
        return self.mtp_drafts(slots, last_tokens, num_drafts).tolist()

    @torch.no_grad()
    def mtp_drafts(self, slots: Sequence[int], last_tokens: Sequence[int], num_drafts: int) -> torch.Tensor:
        """num_drafts greedy MTP drafts per slot [B, num_drafts] on the device, continuing
        last_tokens[i] (the token after the slot's committed ones). The internal head reads the saved
        hidden (save_hidden_for_mtp); a checkpoint's MTP module reads the committed tokens and hidden
        rows, catching its own KV up first."""
        if self.mtp is None:
            raise SlotError("this model has no MTP head (config mtp = false, mtp_layers = 0)")
        if len(slots) != len(last_tokens):
            raise ValueError(f"{len(slots)} slots but {len(last_tokens)} last tokens")
        states = [self._slot(slot) for slot in slots]
        if isinstance(self.mtp, PublishedMtp):
            for slot, state in zip(slots, states, strict=True):
                if not state.seq_len:
                    raise SlotError(f"slot {slot}: MTP proposals need a prefilled sequence")
            return self.mtp.propose(slots, [s.tokens for s in states], self.hidden_history,
                                    [int(t) for t in last_tokens], num_drafts)
        for slot in slots:
            if not self._mtp_hidden_set[slot]:
                raise SlotError(f"slot {slot}: no hidden saved for MTP (call save_hidden_for_mtp)")
        index, toks = send_ints([slots, [int(t) for t in last_tokens]], self.device)
        return self.mtp.propose(self.mtp_hidden.index_select(0, index), toks, num_drafts)

    def dflash_propose(self, slots: Sequence[int], last_tokens: Sequence[int]) -> list[list[int]]:
        """`dflash_drafts`, read back."""
        return self.dflash_drafts(slots, last_tokens).tolist()

    @torch.no_grad()
    def dflash_drafts(self, slots: Sequence[int], last_tokens: Sequence[int]) -> torch.Tensor:
        """dflash_gamma drafts per slot [B, gamma] on the device, from one block forward over
        [last token, MASK x gamma]."""
        drafter = self._require_dflash()
        for slot in slots:
            self._slot(slot)
        return drafter.propose(slots, [int(t) for t in last_tokens], self.device)

    @torch.no_grad()
    def commit_ctx(self, slot: int, n: int) -> None:
        """Extend the DFlash context of `slot` with the first n rows of its last forward (hidden rows
        for the internal drafter, context features for a checkpoint's drafter)."""
        drafter = self._require_dflash()
        rows = self.captured_hidden(slot)
        if isinstance(drafter, PublishedDFlash):
            features = self._captured_features[slot]
            assert features is not None  # every forward of an engine with this drafter records them
            rows = features.rows()
        if not 0 <= n <= rows.shape[0]:
            raise ValueError(f"slot {slot}: cannot commit {n} of {rows.shape[0]} captured rows")
        drafter.append(slot, rows[:n])

    @torch.no_grad()
    def ctx_extend(self, slot: int, upto: int) -> None:
        """Extend the DFlash context of `slot` over committed positions [ctx_len, upto) (their hidden
        rows, or context features for a checkpoint's drafter)."""
        drafter = self._require_dflash()
        state = self._slot(slot)
        start = drafter.ctx_len[slot]
        if not start <= upto <= state.seq_len:
            raise ValueError(f"slot {slot}: cannot extend a DFlash context of {start} rows to {upto} "
                             f"({state.seq_len} committed)")
        history = self.dflash_features if isinstance(drafter, PublishedDFlash) else self.hidden_history
        assert history is not None
        drafter.append(slot, history[slot, start:upto])

    def trim_proposer_state(self, slot: int, n_drop: int) -> None:
        """Drop the last n_drop rows of the DFlash context of `slot`."""
        self._slot(slot)
        self._require_dflash().trim(slot, n_drop)

    def ctx_len(self, slot: int) -> int:
        """Rows in the DFlash context of `slot`."""
        self._slot(slot)
        return self._require_dflash().ctx_len[slot]

    def _require_dflash(self) -> DFlashDrafter | PublishedDFlash:
        if self.dflash is None:
            raise SlotError("this model has no DFlash drafter (config dflash_gamma = 0, no draft model)")
        return self.dflash

    # ---- prefix cache -------------------------------------------------------------------------
    def cache_sequence(self, slot: int) -> int:
        """Insert the slot's full committed blocks (with boundary GDN states) into the prefix cache.

        Blocks up to the last one whose boundary has a snapshot (ModelConfig.gdn_snapshot_blocks: a
        hit resumes from the deepest snapshotted block), the others with no state of their own.
        Returns how many blocks were newly cached.
        """
        state = self._slot(slot)
        if not self.prefix.enabled:  # nothing is cached: no keys to hash, no rows to copy
            return 0
        bs = self.cfg.block_size
        full = state.seq_len // bs
        last = max((k for k in state.boundary_states if k <= full), default=0)
        keys = self.prefix.keys_for(state.adapter_id, state.tokens, last)
        entries = []
        for i, key in enumerate(keys):
            snapshot = state.boundary_states.get(i + 1)
            entries.append(CachedBlock(key, state.block_table[i], state.adapter_id,
                                       tuple(state.tokens[i * bs:(i + 1) * bs]), snapshot,
                                       self.hidden_rows(slot, i * bs, (i + 1) * bs).clone()))
            if self.dflash_features is not None:  # side table: prefill reuses a block with its features
                self._block_features[state.block_table[i]] = self.dflash_features[slot, i * bs:(i + 1) * bs].clone()
        return self.prefix.insert(entries)

    # ---- moving state -------------------------------------------------------------------------
    def compact(self, slot_from: int, slot_to: int) -> None:
        """Move the sequence in slot_from (all per-slot state; blocks by reference) into free slot_to."""
        state = self._slot(slot_from)
        if not 0 <= slot_to < self.cfg.max_slots or self._slots[slot_to] is not None:
            raise SlotError(f"compact target slot {slot_to} must be a free slot in range")
        self._slots[slot_to], self._slots[slot_from] = state, None
        self.gdn.move(slot_from, slot_to)
        if self.dflash is not None:
            self.dflash.move(slot_from, slot_to)
        n = state.seq_len
        if self.keeps_hidden:
            self.hidden_history[slot_to, :n] = self.hidden_history[slot_from, :n]
        if self.dflash_features is not None:
            self.dflash_features[slot_to, :n] = self.dflash_features[slot_from, :n]
        if isinstance(self.mtp, PublishedMtp):
            self.mtp.move(slot_from, slot_to)
        self.mtp_hidden[slot_to] = self.mtp_hidden[slot_from]
        self._mtp_hidden_set[slot_to] = self._mtp_hidden_set[slot_from]
        self._pending[slot_to] = self._pending[slot_from]
        self._captured[slot_to] = self._captured[slot_from]
        self._captured_features[slot_to] = self._captured_features[slot_from]
        self._clear_slot_tensors(slot_from)

    def save_sequence_state(self, slot: int, path: str | Path) -> None:
        """Write the slot's committed state (KV blocks, GDN state, tokens, seq_len, drafter state) to
        `path` (format in spill.py, contents in sequence_io.py). Pending rows are not saved; the
        slot is left unchanged."""
        write_spill(path, *export_sequence(self, slot))

    @torch.no_grad()
    def restore_sequence_state(self, slot: int, path: str | Path) -> None:
        """Restore a sequence saved by save_sequence_state into `slot` (free, or allocated and empty),
        on freshly allocated blocks. Raises SpillError (file missing, truncated, corrupted or from an
        incompatible model) or OutOfBlocksError, in both cases without changing the engine."""
        meta, tensors = read_spill(path)
        check_sequence(self.cfg, self.dflash, path, meta, tensors)
        if not 0 <= slot < self.cfg.max_slots:
            raise SlotError(f"slot {slot} out of range [0, {self.cfg.max_slots})")
        state = self._slots[slot]
        if state is not None and (state.seq_len or state.block_table):
            raise SlotError(f"slot {slot}: restore needs a free or empty slot (seq_len={state.seq_len})")
        blocks = self.pool.allocate(int(meta["num_blocks"]))
        if state is None:
            self.alloc(slot)
        import_sequence(self, slot, blocks, meta, tensors)

    # ---- reference generation -----------------------------------------------------------------
    def greedy_generate(self, prompt: Sequence[int], max_tokens: int, slot: int | None = None,
                        adapter_id: int = 0, free_slot: bool = True, lora_slot: int = -1) -> list[int]:
        """Plain greedy decoding (prefill, then one decode per token): up to max_tokens new tokens,
        stopping after eos_id or when the sequence reaches max_seq_len."""
        if max_tokens <= 0:
            return []
        if slot is None:
            free = self.free_slots()
            if not free:
                raise SlotError("no free slot for greedy_generate")
            slot = free[0]
        self.alloc(slot, adapter_id, lora_slot)
        try:
            token = int(self.prefill(slot, prompt).argmax())
            out = [token]
            while len(out) < max_tokens and token != self.cfg.eos_id and self.seq_len(slot) < self.cfg.max_seq_len:
                token = int(self.decode_batch([slot], [token])[0].argmax())
                out.append(token)
            return out
        finally:
            if free_slot:
                self.free(slot)
