"""The episodes of the model checker's random walk (runtime/check/walk.py).

An episode is drawn from a seeded generator: a drafting mode, batch size, chunking, a spill pool,
a block pool (part of it perhaps held by a reclaimable prefix cache), the admission policy, a
context ceiling, 1–12 requests with random scripts (EOS placement, budgets, draft errors, cancel
points, deadlines, late arrivals, blocking or streaming, beams, sampling parameters, min_tokens,
logprobs, adapter slots), scheduled faults (KV exhaustion, fatal decode and verify errors,
corrupted or missing spill files, a ``DeviceFault`` answered in a chosen waiting phase), perhaps
armed watchdogs with long looping scripts, perhaps a LoRA rotation, and the inbox closing at a
random tick after the last arrival. ``_proposer_quirks`` then adds what a real device and client
vary: short or empty proposals, draft capacities changing per step (0 included), a prompt as long
as the context, DFlash gates over uneven draft blocks, MTP batches wider than the ladder, more
requests than seats on a small pool with early KV exhaustion (aimed at a full batch while
sequences wait preempted or swapped, which coverage still shows unreached), greedy rows whose
script says EOS below ``min_tokens``, and host-side cancels (perhaps while the prompt still
prefills). Half the proposer episodes answer proposals late now and then (some of which then
fail, at their verify), and half of all episodes run the device's work behind the host on a
deferred lane (specs/async.md §16.3, §16.5). ``options.with_options`` then draws production's
settings (chunked prefill under a token budget, prompts prefilled together) in over half the
random episodes (over a third of all), and every other scheduler knob now and then.
"""

from __future__ import annotations

import random
from typing import Any


from fxsched.core.config import SCRIPTED_EOS as EOS
from fxsched.core.records import replace
from fxsched.runtime.check.aimed import AIMED_SHARE, aimed_episode
from fxsched.runtime.check.episode import (BOUNDARY, FAULT_PHASES, MODES, TICK_MS, Episode, SimRequest,
                                           _randints)
from fxsched.runtime.check.options import with_options


def hash_seed(episode: Episode) -> int:
    """A seed drawn from the episode itself (its requests' ids, lengths and budgets), so a replay
    file replays the same device."""
    h = 17
    for r in episode.requests:
        h = (h * 1_000_003 + r.id * 131 + r.prompt_len * 7 + r.max_tokens + len(r.tokens)) & 0xFFFFFFFF
    return h


def _looping_script(rng: random.Random) -> list[int]:
    """A long script for the watchdogs: a lead-in holding the boundary token, then a block repeated
    (each copy perhaps with one token changed, which only the fuzzy check forgives)."""
    lead = _randints(rng, 2, 40, rng.randint(5, 70))
    lead[rng.randrange(len(lead))] = BOUNDARY
    early = len(lead) < 30  # with a short block, a loop complete before the first content-loop check (48)
    noisy = rng.random() < 0.5 and not early
    block = _randints(rng, 2, 40, rng.randint(24, 36) if noisy else rng.randint(2, 6 if early else 20))
    tokens = list(lead)
    while len(tokens) < 260:
        copy = list(block)
        if noisy:  # one token off per copy: within the fuzzy tolerance of max(P // 12, 1) = 2
            copy[rng.randrange(len(copy))] = rng.randint(2, 40)
        tokens.extend(copy)
    return tokens


TWICE_SHARE = 0.05
"""The share of episodes whose every event is stepped twice on the same state (walk._twice: step
is pure), drawn from the episode's hash so the other draws stay as they were."""


def random_episode(rng: random.Random) -> Episode:
    episode = _drawn(rng)
    if (hash_seed(episode) * 2_246_822_519 + 13) % 10_000 < TWICE_SHARE * 10_000:
        return replace(episode, twice=True)
    return episode


