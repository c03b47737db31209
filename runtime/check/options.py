"""The scheduler options an episode of the walk runs with (specs/checker.md §11.1, "Options").

A bug behind an option the walk never varies is invisible to it. So every field of
``SchedulerConfig`` is drawn somewhere: the drafting mode, batch, chunking, spill pool, policy,
context, watchdog and async scheduling by the episode's own draws (draws.py), and here

- **production's settings** in ``PRODUCTION_SHARE`` of the random episodes: what ``generate`` and
  ``serve`` set beyond a mode's own options (runtime/generate.py ``scheduler_setup``): chunked
  prefill under a batch token budget, prompts that arrive together prefilled together (in chunks of
  the whole budget while nothing decodes; a CPU server's bound on the prompt rows beside decoding
  streams in most of those), the KV
  reservation's horizon the model's context. The walk's prompts are at most 40 tokens, so the chunk
  and the budget are scaled to them (a 2048-token chunk would never cut one); a batch mixing adapters;
- **the other knobs** each on its own now and then (``KNOBS``): the MTP batch width limit, the n-gram
  match length and history rule, the rollback re-steer and count, the preemption immunity, a
  second EOS id, and the mixed-prefill bound's floor and rows per stream (without serve's
  settings). The second EOS id is one no script ever says (scripts draw 2..40, the watchdog's
  boundary is 41), so the expected outputs stay the scripts'; what it varies is the EOS set's size.

The draws come from a generator seeded by the episode's own ``hash_seed`` (not the walk's), so the
walk's other draws, and so every episode a seed drew before, stay as they were.
"""

from __future__ import annotations

import random
from typing import Any

import attrs

from fxsched.core.config import SCRIPTED_EOS
from fxsched.runtime.check.episode import Episode

PRODUCTION_SHARE = 0.55  # of the random episodes; the aimed ones (aimed.AIMED_SHARE) keep their own
STOP_OUTSIDE_SCRIPTS = 45
KNOB_CHANCE = 0.12

KNOBS: tuple[tuple[str, tuple[Any, ...]], ...] = (
    ("mtp_width_limit", (1, 2, 4)),
    ("ngram_max_match", (1, 2, 3)),
    ("ngram_history_without_pending_token", (True,)),
    ("rollback_resteer", (False,)),
    ("max_rollbacks", (0, 1)),
    ("idle_prefill_fills_budget", (True,)),  # alone: without prefill_new_together it changes nothing
    ("preemption_immunity_tokens", (0, 2, 8)),
    ("eos_ids", ((SCRIPTED_EOS, STOP_OUTSIDE_SCRIPTS),)),
    ("mixed_prefill_floor", (1, 4)),  # the mixed-prefill bound outside serve's settings (chunked prompts only)
    ("mixed_prefill_per_decode", (1, 2)),
)
"""(SchedulerConfig field, the values drawn besides its default)."""


def with_options(episode: Episode, seed: int) -> Episode:
    """``episode`` with production's settings (a ``PRODUCTION_SHARE`` chance) and each knob of
    ``KNOBS`` (a ``KNOB_CHANCE`` chance each), drawn from ``seed``."""
    rng = random.Random(seed)
    changes: dict[str, Any] = {}
    options: dict[str, Any] = dict(episode.options)
    if rng.random() < PRODUCTION_SHARE:
        chunk = rng.choice((4, 6, 8, 16))
        changes.update(max_prefill_tokens=chunk, admission_watermark=max(episode.max_seq_len,
                                                                          episode.admission_watermark))
        budget = chunk * rng.choice((1, 2, 4))
        served = rng.random() < 0.5  # serve's latency bound, or generate's waves
        options.update(prefill_new_together=True, max_batch_tokens=budget, mixed_adapters=True,
                       idle_prefill_fills_budget=served)
        if served and rng.random() < 0.6:  # a CPU server's bound on prompt rows beside decoding streams
            options.update(mixed_prefill_floor=rng.choice((1, 2, 4, chunk)), mixed_prefill_per_decode=rng.choice((0, 1, 2)))
    elif episode.max_prefill_tokens and rng.random() < 0.25:
        # serve's --max-num-batched-tokens alone: a budget of at least one chunk
        options["max_batch_tokens"] = episode.max_prefill_tokens * rng.choice((1, 2, 3))
    for name, values in KNOBS:
        if rng.random() < KNOB_CHANCE:
            options[name] = rng.choice(values)
    if options:
        changes["options"] = tuple(sorted(options.items()))
    return attrs.evolve(episode, **changes) if changes else episode


def is_production(episode: Episode) -> bool:
    """Whether the episode runs with production's settings (``with_options``)."""
    options = dict(episode.options)
    return bool(options.get("prefill_new_together")) and bool(options.get("mixed_adapters")) and (
        episode.max_prefill_tokens > 0) and (
        options.get("max_batch_tokens", 0) >= episode.max_prefill_tokens)
