#!/usr/bin/env bash
# Build the release: native ops, a PyInstaller one-folder bundle of the whole
# program (engine included) and the self-contained tarball.
#
#   ./build.sh [--out DIR] [--no-tar] [--allow-no-native] [--rebuild]
#
#   --out DIR           where the tree and tarball go (default dist/)
#   --no-tar            stop after the bundle tree
#   --allow-no-native   go on without native/ ops (torch/numpy fallback)
#   --rebuild           run PyInstaller even when a cached bundle matches
#
# Output: DIR/ascendserve-<version>-<device>-<arch>/{bin,conf,systemd,install.sh,README.md,BUILD_INFO,SHA256SUMS}
#         DIR/ascendserve-<version>-<device>-<arch>.tar.gz (+ .sha256)
# ASCENDSERVE_VENV: the environment the program is frozen from (default ~/.venvs/ascendserve).
# ASCENDSERVE_BUILD_CACHE: where PyInstaller bundles are kept (default ~/.cache/ascendserve/build),
#   one per key of packaging/build_key.py (the dependencies, the spec, the entry, the release name,
#   what our code imports); our own code (ascendserve/, roles/, the native library) is copied into
#   every build afresh, so editing it reuses the bundle ("reused build KEY"; else "building KEY").
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
VENV=${ASCENDSERVE_VENV:-$HOME/.venvs/ascendserve}
PY=$VENV/bin/python
PYINSTALLER_VERSION=6.22.3
OUT=$HERE/dist TAR=1 ALLOW_NO_NATIVE=0 REBUILD=0
CACHE_ROOT=${ASCENDSERVE_BUILD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ascendserve/build}
CACHE_KEEP=2          # bundles kept in CACHE_ROOT (~2 GB each), the newest
BUNDLE_FORMAT=1       # bump when the bundle stage below changes what it leaves in the cache
OURS=(ascendserve roles)               # our packages: collected as .py (the spec), replaced on every build
PY_PACKAGES=(torch vllm transformers)  # the spec's other "py"-mode packages: __pycache__ compiled once

while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT=$2; shift 2 ;;
        --no-tar) TAR=0; shift ;;
        --allow-no-native) ALLOW_NO_NATIVE=1; shift ;;
        --rebuild) REBUILD=1; shift ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) echo "build.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

say() { printf '[build] %s\n' "$*" >&2; }
START=$(date +%s.%N) PHASE_START=$START
phase_done() {
    local now; now=$(date +%s.%N)
    say "$(awk -v a="$PHASE_START" -v b="$now" -v n="$1" 'BEGIN { printf "%-10s %6.1f s", n, b - a }')"
    PHASE_START=$now
}

# 1. native ops (native/build.sh puts the library into ascendserve/_native/)
if [ -f "$HERE/native/build.sh" ] && bash "$HERE/native/build.sh"; then
    phase_done native
elif [ "$ALLOW_NO_NATIVE" = 1 ]; then
    say "native ops not built (native/build.sh absent or failed); going on: --allow-no-native"
else
    say "native ops not built (native/build.sh absent or failed); pass --allow-no-native to build without them"
    exit 1
fi

# 2. PyInstaller, pinned: the spec relies on its hooks' behaviour
if ! "$PY" -m PyInstaller --version 2>/dev/null | grep -qx "$PYINSTALLER_VERSION"; then
    "$VENV/bin/pip" install -q "pyinstaller==$PYINSTALLER_VERSION"
fi
read -r VERSION DEVICE < <("$PY" - <<'PY'
import importlib.util
import ascendserve
# find_spec, not import: importing torch_npu initialises the NPU runtime
if importlib.util.find_spec("torch_npu"):
    device = "ascend"
else:
    import torch
    device = "cuda" if torch.version.cuda else "cpu"
print(ascendserve.__version__, device)
PY
)
NAME=ascendserve-$VERSION-$DEVICE-$(uname -m)
TREE=$OUT/$NAME

