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

The operations come from mixins, one module per concern: engine_slots.py (slots, blocks, LoRA
adapters; it declares the state __init__ sets), engine_forward.py (a forward's batch built and
run), engine_commit.py (committed forwards, verifies and the commit of their accepted rows),
engine_prefix.py (the prefix cache), engine_drafters.py (MTP and DFlash proposals) and
decode_path.py (the decode). Here: construction, the moves of a sequence's whole state (compact,
spill, restore) and reference generation.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

import structlog
import torch

from .config import ModelConfig, default_config
from .decode_path import DecodePath
from .drafters import DFlashDrafter, MtpHead
from .engine_commit import CommitPath
from .engine_drafters import Drafting
from .engine_forward import ForwardPath
from .engine_prefix import PrefixCaching
from .engine_slots import SlotTable
from .errors import SlotError
from .gdn import GdnStateCache
from .hf_dflash_dir import load_dflash_drafter
from .hf_drafters import PublishedDFlash, PublishedMtp
from .lora import DEFAULT_MAX_LORA_RANK, LoraPool
from .batch_groups import forward_rows
from .graphs import CudaGraphRecorder, ForwardGraphs, Recorder, buckets, cuda_graphs_wanted
from .model import HybridModel
from .moe import fuse_shared_experts
from .packing import pack_for_cpu
from .paged_kv import BlockPool, PagedKVCache
from .prefix_cache import PrefixCache
from .sequence_io import check_sequence, export_sequence, import_sequence
from .spill import read_spill, write_spill
from .slots import Captured, PendingRows, SlotState
from .weights import Weights, init_weights, load_weights, torch_dtype

log = structlog.get_logger("fxsched.torch_model")


# DecodePath last: the methods it declares (_slot, _run, _attention_kernels) are the other mixins'
class HybridEngine(PrefixCaching, CommitPath, ForwardPath, Drafting, SlotTable, DecodePath):
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
        directory (public format, see hf_dflash_dir.load_dflash_drafter) to draft with. expert_shard:
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
