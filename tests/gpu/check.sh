#!/usr/bin/env bash
# GPU checks of the torch runtime (CUDA machine; about 2-4 minutes, always under 8):
#   1. the GPU-marked tests (Triton kernels on/off identical tokens, lossless speculation on
#      CUDA, real streams/events), and any other gpu-marked test of the suite;
#   2. the generate benchmark on CUDA: tokens/s and target forwards per generated token,
#      speculation vs none, at batch 1, 4 and 16;
#   3. CUDA graphs (specs/async.md §16.4): host syncs per step counted by torch's sync debug mode,
#      tokens/s with graphs on and off in interleaved rounds (medians), tokens identical.
# Usage: tests/gpu/check.sh   (from anywhere; PYTHON=... to pick the interpreter)
set -euo pipefail
cd "$(dirname "$0")/../.."

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
if ! "$PY" -c "import fxsched.runtime.devices.torch" 2>/dev/null; then
    "$PY" -m pip install --quiet --no-deps --no-build-isolation -e . >/dev/null
fi
"$PY" - <<'PYEOF'
import torch
assert torch.cuda.is_available(), "tests/gpu/check.sh needs a CUDA device"
print("torch", torch.__version__, "on", torch.cuda.get_device_name())
try:
    import triton
    print("triton", triton.__version__)
except ImportError:
    print("triton: not installed (kernels use the torch references)")
PYEOF

echo "== GPU tests"
timeout 300 "$PY" -m pytest -q -m gpu tests/

echo "== bench generate (cuda)"
timeout 150 "$PY" -m fxsched.runtime.cli.generate bench generate --device cuda --batches 1,4,16 --max-tokens 32

echo "== generate example (cuda)"
timeout 30 "$PY" -m fxsched.runtime.cli.generate generate --device cuda --prompt "The lighthouse keeper climbed the stairs" --max-tokens 16 --spec mtp --batch 4

echo "== CUDA graphs: syncs per step, graphs on vs off"
timeout 240 "$PY" - <<'PYEOF'
import statistics, time, warnings
import torch
from fxsched.runtime.generate import generate
from fxsched.runtime.torch_model import HybridEngine
from fxsched.runtime.torch_model.default_model import default_model_dir

prompts = [[5 + i, 17, 42, 7 + i] * 8 for i in range(8)]
engines = {on: HybridEngine.from_pretrained(default_model_dir(), device="cuda", max_slots=8, cuda_graphs=on)
           for on in (True, False)}
assert engines[True].graphs is not None and engines[True].graphs.captured, "no graphs captured"
for spec in ("none", "mtp"):
    outs, rates = {}, {True: [], False: []}
    for on, engine in engines.items():
        outs[on] = generate(engine, prompts, 8, spec=spec, eos_ids=()).outputs  # warm-up
    for _ in range(3):  # interleaved rounds
        for on, engine in engines.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            result = generate(engine, prompts, 64, spec=spec, eos_ids=())
            torch.cuda.synchronize()
            rates[on].append(result.summary.generated_tokens / (time.perf_counter() - start))
            outs[on] = result.outputs
    assert outs[True] == outs[False], f"{spec}: tokens differ with graphs on and off"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        result = generate(engines[True], prompts, 32, spec=spec, eos_ids=())
        torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    on, off = statistics.median(rates[True]), statistics.median(rates[False])
    print(f"{spec}: tok/s graphs on {on:.1f}, off {off:.1f}, ratio {on / off:.2f}; "
          f"host syncs {syncs} in {result.summary.steps} steps ({syncs / result.summary.steps:.2f} per step); "
          f"static forwards {engines[True].graphs.stats.static}, eager {engines[True].graphs.stats.eager}")
PYEOF
