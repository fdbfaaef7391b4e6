"""The registry backends side by side: metaserver (one process's memory, polled) vs etcd (3 members,
watched), in one run.

    python -m bench.registry [--trials 20] [--duration 5] [--ttl 3]

1. Discovery, over `--trials` stub decode instances that join and die one after another while a
   client streams requests through the proxy (c=2):
   - join: from the moment the instance's entry is in the registry (polled every 5 ms there) to the
     first request that reaches it;
   - death under traffic: SIGKILL -> the proxy lists it as no longer active (it stops sending to it;
     its failed requests were retried elsewhere);
   - death, idle proxy: the same with no traffic, so only the registry (heartbeat deadline / lease
     TTL, both `--ttl`) and the proxy's health checks can tell.
2. Proxy throughput at c=64 over stub P and D (16 streamed tokens per request, P then D), with one
   proxy and with two (each pinned to its own core, the client splitting its streams), for each
   backend.

Stubs are tests/stub_backend.py; they register exactly as the engine roles do
(discovery/heartbeat.py), every 0.5 s. The proxies are the real role with default settings except
the registry ones.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench._report import save, table
from bench.proxy import load, one_direct, one_via_proxy
from tests.etcd_cluster import EtcdCluster, registry_flags, stub_flags
from tests.procs import Proc, control, start_all, stub

TOKEN = "bench-registry-token"
ADMIN = {"authorization": f"Bearer {TOKEN}"}
BODY = {"model": "stub-model", "prompt": "hi", "max_tokens": 2}


def _q(values: list[float], p: int) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[p - 1]


class Backend:
    def __init__(self, name: str, tmp: Path, ttl: int):
        self.name, self.tmp, self.ttl = name, tmp, ttl
        self.meta = self.etcd = None
        if name == "etcd":
            self.etcd = EtcdCluster(tmp / "etcd", members=3).start()
        else:
            conf = tmp / "meta.toml"
            conf.write_text(f"[metaserver]\nheartbeat_interval_s = 0.5\nheartbeat_timeout_s = {ttl}\n")
            self.meta = control("metaserver", tmp, "--cluster-token", TOKEN, "--config", str(conf),
                                "--log-level", "warning")
            self.meta.start().wait_ready()

    def proxy_flags(self) -> list[str]:
        if self.etcd is not None:
            return registry_flags(self.etcd, self.ttl, "bench")
        return ["--metaserver-url", self.meta.url]

    def stub_flags(self) -> list[str]:
        if self.etcd is not None:
            return stub_flags(self.etcd, self.ttl, "bench")
        return ["--metaserver-url", self.meta.url, "--cluster-token", TOKEN]

    def registered(self, url: str) -> bool:
        if self.etcd is not None:
            from ascendserve.discovery import etcd

            return any(i.get("url") == url for i in etcd.instances(etcd.EtcdSettings(tuple(self.etcd.endpoints),
                                                                                     "bench")))
        view = httpx.get(self.meta.url + "/v1/registry/instances", headers=ADMIN, timeout=5).json()
        return any(i["url"] == url for i in view["instances"])

    def stop(self) -> None:
        if self.etcd is not None:
            self.etcd.stop()
        if self.meta is not None:
            self.meta.stop()


def _wait(predicate, timeout: float, every: float = 0.005) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic()
        time.sleep(every)
    raise TimeoutError("condition not met")


def _state(proxy: Proc, url: str) -> str:
    listed = httpx.get(proxy.url + "/instances", headers=ADMIN, timeout=5).json()["instances"]
    return next((i["state"] for i in listed if i["url"] == url), "gone")


def discovery(backend: Backend, tmp: Path, trials: int) -> dict[str, list[float]]:
    conf = tmp / f"proxy-{backend.name}.toml"
    conf.write_text(f"[metaserver]\nheartbeat_timeout_s = {backend.ttl}\n")
    p = stub("prefill", tmp, *backend.stub_flags())
    d0 = stub("decode", tmp, *backend.stub_flags())
    proxy = control("proxy", tmp, "--cluster-token", TOKEN, "--config", str(conf), "--log-level", "warning",
                    *backend.proxy_flags())
    start_all(p, d0, proxy)
    _wait(lambda: httpx.get(proxy.url + "/health").status_code == 200, 30, 0.1)
    traffic = threading.Event()
    stop = threading.Event()

    def client():
        with httpx.Client(timeout=10) as http:
            while not stop.is_set():
                if traffic.is_set():
                    try:
                        http.post(proxy.url + "/v1/completions", json=BODY)
                    except httpx.HTTPError:
                        pass
                else:
                    time.sleep(0.01)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    out: dict[str, list[float]] = {"join": [], "death, traffic": [], "death, idle": []}
    try:
        for trial in range(trials):
            idle = trial % 2 == 1
            d = stub("decode", tmp, *backend.stub_flags())
            traffic.set()
            d.start()
            t0 = _wait(lambda: backend.registered(d.url), 30)
            t1 = _wait(lambda: httpx.get(d.url + "/stub/stats", timeout=5).json()["requests"] > 0, 30)
            out["join"].append(t1 - t0)
            if idle:
                traffic.clear()
                time.sleep(0.3)
            killed = time.monotonic()
            d.popen.send_signal(signal.SIGKILL)
            gone = _wait(lambda: _state(proxy, d.url) not in ("active", "probing"), 3 * backend.ttl + 15, 0.01)
            out["death, idle" if idle else "death, traffic"].append(gone - killed)
            d.stop()
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        for proc in (proxy, p, d0):
            proc.stop()
    return out


def floor(tmp: Path, duration: float) -> dict:
    """The client doing both hops itself, no proxy: what this host's client and stubs can do."""
    p, d = stub("prefill", tmp), stub("decode", tmp, "--require-kv")
    start_all(p, d)
    try:
        return asyncio.run(load(lambda s: one_direct(s, p.url, d.url), 64, duration))
    finally:
        p.stop(), d.stop()


