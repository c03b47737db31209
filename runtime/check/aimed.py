"""Episodes aimed at rare states (specs/checker.md §11.3): set-ups the random draw of
``draws.random_episode`` reaches seldom or never, built to reach them by construction.

Each aim is a function of the seeded generator that returns an ``Episode`` whose ``aim`` names
it; ``draws.random_episode`` draws one in ``AIMED_SHARE`` of its episodes, the aim chosen
uniformly. The states they are for, and why each matters:

- ``deadlines``: several requests with deadlines in one steady batch, some on a clock reading
  exactly, the others spread; the earliest must decide each tick and an equal deadline expires in
  its tick (specs/scheduler.md §5.19 step 1).
- ``full_batch``: more requests than seats on a large pool with KV exhaustion injected early, so a
  preempted or spilled sequence waits while new requests fill its seat; it may come back only into
  a free seat (§5.19 steps 4-5). Some clients cancel late, after a swap-in or while blocking; now
  and then a spill file is damaged, so a swap-in into another slot than the one left fails.
- ``whole_pool``: prompts admitted on their own blocks (a small admission horizon) into a pool of
  a few blocks, so the KV runs out for real and the sequence preempted needs exactly the whole
  pool, or one block more, to come back, perhaps after reclaiming blocks a prefix cache holds
  and perhaps with a fault in one of the resume's queries (§5.18, §5.19 step 5, faults.md §8.4).
- ``rejected_cross``: speculation with many wrong drafts and draft capacities that fall to 0 every
  other step, prompts just short of a block boundary: a verify that crossed the boundary and was
  rejected is followed by a plain decode, whose block count must not fall (§5.2, §5.16).
- ``gate_fault``: a batching gate (DFlash or MTP) over sequences holding uneven drafts, so some
  are batchable and the rest go serial, with a fault answering the gate: every verify sequence of
  the gate fails, the rest included (specs/faults.md §8.3).
- ``spilled_alone``: a long request spilled to make room for a newcomer that is done at its first
  token, so nothing runs while the spilled one waits: it must come back at once (§5.9, §5.14),
  neither wait for input nor be shut down, whether or not more input comes; now and then its
  restore fails (a fault answering ``AwaitRestore``), and only it ends, with the error.
- ``ahead``: async scheduling (specs/async.md §16.6) with deadlines, faults at a decode's launch,
  budgets and a context ceiling that end on a token kept on the device, cancels, logprob rows and
  late arrivals; or prompts a few tokens short of a block boundary with cancel flags raised in the
  first ticks (rows cross a boundary in ticks that leave the steady columns); or budgets one apart
  with a fault at a decode's launch around their ends; or deadlines alone in a batch its
  synchronous twin must match.
- ``kept_lost``: async scheduling with KV exhaustion injected early and a fifth to a half of the
  decodes answered ahead failing afterwards, so a preempted sequence resumes beside sequences
  holding kept tokens and a decode that feeds both reads a lost one: the fault fails the sequences
  of both decodes (specs/async.md §16.6 rule 6).
- ``rollbacks``: armed watchdogs over blocking requests whose scripts loop after a lead-in longer
  than the rollback span, boundary tokens early in it, on a plain or hybrid model (a snapshot ring), mostly without
  speculation, with ``max_rollbacks`` from 0 to 3 (re-steering now and then off): a sequence rolls
  back until the cap, then its guard finishes it (specs/watchdog.md §7.5). The random draw arms the
  watchdogs in few episodes and most of those stream or speculate, so it rolls back seldom.
- ``wide_mtp``: MTP with two or three drafts over nine to twelve sequences, the batch around the
  ladder's width (8): the draft count falls to 1 past it and comes back below it (specs/speculation.md
  §6.2 step 1); the random draw seldom runs so many MTP sequences at once.
- ``waiting_work``: one long request and a late arrival far behind it, KV exhaustion injected
  twice in a row (a preemption, then the survivor alone fails), with the inbox open or closed: the
  loop must resume the preempted sequence, neither wait for input nor shut down (§5.4, §5.8).
"""

from __future__ import annotations

import random
from typing import Any, Callable

import attrs

from fxsched.runtime.check.episode import BOUNDARY, TICK_MS, Episode, SimRequest, _randints

AIMED_SHARE = 0.3


