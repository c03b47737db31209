"""HybridEngine's forward: a forward's rows validated, their blocks allocated and its batch built in
one pass (`prepare`, `_row_batch`: host lists sent in one copy, specs/async.md §16.2), the model run
(through its static form where one takes it, specs/async.md §16.4, with a checkpoint DFlash
drafter's context features), and the rows kept as the slots' pending and captured rows (`_forward`)
for a commit (engine_commit.py).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch

from .attn_plan import plan_keys
from .engine_slots import SlotTable
from .errors import OutOfBlocksError, SlotError
from .gdn_chunked import KeepPlan
from .hf_drafters import PublishedDFlash
from .kernel_paths import attention_kernels_apply
from .model import ForwardOutput, RowBatch
from .ops import rms_norm
from .paged_kv import flat_indices
from .slots import Captured, PendingRows, SlotState
from .transfers import send_ints


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


class ForwardPath(SlotTable):
    """The forward of ``HybridEngine``: batches built and run, rows kept for a commit."""

    # ---- forward ------------------------------------------------------------------------------
    @property
    def capture_layers(self) -> tuple[int, ...]:
        """The decoder layers whose outputs a forward returns: a checkpoint DFlash drafter's target
        layers (its context features), else none."""
        return tuple(self.dflash.target_layer_ids) if isinstance(self.dflash, PublishedDFlash) else ()

    def prepare(self, slots: Sequence[int], token_lists: Sequence[Sequence[int]], *, commit_all: bool = False,
                in_place: bool = False, static: bool = False, device_tokens: torch.Tensor | None = None,
                packed: bool = False) -> RowBatch:
        """Validate a forward's rows, allocate their blocks (all or nothing) and build its batch
        (see _forward for commit_all and in_place, _packed_forward for packed). static leaves out
        the host-built attention plan, so the forward takes only shape-static paths: the form a CUDA graph or
        torch.compile(fullgraph=True) captures whole (tests/test_traceable_forward.py)."""
        return self._prepared(slots, token_lists, commit_all=commit_all, in_place=in_place, static=static,
                              device_tokens=device_tokens, packed=packed)[0]

    def _prepared(self, slots: Sequence[int], token_lists: Sequence[Sequence[int]], *, commit_all: bool = False,
                  in_place: bool = False, static: bool = False, device_tokens: torch.Tensor | None = None,
                  packed: bool = False) -> tuple[RowBatch, list[SlotState]]:
        """``prepare``'s batch and the slots' records: every slot checked and its new blocks counted in
        one pass (a slot, its rows' tokens and length checked in full only where a quick bound says
        one may be wrong), then the blocks allocated (all or nothing) and the batch built."""
        if len(slots) != len(token_lists):
            raise ValueError(f"{len(slots)} slots but {len(token_lists)} token lists")
        if not slots:
            raise ValueError("empty batch: no slots given")
        if len(set(slots)) != len(slots):
            raise SlotError(f"duplicate slots in one batch: {list(slots)}")
        cfg = self.cfg
        bs, vocab, limit, count, table_of = cfg.block_size, cfg.vocab_size, cfg.max_seq_len, cfg.max_slots, self._slots
        states: list[SlotState] = []
        wants: list[int] = []
        for slot, toks in zip(slots, token_lists, strict=True):
            state = table_of[slot] if 0 <= slot < count else None
            if state is None:
                state = self._slot(slot)  # raises the slot's error
            n, start = len(toks), state.seq_len
            if not n or start + n > limit or min(toks) < 0 or max(toks) >= vocab:
                self._check_rows(slot, start, toks)  # raises what is wrong
            states.append(state)
            wants.append(max(0, -(-(start + n) // bs) - len(state.block_table)))
        need = sum(wants)
        if need > self.pool.num_free():
            raise OutOfBlocksError(f"forward needs {need} new KV blocks, only {self.pool.num_free()} free; "
                                   f"reclaim cached blocks or free a slot")
        if need:
            for state, want in zip(states, wants, strict=True):
                if want:
                    table = state.block_table
                    table.extend(self.pool.allocate(want, after=table[-1] if table else None))
        keep = self._commit_rows(states, token_lists) if commit_all else None
        batch = self._row_batch(slots, states, token_lists, keep, last_logits=commit_all, device_tokens=device_tokens,
                                packed=packed)
        batch.gdn_in_place = in_place
        if static:
            batch.attn = None
        return batch, states

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
        batch, states = self._prepared(slots, token_lists, commit_all=commit_all, in_place=in_place,
                                       device_tokens=device_tokens)
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
        valid = (torch.ones(b, t, dtype=torch.bool, device=dev) if packed or uniform
                 else torch.arange(t, device=dev)[None, :] < lengths_t[:, None])
        # the Triton kernels read every row's keys through the block tables, ragged rows included
        # (specs/gpu-kernels.md §17.5): no host plan of where each sequence's keys lie
        plan = None if self._attention_kernels else plan_keys(
            [s.block_table for s in states], [s.seq_len for s in states], lengths, bs, dev,
            row_kernel=dev.type == "cpu" and bool(self.kv.k) and self.kv.k[0].dtype == torch.bfloat16, firsts=firsts)
        return RowBatch(tokens_t.view(b, t), positions_t.view(b, t), valid, write_t, tables_t.view(seqs, nb), slots_t,
                        uniform, keep_rows, valid_rows=valid_t, attn=plan, logit_rows=logit_rows, gdn_keep=keep_index,
                        lora=lora)