GZ="gzip -1"  # measured on this bundle (2 cores): 700 MiB in 31 s; -6: 633 MiB in 83 s
command -v pigz >/dev/null && GZ="pigz -1"  # the same on every core
# the inputs, taken once: the build can outlast edits to the checkout; they are stored in the entry
INPUTS=$("$PY" "$HERE/packaging/build_key.py" "$HERE" "$BUNDLE_FORMAT" "$VERSION" "$DEVICE" --inputs)
KEY=$(printf '%s\n' "$INPUTS" | sha256sum | cut -c1-24)
ENTRY=$CACHE_ROOT/$KEY
phase_done setup

# 3. the bundle, from the cache when its key matches. An entry holds $NAME/bin (without our
#    packages), bin.sha256 (its SHA256SUMS lines) and, once a tarball was made, bin.tar.gz: that
#    tree as a tar stream without its end-of-archive blocks, so our files' small tar can follow it
#    (a tarball = the two gzip members, one after the other: tar -xzf reads both).
#    PyInstaller's work files go to build/ (gitignored).
compile_pycs() {  # dir...: __pycache__ for .py files imported from disk; the frozen
    # interpreter never writes it, and unchecked-hash pycs stay valid whatever the files' mtimes
    # (-q: only failures are printed, files that would not import either)
    "$PY" -m compileall -q -j 0 --invalidation-mode unchecked-hash "$@" || say "compileall: some files did not compile"
}
if [ "$REBUILD" = 0 ] && [ -f "$ENTRY/DONE" ]; then
    say "reused build $KEY"
    touch "$ENTRY"  # most recently used: pruned last