def throughput(backend: Backend, tmp: Path, duration: float, proxies: int) -> dict:
    p = stub("prefill", tmp, *backend.stub_flags())
    d = stub("decode", tmp, "--require-kv", *backend.stub_flags())
    procs = [control("proxy", tmp, "--cluster-token", TOKEN, "--log-level", "warning", *backend.proxy_flags())
             for _ in range(proxies)]
    start_all(p, d, *procs)
    try:
        for i, proc in enumerate(procs):
            os.sched_setaffinity(proc.pid, {i % os.cpu_count()})
            _wait(lambda: httpx.get(proc.url + "/health").status_code == 200, 30, 0.1)

        async def both():
            per = 64 // proxies
            results = await asyncio.gather(*(load(lambda s, u=proc.url: one_via_proxy(s, u), per, duration)
                                             for proc in procs))
            return {"rps": sum(r["rps"] for r in results), "errors": sum(r["errors"] for r in results),
                    "p50_ms": max(r["p50_ms"] for r in results), "p99_ms": max(r["p99_ms"] for r in results)}

        return asyncio.run(both())
    finally:
        for proc in (*procs, p, d):
            proc.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--ttl", type=int, default=3, help="heartbeat timeout / lease TTL, seconds (both)")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    found: dict[str, dict] = {}
    rates: dict[str, dict[int, dict]] = {}
    with tempfile.TemporaryDirectory() as t:
        rates["direct (floor)"] = {0: floor(Path(t), args.duration)}
        for name in ("metaserver", "etcd"):
            tmp = Path(t) / name
            tmp.mkdir()
            backend = Backend(name, tmp, args.ttl)
            try:
                found[name] = discovery(backend, tmp, args.trials)
                rates[name] = {n: throughput(backend, tmp, args.duration, n) for n in (1, 2)}
            finally:
                backend.stop()
    rows = []
    for name, kinds in found.items():
        for kind, values in kinds.items():
            base = found["metaserver"][kind]
            rows.append([name, kind, len(values), 1000 * _q(values, 50), 1000 * _q(values, 99),
                         _q(base, 50) / _q(values, 50)])
    table(f"Discovery, stub instances, {args.trials} trials, heartbeat/lease {args.ttl} s "
          "(x metaserver: > 1 is faster)", ["backend", "event", "n", "p50 ms", "p99 ms", "x metaserver p50"], rows)
    base, top = rates["metaserver"][1]["rps"], rates["direct (floor)"][0]["rps"]
    table(f"Proxy throughput, c=64, stub P->D, 16 streamed tokens, {args.duration:.0f} s (x: vs 1 proxy on "
          "the metaserver; x floor: vs the client doing both hops itself)",
          ["backend", "proxies", "req/s", "p50 ms", "p99 ms", "errors", "x", "x floor"],
          [[name, n, r["rps"], r["p50_ms"], r["p99_ms"], r["errors"], r["rps"] / base, r["rps"] / top]
           for name, by_n in rates.items() for n, r in by_n.items()])
    save("registry", {"args": vars(args), "discovery": found,
                      "throughput": {k: {str(n): r for n, r in v.items()} for k, v in rates.items()}})


if __name__ == "__main__":
    main()