def _requests(rng: random.Random, n: int, *, prompt: tuple[int, int], budget: tuple[int, int],
              streaming: float = 0.8, wrong: tuple[int, ...] = (0, 0, 2, 3, 4, 5)) -> list[SimRequest]:
    """``n`` requests arriving at once with scripts that never say EOS (they run to their budget)."""
    out = []
    for i in range(n):
        budget_n = rng.randint(*budget)
        out.append(SimRequest(id=i + 1, prompt_len=rng.randint(*prompt), tokens=tuple(_randints(rng, 2, 40, budget_n)),
                              max_tokens=budget_n, streaming=rng.random() < streaming, wrong_every=rng.choice(wrong)))
    return out


def deadlines(rng: random.Random) -> Episode:
    n = rng.randint(2, 5)
    mode = rng.choice(("plain", "plain", "dflash", "mtp2", "ngram"))
    requests = []
    for r in _requests(rng, n, prompt=(2, 30), budget=(12, 30)):
        due = TICK_MS * rng.randint(2, 9) + (0.0 if rng.random() < 0.6 else rng.randint(1, 9))
        requests.append(attrs.evolve(r, deadline_ms=due if rng.random() < 0.85 else None))
    return Episode(mode=mode, max_batch_size=rng.choice((n, 4, 8)), max_prefill_tokens=rng.choice((0, 0, 8)),
                   spill=False, total_blocks=1000, held_blocks=0, requests=tuple(requests), close_tick=0,
                   aim="deadlines")


def full_batch(rng: random.Random) -> Episode:
    n = rng.randint(4, 7)
    requests = _requests(rng, n, prompt=(6, 24), budget=(10, 24), streaming=0.7)
    for i, r in enumerate(requests):  # late client cancels: after a swap-in, or of a blocking request
        if rng.random() < 0.3:
            requests[i] = attrs.evolve(r, host_cancel_tick=rng.randint(3, 14))
    exhaust: tuple[int, ...] = ()
    if rng.random() < 0.5:  # KV exhaustion injected on a large pool: the seat frees, the blocks are there
        first = rng.randint(0, 3)
        total, exhaust, watermark = 1000, (first, first + 1, first + rng.randint(3, 6)), 4096
    else:  # a small pool the prompts are admitted into on their own blocks: new requests spill old ones
        total, exhaust, watermark = rng.choice((6, 8, 10)), (), rng.choice((0, 4))
    # now and then a spill file is damaged or lost: the swap-in fails and releases the slot it was just
    # given, which need not be the one the sequence left (specs/faults.md §8.4)
    damaged = rng.choice(("", "", "corrupt", "missing"))
    victims = tuple(sorted(rng.sample(range(1, n + 1), 2))) if damaged else ()
    return Episode(mode=rng.choice(("plain", "plain", "mtp1", "ngram")), max_batch_size=rng.choice((2, 3)),
                   max_prefill_tokens=0, spill=rng.random() < 0.7, total_blocks=total, held_blocks=0,
                   requests=tuple(requests), kv_exhaust_at=exhaust, close_tick=rng.randint(0, 4),
                   admission_watermark=watermark, aim="full_batch",
                   spill_corrupt_for=victims if damaged == "corrupt" else (),
                   spill_missing_for=victims if damaged == "missing" else ())


def whole_pool(rng: random.Random) -> Episode:
    total = rng.randint(3, 6)
    room = 16 * (total - 2)  # a KV of room .. room + 15 tokens needs total - 1 blocks, and one more to resume
    n = rng.randint(2, 3)
    requests = _requests(rng, n, prompt=(max(1, room - 14), max(1, room - 2)), budget=(20, 40), streaming=0.8,
                         wrong=(0,))
    held = rng.choice((0, 0, 1, 2))  # blocks a prefix cache holds: a resume reclaims them
    fault = rng.choice(("", "", "AwaitResumeFree", "AwaitResumeReclaim", "AwaitResumeSlot"))
    return Episode(mode="plain", max_batch_size=n, max_prefill_tokens=0, spill=False, total_blocks=total + held,
                   held_blocks=held, reclaimable=held, requests=tuple(requests), close_tick=0,
                   admission_watermark=rng.choice((0, 1, 4)), fault_phase=fault, aim="whole_pool")


