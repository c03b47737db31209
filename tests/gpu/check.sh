#!/usr/bin/env bash
# GPU checks of the torch runtime, for the lent CUDA machine (no network; its image has torch 2.11,
# triton 3.6 and transformers 5.17 but not structlog or fla: run tests/gpu/wheels.sh here first and
# carry .whl). Every step runs under its own timeout, within one budget (GPU_CHECK_BUDGET_S, default
# 460 s: under 8 minutes on an H100), and a failing step does not stop the next:
#   wheels       the carried wheels installed with pip --no-index --no-deps --target $FXSCHED_SITE
#   package      fxsched importable without an install: $FXSCHED_SITE/fxsched/X links the source
#                folders as pyproject maps them (and $FXSCHED_SITE/bin/fxsched runs the CLI); the
#                modules the check needs import (tests/gpu/bench_gpu.py imports)
#   environment  versions, GPU, SM count, measured copy bandwidth and bf16 matmul TFLOP/s
#   gpu_tests    python -m pytest -q -m gpu tests/ --continue-on-collection-errors (per-test results
#                from its JUnit XML; a module that cannot be imported is reported, not fatal)
#   parity       greedy tokens of the default model, fxsched generate --device cuda == --device cpu
#   models       real-size random checkpoints (e2e_models) built on the device: tokens/s by batch,
#                spec and CUDA graphs on/off, against transformers, host syncs per decode tick,
#                graph forward counts, batch-1 decode against the HBM roofline
#   kernels      fxsched bench kernels --json, Triton paged attention vs SDPA, GDN vs fla
# Writes $OUT/gpu_check.json (per step: status ok/failed/skipped, reason, seconds, figures) and
# $OUT/gpu_check.log (OUT defaults to /tmp/fxsched-gpu-check). Exit status 1 when a step failed.
# Without CUDA the CUDA parts report "skipped: no CUDA" and the rest runs (tests/gpu/rehearse.sh).
# Usage: tests/gpu/check.sh   (PYTHON=... picks the interpreter, default python3)
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)" || exit 2
cd "$ROOT" || exit 2

PY="${PYTHON:-python3}"
case "$PY" in
    */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;;
    *) PY="$(command -v "$PY")" || { echo "check.sh: no $PY on PATH" >&2; exit 2; } ;;
esac
OUT_DIR="${OUT:-${TMPDIR:-/tmp}/fxsched-gpu-check}"
SITE="${FXSCHED_SITE:-/tmp/site}"
BUDGET="${GPU_CHECK_BUDGET_S:-460}"
mkdir -p "$OUT_DIR" "$SITE" || exit 2
LOG="$OUT_DIR/gpu_check.log"
: >"$LOG"
STEPS="$(mktemp -d "${TMPDIR:-/tmp}/fxsched-gpu-steps.XXXXXX")" || exit 2
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$PATH"
START=$SECONDS
ORDER=()

log() { printf '%s\n' "$*" | tee -a "$LOG"; }

# seconds a step may take: at most CAP, and what the budget leaves once RESERVE is kept for the later
# steps (both written for the default budget of 460 s: reserves scale with the budget, caps only shrink)
limit_for() {
    local cap=$1 reserve=$(( $2 * BUDGET / 460 )) left
    (( BUDGET < 460 )) && cap=$(( cap * BUDGET / 460 ))
    left=$(( BUDGET - (SECONDS - START) - reserve ))
    echo $(( cap < left ? cap : left ))
}

skip() {  # NAME REASON: a step that never started
    ORDER+=("$1")
    printf '{"skipped": "%s"}\n' "$2" >"$STEPS/$1.meta.json"
    log "== $1: skipped ($2)"
}

# step NAME LIMIT CMD...: CMD under `timeout LIMIT`, its output into the log (and stdout); the exit
# status and seconds into $STEPS/NAME.meta.json; the step's own figures are $STEPS/NAME.json
step() {
    local name=$1 limit=$2 t0 t1 rc secs
    shift 2
    if (( limit < 15 )); then
        skip "$name" "time budget of the whole check spent"
        return 1
    fi
    ORDER+=("$name")
    log "== $name (at most ${limit}s, $(( SECONDS - START ))s into the check)"
    t0=$(date +%s.%N)
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$STEPS/$name.log" | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    t1=$(date +%s.%N)
    secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
    printf '{"rc": %d, "seconds": %s, "limit_s": %d}\n' "$rc" "$secs" "$limit" >"$STEPS/$name.meta.json"
    log "-- $name: exit $rc after ${secs}s"
    return "$rc"
}

