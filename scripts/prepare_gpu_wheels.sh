#!/usr/bin/env bash
# Here, where PyPI is reachable: gather what scripts/gpu_check.sh installs on a GPU machine that
# has no network, into .whl/ (ignored through .git/info/exclude, not .gitignore): PyCUDA's source
# distribution and the wheels of its dependencies for CPython 3.11 and 3.12, x86-64 Linux.
#
#   scripts/prepare_gpu_wheels.sh [--with-base] [--with-model]
#     --with-base    also numpy, numba, tqdm, jinja2, pytest (+ deps) for CPython 3.12, for a GPU
#                    machine whose Python lacks them (~65 MB: more than one device call carries
#                    beside the rest; the NVIDIA image this project uses has them)
#     --with-model   also cut the default model into two parts in .gpu_model/, to carry in two
#                    device calls (each call carries at most 64 MiB; the model is 94 MB)
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
VERSION=${PYCUDA_VERSION:-2026.1}
DEST=.whl
WITH_BASE=0
WITH_MODEL=0
for a in "$@"; do
    case "$a" in
        --with-base) WITH_BASE=1 ;;
        --with-model) WITH_MODEL=1 ;;
        *) echo "usage: $0 [--with-base] [--with-model]" >&2; exit 2 ;;
    esac
done

mkdir -p "$DEST" .git/info
for p in /.whl/ /.gpu_model/; do
    grep -qxF "$p" .git/info/exclude 2>/dev/null || echo "$p" >> .git/info/exclude
done

PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
wheels() {   # python version, packages...
    local v=$1; shift
    "$PY" -m pip download --quiet --disable-pip-version-check --only-binary=:all: --python-version "$v" \
        --implementation cp "${PLATFORMS[@]}" -d "$DEST" "$@"
}

"$PY" -m pip download --quiet --disable-pip-version-check --no-deps --no-binary pycuda -d "$DEST" "pycuda==$VERSION"
for v in 3.11 3.12; do
    wheels "$v" pytools platformdirs mako markupsafe siphash24 typing_extensions
done
if [ "$WITH_BASE" = 1 ]; then
    wheels 3.12 "numpy>=1.26,<3" "numba>=0.60,<0.69" "tqdm>=4.66" "jinja2>=3.1" "pytest>=8"
fi

if [ "$WITH_MODEL" = 1 ]; then
    MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
    [ -f "$MODEL" ] || { echo "no $MODEL: run \`make model\` first" >&2; exit 1; }
    mkdir -p .gpu_model
    rm -f .gpu_model/*.part-*
    split -b 48M -d -a 1 "$MODEL" ".gpu_model/$(basename "$MODEL").part-"
    (cd models && sha256sum "$(basename "$MODEL")") > .gpu_model/SHA256SUMS
fi

echo "in $DEST: $(ls "$DEST" | wc -l) files, $(du -sh "$DEST" | cut -f1)"
ls "$DEST"
[ "$WITH_MODEL" = 1 ] && ls -la .gpu_model
exit 0
