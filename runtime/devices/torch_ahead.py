"""The torch device's decodes answered ahead (specs/async.md §16.6): a plain decode's tokens picked
and kept on the device, fed from there to the next decode, and read back later in one read.

``keep_ahead`` picks the last decode's rows on the device (the argmax, or the picks' draws: the
same tokens ``argmax_batch`` / ``sample_rows`` would read) and keeps, per sequence, the tensor and
row of its token. The next ``decode_batch`` whose inputs hold ``LATE_TOKEN`` puts each kept token
in place on the device (one scatter, no read) and records where the engine's token list holds a
placeholder for it; ``read_ahead`` reads the kept tokens of the sequences it is given in one read
(the tokens a decode fed come first: that decode kept new ones for the same sequences) and writes
the values into the engine's token lists, so the prefix cache and the processors see the real
tokens. A decode is kept only when nothing on the host needs its tokens before the next one: no
grammar, no row processor, no logprob record.
"""

from __future__ import annotations

from typing import Optional, Sequence as Seq

import torch

from fxsched.core.events import LATE_TOKEN
from fxsched.kernels.row_argmax import row_argmax
from fxsched.runtime.devices.device import DeviceError
from fxsched.runtime.devices.row_processors import RowProcessors
from fxsched.runtime.devices.torch_book import DeviceBook, DeviceSeq, DeviceStateError
from fxsched.runtime.devices.torch_sampling import picked_tokens
from fxsched.runtime.torch_model.transfers import send_ints

Kept = tuple[torch.Tensor, int]  # the tokens of the decode that kept it, and its row there


class Ahead(DeviceBook):
    """Decodes answered ahead: kept tokens, their feeding and their read."""

    decode_ahead: bool = False  # keep plain decodes' tokens when the plan allows (async scheduling)
    row_processors: Optional[RowProcessors] = None  # per-request logits processing (Forwards)

    def _processed(self, row: int, n: int) -> Optional[torch.Tensor]:
        """Rows ``row``.. after their requests' processors, None when none has any (Forwards)."""
        raise NotImplementedError

    def _ahead_init(self) -> None:
        self._kept: dict[int, Kept] = {}  # seq -> its token kept by the last decode, not yet fed
        self._kept_fed: dict[int, Kept] = {}  # seq -> a kept token a decode fed, its read still owed
        self._placeholders: dict[int, int] = {}  # seq -> where the engine's token list holds a fed one

    def keep_ahead(self, row: int, n: int, picks, eos_ids) -> bool:
        """Pick rows ``row``.. of the last decode on the device and keep them, answering it ahead;
        False (it answers with its tokens) when the device is not set to, or when something on the
        host needs the tokens now: a grammar, a row processor or a logprob record."""
        if not self.decode_ahead or any(p.top_logprobs > 0 for p in picks):
            return False
        self._check_rows(row, n)
        owners = self._owners[row:row + n]
        seqs = [self._seq(seq_id) for seq_id, _ in owners]
        if self.grammars and any(self.grammars.request_of(s.seq_id) is not None for s in seqs):
            return False
        if self.row_processors and self._processed(row, n) is not None:
            return False
        assert self._logits is not None
        logits = self._logits[row:row + n]
        tokens = picked_tokens(logits, picks, eos_ids) if picks else row_argmax(logits)
        for i, s in enumerate(seqs):
            if s.seq_id in self._kept:
                raise DeviceStateError(f"keep_ahead: sequence {s.seq_id} already holds a kept token")
            self._kept[s.seq_id] = (tokens, i)
        self.stats.calls["keep_ahead"] += 1
        return True

    def _late_inputs_of(self, seqs: list[DeviceSeq], tokens: Seq[int]) -> tuple[list[int], Optional[torch.Tensor]]:
        """(the host inputs, a placeholder 0 for each ``LATE_TOKEN``; the inputs on the device with the
        kept tokens in place, or None when none is late)."""
        late = [i for i, t in enumerate(tokens) if t == LATE_TOKEN]
        host = [0 if t == LATE_TOKEN else int(t) for t in tokens]
        for s, t in zip(seqs, tokens, strict=True):
            if (t == LATE_TOKEN) != (s.seq_id in self._kept):
                what = "is fed its kept token but holds none" if t == LATE_TOKEN else f"holds a kept token, fed {t}"
                raise DeviceStateError(f"decode_batch: sequence {s.seq_id} {what}")
        if not late:
            return host, None
        if len(late) == len(seqs):  # the steady case: every row's token kept by the last decode, in order
            first = self._kept[seqs[0].seq_id][0]
            kept = [self._kept[s.seq_id] for s in seqs]
            if first.shape[0] == len(seqs) and all(t is first and j == i for i, (t, j) in enumerate(kept)):
                return host, first
        sources: dict[int, torch.Tensor] = {}
        rows: list[int] = []
        picks: list[int] = []
        for i in late:
            tensor, index = self._kept[seqs[i].seq_id]
            sources.setdefault(id(tensor), tensor)
            rows.append(i)
            picks.append(index)
        device = self.engine.device
        inputs, at, index_t = send_ints([host, rows, picks], device)
        if len(sources) == 1:  # the usual case: every kept token comes from the last decode
            (tensor,) = sources.values()
            inputs[at] = tensor.index_select(0, index_t)
        else:
            values = torch.stack([self._kept[seqs[i].seq_id][0][self._kept[seqs[i].seq_id][1]] for i in late])
            inputs[at] = values
        return host, inputs

    def _fed_late(self, seqs: list[DeviceSeq], tokens: Seq[int], starts: Seq[int]) -> None:
        """After a decode ran: each kept token it fed now waits for its read, and the engine's token
        list holds a placeholder at the position it was fed at."""
        for s, t, start in zip(seqs, tokens, starts, strict=True):
            if t == LATE_TOKEN:
                self._kept_fed[s.seq_id] = self._kept.pop(s.seq_id)
                self._placeholders[s.seq_id] = start

    def read_ahead(self, seqs, fed=()) -> list[int]:
        """The kept tokens of ``seqs`` in one read (a fed one first: the decode that fed it kept a
        new one for the same sequence), written into the engine's token lists where they were fed."""
        held: list[Kept] = []
        for seq_id in seqs:
            got = self._kept_fed.pop(seq_id, None) or self._kept.pop(seq_id, None)
            if got is None:
                raise DeviceError(f"read_ahead: sequence {seq_id} holds no kept token")
            held.append(got)
        if not held:
            return []
        first = held[0][0]
        if all(t is first for t, _ in held):
            at = [i for _, i in held]
            if at == list(range(first.shape[0])):  # every token of the decode that kept them, in order
                values = first.tolist()
            else:
                values = first.index_select(0, send_ints([at], first.device)[0]).tolist()
        else:
            values = torch.stack([t[i] for t, i in held]).tolist()
        slots, positions, tokens = [], [], []
        for seq_id, value in zip(seqs, values, strict=True):
            position = self._placeholders.pop(seq_id, None)
            if position is not None:
                slots.append(self._seq(seq_id).slot)
                positions.append(position)
                tokens.append(value)
        if slots:
            self.engine.fill_tokens(slots, positions, tokens)
        self.stats.calls["read_ahead"] += 1
        return [int(v) for v in values]

    def _forget_ahead(self, seq_id: int) -> None:
        """A freed sequence's kept tokens go with it."""
        self._kept.pop(seq_id, None)
        self._kept_fed.pop(seq_id, None)
        self._placeholders.pop(seq_id, None)
