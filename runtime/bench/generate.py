"""``fxsched bench generate``: tokens/s, mean accepted length and target forwards per generated token of
``generate``, per speculation mode, prompt set and batch size.

Rows: one per (prompt set, batch, mode), the modes in the order given (``none`` first when listed, so
each speculative row can be compared with it). Every run starts on a fresh engine (no prefix-cache
reuse between rows), ignores EOS (every request generates ``max_tokens`` tokens, so rows compare
equal work) and drafts with the drafters' own proposals: the model's MTP module or DFlash drafter,
the scheduler's n-gram lookup -- never an oracle. A row's ``lossless`` says whether its tokens equal
those of the ``none`` run of the same prompts and batch (``-`` when ``none`` was not run).

Prompt sets (``PROMPT_SETS``), both labelled in every row:

* ``held-out``: default_model.EVAL_PROMPTS, text none of the model's training saw, encoded with
  the model's tokenizer (a model without one: seeded random ids);
* ``repetitive``: default_model.REPETITIVE_PROMPTS (without a tokenizer: a random pattern of ids
  repeated), the kind of prompt n-gram drafting is for; its rows are not mixed into the others.

A batch of B runs every prompt of the set (repeated in order to fill the batch when the set has
fewer than B), at most B requests at once. A mode the
model cannot run (``mtp`` without an MTP head, ``dflash`` without a drafter) is one row with
``skipped`` set to the reason and no figures.

Columns (``COLUMNS``): ``tokens/s`` generated tokens per wall-clock second of the whole run
(prefill included); ``fwd/token`` target-model forwards per generated token (one batched forward
serves every request in it, so plain decoding at batch B gives 1/B; an accepted draft saves one);
``mean_acc_len`` tokens gained per verify (accepted drafts + the target's own token; ``-`` for a mode
that does not verify); ``acc/pos`` the share of verified drafts kept at each draft position (the
first draft first, ``/``-separated; vLLM's per-position acceptance; ``-`` without verifies).

``temperature`` > 0 (``bench generate --temperature T``): every request samples at T with a fixed
seed (request i: seed i x 2**20), the speculative modes verifying by rejection sampling
(specs/speculation.md §6.16); the figures are then those at T, and ``lossless`` is ``-`` (a sampled
run keeps the distribution of ``none``, not its tokens: tests/test_spec_distribution.py checks it).

Expert parallelism (``ep_ranks``, e.g. 1, 2, 4; specs/expert-parallel.md §10.5): every row runs once
per rank count, 2 and more through ``generate_ep`` (rank 0 here, the others worker processes that
load their experts from ``model_dir``; the time includes no start-up: the cluster is up before the
run's clock starts, but each row starts its own). When the list is not just ``1`` the table gains
``EP_COLUMNS``: ``ranks``; ``MiB/rank`` each rank's weights (rank 0 first, ``/``-separated) and
``experts_MiB`` the experts part of them; ``coll_ms/fwd`` rank 0's milliseconds in the expert
collectives (broadcasts and reduce, including the wait for the slowest rank) per target forward
(the drafters' MoE layers included), 0 on one rank, ``-`` for a model without experts (its workers
replay the forwards instead); ``=1rank`` whether the tokens equal those of the one-rank run of the
same row.

Overlap (``overlap``, specs/async.md §16.5): ``off`` (the default) and ``on`` run every row without
or with the device lane; ``compare`` runs every one-rank row ``rounds`` times each way, on fresh
engines, alternating which goes first, and the row's ``tokens/s`` is the median without the lane.
The table then gains ``OVERLAP_COLUMNS``: ``tok/s_on`` the median with it; ``on/off`` their ratio;
``host_ms`` the host's working time with the lane (wall less its waits) and ``hidden_%`` the share
of it that ran beside device work, medians; ``=off`` whether every run's tokens equal the first run
without the lane.
"""

from __future__ import annotations

import gc
import statistics
from typing import Any, Callable, Iterable, Optional