def rejected_cross(rng: random.Random) -> Episode:
    n = rng.randint(1, 3)
    requests = [attrs.evolve(r, prompt_len=16 * rng.randint(1, 2) - rng.randint(1, 3))
                for r in _requests(rng, n, prompt=(1, 1), budget=(12, 30), wrong=(2, 2, 3))]
    caps = tuple(rng.choice(((3, 0), (2, 0), (3, 3, 0), (8, 0, 0))))
    return Episode(mode=rng.choice(("mtp2", "mtp3", "dflash", "mtp3")), max_batch_size=4, max_prefill_tokens=0,
                   spill=False, total_blocks=1000, held_blocks=0, requests=tuple(requests), capacities=caps,
                   close_tick=0, aim="rejected_cross")


def waiting_work(rng: random.Random) -> Episode:
    requests = _requests(rng, 2, prompt=(4, 30), budget=(14, 30), wrong=(0,))
    late = rng.randint(12, 30)
    if rng.random() < 0.6:
        requests.append(attrs.evolve(_requests(rng, 1, prompt=(2, 10), budget=(2, 6))[0], id=3, arrive_tick=late))
    first = rng.randint(1, 4)
    return Episode(mode="plain", max_batch_size=2, max_prefill_tokens=0, spill=rng.random() < 0.5, total_blocks=1000,
                   held_blocks=0, requests=tuple(requests), kv_exhaust_at=(first, first + 1),
                   close_tick=late + rng.choice((0, 30)), aim="waiting_work")


def gate_fault(rng: random.Random) -> Episode:
    n = rng.randint(3, 5)
    mode = rng.choice(("dflash", "dflash", "mtp2", "mtp3"))
    requests = _requests(rng, n, prompt=(2, 30), budget=(14, 30), wrong=(0, 2, 3))
    return Episode(mode=mode, max_batch_size=n, max_prefill_tokens=0, spill=False, total_blocks=1000, held_blocks=0,
                   requests=tuple(requests), short_proposals=True, can_batch_verify=True,
                   fault_phase="AwaitDflashGate" if mode == "dflash" else "AwaitMtpGate",
                   fault_phase_at=rng.randint(0, 3), close_tick=0, aim="gate_fault")


def spilled_alone(rng: random.Random) -> Episode:
    # the KV reservation counts the whole pool, the device's free count leaves out the blocks a cache
    # holds: the newcomer is admitted, and its prompt needs the long request's blocks
    long = SimRequest(id=1, prompt_len=rng.randint(32, 44), tokens=tuple(_randints(rng, 2, 40, 30)),
                      max_tokens=rng.randint(20, 30), streaming=rng.random() < 0.7)
    short = SimRequest(id=2, prompt_len=rng.randint(32, 47), tokens=tuple(_randints(rng, 2, 40, 3)),
                       max_tokens=1, streaming=rng.random() < 0.5, arrive_tick=rng.randint(2, 5))
    late = [SimRequest(id=3, prompt_len=4, tokens=(5, 6), max_tokens=2, arrive_tick=rng.randint(30, 60))] \
        if rng.random() < 0.5 else []
    # now and then the long request's spill file is damaged or lost: the swap-in must fail it alone
    damaged = rng.choice(((), (), (), (), "corrupt", "missing"))
    return Episode(mode="plain", max_batch_size=rng.choice((1, 2)), max_prefill_tokens=0, spill=True,
                   total_blocks=8, held_blocks=3, requests=(long, short, *late), admission_watermark=0,
                   close_tick=(late[0].arrive_tick if late else short.arrive_tick) + rng.choice((0, 40)),
                   fault_phase=rng.choice(("", "", "", "AwaitRestore")), aim="spilled_alone",
                   spill_corrupt_for=(1,) if damaged == "corrupt" else (),
                   spill_missing_for=(1,) if damaged == "missing" else ())