def _drawn(rng: random.Random) -> Episode:
    if rng.random() < AIMED_SHARE:
        return aimed_episode(rng)
    mode = rng.choice(MODES)
    watchdog = rng.random() < 0.06
    n = rng.randint(1, 6) if rng.random() < 0.8 else rng.randint(7, 12)
    if watchdog:
        n = rng.randint(1, 3)
    beams = rng.random() < 0.15  # beam-heavy episodes: several blocking beam requests at once
    sampling = rng.random() < 0.2
    adapters = rng.random() < 0.3  # adapter slots: the acquire rules and the cohorts of every path
    requests = []
    last_arrival = 0
    for i in range(n):
        length = rng.randint(1, 14)
        tokens = _randints(rng, 2, 40, length)
        if rng.random() < 0.3:  # repeated content, so n-gram proposals happen
            tokens = (tokens[:3] * 6)[:length]
        if rng.random() < 0.75:
            tokens.append(EOS)
        budget = rng.randint(1, 18)
        if watchdog:
            tokens, budget = _looping_script(rng), rng.randint(100, 300)
        arrive = rng.choice([0, 0, 0, rng.randint(1, 8)])
        last_arrival = max(last_arrival, arrive)
        streaming = rng.random() < (0.3 if beams or watchdog else 0.8)
        beam = not streaming and rng.random() < (0.8 if beams else 0.3)
        fields: dict[str, Any] = {}
        if sampling and rng.random() < 0.6:
            fields = dict(temperature=rng.choice([0.0, 0.5, 1.0]), top_p=rng.choice([1.0, 0.9, 0.5]),
                          top_k=rng.choice([0, 1, 5]), min_p=rng.choice([0.0, 0.1]),
                          top_logprobs=rng.choice([0, 0, 2]), min_tokens=rng.choice([0, 0, 2, 5]))
        if beam or mode == "self_spec":
            # a beam hypothesis is the device's, min_tokens or not. The self-speculative step picks its
            # first token by the host pick (EOS masked below min_tokens) but verifies its drafts
            # greedily (specs/speculation.md §6.15), so an EOS there may be masked or kept unstreamed in
            # the output (§6.1 step 4) depending on which row it falls on: no fixed expected output
            fields.pop("min_tokens", None)
        if adapters:
            fields["adapter_slot"] = rng.choice([-1, -1, -1, 1, 2, 3])
        requests.append(SimRequest(
            id=i + 1, prompt_len=rng.randint(1, 40), tokens=tuple(tokens), max_tokens=budget,
            streaming=streaming, wrong_every=rng.choice([0, 0, 2, 3, 4, 5]),
            cancel_at=rng.randint(1, 10) if streaming and rng.random() < 0.15 else None,
            deadline_ms=(arrive * TICK_MS + rng.randint(20, 200)) if rng.random() < 0.1 else None,
            arrive_tick=arrive,
            num_beams=rng.choice([2, 3]) if beam else 1,
            **fields,
        ))
    spill = rng.random() < 0.3
    held = rng.choice([0, 0, 1, 2, 4])
    fault_phase = rng.choice(FAULT_PHASES) if rng.random() < 0.3 else ""
    episode = Episode(
        mode=mode, max_batch_size=rng.choice([1, 2, 3, 4, 8, 12]),
        max_prefill_tokens=0 if beams and rng.random() < 0.7 else rng.choice([0, 0, 4, 6, 8, 10, 16]),
        spill=spill, total_blocks=rng.choice([6, 8, 12, 24, 1000]) if not watchdog else 1000,
        held_blocks=held, requests=tuple(requests),
        kv_exhaust_at=tuple(sorted(rng.sample(range(30), rng.randint(0, 2)))),
        decode_fault_at=tuple(sorted(rng.sample(range(40), 1))) if rng.random() < 0.1 else (),
        verify_fault_at=tuple(sorted(rng.sample(range(30), 1))) if rng.random() < 0.1 else (),
        spill_corrupt_for=(rng.randint(1, n),) if spill and rng.random() < 0.3 else (),
        can_batch_verify=rng.random() < 0.85,
        rotation_tick=rng.randint(1, 10) if rng.random() < 0.15 else None,
        close_tick=last_arrival + rng.randint(0, 6),
        policy="slai" if rng.random() < 0.2 else "fifo",
        slai_deadline_ms=rng.choice([1_000_000.0, 1_000_000.0, 30.0]),
        watchdog=watchdog,
        max_seq_len=rng.choice([4096, 4096, 4096, 4096, 24, 40, 64]) if not watchdog else 4096,
        prefix_cache=rng.random() < 0.3,
        reclaimable=rng.randint(0, held),
        spill_missing_for=(rng.randint(1, n),) if spill and rng.random() < 0.2 else (),
        fault_phase=fault_phase,
        fault_phase_at=rng.choice([0, 0, 0, 1, 3]) if fault_phase else 0,
    )
    episode = _proposer_quirks(episode, rng)
    episode = with_options(episode, (hash_seed(episode) * 2_654_435_761 + 97) & 0xFFFFFFFF)
    return _suited_to_fault(episode, rng) if fault_phase else episode


