#!/usr/bin/env bash
# GPU checks of the torch runtime (CUDA machine; about 2-4 minutes, always under 8):
#   1. the GPU-marked tests (Triton kernels on/off identical tokens, lossless speculation on
#      CUDA, real streams/events), and any other gpu-marked test of the suite;
#   2. the generate benchmark on CUDA: tokens/s and target forwards per generated token,
#      speculation vs none, at batch 1, 4 and 16.
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
