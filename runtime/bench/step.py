"""``fxsched bench step``: the CPU cost of ``step`` itself, per tick and per running sequence.

Like for like with vLLM's scheduler benchmark (one ``schedule()`` + ``update_from_output()`` per
step, the model output faked and not timed): N sequences in steady decode that never finish, a
device stub that answers every query at once, and only the ``step`` calls timed. Each answer is
built between two timed windows, so neither the stub nor the random draws count.

Modes:

* ``plain``: no speculation; each tick is one batched decode of every sequence (one token each).
  Compare with vLLM's ``A0``.
* ``spec5``: DFlash batched speculation with 5 drafts; each tick is a capacity query, the batching
  gate, one batched verify whose accepted count per sequence is drawn from U{0..5} by a seeded
  generator (outside the timed window), and one batched propose. Compare with vLLM's ``A5``
  (ngram, k = 5, 1 + U{0..5} tokens per step).

``--memory`` instead reports how many bytes the state grows by per generated token over
``--ticks`` ticks (tracemalloc, only the newest state alive): the token logs hold 4 bytes a token.

Method: the state is built and warmed up (``--warmup`` untimed ticks, 20 by default: admission,
prefill and the first verifies), the garbage collector's heap is frozen (``gc.freeze``),
then ``repeats`` windows of ``ticks`` ticks each are timed with this thread's CPU time
(``time.thread_time_ns``) and wall time around every ``step`` call; the figures are medians over
the windows. These machines are shared and noisy: compare CPU times, side by side in one run.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from typing import Any

from tqdm import tqdm

from fxsched.core import events as ev
from fxsched.core.config import ModelInfo, SchedulerConfig
from fxsched.core.machine import step
from fxsched.core.request import Request
from fxsched.core.state import initial_state
from fxsched.effects import device_calls as dc
from fxsched.effects import plans

MODES = ("plain", "spec5")
DRAFTS = (11, 12, 13, 14, 15)  # what the stub drafter proposes (never an EOS)
MISS = 9  # the target token where a draft is rejected


class InstantAnswers:
    """Answers every query at once with plausible values; nothing ever finishes.

    A verify accepts U{0..5} drafts per sequence, drawn from ``random.Random(seed)``.
    """

    def __init__(self, seed: int = 0):
        self.next_slot = 0
        self.rng = random.Random(seed)

    def _verify_rows(self, ks) -> tuple[int, ...]:
        rows: list[int] = []
        for k in ks:
            accepted = self.rng.randint(0, k - 1) if k > 1 else 0  # k = drafts + 1 rows
            rows.extend(DRAFTS[:accepted])
            rows.append(MISS)
            rows.extend((MISS,) * (k - 1 - accepted))
        return tuple(rows)

    def answer(self, effect) -> ev.Event:
        match effect:
            case dc.CreateStream():
                return ev.StreamCreated(1)
            case dc.CreateEvent():
                return ev.EventCreated(2)
            case dc.NumFreeBlocks():
                return ev.FreeBlocks(1 << 30)
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
                return ev.VerifyRows(self._verify_rows((len(tokens),)))
            case dc.DecodeVerifyBatched(ks=ks):
                return ev.VerifyRows(self._verify_rows(ks))
            case plans.Decode(seqs=seqs):
                return ev.TokensSampled((7,) * len(seqs))
            case dc.ArgmaxBatch(n=n):
                return ev.TokensSampled((7,) * n)
        raise RuntimeError(f"the bench stub has no answer for {type(effect).__name__}")


def _config(mode: str, n: int) -> tuple[SchedulerConfig, ModelInfo]:
    common: dict[str, Any] = dict(max_batch_size=max(n, 8), max_seq_len=1 << 30, admission_watermark=4096)
    if mode == "plain":
        return SchedulerConfig(**common), ModelInfo(total_blocks=1 << 30)
    return (SchedulerConfig(use_speculative=True, dflash=True, num_drafts=5, mtp_width_limit=max(n, 32), **common),
            ModelInfo(has_proposer=True, dflash_gamma=6, total_blocks=1 << 30))


def _boot(mode: str, n: int):
    config, model = _config(mode, n)
    state = initial_state(config, model)
    for i in range(n):
        state, _ = step(state, ev.Arrival(Request(id=i + 1, prompt=(i + 1, 3, 4, 5, 6), max_tokens=1 << 30)))
    return state


def _run_ticks(state, stub: InstantAnswers, ticks: int, event, clock=None):
    """Run ``ticks`` ticks; with ``clock`` = [cpu_ns, wall_ns], add the time of each ``step`` call."""
    end = state.tick + ticks
    if clock is None:
        while state.tick < end:
            state, effects = step(state, event)
            event = stub.answer(effects[-1])
        return state, event
    thread_ns, perf_ns = time.thread_time_ns, time.perf_counter_ns
    cpu = wall = 0
    while state.tick < end:
        c0 = thread_ns()
        w0 = perf_ns()
        state, effects = step(state, event)
        w1 = perf_ns()
        c1 = thread_ns()
        cpu += c1 - c0
        wall += w1 - w0
        event = stub.answer(effects[-1])
    clock[0] += cpu
    clock[1] += wall
    return state, event


WARMUP = 20
"""Ticks run untimed before the first window: admission, prefill and the first verifies."""


def measure(n: int, mode: str = "plain", ticks: int = 200, repeats: int = 5, seed: int = 0,
            warmup: int = WARMUP) -> dict:
    """Medians over ``repeats`` windows of ``ticks`` ticks at ``n`` running sequences, after
    ``warmup`` untimed ticks (at least ``WARMUP``; more measures older sequences)."""
    if mode not in MODES:
        raise ValueError(f"--mode {mode}: unknown (choose from {', '.join(MODES)})")
    stub = InstantAnswers(seed)
    state, effects = step(_boot(mode, n), ev.Boot())
    event = stub.answer(effects[-1])
    state, event = _run_ticks(state, stub, max(warmup, WARMUP), event)
    if len(state.active) != n:
        raise RuntimeError(f"bench step: {len(state.active)} of {n} sequences running after warm-up")
    produced_before = sum(len(s.output) for s in state.active)
    gc.collect()
    gc.freeze()
    cpu_us, wall_us = [], []
    try:
        for _ in range(repeats):
            clock = [0, 0]
            state, event = _run_ticks(state, stub, ticks, event, clock)
            cpu_us.append(clock[0] / ticks / 1e3)
            wall_us.append(clock[1] / ticks / 1e3)
    finally:
        gc.unfreeze()
    if len(state.active) != n:
        raise RuntimeError(f"bench step: a sequence finished during the run ({len(state.active)} of {n} left)")
    cpu, wall = statistics.median(cpu_us), statistics.median(wall_us)
    return {"mode": mode, "n": n, "us_per_tick": cpu, "us_per_seq": cpu / n,
            "wall_us_per_tick": wall, "wall_us_per_seq": wall / n,
            "tokens_per_seq_tick": (sum(len(s.output) for s in state.active) - produced_before) / (n * ticks * repeats)}


def measure_memory(n: int, mode: str = "plain", ticks: int = 1000, seed: int = 0) -> dict:
    """Bytes the scheduler state grows by per generated token over ``ticks`` ticks (tracemalloc:
    the memory still allocated after the run, less that before it, with only the newest state
    kept alive), at ``n`` running sequences."""
    import tracemalloc

    stub = InstantAnswers(seed)
    state, effects = step(_boot(mode, n), ev.Boot())
    event = stub.answer(effects[-1])
    state, event = _run_ticks(state, stub, 20, event)
    produced_before = sum(len(s.output) for s in state.active)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        state, event = _run_ticks(state, stub, ticks, event)
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    generated = sum(len(s.output) for s in state.active) - produced_before
    return {"mode": mode, "n": n, "ticks": ticks, "generated_tokens": generated, "state_growth_bytes": after - before,
            "bytes_per_token": (after - before) / generated if generated else 0.0}


def print_table(rows: list[dict]) -> None:
    if not rows:
        return
    keys = list(rows[0])
    print("  ".join(f"{k:>16}" for k in keys))
    for row in rows:
        cells = [f"{v:16.2f}" if isinstance(v, float) else f"{v!s:>16}" for v in row.values()]
        print("  ".join(cells))


def run_step_bench(sizes, mode: str = "plain", ticks: int = 200, repeats: int = 5,
                   warmup: int = WARMUP) -> list[dict]:
    return [measure(n, mode, ticks, repeats, warmup=warmup)
            for n in tqdm(sizes, desc=f"bench step {mode}", unit="size", leave=False)]


def print_step_bench(sizes, mode: str = "plain", ticks: int = 200, repeats: int = 5, as_json: bool = False,
                     memory: bool = False, warmup: int = WARMUP) -> list[dict]:
    import json

    if memory:
        rows = [measure_memory(n, mode, ticks) for n in tqdm(sizes, desc=f"bench step memory {mode}", unit="size",
                                                             leave=False)]
    else:
        rows = run_step_bench(sizes, mode, ticks, repeats, warmup)
    if as_json:
        for row in rows:
            print(json.dumps(row))
    else:
        print_table(rows)
    return rows