def _proposer_quirks(episode: Episode, rng: random.Random) -> Episode:
    """What a real device and client vary and the scripts alone never do (see the module
    docstring); each quirk is drawn on its own."""
    changes: dict[str, Any] = {}
    if episode.mode != "plain" and rng.random() < 0.35:
        changes["short_proposals"] = True
    if episode.mode != "plain" and rng.random() < 0.3:
        changes["capacities"] = tuple(rng.choice((0, 1, 2, 3, 8, 8)) for _ in range(rng.randint(2, 7)))
    if episode.mode == "dflash" and not episode.watchdog and rng.random() < 0.5:
        # a gate with uneven blocks: three or more sequences verified at once, short proposals
        requests = tuple(replace(r, arrive_tick=0, max_tokens=max(r.max_tokens, 12), cancel_at=None,
                                      num_beams=1, tokens=tuple(t for t in r.tokens if t != EOS) or (5,))
                         for r in episode.requests)
        while len(requests) < 3:
            requests += tuple(replace(r, id=r.id + len(requests)) for r in requests)
        changes.update(short_proposals=True, can_batch_verify=True, requests=requests[:6],
                       max_batch_size=max(episode.max_batch_size, 4))
    if episode.mode.startswith("mtp") and not episode.watchdog and rng.random() < 0.12:
        # a wide batch: nine or more sequences at once, past the MTP ladder's width of 8
        requests = tuple(replace(r, arrive_tick=0, max_tokens=max(r.max_tokens, 8), cancel_at=None,
                                      num_beams=1, streaming=True) for r in episode.requests)
        while len(requests) < 10:
            requests += tuple(replace(r, id=r.id + len(requests)) for r in requests)
        changes.update(requests=requests[:rng.randint(9, 12)], max_batch_size=12, total_blocks=1000,
                       kv_exhaust_at=(), max_seq_len=4096)
    if not episode.watchdog and not episode.fault_phase and rng.random() < 0.06:
        # more requests than seats on a small block pool, KV exhaustion early, a spill pool half the
        # time (aimed at a full batch while preempted or swapped sequences wait; one adapter cohort, so
        # that no request is deferred for its adapter)
        requests = tuple(replace(r, arrive_tick=0, max_tokens=max(r.max_tokens, 10), num_beams=1, adapter_slot=-1,
                                      prompt_len=min(r.prompt_len, 20), tokens=tuple(t for t in r.tokens if t != EOS)
                                      or (5,)) for r in changes.get("requests", episode.requests))
        while len(requests) < 5:
            requests += tuple(replace(r, id=r.id + len(requests)) for r in requests)
        total = rng.choice((10, 12, 16))
        # half the pool held by the prefix cache and not given back: the free blocks (which a requeue
        # resume and a swap-in need) run short while the KV reservation (which counts the pool
        # whole) still admits new requests, so the batch fills while preempted sequences wait
        changes.update(requests=requests[:8], max_batch_size=rng.choice((2, 3)), spill=rng.random() < 0.5,
                       total_blocks=total, held_blocks=total // 2, reclaimable=0,
                       kv_exhaust_at=(1, 3, 6), max_seq_len=4096, spill_corrupt_for=(), spill_missing_for=())
    if episode.mode != "self_spec" and rng.random() < 0.1:
        # greedy rows below min_tokens whose script says EOS early: the EOS must be masked
        rs: list[SimRequest] = list(changes.get("requests", episode.requests))
        i = rng.randrange(len(rs))
        r = rs[i]
        if r.num_beams == 1:
            lead = tuple(r.tokens[:rng.randint(0, 2)])
            rs[i] = replace(r, tokens=lead + (EOS,) + tuple(t for t in r.tokens if t != EOS) + (EOS,),
                                 min_tokens=rng.randint(len(lead) + 1, len(lead) + 4), temperature=0.0,
                                 top_logprobs=0, max_tokens=max(r.max_tokens, 8))
            changes["requests"] = tuple(rs)
    if episode.watchdog and rng.random() < 0.5:
        # a hybrid model: rollbacks need a snapshot of the SSM state in the ring
        changes["ssm_ring"] = rng.choice((1, 2, 3, 4))
        if rng.random() < 0.7:  # boundary tokens all through the lead-in: saves that go round the ring
            step = rng.randint(5, 12)
            changes["requests"] = tuple(replace(r, tokens=tuple(
                BOUNDARY if i % step == step - 1 and i < 90 else t for i, t in enumerate(r.tokens)))
                for r in changes.get("requests", episode.requests))
    if rng.random() < 0.15:
        # a client cancel from the host, perhaps while the prompt still prefills
        rs = list(changes.get("requests", episode.requests))
        i = rng.randrange(len(rs))
        if rs[i].streaming:
            rs[i] = replace(rs[i], host_cancel_tick=rs[i].arrive_tick + rng.randint(1, 4))
            changes["requests"] = tuple(rs)
    if episode.max_seq_len < 4096 and rng.random() < 0.3:
        rs = list(changes.get("requests", episode.requests))
        i = rng.randrange(len(rs))
        rs[i] = replace(rs[i], prompt_len=episode.max_seq_len)
        changes["requests"] = tuple(rs)
    episode = replace(episode, **changes) if changes else episode
    if episode.mode.startswith(("mtp", "dflash")) and hash_seed(episode) % 2:
        # half the proposer episodes answer late now and then; decided from the episode, so the
        # generator's draws (and every episode a seed drew before) stay as they were
        episode = replace(episode, late_drafts=True)
    if hash_seed(episode) // 2 % 2:  # half of all episodes run their device behind the host (a lane)
        episode = replace(episode, lane=True)
    if episode.mode == "plain" and hash_seed(episode) // 4 % 3:
        # two plain episodes in three schedule asynchronously: decodes answered ahead now and then
        episode = replace(episode, async_scheduling=True)
    elif episode.mode != "plain" and hash_seed(episode) // 4 % 3 == 0:
        # one speculative episode in three too: its plain ticks (a batch past the speculative width,
        # n-gram beside other sequences) answered ahead, read before a tick that speculates
        episode = replace(episode, async_scheduling=True)
    return episode


