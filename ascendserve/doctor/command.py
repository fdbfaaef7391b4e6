"""`ascendserve doctor`: the pre-flight check of a serving host.

    ascendserve doctor [--device auto|cpu|cuda|npu] [--ports 8000,9000]
                       [--peers host:port,...] [--npu-peers IP,...] [--no-links]
                       [--config FILE --role ROLE] [--json]

Checks the engine stack installed and the devices it sees (devices.py), the links a
multi-node start needs where the tools exist (NPU: hccn_tool, npu_links.py; CUDA:
nvidia-smi, NCCL, peer access, cuda_links.py), that the ports this host must bind are
free, that peers answer on theirs and that their clocks agree with ours (host.py).
Prints a table; exits 1 when something blocks serving (FAIL), 0 otherwise (warnings
and checks that could not run included).
"""

from __future__ import annotations

import argparse
import glob
import ipaddress
import json
import re
import shutil
import sys
from dataclasses import asdict

from ascendserve.doctor.base import FAIL, Check, find_tool
from ascendserve.doctor.cuda_links import SMI_DIRS, cuda_link_checks
from ascendserve.doctor.devices import device_checks, probe_devices, run_probe
from ascendserve.doctor.host import host_checks, peer_check, port_check
from ascendserve.doctor.npu_links import TOOL_DIRS, npu_link_checks


def _ports(args, env: dict[str, str]) -> tuple[str, list[int]]:
    ports = [int(p) for p in args.ports.replace(",", " ").split()] if args.ports else []
    host = args.host
    if args.config or args.role:
        from ascendserve.config import load

        config = load(args.role, args.config, {}, env)
        host = host or config.server.host
        ports.append(config.server.port)
        if config.role in ("prefill", "decode") and config.kv.connector != "example":
            # the side channel (ours, NIXL) or bootstrap/handshake port (Mooncake's) of each TP rank
            ports += [config.kv.port + r for r in range(config.engine.tensor_parallel_size)]
        if config.role == "all":
            ports.append(config.server.port + 1)
    return host or "127.0.0.1", sorted(set(ports))


def npu_devices() -> list[int]:
    return sorted(int(m.group(1)) for path in glob.glob("/dev/davinci[0-9]*")
                  if (m := re.fullmatch(r"/dev/davinci(\d+)", path)))


def link_checks(args, found: dict) -> list[Check]:
    """NPU and CUDA link checks: for the device asked for, and with --device auto where this
    host has the hardware or its tools; never on --device cpu or with --no-links."""
    if args.no_links or args.device == "cpu":
        return []
    auto = args.device == "auto"
    npu_here = found.get("davinci") or find_tool("hccn_tool", shutil.which, TOOL_DIRS)
    cuda_here = found.get("nvidia") or found.get("cuda") or find_tool("nvidia-smi", shutil.which, SMI_DIRS)
    checks: list[Check] = []
    if args.device == "npu" or args.npu_peers or (auto and npu_here):
        checks += npu_link_checks(npu_devices(), args.npu_peers)
    if args.device == "cuda" or (auto and cuda_here):
        checks += cuda_link_checks(found, args.device)
    return checks


def run(args, env: dict[str, str]) -> list[Check]:
    found, failed = run_probe(env)
    checks = failed or device_checks(args.device, found, env)
    checks += link_checks(args, found) + host_checks()
    host, ports = _ports(args, env)
    checks += [port_check(host, p) for p in ports]
    for peer in (p for p in args.peers.replace(",", " ").split() if p) if args.peers else ():
        checks += peer_check(peer)
    return checks


def render(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = [f"{'CHECK':<{width}}  STATUS  DETAIL"]
    lines += [f"{c.name:<{width}}  {c.status:<6}  {c.detail}" for c in checks]
    failed = sum(c.status == FAIL for c in checks)
    lines.append(f"{failed} blocking problem(s)" if failed else "ready to serve")
    return "\n".join(lines)


def _addresses(text: str) -> list[str]:
    out = []
    for item in text.replace(",", " ").split():
        try:
            out.append(str(ipaddress.IPv4Address(item)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is not an IPv4 address") from None
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ascendserve doctor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("auto", "cpu", "cuda", "npu"), default="auto",
                        help="the device this host must serve on (auto: report what is there)")
    parser.add_argument("--ports", help="ports this host must be able to bind, comma-separated")
    parser.add_argument("--host", help="address the ports are bound on (default: the config's, or 127.0.0.1)")
    parser.add_argument("--peers", help="host:port of peers to reach (registry, proxy, KV, NetLoader ...)")
    parser.add_argument("--npu-peers", type=_addresses, default=[], metavar="IP,...",
                        help="NPU addresses on the other nodes of a multi-node start: every NPU here pings "
                             "them, and NPU link problems become blocking")
    parser.add_argument("--no-links", action="store_true", help="skip the NPU/CUDA link checks")
    parser.add_argument("--config", help="a role's TOML config: adds the ports that role binds")
    parser.add_argument("--role", help="the role of --config (when the file does not say)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        print(json.dumps(probe_devices()))
        return 0
    from ascendserve.config import ConfigError, environ

    try:
        checks = run(args, environ())
    except ConfigError as exc:
        print(f"ascendserve doctor: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps([asdict(c) for c in checks], indent=1) if args.json else render(checks))
    return 1 if any(c.status == FAIL for c in checks) else 0
