"""This host's ports and limits, and the peers it must reach (with their clocks)."""

from __future__ import annotations

import os
import shutil
import socket
import time
import urllib.error
import urllib.request
from email.utils import parsedate_to_datetime

from ascendserve.doctor.base import FAIL, OK, WARN, Check

CONNECT_TIMEOUT_S = 2.0
SKEW_FAIL_S = 2.0  # KV/EC deadlines are local, but TTLs in shared stores and logs are not
SKEW_SAMPLES = 5


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
