"""A worker's model copy: a ``HybridEngine`` driven by the mirror's slot operations.

For a model without experts (the small hybrid model, a dense checkpoint) there is nothing to
shard, so a worker's "part of the model" is the whole model: it runs every forward the leader runs,
on the same slots, batch for batch (committed rows are forwarded and folded; verify rows stay
pending until a length or the slot's next forward settles them; draft rows extend the slot's draft
chain, as ``TorchDevice`` does). A sharded MoE model's workers hold experts instead
(runtime/ep/experts.py) and no replica.

Invariant (checked at every tick): the engine's committed tokens plus the kept pending rows of
each slot equal the mirror's tokens. Numerics: every forward that appends to a slot starts with
the token the replica's own logits predict there on a greedy run (the leader's sampled or
verified token); ``agreed`` / ``disagreed`` count those.
"""

from __future__ import annotations

from typing import Optional

import attrs
import structlog

from fxsched.runtime.ep.mirror import SlotOp, Snapshot
from fxsched.runtime.ep.protocol import Forward, Move, Release, Restore, Rows, SetLength

log = structlog.get_logger("fxsched.ep")


class ReplicaError(RuntimeError):
    """The operations do not fit the replica's slots (the stream and the model disagree)."""


@attrs.define
class _Chain:
    """Uncommitted rows of a slot (a verify or a draft chain) and how many of them count."""

    tokens: list
    keep: int
    draft: bool
    predictions: list  # argmax of each row


