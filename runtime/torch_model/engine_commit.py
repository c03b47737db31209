"""HybridEngine's commits: forwards whose every row is committed (a prefill chunk, a mixed or
batched prefill: `commit_forward`, grouped or packed), speculative verifies (`verify_batched`) and
the commit of their accepted prefix with write-on-accept of the GDN state (`gdn_fold_accepted`,
one `gdn_fold` per layer), and the tokens of rows that ran on device-fed tokens (specs/async.md
§16.3) recorded once read back.
"""

from __future__ import annotations

from typing import Sequence

import torch

from fxsched.kernels.cpu_fold import gdn_fold_layers
from fxsched.kernels.gdn_fold import gdn_fold, gdn_fold_rows

from .batch_groups import row_groups
from .engine_forward import ForwardPath
from .errors import SlotError
from .kernel_paths import gdn_fold_kernel_applies, kernels_opted_in
from .model import ForwardOutput
from .paged_kv import blocks_for
from .slots import Captured, PendingRows, in_cache
from .transfers import send_ints


_VIEW_COPY_LAYERS = 4
"""Up to this many GDN layers, one sequence's fold on the CPU copies its rows as views (two copies a
layer) rather than through the kernel. Measured on one AMX core: alone, the kernel call takes 14,
20, 30 and 48 us at 2, 4, 8 and 16 layers, the view copies 16, 32, 66 and 127 us; in the engine
(`fxsched bench host --modes mtp --batches 1`, the default model's 2 layers) the views' commit was
~9 us cheaper, three rounds of seven each way. So the kernel pays from about 4 layers on."""


class CommitPath(ForwardPath):
    """Committed forwards, verifies and commits of ``HybridEngine`` (which provides the rest)."""

    # ---- committed forwards ---------------------------------------------------------------------
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

    # ---- verify and commit ----------------------------------------------------------------------
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

        On the CPU one `fxsched.kernels.cpu_fold` call per forward the pending rows come from, every
        layer in it; elsewhere one `fxsched.kernels.gdn_fold` call per (GDN layer, forward), on the
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
            triton = kernels_opted_in(out.hidden)
            single = len(live) == 1 and len(out.gdn_rows) <= _VIEW_COPY_LAYERS
            if not triton and not single and gdn_fold_layers(
                    [g.states for g in out.gdn_rows], [g.windows for g in out.gdn_rows], self.gdn.recurrent,
                    self.gdn.conv, live, [rows[b] for b in live], [slot_ids[b] for b in live]):
                continue  # the CPU kernel: every layer in one call
            if len(live) == 1 and not triton:  # one entry on the torch path: its rows copied as views
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