from fxsched.runtime.bench.prompts import random_prompts
from fxsched.runtime.generate import (GREEDY, GenerateError, GenerateResult, SamplingOptions, Summary, expand_prompts,
                                      generate, max_prompt_len, scheduler_setup)
from fxsched.runtime.torch_model import HybridEngine, ModelConfig

PROMPT_SETS = ("held-out", "repetitive")
COLUMNS = ("prompts", "spec", "batch", "tokens", "tokens/s", "fwd/token", "mean_acc_len", "acc/pos", "lossless")
EP_COLUMNS = ("ranks", "MiB/rank", "experts_MiB", "coll_ms/fwd", "=1rank")
OVERLAP_COLUMNS = ("tok/s_on", "on/off", "host_ms", "hidden_%", "=off")
OVERLAPS = ("off", "on", "compare")
MIB = 1024 * 1024
REPEAT_PATTERN_LEN = 6  # ids of the repeated pattern of a repetitive set without a tokenizer
REPETITIVE_LEN = 40  # tokens of such a prompt


def bench_prompts(cfg: ModelConfig, count: int, seed: int = 7, min_len: int = 8, max_len: int = 24) -> list[list[int]]:
    """``count`` seeded random prompts for a model without a tokenizer."""
    return random_prompts(seed, count, cfg.vocab_size, min_len, max_len)


