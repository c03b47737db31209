"""HybridEngine's decode: one row per sequence, validated, placed, run and committed in one pass
over the batch each (specs/async.md §16.7).

A decode is the forward every tick of a plain decode runs, at every batch size, so its host work is
what the host adds to each GPU forward. The general path (``HybridEngine._forward`` and
``gdn_fold_accepted``) serves rows of any count: it looks each slot up several times, builds a
pending record per slot and commits it row by row. Here a decode's rows are checked and their
blocks counted in one loop, placed (new blocks, positions, write indices, padded tables) in a
second, sent in one copy, and committed with one write of the hidden rows, one GDN fold and a loop
that only appends each token. The result is the general path's, state for state (the tests run
both on the same engine).
"""

from __future__ import annotations

from typing import Sequence

import torch

from fxsched.kernels.gdn_fold import gdn_fold, gdn_fold_rows

from .attn_plan import decode_plan, plan_keys
from .config import ModelConfig
from .errors import OutOfBlocksError, SlotError
from .gdn import GdnStateCache
from .lora import LoraPool
from .kernel_paths import gdn_decode_in_place, gdn_fold_kernel_applies
from .model import ForwardOutput, RowBatch
from .paged_kv import BlockPool, PagedKVCache
from .slots import Captured, PendingRows, SlotState, in_cache
from .transfers import send_ints


