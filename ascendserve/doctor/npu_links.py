"""NPU links, checked as vllm-ascend's multi-node guides check them before a start.

vllm-ascend's large-scale EP guide and installation guide ("Multi-node Deployment") run, for
every NPU of a node (A2: 0..7, A3: 0..15), the driver's hccn_tool:

    -lldp -g        a switch port answers LLDP           "Ifname: ..."
    -link -g        the port is up                       "link status: UP"
    -net_health -g  the NIC reaches its detect address   "net health status: Success"
    -netdetect -g   that detect address is set
    -gateway -g     a default gateway is set
    -ip -g          (A2) the RoCE address; /etc/hccn.conf's address_N says what it should be
    -vnic -g        (A3) the HCCS virtual NIC's address

and then pings peer NPUs (-ping on A2, -hccs_ping on A3) looking for "0.00% packet loss".
Here every NPU pings its neighbour on this host (NPU i -> the next one, at its address_N on
A2, its vnic address on A3: each NIC sends and answers once, in O(NPUs) pings) and every
--npu-peers address (NPUs on the other nodes). One Check per aspect, naming the NPUs that
fail it. A problem warns; with --npu-peers (a multi-node start) the blocking ones fail.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ascendserve.doctor.base import FAIL, OK, SKIP, WARN, Check, Output, Runner, Which, find_tool, run_tool

HCCN_CONF = "/etc/hccn.conf"
TOOL_DIRS = ("/usr/local/Ascend/driver/tools", "/usr/local/sbin", "/usr/local/bin")
QUERY_TIMEOUT_S = 10.0
PING_TIMEOUT_S = 30.0
PARALLEL = 16  # hccn_tool calls at once
IPV4 = r"(?<![\d.])(\d{1,3}(?:\.\d{1,3}){3})(?![\d.])"

Verdict = tuple[bool, str]  # (good, what was seen)


def _ipv4(text: str, label: str = "") -> str | None:
    pattern = rf"{label}\s*:?\s*{IPV4}" if label else IPV4
    for match in re.finditer(pattern, text, re.IGNORECASE):
        if match.group(1) != "0.0.0.0":
            return match.group(1)
    return None


def parse_link(text: str) -> Verdict:
    m = re.search(r"link status\s*:\s*(\w+)", text, re.IGNORECASE)
    return (m is not None and m.group(1).upper() == "UP"), (m.group(1).upper() if m else "no link status")


def parse_health(text: str) -> Verdict:
    m = re.search(r"net health status\s*:\s*([^\r\n]+)", text, re.IGNORECASE)
    status = m.group(1).strip() if m else "no health status"
    return status.lower() == "success", status


def parse_lldp(text: str) -> Verdict:
    m = re.search(r"Ifname\s*:\s*(\S+)", text, re.IGNORECASE)
    return (True, m.group(1)) if m else (False, "no LLDP neighbour (cable, optics, or LLDP off on the switch)")


def parse_address(what: str, label: str = "") -> Callable[[str], Verdict]:
    def parse(text: str) -> Verdict:
        ip = _ipv4(text, label) or (_ipv4(text) if label else None)
        return (True, ip) if ip else (False, f"no {what}")
    return parse


def parse_ping(text: str) -> Verdict:
    m = re.search(r"([\d.]+)\s*%\s*packet loss", text, re.IGNORECASE)
    if m:
        loss = float(m.group(1))
        return loss == 0.0, f"{loss:g}% packet loss"
    if re.search(r"time\s*out", text, re.IGNORECASE):
        return False, "no answer (recv time out)"
    return False, "no ping statistics"


@dataclass(frozen=True)
class Aspect:
    name: str
    flag: str
    parse: Callable[[str], Verdict]
    blocking: bool  # fails a multi-node start
    good: str  # what all-good reads as


ASPECTS = (
    Aspect("lldp", "-lldp", parse_lldp, False, "see a switch port (LLDP)"),
    Aspect("link", "-link", parse_link, True, "UP"),
    Aspect("net_health", "-net_health", parse_health, True, "Success"),
    Aspect("netdetect", "-netdetect", parse_address("detect address"), False, "have a detect address"),
    Aspect("gateway", "-gateway", parse_address("gateway"), False, "have a gateway"),
)
ADDRESS = {  # the address the other NPUs reach this one at
    "A2": Aspect("ip", "-ip", parse_address("address", "ipaddr"), True, "have an address"),
    "A3": Aspect("vnic", "-vnic", parse_address("vnic address"), True, "have a vnic address"),
}
PING_FLAG = {"A2": "-ping", "A3": "-hccs_ping"}


def read_hccn_conf(path: str = HCCN_CONF) -> dict[int, str] | None:
    """address_N=IP lines of /etc/hccn.conf (NPU N's RoCE address); None without the file."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    return {int(n): ip for n, ip in re.findall(r"^\s*address_(\d+)\s*=\s*" + IPV4, text, re.MULTILINE)}


def npu_series(count: int, run: Runner, which: Which) -> tuple[str, str]:
    """A2 (8 NPUs a node) or A3 (16: two dies a chip), from npu-smi's chip names, else the count."""
    smi = find_tool("npu-smi", which, TOOL_DIRS)
    if smi:
        out = run([smi, "info"], QUERY_TIMEOUT_S)
        if out.code == 0 and re.search(r"910_?93", out.text):
            return "A3", "npu-smi: Ascend910_93"
        if out.code == 0 and re.search(r"910B", out.text):
            return "A2", "npu-smi: Ascend910B"
    return ("A3" if count > 8 else "A2"), f"{count} NPUs"


def _run_all(run: Runner, jobs: dict, timeout_s: float) -> dict:
    if not jobs:
        return {}
    with ThreadPoolExecutor(max_workers=min(PARALLEL, len(jobs))) as pool:
        futures = {key: pool.submit(run, argv, timeout_s) for key, argv in jobs.items()}
        return {key: future.result() for key, future in futures.items()}


def _verdict(out: Output, parse: Callable[[str], Verdict], what: str) -> Verdict:
    return parse(out.text) if out.code == 0 else (False, f"hccn_tool {what}: {out.last_line()}")


def _summary(name: str, results: dict, good: str, blocking: bool) -> Check:
    bad = [f"{who} {seen}" for who, (ok, seen) in results.items() if not ok]
    if not bad:
        return Check(name, OK, f"{len(results)}/{len(results)} {good}")
    listed = "; ".join(bad[:6]) + (f"; +{len(bad) - 6} more" if len(bad) > 6 else "")
    return Check(name, FAIL if blocking else WARN, f"{listed} ({len(bad)} of {len(results)})")


def npu_link_checks(devices: Sequence[int], peers: Sequence[str] = (), *, run: Runner = run_tool,
                    which: Which = shutil.which, hccn_conf: str = HCCN_CONF) -> list[Check]:
    """The checks above for NPUs `devices` (their /dev/davinciN numbers); `peers`: NPU addresses
    on other nodes, which make this a multi-node check (blocking problems fail)."""
    if not devices:
        return [Check("npu links", SKIP, "no /dev/davinci*: no Ascend NPU or driver here")]
    tool = find_tool("hccn_tool", which, TOOL_DIRS)
    if tool is None:
        return [Check("npu links", SKIP, "hccn_tool not found (the Ascend driver's tools, "
                                         "/usr/local/Ascend/driver/tools): cannot check NPU links")]
    devices, strict = sorted(devices), bool(peers)
    series, why = npu_series(len(devices), run, which)
    aspects = (*ASPECTS, ADDRESS[series])
    outs = _run_all(run, {(a.name, n): [tool, "-i", str(n), a.flag, "-g"] for a in aspects for n in devices},
                    QUERY_TIMEOUT_S)
    checks = [Check("npu series", OK, f"{series} ({why}); NPUs {', '.join(map(str, devices))}")]
    conf, own = read_hccn_conf(hccn_conf), {}
    for a in aspects:
        results = {n: _verdict(outs[(a.name, n)], a.parse, f"{a.flag} -g") for n in devices}
        if a is ADDRESS["A2"]:
            results = {n: _against_conf(n, verdict, conf) for n, verdict in results.items()}
        checks.append(_summary(f"npu {a.name}", {f"npu{n}": v for n, v in results.items()}, a.good,
                               a.blocking and strict))
        if a is ADDRESS[series]:  # where the others reach each NPU: as configured, else as found
            own = conf if series == "A2" and conf else {n: seen for n, (ok, seen) in results.items() if ok}
    if series == "A2" and conf is None:  # HCCL reads the driver, not the file: a warning
        checks[-1].detail += f"; no {hccn_conf} (on a container, mount the host's)"
        checks[-1].status = WARN if checks[-1].status == OK else checks[-1].status
    checks.append(_ping_check(tool, series, devices, own, list(peers), run, strict))
    return checks


def _against_conf(n: int, verdict: Verdict, conf: dict[int, str] | None) -> Verdict:
    ok, seen = verdict
    if ok and conf and n in conf and conf[n] != seen:
        return False, f"{seen}, /etc/hccn.conf says {conf[n]}"
    return verdict


def _ping_check(tool: str, series: str, devices: list[int], own: dict[int, str], peers: list[str],
                run: Runner, strict: bool) -> Check:
    flag, jobs = PING_FLAG[series], {}
    for k, n in enumerate(devices):
        neighbour = devices[(k + 1) % len(devices)]
        targets = ([own[neighbour]] if neighbour != n and neighbour in own else []) + peers
        for target in targets:
            jobs[(n, target)] = [tool, "-i", str(n), flag, "-g", "address", target]
    if not jobs:
        where = "/etc/hccn.conf address_N" if series == "A2" else "-vnic -g"
        return Check(f"npu {flag[1:]}", SKIP, f"no address to ping: none from {where}, no --npu-peers")
    outs = _run_all(run, jobs, PING_TIMEOUT_S)
    results = {f"npu{n}->{target}": _verdict(outs[(n, target)], parse_ping, flag) for n, target in jobs}
    check = _summary(f"npu {flag[1:]}", results, "answered (0% loss)", strict)
    scope = f"each NPU -> the next one here{f' and {len(peers)} peer address(es)' if peers else ''}"
    check.detail = f"{check.detail} [{scope}]"
    return check