def prompt_set(name: str, cfg: ModelConfig, tokenizer: Any = None) -> list[list[int]]:
    """The prompts (token ids) of set ``name`` for this model (see the module docstring)."""
    from fxsched.runtime.torch_model.default_model import EVAL_PROMPTS, REPETITIVE_PROMPTS

    if name not in PROMPT_SETS:
        raise GenerateError(f"--prompts {name}: unknown prompt set (choose from {', '.join(PROMPT_SETS)})")
    if tokenizer is not None:
        texts = EVAL_PROMPTS if name == "held-out" else REPETITIVE_PROMPTS
        prompts = [tokenizer.encode(t) for t in texts]
    elif name == "held-out":
        prompts = bench_prompts(cfg, len(EVAL_PROMPTS))
    else:
        patterns = random_prompts(11, len(REPETITIVE_PROMPTS), cfg.vocab_size, REPEAT_PATTERN_LEN, REPEAT_PATTERN_LEN)
        prompts = [(p * (REPETITIVE_LEN // len(p) + 1))[:REPETITIVE_LEN] for p in patterns]
    limit = max_prompt_len(cfg)
    return [p[:limit] for p in prompts]


def _unavailable(cfg: ModelConfig, spec: str, batch: int) -> Optional[str]:
    """Why ``spec`` cannot run on this model (``None``: it can)."""
    try:
        scheduler_setup(cfg, spec, batch)
    except GenerateError as err:
        return str(err).split(": ", 1)[-1]
    return None


def bench_generate(engine_factory: Callable[..., HybridEngine], batches: Iterable[int] = (1, 4, 16),
                   max_tokens: int = 32, specs: Iterable[str] = ("none", "mtp", "dflash", "ngram"),
                   progress: Optional[Callable[[str], None]] = None, tokenizer: Any = None,
                   prompt_sets: Iterable[str] = PROMPT_SETS, ep_ranks: Iterable[int] = (1,),
                   model_dir: Optional[str] = None, weights: Optional[str] = None,
                   temperature: float = 0.0, overlap: str = "off", rounds: int = 1) -> list[dict[str, Any]]:
    """One row per (prompt set, batch, rank count, mode): see the module docstring for the columns.
    ``engine_factory()`` builds a one-rank engine, ``engine_factory(n)`` rank 0's of n ranks (with
    expert_shard=(0, n) for a MoE checkpoint); ``model_dir`` / ``weights`` name what the workers load."""
    specs = list(specs)
    sampling = SamplingOptions(temperature=temperature) if temperature > 0 else GREEDY
    ordered = (["none"] if "none" in specs else []) + [s for s in specs if s != "none"]
    ranks_list = list(ep_ranks)
    with_ep = ranks_list != [1]
    cfg = engine_factory().cfg
    sets = {name: prompt_set(name, cfg, tokenizer) for name in prompt_sets}
    rows: list[dict[str, Any]] = []
    for name, prompts in sets.items():
        for batch in batches:
            chosen = expand_prompts(prompts, batch)
            one_rank: dict[str, list[list[int]]] = {}
            for ranks in ranks_list:
                base: Optional[GenerateResult] = None
                for spec in ordered:
                    if progress:
                        progress(f"{name} {spec} batch {batch}" + (f" ranks {ranks}" if with_ep else ""))
                    reason = _unavailable(cfg, spec, batch)
                    if reason is not None:
                        rows.append({"prompts": name, "spec": spec, "batch": batch, "skipped": reason,
                                     **({"ranks": ranks} if with_ep else {})})
                        continue
                    compare = overlap == "compare" and ranks == 1
                    if compare:
                        result, engine, figures = _compare_overlap(engine_factory, chosen, max_tokens, spec, batch,
                                                                   sampling, rounds)
                    else:
                        result, engine = _run(engine_factory, ranks, chosen, max_tokens, spec, batch, model_dir,
                                              weights, sampling, overlap == "on")
                    if spec == "none":
                        base = result
                    s = result.summary
                    row = {
                        "prompts": name, "spec": spec, "batch": batch, "tokens": s.generated_tokens,
                        "tokens/s": s.tokens_per_s, "fwd/token": s.forwards_per_token,
                        "mean_acc_len": s.mean_accepted_length,
                        "acc/pos": list(s.acceptance_by_position) if s.verifies else None,
                        "lossless": (None if base is None or spec == "none" or temperature > 0
                                     else result.outputs == base.outputs),
                    }
                    if compare:
                        row.update(figures)
                    if with_ep:
                        if ranks == 1:
                            one_rank[spec] = result.outputs
                        row.update(_ep_figures(result, engine, ranks))
                        row["=1rank"] = None if ranks == 1 or spec not in one_rank else result.outputs == one_rank[spec]
                    rows.append(row)
    return rows


def _run(engine_factory: Callable[..., HybridEngine], ranks: int, prompts: list[list[int]], max_tokens: int,
         spec: str, batch: int, model_dir: Optional[str], weights: Optional[str],
         sampling: SamplingOptions = GREEDY, overlap: bool = False) -> tuple[GenerateResult, HybridEngine]:
    """One run on a fresh engine, on one rank or through ``generate_ep`` (greedy, no lane there)."""
    if ranks == 1:
        engine = engine_factory()
        return generate(engine, prompts, max_tokens, spec, batch, eos_ids=(), sampling=sampling,
                        overlap=overlap), engine
    from fxsched.runtime.ep.generate import generate_ep

    engine = engine_factory(ranks)
    return generate_ep(engine, prompts, max_tokens, spec, batch, eos_ids=(), ep_ranks=ranks, model_dir=model_dir,
                       weights=weights), engine


def _compare_overlap(engine_factory: Callable[..., HybridEngine], prompts: list[list[int]], max_tokens: int,
                     spec: str, batch: int, sampling: SamplingOptions,
                     rounds: int) -> tuple[GenerateResult, HybridEngine, dict[str, Any]]:
    """``rounds`` runs with the device lane and without, interleaved (the first of each round
    alternates), each on a fresh engine: the first run without it, its engine, and the
    ``OVERLAP_COLUMNS`` (the row's ``tokens/s`` is the median without). Only the first run keeps
    its engine: a real-size engine is gigabytes."""
    runs: dict[bool, list[tuple[list[list[int]], Summary]]] = {True: [], False: []}
    first: Optional[tuple[GenerateResult, HybridEngine]] = None
    for r in range(rounds):
        for lane in ((True, False) if r % 2 == 0 else (False, True)):
            engine = engine_factory()
            result = generate(engine, prompts, max_tokens, spec, batch, eos_ids=(), sampling=sampling, overlap=lane)
            runs[lane].append((result.outputs, result.summary))
            if first is None and not lane:
                first = (result, engine)
            del result, engine
            gc.collect()
    assert first is not None
    with_lane = [s for _, s in runs[True]]
    on = statistics.median(s.tokens_per_s for s in with_lane)
    off = statistics.median(s.tokens_per_s for _, s in runs[False])
    figures = {
        "tokens/s": off, "tok/s_on": on, "on/off": on / off if off else None,
        "host_ms": statistics.median(1000 * (s.host_s or 0.0) for s in with_lane),
        "hidden_%": statistics.median(100 * (s.hidden_s or 0.0) / s.host_s if s.host_s else 0.0 for s in with_lane),
        "=off": all(out == first[0].outputs for out, _ in runs[True] + runs[False]),
    }
    return first[0], first[1], figures


def _ep_figures(result: GenerateResult, engine: HybridEngine, ranks: int) -> dict[str, Any]:
    """The EP columns of a row: weights per rank, collective time per target forward."""
    from fxsched.runtime.torch_model.moe import weight_bytes

    report = getattr(result, "weights", None)
    if report is not None:  # a sharded model: each rank's own report
        per_rank = [list(r) for r in report.ranks]
    else:  # one rank, or replicas: every rank holds the whole model
        per_rank = [list(weight_bytes(engine.model.w))] * ranks
    stats = getattr(result, "experts", None) or {}
    forwards = result.summary.target_forwards
    if ranks == 1:
        coll: Optional[float] = 0.0
    elif stats and forwards:
        coll = 1000.0 * stats["collective_s"] / forwards
    else:
        coll = None
    return {"ranks": ranks, "MiB/rank": [(e + o) / MIB for e, o in per_rank],
            "experts_MiB": [e / MIB for e, _ in per_rank], "coll_ms/fwd": coll}


def row_json(row: dict[str, Any]) -> dict[str, Any]:
    """The ``--json`` record of a row: the same keys, ``tokens_per_s`` / ``forwards_per_token`` /
    ``mean_accepted_length`` spelled out, JSON null where a figure does not apply."""
    names = {"tokens/s": "tokens_per_s", "fwd/token": "forwards_per_token", "mean_acc_len": "mean_accepted_length",
             "acc/pos": "acceptance_by_position",
             "MiB/rank": "weights_mib_per_rank", "experts_MiB": "expert_mib_per_rank",
             "coll_ms/fwd": "collective_ms_per_forward", "=1rank": "same_as_one_rank",
             "tok/s_on": "tokens_per_s_overlap", "on/off": "overlap_ratio", "host_ms": "host_ms_overlap",
             "hidden_%": "hidden_host_percent", "=off": "same_as_no_overlap"}
    return {names.get(k, k): v for k, v in row.items()}


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a right-aligned text table; skipped modes are listed below it with their reason."""
    ran = [r for r in rows if "skipped" not in r]
    lines: list[str] = []
    columns = (COLUMNS + (EP_COLUMNS if any("ranks" in r for r in rows) else ())
               + (OVERLAP_COLUMNS if any("=off" in r for r in rows) else ()))
    if ran:
        cells = [[_cell(r.get(k), k) for k in columns] for r in ran]
        widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(columns)]
        lines.append("  ".join(f"{k:>{w}}" for k, w in zip(columns, widths, strict=True)))
        lines += ["  ".join(f"{c:>{w}}" for c, w in zip(row, widths, strict=True)) for row in cells]
    skipped = {(r["spec"], r["skipped"]) for r in rows if "skipped" in r}
    lines += [f"{spec}: skipped ({reason})" for spec, reason in sorted(skipped)]
    return "\n".join(lines)


def _cell(value: Any, key: str) -> str:
    if key in ("lossless", "=1rank", "=off"):
        return "-" if value is None else ("yes" if value else "NO")
    if value is None:
        return "-"
    if isinstance(value, list):
        return "/".join(f"{v:.2f}" for v in value)
    return f"{value:.2f}" if isinstance(value, float) else str(value)
