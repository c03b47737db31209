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
that does not verify).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

from fxsched.runtime.bench.prompts import random_prompts
from fxsched.runtime.generate import (GenerateError, GenerateResult, expand_prompts, generate, max_prompt_len,
                                      scheduler_setup)
from fxsched.runtime.torch_model import HybridEngine, ModelConfig

PROMPT_SETS = ("held-out", "repetitive")
COLUMNS = ("prompts", "spec", "batch", "tokens", "tokens/s", "fwd/token", "mean_acc_len", "lossless")
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


def bench_generate(engine_factory: Callable[[], HybridEngine], batches: Iterable[int] = (1, 4, 16),
                   max_tokens: int = 32, specs: Iterable[str] = ("none", "mtp", "dflash", "ngram"),
                   progress: Optional[Callable[[str], None]] = None, tokenizer: Any = None,
                   prompt_sets: Iterable[str] = PROMPT_SETS) -> list[dict[str, Any]]:
    """One row per (prompt set, batch, mode): see the module docstring for the columns."""
    specs = list(specs)
    ordered = (["none"] if "none" in specs else []) + [s for s in specs if s != "none"]
    cfg = engine_factory().cfg
    sets = {name: prompt_set(name, cfg, tokenizer) for name in prompt_sets}
    rows: list[dict[str, Any]] = []
    for name, prompts in sets.items():
        for batch in batches:
            chosen = expand_prompts(prompts, batch)
            base: Optional[GenerateResult] = None
            for spec in ordered:
                if progress:
                    progress(f"{name} {spec} batch {batch}")
                reason = _unavailable(cfg, spec, batch)
                if reason is not None:
                    rows.append({"prompts": name, "spec": spec, "batch": batch, "skipped": reason})
                    continue
                result = generate(engine_factory(), chosen, max_tokens, spec, batch, eos_ids=())
                if spec == "none":
                    base = result
                s = result.summary
                rows.append({
                    "prompts": name, "spec": spec, "batch": batch, "tokens": s.generated_tokens,
                    "tokens/s": s.tokens_per_s, "fwd/token": s.forwards_per_token,
                    "mean_acc_len": s.mean_accepted_length,
                    "lossless": None if base is None or spec == "none" else result.outputs == base.outputs,
                })
    return rows


def row_json(row: dict[str, Any]) -> dict[str, Any]:
    """The ``--json`` record of a row: the same keys, ``tokens_per_s`` / ``forwards_per_token`` /
    ``mean_accepted_length`` spelled out, JSON null where a figure does not apply."""
    names = {"tokens/s": "tokens_per_s", "fwd/token": "forwards_per_token", "mean_acc_len": "mean_accepted_length"}
    return {names.get(k, k): v for k, v in row.items()}


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a right-aligned text table; skipped modes are listed below it with their reason."""
    ran = [r for r in rows if "skipped" not in r]
    lines: list[str] = []
    if ran:
        cells = [[_cell(r.get(k), k) for k in COLUMNS] for r in ran]
        widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(COLUMNS)]
        lines.append("  ".join(f"{k:>{w}}" for k, w in zip(COLUMNS, widths, strict=True)))
        lines += ["  ".join(f"{c:>{w}}" for c, w in zip(row, widths, strict=True)) for row in cells]
    skipped = {(r["spec"], r["skipped"]) for r in rows if "skipped" in r}
    lines += [f"{spec}: skipped ({reason})" for spec, reason in sorted(skipped)]
    return "\n".join(lines)


def _cell(value: Any, key: str) -> str:
    if key == "lossless":
        return "-" if value is None else ("yes" if value else "NO")
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, float) else str(value)