def ahead(rng: random.Random) -> Episode:
    """Async scheduling under pressure (specs/async.md §16.6): decodes answered ahead while deadlines
    pass, faults strike a decode's launch with kept tokens to resolve, budgets and a context ceiling
    end on a kept token, clients cancel, rows ask for logprobs and late arrivals settle the tokens.
    Three set-ups besides: prompts a few tokens short of a block boundary with cancel flags raised in
    the first ticks (rows cross a boundary in ticks that leave the steady columns); budgets one apart
    with a fault at a decode's launch around their ends (a kept token that is its sequence's last
    must be taken before the fault fails the rest); deadlines alone, every request there at once, no
    chunking (the episode's synchronous twin must give the same frames, walk._comparable)."""
    n = rng.randint(2, 5)
    setup = rng.choices(("plain", "near_boundary", "staggered", "timed"), weights=(4, 2, 2, 2))[0]
    base = rng.randint(3, 8)
    requests = []
    for i, r in enumerate(_requests(rng, n, prompt=(2, 30), budget=(3, 20))):
        changes: dict[str, Any] = {}
        if setup == "staggered":
            changes.update(max_tokens=base + i, tokens=tuple(_randints(rng, 2, 40, base + i)))
            requests.append(attrs.evolve(r, **changes))
            continue
        if setup == "near_boundary":  # cancel flags raised one by one in those ticks: the records' path
            changes.update(prompt_len=16 * rng.randint(1, 2) - rng.randint(1, 4), streaming=True,
                           cancel_at=i + rng.randint(1, 3))
        if setup == "timed":  # deadlines alone, in a batch that its synchronous twin must match
            changes["deadline_ms"] = TICK_MS * rng.randint(2, 9) + (0.0 if rng.random() < 0.5 else rng.randint(1, 9))
            requests.append(attrs.evolve(r, **changes))
            continue
        if rng.random() < 0.4:
            changes["deadline_ms"] = TICK_MS * rng.randint(2, 9) + (0.0 if rng.random() < 0.5 else rng.randint(1, 9))
        if rng.random() < 0.3:  # EOS somewhere: a row computed ahead for nothing
            cut = rng.randint(1, len(r.tokens))
            changes["tokens"] = r.tokens[:cut] + (63,)
        if rng.random() < 0.15 and r.streaming:
            changes["host_cancel_tick"] = rng.randint(2, 8)
        if rng.random() < 0.1:
            changes["top_logprobs"] = 2
        if rng.random() < 0.3:
            changes["arrive_tick"] = rng.randint(2, 8)
        requests.append(attrs.evolve(r, **changes))
    decode_fault_at: tuple[int, ...] = ()
    kv_exhaust_at: tuple[int, ...] = ()
    if setup == "staggered":
        decode_fault_at = (rng.randint(max(0, base - 3), base + n),)
    elif setup != "timed" and rng.random() < 0.5:
        if rng.random() < 0.4:
            decode_fault_at = (rng.randint(2, 8),)
        else:
            kv_exhaust_at = (rng.randint(2, 8),)
    chunk = 0 if setup == "timed" else rng.choice((0, 0, 8))
    return Episode(mode="plain", max_batch_size=rng.choice((n, 4, 8)), max_prefill_tokens=chunk,
                   spill=False, total_blocks=1000, held_blocks=0, requests=tuple(requests), close_tick=0,
                   max_seq_len=rng.choice((4096, 4096, 40)), decode_fault_at=decode_fault_at,
                   kv_exhaust_at=kv_exhaust_at, async_scheduling=True, aim="ahead")


def kept_lost(rng: random.Random) -> Episode:
    """Kept decodes that fail after their answer beside sequences that hold none (specs/async.md
    §16.6 rule 6): KV exhaustion injected early, so a preempted sequence resumes into a batch whose
    others hold kept tokens, and a fifth to a half of the kept decodes failing afterwards."""
    n = rng.randint(2, 4)
    exhaust = tuple(sorted(rng.sample(range(2, 9), rng.randint(1, 2))))
    return Episode(mode="plain", max_batch_size=n, max_prefill_tokens=0, spill=False, total_blocks=1000,
                   held_blocks=0, requests=tuple(_requests(rng, n, prompt=(2, 20), budget=(8, 20))), close_tick=0,
                   max_seq_len=4096, kv_exhaust_at=exhaust, async_scheduling=True,
                   ahead_failures=rng.choice((0.2, 0.35, 0.5)), aim="kept_lost")