class DecodePath:
    """``decode_batch`` and ``decode_blocks_needed`` of ``HybridEngine`` (which provides the rest)."""

    cfg: ModelConfig
    device: torch.device
    pool: BlockPool
    kv: PagedKVCache
    gdn: GdnStateCache
    keeps_hidden: bool
    hidden_history: torch.Tensor
    dflash_features: torch.Tensor | None
    lora: LoraPool | None
    _slots: list[SlotState | None]
    _pending: list[PendingRows | None]
    _captured: list[Captured | None]
    _captured_features: list[Captured | None]

    def _slot(self, slot: int) -> SlotState:
        raise NotImplementedError

    def _run(self, batch: RowBatch) -> tuple[ForwardOutput, torch.Tensor | None]:
        raise NotImplementedError

    @property
    def _attention_kernels(self) -> bool:
        raise NotImplementedError

    def decode_blocks_needed(self, slots: Sequence[int]) -> int:
        """New blocks a decode of ``slots`` (one row each) would allocate."""
        bs, table_of, count = self.cfg.block_size, self._slots, self.cfg.max_slots
        need = 0
        for slot in slots:
            state = table_of[slot] if 0 <= slot < count else None
            if state is None:
                state = self._slot(slot)
            have = len(state.block_table)
            if state.seq_len >= have * bs:
                need += state.seq_len // bs + 1 - have
        return need

    @torch.no_grad()
    def decode_batch(self, slots: Sequence[int], tokens: Sequence[int],
                     device_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Append and commit one token per slot; returns logits [B, V] for the next position.
        device_tokens [B] (int64, on the device): the tokens fed instead of ``tokens``, whose values
        the host has not read (``tokens`` then holds placeholders, set later with ``fill_token``)."""
        states, host = self._decode_checked(slots, tokens)
        batch = self._decode_rows(slots, states, host, device_tokens)
        out, features = self._run(batch)
        self._decode_commit(slots, states, host, batch, out, features)
        return out.logits[:, 0]

    def _decode_checked(self, slots: Sequence[int], tokens: Sequence[int]) -> tuple[list[SlotState], list[int]]:
        """The slots' records and the tokens as ints, every check of the general path made (before
        anything changes: all or nothing), and the blocks the rows need allocated."""
        cfg = self.cfg
        b, bs, vocab, limit, count = len(slots), cfg.block_size, cfg.vocab_size, cfg.max_seq_len, cfg.max_slots
        if b != len(tokens):
            raise ValueError(f"{b} slots but {len(tokens)} token lists")
        if not b:
            raise ValueError("empty batch: no slots given")
        table_of = self._slots
        states: list[SlotState] = []
        host: list[int] = []
        need = 0
        for slot, token in zip(slots, tokens, strict=True):
            state = table_of[slot] if 0 <= slot < count else None
            if state is None:
                state = self._slot(slot)  # raises the slot's error
            t = int(token)
            if not 0 <= t < vocab:
                raise ValueError(f"slot {slot}: token ids {[t]} outside [0, {vocab})")
            n = state.seq_len
            if n >= limit:
                raise SlotError(f"slot {slot}: {n} + 1 rows exceed max_seq_len={limit}")
            have = len(state.block_table)
            if n >= have * bs:
                need += n // bs + 1 - have
            states.append(state)
            host.append(t)
        if len(set(slots)) != b:
            raise SlotError(f"duplicate slots in one batch: {list(slots)}")
        if need > self.pool.num_free():
            raise OutOfBlocksError(f"forward needs {need} new KV blocks, only {self.pool.num_free()} free; "
                                   f"reclaim cached blocks or free a slot")
        if need:
            for state in states:
                table = state.block_table
                if state.seq_len >= len(table) * bs:
                    table.extend(self.pool.allocate(state.seq_len // bs + 1 - len(table),
                                                    after=table[-1] if table else None))
        return states, host

    def _decode_rows(self, slots: Sequence[int], states: list[SlotState], host: list[int],
                     device_tokens: torch.Tensor | None) -> RowBatch:
        """The decode's batch (the general ``_row_batch`` of one row per slot), in one copy."""
        b, bs = len(slots), self.cfg.block_size
        positions = [s.seq_len for s in states]
        nb = max(len(s.block_table) for s in states)
        tables: list[int] = []
        write: list[int] = []
        for state, n in zip(states, positions, strict=True):
            table = state.block_table
            write.append(table[n // bs] * bs + n % bs)
            tables += table
            if len(table) < nb:
                tables += [0] * (nb - len(table))
        dev = self.device
        fields = [positions, tables, write, list(slots)]
        if device_tokens is None:
            fields.append(host)
        lora_slots = [s.lora_slot for s in states] if self.lora is not None else []
        lora_fields = self.lora.row_fields(lora_slots, [1] * b, 1) if self.lora is not None else None
        if lora_fields is not None:
            fields += lora_fields
        sent = send_ints(fields, dev)
        positions_t, tables_t, write_t, slots_t = sent[:4]
        tokens_t = sent[4] if device_tokens is None else device_tokens.to(torch.int64)
        lora = None
        if lora_fields is not None:
            assert self.lora is not None
            lora = self.lora.batch_rows(lora_slots, lora_fields[1], *sent[-2:])
        tables_t = tables_t.view(b, nb)
        plan = None
        if not self._attention_kernels:
            tables_host = [s.block_table for s in states]
            row_kernel = dev.type == "cpu" and bool(self.kv.k) and self.kv.k[0].dtype == torch.bfloat16
            if row_kernel and min(positions) > 0:
                plan = decode_plan(tables_host, positions, tables_t, bs, dev)
            else:
                plan = plan_keys(tables_host, positions, [1] * b, bs, dev, row_kernel=row_kernel)
        valid = torch.ones(b, 1, dtype=torch.bool, device=dev)
        return RowBatch(tokens_t.view(b, 1), positions_t.view(b, 1), valid, write_t, tables_t, slots_t, True, None,
                        attn=plan, gdn_in_place=gdn_decode_in_place(dev), lora=lora)

    def _decode_commit(self, slots: Sequence[int], states: list[SlotState], host: list[int], batch: RowBatch,
                       out: ForwardOutput, features: torch.Tensor | None) -> None:
        """``gdn_fold_accepted(slots, [1] * B)`` of the decode: its GDN states folded (unless the
        forward updated them in place), its hidden rows and context features written in one index
        each, then per slot only the token, the length and a snapshot at a snapshot boundary."""
        folded = in_cache(out)
        if not folded:
            self._fold_decode(batch.slots, out)
        at = (batch.slots, batch.positions[:, 0])
        if self.keeps_hidden:
            self.hidden_history[at] = out.hidden[:, 0].to(self.hidden_history.dtype)
        if self.dflash_features is not None and features is not None:
            self.dflash_features[at] = features[:, 0].to(self.dflash_features.dtype)
        bs, every = self.cfg.block_size, self.cfg.gdn_snapshot_blocks
        pending, captured, captured_features = self._pending, self._captured, self._captured_features
        for b, (slot, state, token) in enumerate(zip(slots, states, host, strict=True)):
            state.tokens.append(token)
            n = state.seq_len = state.seq_len + 1
            if n % bs == 0 and (n // bs) % every == 0:
                state.boundary_states[n // bs] = self.gdn.snapshot(slot) if folded else [
                    (r.clone(), c.clone()) for r, c in (rows.row(b, 0) for rows in out.gdn_rows)]
            if len(state.block_table) > -(-n // bs):  # blocks a verify left beyond the sequence
                for block in state.block_table[-(-n // bs):]:
                    self.pool.decref(block)
                del state.block_table[-(-n // bs):]
            pending[slot] = None
            captured[slot] = Captured(out.hidden, b, 1)
            captured_features[slot] = Captured(features, b, 1) if features is not None else None

    def _fold_decode(self, slots_t: torch.Tensor, out: ForwardOutput) -> None:
        """Each slot's GDN state set to the state after its one row (``_fold_gdn_states`` of a
        decode, its indices the batch's own: no copy)."""
        if not out.gdn_rows:
            return
        b = slots_t.shape[0]
        rows_t = torch.full((b,), out.gdn_rows[0].index(0), dtype=torch.int64, device=slots_t.device)
        live_t = torch.arange(b, device=slots_t.device)
        for layer, gdn_rows in enumerate(out.gdn_rows):
            args = (gdn_rows.states, gdn_rows.conv_rows(), rows_t, slots_t, self.gdn.recurrent[layer],
                    self.gdn.conv[layer])
            if gdn_fold_kernel_applies(*args):
                gdn_fold(*args)
            else:
                gdn_fold_rows(gdn_rows.states, gdn_rows.conv_rows(), live_t, rows_t, slots_t,
                              self.gdn.recurrent[layer], self.gdn.conv[layer])
