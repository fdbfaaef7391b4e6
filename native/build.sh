#!/usr/bin/env bash
# Build libascendserve_ops.so (the torch.ops.ascendserve CPU kernels),
# libascendserve_xfer.so (the KV side channel's socket I/O off the GIL, a plain C
# ABI for ctypes: ascendserve/connectors/transport/native.py) and, when
# an nvcc is found, libascendserve_cuda.so (CUDA kernels behind a plain C ABI,
# no torch: ascendserve/ops_cuda.py calls them through ctypes); copy them to OUT_DIR
# (default: ascendserve/_native/, where ascendserve/ops.py loads them).
#
#   native/build.sh [OUT_DIR]
#
# PYTHON   the python whose torch to build against (default: the venv's,
#          $ASCENDSERVE_VENV or ~/.venvs/ascendserve, else python3)
# NVCC     the nvcc to use (default: nvcc on PATH, else /usr/local/cuda/bin/nvcc;
#          none: no CUDA library). Any CUDA toolkit: torch may be a CPU build.
# ASCENDSERVE_CUDA_ARCHS   GPU architectures, e.g. "80,90" (the default): SASS
#          for each, plus PTX of the last one for newer GPUs
# ASCENDSERVE_REQUIRE_CUDA=1   fail when the CUDA library is not built (by
#          default a failed or impossible CUDA build is reported, and the CPU
#          library still ships)
# Build tree: build/native/ (incremental; a no-op rebuild takes about a second).
# Output: cmake/ninja/nvcc logs go to build/native/build.log, shown on failure;
# the last line says what was built.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HERE")
OUT=${1:-$REPO/ascendserve/_native}
BUILD=$REPO/build/native
LIB=libascendserve_ops.so
XFER_LIB=libascendserve_xfer.so
VENV=${ASCENDSERVE_VENV:-$HOME/.venvs/ascendserve}
if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
elif [ -x "$VENV/bin/python" ]; then
    PY=$VENV/bin/python
else
    PY=python3
fi

fail() { printf 'native: FAILED: %s\n' "$*" >&2; exit 1; }

command -v cmake >/dev/null 2>&1 || fail "cmake not found (apt-get install cmake, or pip install cmake)"
CXX_BIN=${CXX:-}
if [ -z "$CXX_BIN" ]; then
    for c in c++ g++ clang++; do command -v "$c" >/dev/null 2>&1 && { CXX_BIN=$c; break; }; done
fi
[ -n "$CXX_BIN" ] && command -v "$CXX_BIN" >/dev/null 2>&1 \
    || fail "no C++ compiler found (apt-get install g++, or set CXX)"
if command -v ninja >/dev/null 2>&1; then
    GEN=Ninja
else
    GEN="Unix Makefiles"
    BUILD=$REPO/build/native-make
fi

mkdir -p "$BUILD"
LOG=$BUILD/build.log
exec 9>"$BUILD/.lock"
flock 9  # concurrent builds (tests, CI) share one tree
: > "$LOG"
start=$(date +%s.%N)

# Configure only when needed: the torch import costs seconds. A configured
# tree re-runs cmake by itself when CMakeLists.txt changes.
STAMP=$BUILD/.python
if [ ! -f "$BUILD/CMakeCache.txt" ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$PY" ]; then
    command -v "$PY" >/dev/null 2>&1 || fail "python '$PY' not found (set PYTHON)"
    prefix=$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>>"$LOG") \
        || fail "torch is not importable by $PY (set PYTHON to a python with torch): $(tail -n 1 "$LOG")"
    rm -f "$STAMP" "$BUILD/CMakeCache.txt"  # another python: find torch afresh
    if ! cmake -G "$GEN" -S "$HERE" -B "$BUILD" -DCMAKE_PREFIX_PATH="$prefix" \
            -DCMAKE_CXX_COMPILER="$CXX_BIN" -DCMAKE_BUILD_TYPE=Release >>"$LOG" 2>&1; then
        tail -n 30 "$LOG" >&2
        fail "cmake configure failed (full log: $LOG)"
    fi
    echo "$PY" > "$STAMP"
    # what configure found (torch, device toolchains): shown once per configure
    sed -n 's/^-- ascendserve: /native: /p' "$LOG" >&2
fi
if ! cmake --build "$BUILD" -j "$(nproc 2>/dev/null || echo 2)" >>"$LOG" 2>&1; then
    tail -n 40 "$LOG" >&2
    fail "compile failed (full log: $LOG)"
fi

# ---- CUDA kernels (optional): libascendserve_cuda.so ---------------------------
# Compiled straight with nvcc, not CMake's CUDA language: no torch and no
# configure step (enable_language(CUDA) probes the toolkit for ~10 s). The CUDA
# runtime is linked statically, so the library needs only the driver's
# libcuda.so, opened on first use (it loads on hosts without one); its symbols
# are hidden, so it never binds to the cudart torch brought.
CUDA_LIB=libascendserve_cuda.so
CUDA_SRC=$HERE/csrc/block_copy_cuda.cu
CUDA_BUILD=$BUILD/cuda
CUDA_NOTE=""  # what the last line says about CUDA

find_nvcc() {
    if [ -n "${NVCC:-}" ]; then
        echo "$NVCC"
    elif command -v nvcc >/dev/null 2>&1; then
        command -v nvcc
    elif [ -x /usr/local/cuda/bin/nvcc ]; then
        echo /usr/local/cuda/bin/nvcc
    fi
}