def rollbacks(rng: random.Random) -> Episode:
    n = rng.randint(1, 3)
    ring = rng.choice((0, 2, 3, 4))
    requests = []
    for i in range(n):
        # a lead-in longer than the content-loop span (64), boundary tokens only in its first part: when
        # the loop after it is found, a boundary lies far enough back, and a small ring still holds it
        # (now and then a short one: the loop is there at the first check, at 48 content tokens, with no
        # boundary far enough back, and the guard finishes the sequence there)
        lead = _randints(rng, 2, 40, rng.randint(70, 100) if rng.random() < 0.7 else rng.randint(8, 30))
        every, early = rng.randint(3, 8), rng.randint(12, 30)
        lead = [BOUNDARY if j < early and j % every == every - 1 else t for j, t in enumerate(lead)]
        block = _randints(rng, 2, 40, rng.randint(2, 12))
        tokens = list(lead)
        while len(tokens) < 260:
            tokens += block
        requests.append(SimRequest(id=i + 1, prompt_len=rng.randint(1, 20), tokens=tuple(tokens),
                                   max_tokens=rng.randint(100, 250), streaming=rng.random() < 0.15,
                                   arrive_tick=rng.choice((0, 0, rng.randint(1, 20)))))
    options: dict[str, Any] = {"max_rollbacks": rng.choice((0, 1, 2, 2, 3))}
    if rng.random() < 0.1:
        options["rollback_resteer"] = False
    return Episode(mode=rng.choice(("plain", "plain", "plain", "plain", "mtp2", "dflash", "ngram")),
                   max_batch_size=rng.choice((n, 4)), max_prefill_tokens=rng.choice((0, 0, 8)), spill=False,
                   total_blocks=1000, held_blocks=0, requests=tuple(requests), close_tick=0, watchdog=True,
                   ssm_ring=ring, options=tuple(sorted(options.items())), aim="rollbacks")


def wide_mtp(rng: random.Random) -> Episode:
    n = rng.randint(9, 12)
    requests = [attrs.evolve(r, arrive_tick=rng.choice((0, 0, 0, rng.randint(1, 4))))
                for r in _requests(rng, n, prompt=(2, 20), budget=(6, 24), wrong=(0, 0, 2, 3))]
    return Episode(mode=rng.choice(("mtp2", "mtp3")), max_batch_size=rng.choice((n, 12)),
                   max_prefill_tokens=rng.choice((0, 0, 8)), spill=False, total_blocks=1000, held_blocks=0,
                   requests=tuple(requests), can_batch_verify=rng.random() < 0.8, close_tick=0, aim="wide_mtp")


def swap_middle(rng: random.Random) -> Episode:
    """Swap-outs whose victim is not the last active sequence (specs/scheduler.md §5.9 steps 3, 4): a
    long prompt arrives first, short ones after it, then newcomers into a small pool with a spill
    pool whose free count leaves out blocks a cache holds (the KV reservation counts them), so the
    long one (the longest block table) is spilled from the front of ``active`` and the last sequence
    takes its place. Random draws give it about once in 250,000 steps."""
    long = SimRequest(id=0, prompt_len=rng.randint(33, 47), tokens=tuple(_randints(rng, 2, 40, 30)),
                      max_tokens=rng.randint(20, 30), streaming=rng.random() < 0.7)
    first = _requests(rng, rng.randint(1, 3), prompt=(2, 12), budget=(16, 30))
    first.insert(rng.randint(0, len(first) - 1), long)  # the victim at the front or further in, never last
    late = [attrs.evolve(r, arrive_tick=rng.randint(2, 6))
            for r in _requests(rng, rng.randint(1, 2), prompt=(4, 20), budget=(4, 12))]
    requests = tuple(attrs.evolve(r, id=i + 1) for i, r in enumerate(first + late))
    return Episode(mode=rng.choice(("plain", "plain", "mtp1", "ngram")), max_batch_size=len(requests), max_prefill_tokens=0,
                   spill=True, total_blocks=rng.randint(8, 10), held_blocks=rng.randint(2, 4), requests=requests,
                   admission_watermark=0, close_tick=max(r.arrive_tick for r in requests), aim="swap_middle")


AIMS: dict[str, Callable[[random.Random], Episode]] = {
    "deadlines": deadlines, "full_batch": full_batch, "whole_pool": whole_pool, "rejected_cross": rejected_cross,
    "waiting_work": waiting_work, "gate_fault": gate_fault, "spilled_alone": spilled_alone, "ahead": ahead,
    "kept_lost": kept_lost, "rollbacks": rollbacks, "wide_mtp": wide_mtp, "swap_middle": swap_middle,
}


WEIGHTS: dict[str, int] = {"whole_pool": 2}
"""How many times as often as the others an aim is drawn (1 unless named): the state ``whole_pool``
is for, a preempted sequence needing exactly the pool, comes of one draw in several."""


def aimed_episode(rng: random.Random) -> Episode:
    names = sorted(AIMS)
    return AIMS[rng.choices(names, weights=[WEIGHTS.get(n, 1) for n in names])[0]](rng)
