#!/usr/bin/env bash
# Build libascendserve_ops.so (the torch.ops.ascendserve kernels) and copy it
# to OUT_DIR (default: ascendserve/_native/, where ascendserve/ops.py loads it).
#
#   native/build.sh [OUT_DIR]
#
# PYTHON   the python whose torch to build against (default: the venv's,
#          $ASCENDSERVE_VENV or ~/.venvs/ascendserve, else python3)
# Build tree: build/native/ (incremental; a no-op rebuild takes about a second).
# Output: cmake/ninja logs go to build/native/build.log, shown on failure; the
# last line says what was built.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HERE")
OUT=${1:-$REPO/ascendserve/_native}
BUILD=$REPO/build/native
LIB=libascendserve_ops.so
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

mkdir -p "$OUT"
if ! cmp -s "$BUILD/$LIB" "$OUT/$LIB"; then
    # a new inode, never an overwrite: a process may have the old one mapped
    cp "$BUILD/$LIB" "$OUT/.$LIB.tmp.$$"
    mv -f "$OUT/.$LIB.tmp.$$" "$OUT/$LIB"
fi
secs=$(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN { printf "%.1f", e - s }')
echo "native: $OUT/$LIB ready (CPU kernels; device tensors use the torch reference) in ${secs}s"
