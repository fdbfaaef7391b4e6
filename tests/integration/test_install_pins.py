"""The CUDA and Ascend engine pins (scripts/pins/*.txt) still resolve, without installing them.

Each stack is resolved for the hosts it is for (CPython 3.11, glibc 2.35; CUDA on x86_64,
Ascend on aarch64 and x86_64) by `uv pip compile --python-platform ... --only-binary :all:`:
nothing is built or installed, wheels' metadata is read with HTTP range requests, environment
markers are evaluated for the target (pip's `install --dry-run --platform` evaluates them for
this machine, and took ~200 s for the three stacks here against ~10 s). Every pinned
distribution must resolve to its pin. The index is PyPI alone: no config file, no UV_*
variable of this host takes part.

What PyPI cannot give stands in as a metadata-only wheel of the pinned version (STAND_INS,
with the reason; their own dependencies are not resolved). vLLM for Ascend is built from its
source (VLLM_TARGET_DEVICE=empty, scripts/install.sh), so its requirements come from its sdist's
requirements/common.txt. Needs the package index (ASCENDSERVE_TEST_OFFLINE=1 skips); tests/conftest.py
keeps the module out of --quick.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tarfile
import urllib.request
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PINS = REPO / "scripts" / "pins"
GLIBC = "2_35"  # Ubuntu 22.04, the OS of vllm-ascend's CANN image; mooncake's Ascend wheels need it
UV_TIMEOUT_S = 300
STACKS = {  # name: (pins file, machine)
    "cuda-x86_64": ("cuda.txt", "x86_64"),
    "npu-aarch64": ("npu.txt", "aarch64"),
    "npu-x86_64": ("npu.txt", "x86_64"),
}
# (device, machine or None for any, distribution, local version label, why it stands in)
STAND_INS = [
    ("npu", None, "triton-ascend", "", "on Ascend's index only (install.sh's ASCEND_INDEX); PyPI stops at 3.2.0"),
    ("npu", None, "arctic-inference", "", "an sdist only on PyPI, whose build needs torch 2.7.0"),
    ("npu", "x86_64", "torch", "+cpu", "torch-npu's x86_64 wheel requires torch's +cpu build, on PyTorch's "
                                       "CPU index only (install.sh's TORCH_CPU_INDEX)"),
]
BUILT_FROM_SOURCE = {"npu": "vllm"}  # VLLM_TARGET_DEVICE=empty: its sdist's requirements/common.txt

# The package index is needed (CI reaches it); ASCENDSERVE_TEST_OFFLINE=1 skips these where it is not.
needs_pypi = pytest.mark.skipif(os.environ.get("ASCENDSERVE_TEST_OFFLINE") == "1",
                                reason="ASCENDSERVE_TEST_OFFLINE=1: no package index")


def read_pins(name: str) -> dict[str, Requirement]:
    reqs = [Requirement(line.strip()) for line in (PINS / name).read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")]
    return {canonicalize_name(r.name): r for r in reqs}


def pinned_version(req: Requirement) -> str:
    (spec,) = req.specifier
    return spec.version


def _stand_in(directory: Path, name: str, version: str) -> None:
    """A wheel with nothing but metadata: enough for a resolution."""
    dist = f"{name.replace('-', '_')}-{version}"
    meta = {f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
            f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    meta[f"{dist}.dist-info/RECORD"] = "".join(f"{path},,\n" for path in meta) + f"{dist}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(directory / f"{dist}-py3-none-any.whl", "w") as wheel:
        for path, text in meta.items():
            wheel.writestr(path, text)


def index_url() -> str:
    """The package index pip would use: PIP_INDEX_URL, else pip's own default."""
    from pip._internal.models.index import PyPI

    return os.environ.get("PIP_INDEX_URL") or PyPI.simple_url


