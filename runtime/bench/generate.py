"""``fxsched bench generate``: tokens/s and target forwards per generated token of ``generate``,
for each speculation mode against none, at several batch sizes."""

from __future__ import annotations

from typing import Callable, Iterable, Optional

from fxsched.runtime.bench.prompts import random_prompts
from fxsched.runtime.generate import GenerateResult, generate
from fxsched.runtime.torch_model import HybridEngine, ModelConfig


def bench_prompts(cfg: ModelConfig, count: int, seed: int = 7, min_len: int = 8, max_len: int = 24) -> list[list[int]]:
    return random_prompts(seed, count, cfg.vocab_size, min_len, max_len)


def bench_generate(engine_factory: Callable[[], HybridEngine], batches: Iterable[int] = (1, 4, 16),
                   max_tokens: int = 32, specs: Iterable[str] = ("none", "mtp", "dflash"),
                   progress: Optional[Callable[[str], None]] = None) -> list[dict]:
    """Rows of tokens/s and target forwards per generated token for each (spec, batch).

    Each run has ``batch`` prompts at once on a fresh engine (so no prefix-cache reuse between
    rows). A speculative row is lossless when its tokens equal those of the batch's ``none`` run
    (run first when ``specs`` lists it; otherwise nothing is compared).
    """
    rows = []
    for batch in batches:
        prompts = bench_prompts(engine_factory().cfg, batch)
        base: Optional[GenerateResult] = None
        for spec in specs:
            if progress:
                progress(f"{spec} batch {batch}")
            result = generate(engine_factory(), prompts, max_tokens, spec, batch)
            if spec == "none":
                base = result
            s = result.summary
            lossless = base is None or result.outputs == base.outputs
            rows.append({
                "spec": spec, "batch": batch, "tokens": s.generated_tokens,
                "tokens/s": s.tokens_per_s, "fwd/token": s.forwards_per_token,
                "mean_acc_len": s.mean_accepted_length if s.mean_accepted_length is not None else "-",
                "lossless": "yes" if lossless else "NO",
            })
    return rows


def format_table(rows: list[dict]) -> str:
    if not rows:
        return ""
    keys = list(rows[0])
    widths = {k: max(len(k), *(len(_cell(r[k])) for r in rows)) for k in keys}
    lines = ["  ".join(f"{k:>{widths[k]}}" for k in keys)]
    for r in rows:
        lines.append("  ".join(f"{_cell(r[k]):>{widths[k]}}" for k in keys))
    return "\n".join(lines)


def _cell(value) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)