# ASCENDSERVE_CUDA_ARCHS ("80,90", commas, semicolons or spaces) -> GENCODE
# flags, SM_LIST "sm_80,sm_90" and PTX_ARCH "compute_90"; 1 if malformed.
cuda_archs() {
    local spec=${ASCENDSERVE_CUDA_ARCHS:-80,90} archs=() a
    GENCODE=()
    SM_LIST=""
    IFS=' ,;' read -r -a archs <<<"$spec"
    for a in "${archs[@]}"; do
        [ -n "$a" ] || continue
        [[ $a =~ ^[0-9]{2,3}[af]?$ ]] || return 1
        GENCODE+=(-gencode "arch=compute_$a,code=sm_$a")
        SM_LIST+="${SM_LIST:+,}sm_$a"
        PTX_ARCH=compute_$a
    done
    [ -n "$SM_LIST" ] || return 1
    GENCODE[${#GENCODE[@]}-1]="arch=$PTX_ARCH,code=[sm_${PTX_ARCH#compute_},$PTX_ARCH]"  # + PTX of the last
}

# Builds $CUDA_BUILD/$CUDA_LIB when its stamp (nvcc, its version, the flags,
# the source's hash) changed; sets CUDA_NOTE. 0: ready, 1: failed, 2: no nvcc.
build_cuda() {
    local nvcc version flags stamp
    nvcc=$(find_nvcc)
    if [ -z "$nvcc" ]; then
        CUDA_NOTE="no nvcc: no CUDA kernels"
        return 2
    fi
    if ! version=$("$nvcc" --version 2>>"$LOG" | tail -n 1) || [ -z "$version" ]; then
        CUDA_NOTE="CUDA kernels NOT built: '$nvcc --version' failed"
        return 1
    fi
    if ! cuda_archs; then
        CUDA_NOTE="CUDA kernels NOT built: ASCENDSERVE_CUDA_ARCHS='${ASCENDSERVE_CUDA_ARCHS:-}' is not like 80,90"
        return 1
    fi
    flags=(-O3 -std=c++17 -shared -Xcompiler -fPIC,-fvisibility=hidden,-Wall,-Wextra,-Wno-unknown-pragmas
           -Xlinker --exclude-libs,ALL -cudart static "${GENCODE[@]}")
    stamp=$(printf '%s\n' "$nvcc" "$version" "${flags[*]}" "$(sha256sum <"$CUDA_SRC")")
    mkdir -p "$CUDA_BUILD"
    if [ ! -f "$CUDA_BUILD/$CUDA_LIB" ] || [ "$(cat "$CUDA_BUILD/stamp" 2>/dev/null)" != "$stamp" ]; then
        echo "== $nvcc ${flags[*]}" >>"$LOG"
        rm -f "$CUDA_BUILD/stamp"
        if ! "$nvcc" "${flags[@]}" --threads "$(nproc 2>/dev/null || echo 2)" \
                -o "$CUDA_BUILD/.$CUDA_LIB.tmp" "$CUDA_SRC" >>"$LOG" 2>&1; then
            tail -n 30 "$LOG" >&2
            CUDA_NOTE="CUDA kernels NOT built: nvcc failed (full log: $LOG)"
            return 1
        fi
        # a library that does not load (an unresolved symbol) is no library
        if ! "$PY" -c 'import ctypes, sys; assert ctypes.CDLL(sys.argv[1]).asv_cuda_abi_version() > 0' \
                "$CUDA_BUILD/.$CUDA_LIB.tmp" >>"$LOG" 2>&1; then
            tail -n 5 "$LOG" >&2
            CUDA_NOTE="CUDA kernels NOT built: $CUDA_LIB does not load (full log: $LOG)"
            return 1
        fi
        mv -f "$CUDA_BUILD/.$CUDA_LIB.tmp" "$CUDA_BUILD/$CUDA_LIB"
        echo "$stamp" >"$CUDA_BUILD/stamp"
    fi
    local tested="not tested on this host: no GPU"
    if ls /proc/driver/nvidia/gpus/* >/dev/null 2>&1; then
        tested="a GPU is here: tests/unit/test_native_cuda.py checks them"
    fi
    CUDA_NOTE="CUDA kernels $CUDA_LIB for $SM_LIST + $PTX_ARCH PTX ($tested)"
}

# a new inode, never an overwrite: a process may have the old one mapped
install_lib() {
    if ! cmp -s "$1" "$OUT/$2"; then
        cp "$1" "$OUT/.$2.tmp.$$"
        mv -f "$OUT/.$2.tmp.$$" "$OUT/$2"
    fi
}

mkdir -p "$OUT"
install_lib "$BUILD/$LIB" "$LIB"
install_lib "$BUILD/$XFER_LIB" "$XFER_LIB"
cuda_rc=0
build_cuda || cuda_rc=$?
if [ "$cuda_rc" = 0 ]; then
    install_lib "$CUDA_BUILD/$CUDA_LIB" "$CUDA_LIB"
else
    rm -f "$OUT/$CUDA_LIB"  # OUT holds what this build made: no stale CUDA library
    [ "${ASCENDSERVE_REQUIRE_CUDA:-0}" != 1 ] || fail "ASCENDSERVE_REQUIRE_CUDA=1: $CUDA_NOTE"
    [ "$cuda_rc" = 2 ] || echo "native: $CUDA_NOTE; going on with the CPU library" >&2
fi
secs=$(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN { printf "%.1f", e - s }')
echo "native: $OUT/$LIB ready (CPU kernels; $CUDA_NOTE; KV transfer I/O $XFER_LIB) in ${secs}s"
