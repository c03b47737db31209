#!/usr/bin/env bash
# Rehearses tests/gpu/check.sh on this CPU machine, in a venv shaped like the lent GPU machine's
# image: Python 3.12, torch 2.11.0 (PyPI's CUDA build, run on the
# CPU), triton 3.6.0, transformers 5.17.0 and the image's other packages that the check touches, and
# nothing of fxsched's own requirements that the image lacks: those come from .whl/
# (tests/gpu/wheels.sh), installed exactly as check.sh installs them. The CUDA parts report
# "skipped: no CUDA"; everything else really runs (the wheel install, the imports, collecting the
# gpu-marked tests, building the model families at toy sizes and running them, the JSON).
# Passes (exit 0) when check.sh exits 0, its JSON is written and no step failed.
# Not part of CI. Usage: tests/gpu/rehearse.sh [--fresh]   (--fresh: rebuild the venv)
#   REHEARSE_VENV (default ~/.cache/fxsched/gpu-rehearse-py312), PY312 (the Python 3.12 to use),
#   REHEARSE_OUT (default /tmp/fxsched-gpu-rehearse), GPU_CHECK_BUDGET_S (default 900 here: a
#   shared 2-core machine is slower than the device's 16 cores)
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)" || exit 2
cd "$ROOT" || exit 2

PY312="${PY312:-/root/.pyenv/versions/3.12.1/bin/python}"
VENV="${REHEARSE_VENV:-$HOME/.cache/fxsched/gpu-rehearse-py312}"
OUT_DIR="${REHEARSE_OUT:-/tmp/fxsched-gpu-rehearse}"
# the image's versions where they are known; the rest as pip resolves them
PACKAGES=(torch==2.11.0 triton==3.6.0 transformers==5.17.0 safetensors==0.8.0 tokenizers==0.23.2 numpy==2.5.2
          jinja2 attrs tqdm pytest hypothesis httpx einops peft)
# what the image lacks: must come from .whl/, never from the venv
ABSENT=(structlog fla fxsched)

start=$SECONDS
if [ "${1:-}" = "--fresh" ]; then
    rm -rf "$VENV"
fi
stamp="$VENV/.fxsched-rehearse"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "${PACKAGES[*]}" ]; then
    echo "== venv $VENV (Python 3.12: ${PACKAGES[*]})"
    rm -rf "$VENV"
    "$PY312" -m venv "$VENV" || exit 2
    # /etc/xdg/pip/pip.conf caps torch for this machine's own wheels; the image's torch is older anyway
    PIP_CONFIG_FILE=/dev/null "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
        "${PACKAGES[@]}" || exit 2
    echo "${PACKAGES[*]}" >"$stamp"
else
    echo "== venv $VENV (re-used)"
fi
for module in "${ABSENT[@]}"; do
    if env -u PYTHONPATH "$VENV/bin/python" -c "import $module" 2>/dev/null; then
        echo "rehearse.sh: $module is importable in the venv; the image lacks it, so the rehearsal would hide a missing wheel" >&2
        exit 2
    fi
done
venv_s=$(( SECONDS - start ))

echo "== wheels"
bash tests/gpu/wheels.sh || exit 2

rm -rf "$OUT_DIR"
mkdir -p "$OUT_DIR"
site="$(mktemp -d "${TMPDIR:-/tmp}/fxsched-rehearse-site.XXXXXX")"
models="$(mktemp -d "${TMPDIR:-/tmp}/fxsched-rehearse-models.XXXXXX")"  # built anew every time
check_start=$SECONDS
env -u PYTHONPATH -u VIRTUAL_ENV -u TRITON_INTERPRET -u FXSCHED_KERNELS \
    OUT="$OUT_DIR" PYTHON="$VENV/bin/python" FXSCHED_SITE="$site" FXSCHED_GPU_MODELS_DIR="$models" \
    GPU_CHECK_BUDGET_S="${GPU_CHECK_BUDGET_S:-900}" \
    bash tests/gpu/check.sh
rc=$?
check_s=$(( SECONDS - check_start ))
rm -rf "$site" "$models"

echo "== rehearsal: venv ${venv_s}s, check.sh ${check_s}s (exit $rc), all $(( SECONDS - start ))s"
if [ ! -s "$OUT_DIR/gpu_check.json" ]; then
    echo "rehearse.sh: check.sh wrote no $OUT_DIR/gpu_check.json" >&2
    exit 1
fi
"$VENV/bin/python" - "$OUT_DIR/gpu_check.json" <<'PYEOF' || exit 1
import json, sys
report = json.load(open(sys.argv[1]))
failed = report["summary"]["failed"]
print("summary:", json.dumps(report["summary"]))
if failed:
    sys.exit(f"rehearse.sh: steps failed: {', '.join(failed)}")
PYEOF
[ "$rc" = 0 ] || { echo "rehearse.sh: check.sh exited $rc" >&2; exit 1; }
echo "rehearse.sh: passed ($OUT_DIR/gpu_check.json, $OUT_DIR/gpu_check.log)"
