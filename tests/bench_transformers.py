"""tokens/s of ``fxsched generate`` (spec none, batch 1) next to transformers' ``generate`` on the same
model directory and the same torch thread count: a measurement, not a test (pytest does not collect it).

    python tests/bench_transformers.py [--model DIR] [--threads N] [--max-tokens N] [--repeats N]

Defaults: the embedded default model, 1 thread, 64 greedy tokens per prompt, the best of 3 repeats
per prompt (default_model.EVAL_PROMPTS). Both sides decode greedily with EOS ignored, so they
produce the same number of tokens (the script checks that the tokens are equal too). fxsched's
figure is its whole run through the scheduler (prefill included, as ``Summary.tokens_per_s``);
transformers' is ``model.generate(..., max_new_tokens=N, min_new_tokens=N, do_sample=False)`` wall
time with its KV/GDN cache, on its pure-torch GDN functions (flash-linear-attention's Triton kernels,
which transformers binds when fla is installed, cannot run on a CPU). Also prints fxsched's ``--spec mtp``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from support.hf_tiny import transformers_torch_gdn  # noqa: E402

from fxsched.runtime.generate import generate  # noqa: E402
from fxsched.runtime.text import load_tokenizer  # noqa: E402
from fxsched.runtime.torch_model import HybridEngine  # noqa: E402
from fxsched.runtime.torch_model.default_model import EVAL_PROMPTS, default_model_dir  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description="tokens/s of fxsched generate next to transformers' generate")
    parser.add_argument("--model", default=str(default_model_dir()))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    tokenizer = load_tokenizer(args.model)
    assert tokenizer is not None, f"{args.model} has no tokenizer"
    prompts = [tokenizer.encode(p) for p in EVAL_PROMPTS]
    n = args.max_tokens
    fx: dict[str, float] = {"none": 0.0, "mtp": 0.0}
    hf_seconds = 0.0
    with transformers_torch_gdn():
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model).eval()
        for prompt in prompts:
            ids = torch.tensor([prompt])
            best = float("inf")
            with torch.no_grad():
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                                         pad_token_id=0)
                    best = min(best, time.perf_counter() - start)
            hf_seconds += best
            hf_tokens = out[0, len(prompt):].tolist()
            for spec in fx:
                runs = [generate(HybridEngine.from_pretrained(args.model), [prompt], n, spec, 1, eos_ids=())
                        for _ in range(args.repeats)]
                fx[spec] += min(r.summary.seconds for r in runs)
                if runs[0].outputs[0] != hf_tokens:
                    print(f"tokens differ from transformers' on prompt {prompt[:8]}... ({spec})")
                    return 1
    total = n * len(prompts)
    print(f"model={args.model} threads={args.threads} prompts={len(prompts)} tokens/prompt={n} "
          f"(best of {args.repeats})")
    print(f"{'':24}{'tokens/s':>10}")
    print(f"{'transformers generate':24}{total / hf_seconds:>10.1f}")
    print(f"{'fxsched generate (none)':24}{total / fx['none']:>10.1f}")
    print(f"{'fxsched generate (mtp)':24}{total / fx['mtp']:>10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
