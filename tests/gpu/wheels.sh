#!/usr/bin/env bash
# Downloads into .whl/ (ignored) the wheels that the lent GPU machine's image lacks for the GPU
# check (tests/gpu/check.sh): `import fxsched`, `fxsched generate`, the gpu-marked tests and the
# benchmarks. The image has no network; check.sh installs these with
# `pip install --no-index --no-deps --target /tmp/site`, and the device call carries ".whl".
#
# What the image (Python 3.12, torch 2.11, triton 3.6, transformers 5.17, einops, attrs, tqdm,
# safetensors, ...) lacks:
#   structlog   fxsched's logging (imported by every runtime module)
#   fla-core    flash-linear-attention, pinned as in pyproject's test extra: the GDN reference of
#               tests/gpu/bench_gpu.py kernels and of transformers' Qwen3.5 / Qwen3-Next layers
#               (needs only einops, which the image has)
# One version of each, pure-Python wheels; idempotent (a second run downloads nothing).
# Usage: tests/gpu/wheels.sh   (from anywhere; PYTHON=... picks the interpreter that runs pip)
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1

WHEELS=(structlog==26.1.0 fla-core==0.6.0)
PY="${PYTHON:-python3}"
DEST=.whl

# ignored in this clone even before .gitignore lists it (and wherever .gitignore is not committed)
exclude="$(git rev-parse --git-path info/exclude 2>/dev/null)"
if [ -n "$exclude" ]; then
    mkdir -p "$(dirname "$exclude")"
    grep -qxF "/$DEST/" "$exclude" 2>/dev/null || echo "/$DEST/" >>"$exclude"
fi
mkdir -p "$DEST"

# the file-name prefix of a requirement's wheel: fla-core==0.6.0 -> fla_core-0.6.0-
prefix() { local name="${1%%==*}" version="${1##*==}"; echo "${name//-/_}-${version}-"; }

status=0
wanted=()
for req in "${WHEELS[@]}"; do
    p="$(prefix "$req")"
    wanted+=("$p")
    if compgen -G "$DEST/$p*.whl" >/dev/null; then
        echo "have $(basename "$(compgen -G "$DEST/$p*.whl" | head -n 1)")"
        continue
    fi
    if ! "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            -d "$DEST" "$req"; then
        echo "wheels.sh: could not download $req" >&2
        status=1
        continue
    fi
    echo "got  $(basename "$(compgen -G "$DEST/$p*.whl" | head -n 1)")"
done

# one version of each: anything else in .whl/ (an older pin, a stray download) goes
for file in "$DEST"/*.whl; do
    [ -e "$file" ] || continue
    keep=0
    for p in "${wanted[@]}"; do
        case "$(basename "$file")" in "$p"*) keep=1 ;; esac
    done
    if [ "$keep" = 0 ]; then
        echo "drop $(basename "$file") (not in the list)"
        rm -f "$file"
    fi
done
du -ch "$DEST"/*.whl 2>/dev/null | tail -n 1
exit "$status"
