#!/usr/bin/env bash
# Build the release: native ops, a PyInstaller one-folder bundle of the whole
# program (engine included) and the self-contained tarball.
#
#   ./build.sh [--out DIR] [--no-tar] [--allow-no-native]
#
#   --out DIR           where the tree and tarball go (default dist/)
#   --no-tar            stop after the bundle tree
#   --allow-no-native   go on without native/ ops (torch/numpy fallback)
#
# Output: DIR/ascendserve-<version>-<device>-<arch>/{bin,conf,systemd,install.sh,README.md,BUILD_INFO,SHA256SUMS}
#         DIR/ascendserve-<version>-<device>-<arch>.tar.gz (+ .sha256)
# ASCENDSERVE_VENV: the environment the program is frozen from (default ~/.venvs/ascendserve).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
VENV=${ASCENDSERVE_VENV:-$HOME/.venvs/ascendserve}
PY=$VENV/bin/python
PYINSTALLER_VERSION=6.22.3
OUT=$HERE/dist TAR=1 ALLOW_NO_NATIVE=0

while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT=$2; shift 2 ;;
        --no-tar) TAR=0; shift ;;
        --allow-no-native) ALLOW_NO_NATIVE=1; shift ;;
        -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
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
phase_done setup

# 3. the bundle (work files in build/, gitignored; measured: a rebuild after code edits redoes the
#    whole analysis, ~5 min, so keeping them saves nothing worth a cache)
WORK=$HERE/build/pyinstaller-$DEVICE
rm -rf "$TREE" "$OUT/.pyinstaller-dist"
ASCENDSERVE_REPO=$HERE "$PY" -m PyInstaller --noconfirm --log-level WARN \
    --workpath "$WORK" --distpath "$OUT/.pyinstaller-dist" "$HERE/packaging/ascendserve.spec"
mkdir -p "$TREE"
mv "$OUT/.pyinstaller-dist/ascendserve" "$TREE/bin"  # bin/ascendserve + bin/_internal/
rmdir "$OUT/.pyinstaller-dist"
phase_done bundle

# 4. the release tree around it
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
INFO
(cd "$TREE" && find . -type f ! -name SHA256SUMS -print0 | sort -z | xargs -0 sha256sum > SHA256SUMS)
phase_done tree

# 5. the tarball: gzip -1, measured on this bundle (2 cores): 700 MiB in 31 s; -6: 633 MiB in 83 s.
#    pigz, when installed, does the same on every core.
if [ "$TAR" = 1 ]; then
    GZ="gzip -1"
    command -v pigz >/dev/null && GZ="pigz -1"
    tar -C "$OUT" -cf - "$NAME" | $GZ > "$OUT/$NAME.tar.gz.partial"
    mv "$OUT/$NAME.tar.gz.partial" "$OUT/$NAME.tar.gz"
    (cd "$OUT" && sha256sum "$NAME.tar.gz" > "$NAME.tar.gz.sha256")
    phase_done tarball
fi
say "$(awk -v a="$START" -v b="$(date +%s.%N)" 'BEGIN { printf "total      %6.1f s", b - a }')"
say "bundle $(du -sh "$TREE" | cut -f1) $TREE"
[ "$TAR" = 1 ] && say "tarball $(du -h "$OUT/$NAME.tar.gz" | cut -f1) $OUT/$NAME.tar.gz"
echo "$TREE"