else
    say "building $KEY"
    mkdir -p "$CACHE_ROOT"
    STAGE=$(mktemp -d "$CACHE_ROOT/.partial-$KEY.XXXXXX")
    trap 'rm -rf "$STAGE"' EXIT
    ASCENDSERVE_REPO=$HERE "$PY" -m PyInstaller --noconfirm --log-level WARN \
        --workpath "$HERE/build/pyinstaller-$DEVICE" --distpath "$STAGE/dist" "$HERE/packaging/ascendserve.spec"
    mkdir "$STAGE/$NAME"
    mv "$STAGE/dist/ascendserve" "$STAGE/$NAME/bin"  # bin/ascendserve + bin/_internal/
    rmdir "$STAGE/dist"
    INTERNAL=$STAGE/$NAME/bin/_internal
    for pkg in "${OURS[@]}"; do rm -rf "${INTERNAL:?}/$pkg"; done
    for pkg in "${PY_PACKAGES[@]}"; do
        [ -d "$INTERNAL/$pkg" ] || { say "the spec collected no $pkg/ as .py files"; exit 1; }
    done
    compile_pycs "${PY_PACKAGES[@]/#/$INTERNAL/}"
    (cd "$STAGE/$NAME" && find ./bin -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum) > "$STAGE/bin.sha256"
    printf '%s\n' "$INPUTS" > "$STAGE/INPUTS"
    touch "$STAGE/DONE"
    rm -rf "$ENTRY"  # --rebuild, or a half-removed entry
    mv -T "$STAGE" "$ENTRY" 2>/dev/null || rm -rf "$STAGE"  # a concurrent build of the same key won: keep its
    trap - EXIT
    # prune: keep the newest CACHE_KEEP entries
    ls -1dt "$CACHE_ROOT"/*/ 2>/dev/null | tail -n +$((CACHE_KEEP + 1)) | while read -r old; do
        if [ "${old%/}" != "$ENTRY" ]; then rm -rf "$old"; fi
    done
fi
phase_done bundle

# 4. the release tree: the cached bundle, our packages from this checkout, the rest
rm -rf "$TREE"
mkdir -p "$TREE"
cp -a "$ENTRY/$NAME/bin" "$TREE/bin"
for pkg in "${OURS[@]}"; do  # sources and the native library, not caches or build leftovers
    (cd "$HERE" && find "$pkg" \( -name __pycache__ -o -name '*.egg-info' \) -prune -o -type f ! -name '*.pyc' -print0 \
        | xargs -0 cp --parents -t "$TREE/bin/_internal")
done
compile_pycs "${OURS[@]/#/$TREE/bin/_internal/}"
cp -r "$HERE/conf" "$TREE/conf"
[ -d "$HERE/packaging/systemd" ] && cp -r "$HERE/packaging/systemd" "$TREE/systemd"
[ -f "$HERE/packaging/install.sh" ] && install -m 755 "$HERE/packaging/install.sh" "$TREE/install.sh"
if [ -f "$HERE/packaging/README.md" ]; then
    cp "$HERE/packaging/README.md" "$TREE/README.md"
else
    cat > "$TREE/README.md" <<README
# ascendserve $VERSION ($DEVICE, $(uname -m))

A self-contained build: Python, torch and vLLM are inside bin/; nothing to install.

    bin/ascendserve --role all                  a demo cluster on this host
    bin/ascendserve --role ROLE --help          one role's flags
    bin/ascendserve --role pd --config conf/pd.toml

conf/ holds a commented config per role. Check the files: sha256sum -c SHA256SUMS
README
fi
COMMIT=$(git -C "$HERE" rev-parse HEAD 2>/dev/null || echo unknown)
DIRTY=$([ -n "$(git -C "$HERE" status --porcelain 2>/dev/null)" ] && echo yes || echo no)
cat > "$TREE/BUILD_INFO" <<INFO
version=$VERSION
device=$DEVICE
arch=$(uname -m)
commit=$COMMIT
dirty=$DIRTY
built=$(date -u +%Y-%m-%dT%H:%M:%SZ)
bundle=$KEY
INFO
# everything but the cached bundle's files, whose sums were taken once
FRESH=(conf README.md BUILD_INFO "${OURS[@]/#/bin/_internal/}")
[ -d "$TREE/systemd" ] && FRESH+=(systemd)
[ -f "$TREE/install.sh" ] && FRESH+=(install.sh)
(cd "$TREE" && { cat "$ENTRY/bin.sha256"; find "${FRESH[@]/#/./}" -type f -print0 | xargs -0 sha256sum; } \
    | LC_ALL=C sort -k2 > SHA256SUMS)
phase_done tree

# 5. the tarball: the bundle's gzip member (made once per cache entry), then ours
if [ "$TAR" = 1 ]; then
    if [ ! -f "$ENTRY/bin.tar.gz" ]; then
        # -b 1: 512-byte records, so the stream ends in exactly the two zero blocks that head drops
        tar -C "$ENTRY" -b 1 -cf - "$NAME/bin" | head -c -1024 | $GZ > "$ENTRY/bin.tar.gz.partial.$$"
        mv "$ENTRY/bin.tar.gz.partial.$$" "$ENTRY/bin.tar.gz"
    fi
    { cat "$ENTRY/bin.tar.gz"; tar -C "$OUT" -cf - "${FRESH[@]/#/$NAME/}" "$NAME/SHA256SUMS" | $GZ; } \
        > "$OUT/$NAME.tar.gz.partial"
    mv "$OUT/$NAME.tar.gz.partial" "$OUT/$NAME.tar.gz"
    (cd "$OUT" && sha256sum "$NAME.tar.gz" > "$NAME.tar.gz.sha256")
    phase_done tarball
fi
say "$(awk -v a="$START" -v b="$(date +%s.%N)" 'BEGIN { printf "total      %6.1f s", b - a }')"
say "bundle $(du -sh "$TREE" | cut -f1) $TREE"
[ "$TAR" = 1 ] && say "tarball $(du -h "$OUT/$NAME.tar.gz" | cut -f1) $OUT/$NAME.tar.gz"
echo "$TREE"