class EngineReplica:
    def __init__(self, engine) -> None:
        self.engine = engine
        self.forwards = 0
        self.agreed = 0
        self.disagreed = 0
        self._pending: dict[int, _Chain] = {}
        self._predicted: dict[int, int] = {}  # slot -> argmax after its committed tokens

    # --- operations ---------------------------------------------------------------------------

    def run(self, ops: list[SlotOp]) -> None:
        import torch

        with torch.no_grad():
            for op in ops:
                self._run(op)

    def _run(self, op: SlotOp) -> None:
        match op:
            case Forward(rows=rows, committed=True):
                self._forward_committed(rows)
            case Forward(rows=rows, draft=draft):
                self._forward_pending(rows, draft)
            case SetLength(slot=slot, length=n):
                self._set_length(slot, n)
            case Release(slot=slot):
                self._release(slot)
            case Move(src=src, dst=dst):
                if src != dst:
                    self.engine.compact(src, dst)
                    if src in self._pending:
                        self._pending[dst] = self._pending.pop(src)
                    if src in self._predicted:
                        self._predicted[dst] = self._predicted.pop(src)
            case Restore(slot=slot, tokens=tokens):
                self._release(slot)
                self.engine.alloc(slot)
                if tokens:
                    self._forward_committed((Rows(slot, 0, tokens),))

    def _committed(self, slot: int) -> int:
        return self.engine.seq_len(slot) if self.engine.is_allocated(slot) else 0

    def _prediction(self, slot: int) -> Optional[int]:
        chain = self._pending.get(slot)
        if chain is not None and chain.keep > 0:
            return chain.predictions[chain.keep - 1]
        return self._predicted.get(slot)

    def _compare(self, r: Rows) -> None:
        """The first row of an appending forward against the replica's own prediction."""
        length = self._committed(r.slot) + (self._pending[r.slot].keep if r.slot in self._pending else 0)
        predicted = self._prediction(r.slot)
        if predicted is None or r.start != length or not r.tokens:
            return
        if r.tokens[0] == predicted:
            self.agreed += 1
        else:
            self.disagreed += 1

    def _settle(self, slots) -> None:
        todo = [s for s in slots if s in self._pending]
        if not todo:
            return
        chains = [self._pending.pop(s) for s in todo]
        self.engine.gdn_fold_accepted(todo, [c.keep for c in chains])
        for slot, chain in zip(todo, chains, strict=True):
            if chain.keep > 0:
                self._predicted[slot] = chain.predictions[chain.keep - 1]

    def _ready(self, r: Rows) -> None:
        if not self.engine.is_allocated(r.slot):
            self.engine.alloc(r.slot)
        committed = self.engine.seq_len(r.slot)
        if r.start != committed:
            raise ReplicaError(f"slot {r.slot}: rows from position {r.start} but {committed} tokens are committed")

    def _forward_committed(self, rows) -> None:
        for r in rows:
            self._compare(r)
        slots = [r.slot for r in rows]
        self._settle(slots)
        for r in rows:
            self._ready(r)
        lists = [list(r.tokens) for r in rows]
        outs = self.engine.verify_batched(slots, lists)
        self.engine.gdn_fold_accepted(slots, [len(t) for t in lists])
        self.forwards += 1
        for slot, logits in zip(slots, outs, strict=True):
            self._predicted[slot] = int(logits[-1].argmax())

    def _forward_pending(self, rows, draft: bool) -> None:
        slots, lists = [], []
        for r in rows:
            self._compare(r)
            chain = self._pending.get(r.slot)
            if draft and chain is not None and chain.draft and r.start == self._committed(r.slot) + chain.keep:
                tokens = chain.tokens[:chain.keep] + list(r.tokens)
            else:
                self._settle([r.slot])
                self._ready(r)
                tokens = list(r.tokens)
            slots.append(r.slot)
            lists.append(tokens)
        outs = self.engine.verify_batched(slots, lists)
        self.forwards += 1
        for slot, tokens, logits in zip(slots, lists, outs, strict=True):
            self._pending[slot] = _Chain(tokens, len(tokens), draft, logits.argmax(-1).tolist())

    def _set_length(self, slot: int, n: int) -> None:
        committed = self._committed(slot)
        chain = self._pending.get(slot)
        if chain is not None and committed <= n <= committed + len(chain.tokens):
            chain.keep = n - committed
            return
        if chain is None and n == committed:
            return
        rows = len(chain.tokens) if chain else 0
        raise ReplicaError(f"slot {slot}: length {n} with {committed} committed and {rows} pending rows "
                           f"(a committed state cannot be rewound)")

    def _release(self, slot: int) -> None:
        self._pending.pop(slot, None)
        self._predicted.pop(slot, None)
        if self.engine.is_allocated(slot):
            self.engine.free(slot)

    # --- checks -------------------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        out = []
        for slot in range(self.engine.cfg.max_slots):
            if not self.engine.is_allocated(slot):
                continue
            chain = self._pending.get(slot)
            tokens = tuple(self.engine.tokens(slot)) + (tuple(chain.tokens[:chain.keep]) if chain else ())
            if tokens:
                out.append((slot, tokens))
        return tuple(out)

    def check(self, snapshot: Snapshot) -> None:
        mine = dict(self.snapshot())
        theirs = dict(snapshot)
        for slot in sorted(set(mine) | set(theirs)):
            if mine.get(slot) != theirs.get(slot):
                raise ReplicaError(f"slot {slot}: the model holds {list(mine.get(slot, ()))}, "
                                   f"the mirror {list(theirs.get(slot, ()))}")

    def stats(self) -> dict:
        return {"forwards": self.forwards, "agreed": self.agreed, "disagreed": self.disagreed}


@attrs.frozen
class EngineReplicaSpec:
    """Builds an ``EngineReplica`` in the worker process (picklable: a process argument). The model
    is the leader's: the same config and the same weights file, checkpoint directory (loaded with
    the leader's dtype and cache sizes), or seeded random init."""

    config: dict
    weights: Optional[str] = None
    device: str = "cpu"
    threads: int = 1
    model_dir: Optional[str] = None

    def __call__(self) -> EngineReplica:
        import torch

        from fxsched.runtime.torch_model import HybridEngine, ModelConfig

        if self.device == "cpu":
            torch.set_num_threads(self.threads)
        cfg = ModelConfig.from_dict(self.config)
        if self.model_dir is not None:
            return EngineReplica(HybridEngine.from_pretrained(
                self.model_dir, device=self.device, dtype=cfg.dtype, max_seq_len=cfg.max_seq_len,
                max_slots=cfg.max_slots, num_blocks=cfg.num_blocks, block_size=cfg.block_size))
        if self.weights is not None:
            return EngineReplica(HybridEngine.from_weights_file(self.weights, cfg, self.device))
        return EngineReplica(HybridEngine(cfg, device=self.device))