# --- wheels: what the image lacks, carried as .whl/ (tests/gpu/wheels.sh) --------------------------
# shellcheck disable=SC2016
step wheels "$(limit_for 60 400)" bash -c '
    shopt -s nullglob; wheels=(.whl/*.whl)
    if [ ${#wheels[@]} = 0 ]; then
        echo "no wheels in .whl/: run tests/gpu/wheels.sh before the call and carry .whl"; exit 1
    fi
    printf "%s\n" "${wheels[@]}"
    exec "$0" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$1" "${wheels[@]}"
' "$PY" "$SITE"

# --- package: the source folders as the fxsched package (pyproject's package-dir), and the CLI -----
mkdir -p "$SITE/fxsched" "$SITE/bin"
for folder in core effects kernels runtime specs; do
    ln -sfn "$ROOT/$folder" "$SITE/fxsched/$folder" || log "check.sh: cannot link $SITE/fxsched/$folder"
done
printf '#!/bin/sh\nexec "%s" -m fxsched.runtime.cli "$@"\n' "$PY" >"$SITE/bin/fxsched" && chmod +x "$SITE/bin/fxsched"
step package "$(limit_for 90 340)" "$PY" tests/gpu/bench_gpu.py imports --json "$STEPS/package.json"

# --- environment ----------------------------------------------------------------------------------
step environment "$(limit_for 60 300)" "$PY" tests/gpu/bench_gpu.py env --json "$STEPS/environment.json"
CUDA=$("$PY" -c 'import torch; print("yes" if torch.cuda.is_available() else "no")' 2>/dev/null || echo no)
log "CUDA: $CUDA"

# --- the gpu-marked tests -------------------------------------------------------------------------
step gpu_tests "$(limit_for 150 220)" "$PY" -m pytest -q -m gpu tests/ -p no:cacheprovider --continue-on-collection-errors \
    --junitxml="$STEPS/junit.xml"
rc=$?
if [ -e "$STEPS/gpu_tests.meta.json" ] && ! grep -q skipped "$STEPS/gpu_tests.meta.json"; then
    "$PY" tests/gpu/check_report.py junit "$STEPS/junit.xml" --json "$STEPS/gpu_tests.json" --rc "$rc" \
        --cuda "$CUDA" >>"$LOG" 2>&1
fi

# --- greedy tokens on CUDA equal the CPU's --------------------------------------------------------
step parity "$(limit_for 90 180)" "$PY" tests/gpu/bench_gpu.py parity --json "$STEPS/parity.json"

# --- real-size models -----------------------------------------------------------------------------
limit=$(limit_for 300 75)
step models "$limit" "$PY" tests/gpu/bench_gpu.py models --json "$STEPS/models.json" \
    --env-json "$STEPS/environment.json" --budget-s $(( limit > 60 ? limit - 25 : limit / 2 ))

# --- kernels --------------------------------------------------------------------------------------
limit=$(limit_for 90 0)
step kernels "$limit" "$PY" tests/gpu/bench_gpu.py kernels --json "$STEPS/kernels.json" \
    --cli-timeout-s $(( limit / 2 ))

# --- the report -----------------------------------------------------------------------------------
order="$(IFS=,; echo "${ORDER[*]}")"
"$PY" tests/gpu/check_report.py report --steps "$STEPS" --out "$OUT_DIR/gpu_check.json" --order "$order" \
    --budget "$BUDGET" --total "$(( SECONDS - START ))" 2>&1 | tee -a "$LOG"
status=${PIPESTATUS[0]}
if [ "$status" != 0 ] && [ "$status" != 1 ]; then  # the report itself broke: say so in the JSON
    printf '{"check": "tests/gpu/check.sh", "error": "check_report.py exited %s", "steps": "%s"}\n' \
        "$status" "$order" >"$OUT_DIR/gpu_check.json"
    status=1
fi
[ -n "${KEEP_STEPS:-}" ] || rm -rf "$STEPS"
exit "$status"
