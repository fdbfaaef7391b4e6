"""CUDA: the driver, NCCL, and peer access between GPUs, before a multi-GPU or multi-node start.

    cuda driver  nvidia-smi: the driver's version and the newest CUDA it runs, against the
                 CUDA torch was built for (the device probe's torch.version.cuda)
    nccl         the NCCL library torch loads (torch.cuda.nccl.version(), in the probe)
    cuda p2p     torch.cuda.can_device_access_peer for every pair of GPUs (in the probe), with
                 the link between each pair from `nvidia-smi topo -m` (NV#: NVLink; PIX, PXB,
                 PHB: PCIe; NODE, SYS: through the CPUs)
A check that cannot run (no driver tools, a CPU torch, one GPU) says why and does not fail.
"""

from __future__ import annotations

import re
import shutil
from collections import Counter

from ascendserve.doctor.base import FAIL, OK, SKIP, WARN, Check, Runner, Which, find_tool, run_tool

SMI_TIMEOUT_S = 15.0
SMI_DIRS = ("/usr/bin", "/usr/local/nvidia/bin", "/usr/lib/wsl/lib")


def _major_minor(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:2])


def driver_check(smi: str | None, found: dict, want: str, run: Runner) -> Check:
    if smi is None:
        return Check("cuda driver", SKIP, "nvidia-smi not found: no NVIDIA driver on this host")
    out = run([smi], SMI_TIMEOUT_S)
    if out.code != 0:
        return Check("cuda driver", FAIL if want == "cuda" else WARN, f"nvidia-smi: {out.last_line()}")
    driver = re.search(r"Driver Version:\s*([\d.]+)", out.text)
    runs = re.search(r"CUDA Version:\s*([\d.]+)", out.text)
    names = run([smi, "--query-gpu=name", "--format=csv,noheader"], SMI_TIMEOUT_S)
    gpus = Counter(line.strip() for line in names.text.splitlines() if line.strip()) if names.code == 0 else {}
    detail = f"driver {driver.group(1) if driver else '?'} (runs CUDA <= {runs.group(1) if runs else '?'})"
    detail += "".join(f", {count} x {name}" for name, count in gpus.items())
    built = found.get("torch_cuda")
    if not built:
        return Check("cuda driver", OK, detail + "; torch is not a CUDA build")
    detail += f"; torch built for CUDA {built}"
    if runs and _major_minor(built)[:1] > _major_minor(runs.group(1))[:1]:
        return Check("cuda driver", FAIL if want == "cuda" else WARN,
                     f"{detail}: this driver is too old for it (update the NVIDIA driver)")
    if runs and _major_minor(built) > _major_minor(runs.group(1)):
        detail += " (newer minor: CUDA's minor-version compatibility, no PTX JIT)"
    return Check("cuda driver", OK, detail)


def nccl_check(found: dict) -> Check:
    if not found.get("torch_cuda"):
        why = "torch did not import" if "torch_error" in found else "torch is not a CUDA build"
        return Check("nccl", SKIP, f"{why}: no NCCL to check")
    if "nccl" in found:
        return Check("nccl", OK, f"NCCL {found['nccl']} (loaded by torch {found.get('versions', {}).get('torch', '')})")
    return Check("nccl", WARN, f"torch has no usable NCCL ({found.get('nccl_error', 'unknown')}): "
                               "tensor parallelism and multi-node runs need it")


def parse_topo(text: str) -> dict[tuple[int, int], str]:
    """`nvidia-smi topo -m`'s matrix: (i, j) -> the link between GPU i and GPU j."""
    header: list[int] = []
    links: dict[tuple[int, int], str] = {}
    for line in text.splitlines():
        tokens = line.split()
        if not header and tokens and tokens[0] == "GPU0":
            header = [int(t[3:]) for t in tokens if re.fullmatch(r"GPU\d+", t)]
        elif header and tokens and re.fullmatch(r"GPU\d+", tokens[0]):
            i = int(tokens[0][3:])
            for j, cell in zip(header, tokens[1:]):
                if i != j:
                    links[(i, j)] = cell
    return links


def p2p_check(smi: str | None, found: dict, run: Runner) -> Check:
    n = found.get("cuda", 0)
    if n < 2:
        return Check("cuda p2p", SKIP, f"{n} GPU(s) visible to torch: no pair to check")
    if "p2p_error" in found:
        return Check("cuda p2p", WARN, f"peer access not checked: {found['p2p_error']}")
    links: dict[tuple[int, int], str] = {}
    if smi:
        out = run([smi, "topo", "-m"], SMI_TIMEOUT_S)
        links = parse_topo(out.text) if out.code == 0 else {}
    kinds = ", ".join(sorted(set(links.values()))) or "links unknown"
    missing = sorted({tuple(sorted(pair)) for pair in found.get("p2p_missing", [])})
    if not missing:
        return Check("cuda p2p", OK, f"{n} GPUs, every pair has peer access ({kinds})")
    listed = ", ".join(f"GPU{i}<->GPU{j} ({links.get((i, j), '?')})" for i, j in missing[:8])
    return Check("cuda p2p", WARN, f"{len(missing)} of {n * (n - 1) // 2} GPU pairs without peer access: {listed}; "
                                   "NCCL goes through host memory there (slower tensor parallelism)")


def cuda_link_checks(found: dict, want: str, *, run: Runner = run_tool, which: Which = shutil.which) -> list[Check]:
    smi = find_tool("nvidia-smi", which, SMI_DIRS)
    return [driver_check(smi, found, want, run), nccl_check(found), p2p_check(smi, found, run)]
