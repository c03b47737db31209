"""``fxsched bench step``: microseconds per tick and per running sequence of ``step`` itself.

A steady-state DFlash batched workload: N sequences that never finish, each tick a capacity
query, the batching gate, one batched verify (3 of 5 drafts accepted) and one batched propose.
The device is a stub that answers every query at once and records nothing, so the figures are
the scheduler's own cost. Medians over repeats; the machine is shared and noisy.
"""

from __future__ import annotations

import statistics
import time

from tqdm import tqdm

from fxsched.core import events as ev
from fxsched.core.config import ModelInfo, SchedulerConfig
from fxsched.core.machine import step
from fxsched.core.request import Request
from fxsched.core.state import initial_state
from fxsched.effects import device_calls as dc
from fxsched.effects import plans

DRAFTS = (1, 2, 3, 4, 5)


class InstantAnswers:
    """Answers queries with plausible values at once (3 of 5 drafts accepted, nothing finishes)."""

    def __init__(self):
        self.next_slot = 0

    def answer(self, effect):
        match effect:
            case dc.CreateStream():
                return ev.StreamCreated(1)
            case dc.CreateEvent():
                return ev.EventCreated(2)
            case dc.NumFreeBlocks():
                return ev.FreeBlocks(1000)
            case dc.AdapterIdFor(slots=slots):
                return ev.AdapterIds((0,) * len(slots))
            case dc.AllocSequence():
                self.next_slot += 1
                return ev.SlotAllocated(self.next_slot - 1)
            case dc.Prefill() | dc.DecodeCall():
                return ev.ForwardDone()
            case dc.ArgmaxOnDevice():
                return ev.TokenSampled(7)
            case dc.SlotDraftCapacity(slots=slots):
                return ev.DraftCapacity((8,) * len(slots))
            case dc.CanBatchVerify():
                return ev.BatchVerifyAllowed(True)
            case dc.ProposeMulti(n=n):
                return ev.Drafts(DRAFTS[:n])
            case dc.ProposeBatched(seqs=seqs, n=n):
                return ev.BatchedDrafts((DRAFTS[:n],) * len(seqs))
            case dc.SerialVerify(tokens=tokens):
                return ev.VerifyRows(tokens[1:] + (9,))
            case dc.DecodeVerifyBatched(ks=ks):
                row = DRAFTS[:3] + (9,) * (ks[0] - 3)
                return ev.VerifyRows(row * len(ks))
            case plans.Decode(seqs=seqs):
                return ev.TokensSampled((7,) * len(seqs))
        raise RuntimeError(f"the bench stub has no answer for {type(effect).__name__}")


def _boot(n: int):
    config = SchedulerConfig(max_batch_size=max(n, 8), use_speculative=True, dflash=True, num_drafts=5,
                             mtp_width_limit=max(n, 32), max_seq_len=1 << 30, admission_watermark=4096)
    model = ModelInfo(has_proposer=True, dflash_gamma=6, total_blocks=1 << 30)
    state = initial_state(config, model)
    for i in range(n):
        state, _ = step(state, ev.Arrival(Request(id=i + 1, prompt=(i + 1, 3, 4, 5, 6), max_tokens=1 << 30)))
    return state


def _run_ticks(state, stub: InstantAnswers, ticks: int, pending):
    start_tick = state.tick
    event = pending
    steps = 0
    while state.tick < start_tick + ticks:
        state, effects = step(state, event)
        steps += 1
        event = stub.answer(effects[-1])
    return state, event, steps


def measure(n: int, ticks: int, repeats: int) -> dict:
    """Median microseconds per tick and per sequence-tick at ``n`` running sequences."""
    stub = InstantAnswers()
    state, effects = step(_boot(n), ev.Boot())
    event = stub.answer(effects[-1])
    state, event, _ = _run_ticks(state, stub, 3, event)  # admission and bootstraps
    per_tick = []
    steps = 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        state, event, steps = _run_ticks(state, stub, ticks, event)
        per_tick.append((time.perf_counter() - t0) / ticks * 1e6)
    us = statistics.median(per_tick)
    return {"sequences": n, "us_per_tick": us, "us_per_seq_tick": us / n, "steps_per_tick": steps / ticks,
            "active": len(state.active)}


def print_table(rows: list[dict]) -> None:
    if not rows:
        return
    keys = list(rows[0])
    print("  ".join(f"{k:>16}" for k in keys))
    for row in rows:
        cells = [f"{v:16.2f}" if isinstance(v, float) else f"{v!s:>16}" for v in row.values()]
        print("  ".join(cells))


def print_step_bench(sizes, ticks: int = 200, repeats: int = 5) -> list[dict]:
    rows = [measure(n, ticks, repeats) for n in tqdm(sizes, desc="bench step", unit="size", leave=False)]
    print_table(rows)
    return rows
