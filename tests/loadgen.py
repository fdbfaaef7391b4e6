"""Many concurrent streaming clients and the proxy's resource use, for test_load.py and bench/load.py.

A round is `concurrency` streaming completions sent at once from one process,
each checked to the end (every token event, the usage event, [DONE], no error
event). Failures are counted by kind, so a limit names itself: EMFILE is the
open files limit, EADDRNOTAVAIL the ephemeral ports, MemoryError memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx
import psutil

MODEL = "stub-model"


@dataclass
class RoundResult:
    concurrency: int
    ok: int = 0
    errors: Counter = field(default_factory=Counter)
    ttft_s: list[float] = field(default_factory=list)
    total_s: list[float] = field(default_factory=list)
    peak_open: int = 0  # streams whose headers had arrived and whose end had not, at once
    wall_s: float = 0.0

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    def quantile_ms(self, which: str, q: int) -> float:
        values = sorted(getattr(self, which))
        if len(values) < 2:
            return values[0] * 1000 if values else float("nan")
        return statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1000


@dataclass
class Usage:
    rss_mb: float
    fds: int
    sockets: int  # TCP sockets other than listening ones


def error_kind(exc: BaseException) -> str:
    """A short name for why a request failed, with the errno where there is one."""
    cause = getattr(exc, "os_error", None) or exc
    if isinstance(cause, OSError) and cause.errno in errno.errorcode:
        return f"{type(exc).__name__}({errno.errorcode[cause.errno]})"
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return "timeout"
    return type(exc).__name__


async def _one(session: aiohttp.ClientSession, url: str, body: dict, headers: dict, result: RoundResult,
               open_now: list[int]) -> None:
    started = time.monotonic()
    try:
        async with session.post(url + "/v1/completions", json=body, headers=headers) as r:
            if r.status != 200:
                await r.read()
                result.errors[f"http_{r.status}"] += 1
                return
            open_now[0] += 1
            result.peak_open = max(result.peak_open, open_now[0])
            try:
                data, first = b"", None
                async for chunk in r.content.iter_any():
                    if first is None:
                        first = time.monotonic()
                    data += chunk
            finally:
                open_now[0] -= 1
        if b'"error"' in data:
            result.errors["error_event"] += 1
        # every token's event and [DONE] (the stub's usage event reaches the client only when it asked
        # for it, as with vLLM: the proxy's token ledger asks the engine for it and strips it)
        elif not data.endswith(b"data: [DONE]\n\n") or data.count(b'"choices":[{') != body["max_tokens"]:
            result.errors["incomplete_stream"] += 1
        else:
            result.ok += 1
            result.ttft_s.append(first - started)
            result.total_s.append(time.monotonic() - started)
    except MemoryError:
        result.errors["MemoryError"] += 1
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
        result.errors[error_kind(exc)] += 1


async def _round(url: str, concurrency: int, tokens: int, timeout_s: float, headers: dict) -> RoundResult:
    result = RoundResult(concurrency)
    body = {"model": MODEL, "prompt": "load test prompt " * 4, "max_tokens": tokens, "stream": True}
    connector = aiohttp.TCPConnector(limit=0, force_close=True)  # one connection per stream, closed at its end
    started = time.monotonic()
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        open_now = [0]
        await asyncio.gather(*(_one(session, url, body, headers, result, open_now) for _ in range(concurrency)))
    result.wall_s = time.monotonic() - started
    return result


def run_round(url: str, concurrency: int, tokens: int = 8, timeout_s: float = 120.0,
              headers: dict | None = None) -> RoundResult:
    """`concurrency` streaming completions at once through `url`; every one is read to its end."""
    return asyncio.run(_round(url, concurrency, tokens, timeout_s, headers or {}))


def reset_stubs(prefill_url: str, decode_url: str, gate: int) -> None:
    """Zero both stubs' counters; D holds each stream after its first token until `gate` are open at once."""
    httpx.post(prefill_url + "/stub/reset", timeout=10)
    httpx.post(decode_url + "/stub/reset", json={"gate": gate}, timeout=10)


def stub_stats(url: str) -> dict:
    return httpx.get(url + "/stub/stats", timeout=10).json()


def usage(pid: int) -> Usage:
    proc = psutil.Process(pid)
    sockets = [c for c in proc.net_connections(kind="tcp") if c.status != psutil.CONN_LISTEN]
    return Usage(proc.memory_info().rss / 2**20, proc.num_fds(), len(sockets))


def wait_idle(pid: int, timeout_s: float = 30.0, within: Usage | None = None, slack: float = 0.10) -> Usage:
    """Poll until the process holds no TCP connection (clients gone, pooled backend sockets
    expired) and, given `within`, its RSS and fd count are back within `slack` of it.
    Returns the last reading, idle or not, when `timeout_s` runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = usage(pid)
        idle = now.sockets == 0 and (within is None or (
            now.fds <= within.fds * (1 + slack) and now.rss_mb <= within.rss_mb * (1 + slack)))
        if idle or time.monotonic() > deadline:
            return now
        time.sleep(0.25)


@contextlib.contextmanager
def stub_cluster(log_dir: Path, gate_timeout_s: float):
    """1P1D pull on 127.0.0.1: one proxy worker in front of a stub P and a stub D that refuses requests
    which skipped P. Yields (prefill, decode, proxy); all three are stopped after."""
    from tests.procs import control, start_all, stub, wait_for

    conf = log_dir / "proxy.toml"
    # No periodic health checks: "idle" is then exactly "no socket open", so readings compare.
    conf.write_text("[proxy]\nhealth_interval_s = 3600\n")
    p = stub("prefill", log_dir)
    d = stub("decode", log_dir, "--require-kv", "--gate-timeout-s", str(gate_timeout_s))
    procs = [p, d]
    try:
        start_all(p, d)
        proxy = control("proxy", log_dir, "--config", str(conf), "--prefill", f"127.0.0.1:{p.port}",
                        "--decode", f"127.0.0.1:{d.port}", "--log-level", "warning")
        procs.append(proxy)
        start_all(proxy)
        wait_for(lambda: httpx.get(proxy.url + "/health").status_code == 200, 30, "proxy never healthy")
        yield p, d, proxy
    finally:
        for proc in reversed(procs):
            proc.stop()