def _suited_to_fault(episode: Episode, rng: random.Random) -> Episode:
    """An episode whose fault phase its set-up would seldom reach, made to reach it: the drafting
    mode, beams, a spill pool, preemption or a rotation the phase belongs to."""
    name = episode.fault_phase
    changes: dict[str, Any] = {}
    if "Dflash" in name:
        changes["mode"] = "dflash"
    elif name in ("AwaitMtpGate", "AwaitMtpBatch", "AwaitBatchedProposal", "AwaitKVerify", "AwaitProposal",
                  "AwaitCapacity", "AwaitMtpDecode"):
        changes["mode"] = rng.choice(("mtp1", "mtp2", "mtp3"))
    elif "Ngram" in name:
        changes["mode"] = "ngram"
    elif "Self" in name:
        changes["mode"] = "self_spec"
    if name in ("AwaitMtpGate", "AwaitMtpBatch", "AwaitBatchedProposal", "AwaitBatchedDflash", "AwaitDflashGate"):
        changes.update(max_batch_size=max(episode.max_batch_size, 4), can_batch_verify=True)
    if name in ("AwaitMixedReadback", "AwaitPrefillToken"):
        changes.update(max_prefill_tokens=4, mode="plain", max_batch_size=max(episode.max_batch_size, 3),
                       requests=tuple(replace(r, prompt_len=max(r.prompt_len, 9), arrive_tick=0)
                                      for r in episode.requests))
    if "Beam" in name:
        changes["max_prefill_tokens"] = 0
        changes["requests"] = tuple(replace(r, streaming=False, num_beams=2, cancel_at=None, min_tokens=0)
                                    for r in episode.requests) * 1
    if name in ("AwaitSwapInSlot", "AwaitRestore"):
        changes.update(spill=True, total_blocks=8, kv_exhaust_at=(2, 5), max_batch_size=max(episode.max_batch_size, 3))
        if name == "AwaitSwapInSlot":  # a sequence swapped out by preemption: unchunked prompts, which
            # reserve no room for their output (options.py's production chunks reserve it)
            changes.update(max_prefill_tokens=0, options=tuple(
                (k, v) for k, v in episode.options if k not in ("prefill_new_together", "max_batch_tokens")))
    if name.startswith("AwaitResume"):
        changes.update(spill=False, total_blocks=rng.choice((12, 24)), held_blocks=4, reclaimable=4,
                       kv_exhaust_at=(1, 3, 6), max_batch_size=max(episode.max_batch_size, 3))
    if name == "AwaitRotation":
        changes["rotation_tick"] = rng.randint(1, 6)
    if name == "AwaitAhead":  # kept tokens read alone: async scheduling, arrivals that need them settled
        changes.update(mode="plain", async_scheduling=True, max_batch_size=max(episode.max_batch_size, 3),
                       requests=tuple(replace(r, arrive_tick=rng.choice((0, 2, 4))) for r in episode.requests))
    if len(episode.requests) < 3 and name not in ("AwaitRotation",):
        extra = [replace(r, id=r.id + len(episode.requests)) for r in episode.requests]
        changes.setdefault("requests", episode.requests)
        changes["requests"] = tuple(changes["requests"]) + tuple(
            replace(r, id=r.id + len(episode.requests)) for r in changes["requests"][:len(extra)])
    episode = replace(episode, **changes)
    if episode.mode == "self_spec":  # no min_tokens there (see random_episode)
        episode = replace(episode, requests=tuple(replace(r, min_tokens=0) for r in episode.requests))
    return episode
