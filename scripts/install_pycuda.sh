#!/usr/bin/env bash
# Build and install PyCUDA from its source distribution, finding the CUDA toolkit and the driver
# library itself. A plain `pip install pycuda` guesses the toolkit from the folder above the first
# nvcc on PATH, which is wrong when that nvcc is a wrapper script (/usr/local/bin/nvcc), and links
# cuRAND, which a minimal toolkit lacks; the cuda stage needs neither guess nor cuRAND.
#
#   scripts/install_pycuda.sh                         from PyPI, into the running Python's environment
#   scripts/install_pycuda.sh --offline DIR           from DIR (the sdist and the dependency wheels that
#                                                     scripts/prepare_gpu_wheels.sh puts in .whl/), no network
#   ... --target SITE                                 install into SITE (then: export PYTHONPATH=SITE)
#
# Environment: PYTHON (default: python3), PYCUDA_VERSION (default 2026.1), CUDA_ROOT (the toolkit),
# LIBCUDA_DIR (a folder with libcuda.so to link against: the driver's, or the toolkit's stubs).
set -euo pipefail

PY=${PYTHON:-python3}
VERSION=${PYCUDA_VERSION:-2026.1}
OFFLINE=""
TARGET=""
while [ $# -gt 0 ]; do
    case "$1" in
        --offline) OFFLINE=$(cd "$2" && pwd); shift 2 ;;
        --target) TARGET=$2; shift 2 ;;
        *) echo "usage: $0 [--offline DIR] [--target SITE]" >&2; exit 2 ;;
    esac
done

die() { echo "install_pycuda: $*" >&2; exit 1; }

# The CUDA toolkit: CUDA_ROOT, CUDA_HOME, CUDA_PATH, where nvcc says it lives, /usr/local/cuda.
cuda_root() {
    local c top
    for c in "${CUDA_ROOT:-}" "${CUDA_HOME:-}" "${CUDA_PATH:-}"; do
        [ -n "$c" ] && [ -f "$c/include/cuda.h" ] && { echo "$c"; return; }
    done
    if command -v nvcc >/dev/null; then
        top=$(nvcc --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)
        [ -n "$top" ] && [ -f "$top/include/cuda.h" ] && { (cd "$top" && pwd -P); return; }
        c=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
        [ -f "$c/include/cuda.h" ] && { echo "$c"; return; }
    fi
    [ -f /usr/local/cuda/include/cuda.h ] && { echo /usr/local/cuda; return; }
    return 1
}

# A folder holding libcuda.so to link against: the driver's library, else the toolkit's stub.
libcuda_dir() {
    local root=$1 lib d
    if [ -n "${LIBCUDA_DIR:-}" ]; then echo "$LIBCUDA_DIR"; return; fi
    lib=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so(\.1)? .*x86-64|libcuda\.so(\.1)? .*AArch64/ {print $NF; exit}')
    if [ -z "$lib" ]; then
        local IFS_SAVE=$IFS; IFS=:
        set -- ${LD_LIBRARY_PATH:-}
        IFS=$IFS_SAVE
        for d in "$@" /usr/local/nvidia/lib64 /usr/lib/x86_64-linux-gnu /usr/lib/aarch64-linux-gnu /usr/lib64 /usr/lib/wsl/lib; do
            for f in "$d/libcuda.so.1" "$d/libcuda.so"; do [ -e "$f" ] && { lib=$f; break 2; }; done
        done
    fi
    if [ -n "$lib" ]; then                              # link through a folder whose libcuda.so is it
        d=$(mktemp -d /tmp/libcuda-link.XXXXXX)
        ln -s "$(readlink -f "$lib")" "$d/libcuda.so"
        echo "$d"; return
    fi
    for d in "$root/lib64/stubs" "$root/lib/stubs" "$root/targets/$(uname -m)-linux/lib/stubs"; do
        [ -e "$d/libcuda.so" ] && { echo "$d"; return; }
    done
    return 1
}

"$PY" -c "import os, sysconfig, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))" \
    || die "no Python.h for $("$PY" --version) (PyCUDA compiles a C++ extension): install the Python development headers"
"$PY" -c "import numpy" 2>/dev/null || die "numpy is not importable by $PY (PyCUDA builds against it)"
ROOT_DIR=$(cuda_root) || die "no CUDA toolkit found (no include/cuda.h under CUDA_ROOT, CUDA_HOME, nvcc's folder or /usr/local/cuda); install the CUDA toolkit"
LIB_DIR=$(libcuda_dir "$ROOT_DIR") || die "no libcuda.so to link against: install the NVIDIA driver (or set LIBCUDA_DIR to the toolkit's lib64/stubs)"
echo "install_pycuda: CUDA toolkit $ROOT_DIR, libcuda from $LIB_DIR, $($PY --version)"

WORK=$(mktemp -d /tmp/pycuda-build.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
if [ -n "$OFFLINE" ]; then
    SDIST=$(ls "$OFFLINE"/pycuda-*.tar.gz 2>/dev/null | head -1)
    [ -n "$SDIST" ] || die "no pycuda-*.tar.gz in $OFFLINE (run scripts/prepare_gpu_wheels.sh where PyPI is reachable)"
else
    "$PY" -m pip download --quiet --no-deps --no-binary pycuda -d "$WORK" "pycuda==$VERSION"
    SDIST=$(ls "$WORK"/pycuda-*.tar.gz | head -1)
fi
tar xzf "$SDIST" -C "$WORK"
SRC=$(ls -d "$WORK"/pycuda-*/ | head -1)
cat > "$SRC/siteconf.py" <<EOF
CUDA_ROOT = '$ROOT_DIR'
CUDA_ENABLE_CURAND = False
CUDADRV_LIB_DIR = ['$LIB_DIR']
EOF

PIP=("$PY" -m pip install --no-cache-dir --disable-pip-version-check)
[ -n "$TARGET" ] && PIP+=(--target "$TARGET" --upgrade)
if [ -n "$OFFLINE" ]; then
    # the pure-Python dependencies first, then PyCUDA built against this Python's numpy and setuptools
    "${PIP[@]}" --quiet --no-index --find-links "$OFFLINE" pytools platformdirs mako
    "${PIP[@]}" --no-index --no-build-isolation --no-deps "$SRC"
else
    "${PIP[@]}" "$SRC"
fi
echo "install_pycuda: PyCUDA $VERSION installed${TARGET:+ into $TARGET}"