def sdist_requirements(name: str, version: str) -> list[str]:
    """requirements/common.txt of `name`'s source release on the index, read as the archive streams
    past (pip would build the sdist's metadata, which for vLLM needs its build environment)."""
    request = urllib.request.Request(f"{index_url().rstrip('/')}/{name}/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        files = json.load(r)["files"]
    url = next((f["url"] for f in files if f["filename"] == f"{name}-{version}.tar.gz"), None)
    assert url, f"{name} {version} has no source release on the index, and the Ascend stack builds it from source"
    wanted = f"{name}-{version}/requirements/common.txt"
    with urllib.request.urlopen(url, timeout=120) as r, tarfile.open(fileobj=r, mode="r|gz") as tar:
        for member in tar:
            if member.name == wanted:
                text = tar.extractfile(member).read().decode()
                lines = [line.split("#")[0].strip() for line in text.splitlines()]
                assert not any(line.startswith("-") for line in lines), f"{wanted} includes other files now"
                return [line for line in lines if line]
    raise AssertionError(f"{wanted} is not in the sdist: how vLLM lists its requirements changed")


def compile_stack(machine: str, requirements: list[str], tmp: Path) -> subprocess.CompletedProcess:
    """uv's resolution of `requirements` for Linux `machine`, CPython 3.11, wheels only."""
    from uv import find_uv_bin

    (tmp / "requirements.in").write_text("\n".join(requirements) + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("UV_")}
    return subprocess.run([find_uv_bin(), "pip", "compile", "--no-config", "--no-cache", "--quiet",
                           "--index-url", index_url(), "--find-links", str(tmp / "stand-ins"),
                           "--python-version", "3.11", "--python-platform", f"{machine}-manylinux_{GLIBC}",
                           "--only-binary", ":all:", "--no-annotate", "--no-header", str(tmp / "requirements.in")],
                          capture_output=True, text=True, timeout=UV_TIMEOUT_S, env=env)


def plan(stack: str, pins: dict[str, Requirement], tmp: Path) -> tuple[list[str], dict[str, str]]:
    """What uv resolves for `stack` (its stand-ins made under tmp), and why each stand-in stands in."""
    device, machine = stack.split("-", 1)
    (tmp / "stand-ins").mkdir(parents=True, exist_ok=True)
    reasons = {}
    for prefix, arch, dist, local, why in STAND_INS:
        if prefix == device and arch in (None, machine):
            _stand_in(tmp / "stand-ins", dist, pinned_version(pins[dist]) + local)
            reasons[dist] = why
    source = BUILT_FROM_SOURCE.get(device)
    reqs = [str(r) for name, r in pins.items() if name != source]
    if source:
        reqs += sdist_requirements(source, pinned_version(pins[source]))
    return reqs, reasons


def resolved(output: str) -> dict[str, str]:
    return {canonicalize_name(m.group(1)): m.group(2)
            for m in re.finditer(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", output, re.MULTILINE)}


@needs_pypi
@pytest.mark.parametrize("stack", sorted(STACKS))
def test_pins_resolve_to_themselves(tmp_path, stack):
    pins_file, machine = STACKS[stack]
    pins = read_pins(pins_file)
    reqs, reasons = plan(stack, pins, tmp_path)
    done = compile_stack(machine, reqs, tmp_path)
    assert done.returncode == 0, f"scripts/pins/{pins_file} does not resolve for {stack}:\n{done.stderr[-3000:]}"
    versions = resolved(done.stdout)
    for name, pin in pins.items():
        if name == BUILT_FROM_SOURCE.get(stack.split("-")[0]):
            continue  # its sdist was found and read (sdist_requirements)
        assert name in versions, f"{name} is pinned but not resolved for {stack}"
        assert pin.specifier.contains(versions[name], prereleases=True), \
            f"{stack}: {name} resolved to {versions[name]}, pinned {pin.specifier}"
    assert len(versions) > 3 * len(pins), versions  # a real dependency tree was resolved, not just the pins
    print(f"{stack}: {len(versions)} distributions; stood in: " + "; ".join(f"{k} ({v})" for k, v in reasons.items()))


@needs_pypi
def test_a_pin_pypi_does_not_have_fails_the_resolution(tmp_path):
    """The check above can fail: one impossible pin and the stack does not resolve."""
    pins = read_pins("cuda.txt")
    reqs, _ = plan("cuda-x86_64", pins, tmp_path)
    reqs = [r for r in reqs if not r.startswith("torch==")] + ["torch==2.13.0.post999"]
    done = compile_stack("x86_64", reqs, tmp_path)
    assert done.returncode != 0 and "torch==2.13.0.post999" in done.stderr, done.stderr[-2000:]
    assert not resolved(done.stdout)


def test_pins_are_exact_and_install_sh_reads_them():
    """Offline: one `name==version` per line, and install.sh installs from these two files."""
    for name in ("cuda.txt", "npu.txt"):
        pins = read_pins(name)
        assert pins and all(len(r.specifier) == 1 and next(iter(r.specifier)).operator == "=="
                            for r in pins.values()), pins
    script = (REPO / "scripts" / "install.sh").read_text()
    assert "scripts/pins/cuda.txt" in script and "scripts/pins/npu.txt" in script
