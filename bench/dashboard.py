"""What an open dashboard costs the proxy, and how fast it hears of a change.

    python -m bench.dashboard [--duration 10] [--repeats 3] [--concurrency 64] [--pages 0,1,5] [--toggles 20]

1P1D pull over stub engines (tests/stub_backend.py; D refuses a request that skipped P), one proxy
worker, c=64 streaming completions of 16 tokens (bench/proxy.py's client), side by side in one run:
with no dashboard open, then 1 and 5 pages subscribed to /dashboard/events (tests/dashboard_pages.py,
an EventSource's reads without a browser, in a process of their own), in turn, `--repeats` times. Per setting: req/s, latency,
the proxy's CPU per request (its process's user + system time over the phase / requests) and its
ratio to no dashboard, the dashboard's own share of it (the CPU time of its ticks, which the proxy
counts and shows: readings, snapshots, fan-out), bytes per second per open page.
Update latency: a stub encoder (never on a text request's path) is stopped (SIGSTOP) and continued
`--toggles` times while the same c=64 load runs with one page open; for each ejected/readmitted
event, from the proxy's time of it to its arrival on the page (push), and from the SIGSTOP /
SIGCONT to its arrival (detection by the health checks, every 0.5 s here, + push), p50/p99.
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
import psutil

from bench._report import save, table
from bench.proxy import load, one_via_proxy
from tests.dashboard_pages import Pages, PagesProcess, hub_cpu_ms
from tests.procs import control, signal_group, start_all, stub, wait_for

HEALTH_INTERVAL_S = 0.5


def quantiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return (values[0], values[0]) if values else (float("nan"), float("nan"))
    q = statistics.quantiles(values, n=100, method="inclusive")
    return q[49], q[98]


def phase(proxy, pages: int, concurrency: int, duration: float) -> dict:
    proc = psutil.Process(proxy.pid)
    with PagesProcess(proxy.url, pages) as open_pages:
        hub_before = hub_cpu_ms(proxy.url)
        before = proc.cpu_times()
        r = asyncio.run(load(lambda s: one_via_proxy(s, proxy.url), concurrency, duration))
        spent = proc.cpu_times()
        time.sleep(1.1)  # the next snapshot has the ticks of the phase
        r["hub_cpu_ms"] = (hub_cpu_ms(proxy.url) - hub_before) / max(1, r["calls"])
    r["cpu_ms"] = 1000 * (spent.user + spent.system - before.user - before.system) / max(1, r["calls"])
    r["bytes_per_s_per_page"] = open_pages.bytes_per_second() if pages else 0.0
    r["snapshots_per_s_per_page"] = sum(open_pages.snapshots) / max(1, pages) / open_pages.seconds if pages else 0.0
    r["page_errors"] = open_pages.errors + ([f"{open_pages.ended} streams ended"] if open_pages.ended else [])
    return r


def update_latency(proxy, encoder, concurrency: int, toggles: int) -> dict:
    """Toggle the encoder while c=64 runs and one page listens; latencies in ms."""
    cause: dict[str, list[float]] = {"ejected": [], "readmitted": []}  # when we stopped / continued it
    done = threading.Event()

    def toggler():
        for _ in range(toggles):
            for sig, kind in ((signal.SIGSTOP, "ejected"), (signal.SIGCONT, "readmitted")):
                before = len(seen(kind))
                cause[kind].append(time.time())
                signal_group(encoder, sig)
                deadline = time.monotonic() + 10
                while len(seen(kind)) <= before and time.monotonic() < deadline:
                    time.sleep(0.01)
                time.sleep(0.2)
        done.set()

    with Pages(proxy.url, 1) as page:
        def seen(kind):
            return [a for a in page.arrivals if a[3] == kind and a[4] == encoder.url]

        thread = threading.Thread(target=toggler, daemon=True)
        thread.start()

        try:
            asyncio.run(_until(load(lambda s: one_via_proxy(s, proxy.url), concurrency, 600.0, warmup=0.0), done))
        finally:
            signal_group(encoder, signal.SIGCONT)
            thread.join(5)
        push, detect = [], []
        for kind in cause:
            arrivals = seen(kind)
            push += [(arrived - server_t) * 1000 for _, server_t, arrived, _, _ in arrivals]
            for t0 in cause[kind]:  # the first such event after each stop / continue
                first = next((arrived for _, server_t, arrived, _, _ in arrivals if server_t >= t0), None)
                if first is not None:
                    detect.append((first - t0) * 1000)
    return {"events": len(push), "push_ms": push, "detect_ms": detect}


async def _until(coro, done: threading.Event):
    task = asyncio.ensure_future(coro)
    while not done.is_set() and not task.done():
        await asyncio.sleep(0.1)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per phase")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--pages", default="0,1,5")
    ap.add_argument("--toggles", type=int, default=20, help="encoder stop/continue cycles for the update latency")
    args = ap.parse_args()
    settings = [int(x) for x in args.pages.split(",")]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        conf = tmp / "proxy.toml"
        conf.write_text(f"[proxy]\nhealth_interval_s = {HEALTH_INTERVAL_S}\nhealth_timeout_s = 0.5\neject_after = 1\n")
        p, d, e = stub("prefill", tmp), stub("decode", tmp, "--require-kv"), stub("encoder", tmp)
        start_all(p, d, e)
        proxy = control("proxy", tmp, "--config", str(conf), "--prefill", f"127.0.0.1:{p.port}", "--decode",
                        f"127.0.0.1:{d.port}", "--encoder", f"127.0.0.1:{e.port}", "--log-level", "warning")
        start_all(proxy)
        try:
            wait_for(lambda: httpx.get(proxy.url + "/health").status_code == 200, 30, "proxy never healthy")
            runs: dict[int, list[dict]] = {n: [] for n in settings}
            for rep in range(args.repeats):
                for n in settings if rep % 2 == 0 else reversed(settings):
                    print(f"repeat {rep + 1}/{args.repeats}: {n} page(s) open ...", flush=True)
                    runs[n].append(phase(proxy, n, args.concurrency, args.duration))
            print(f"update latency: {args.toggles} encoder stop/continue cycles under c={args.concurrency} ...",
                  flush=True)
            latency = update_latency(proxy, e, args.concurrency, args.toggles)
            protocol_errors = httpx.get(d.url + "/stub/stats").json()["protocol_errors"]
        finally:
            for proc in (proxy, p, d, e):
                proc.stop()
    base = statistics.median(r["cpu_ms"] for r in runs[settings[0]])
    rows = []
    for n, rs in runs.items():
        cpu = statistics.median(r["cpu_ms"] for r in rs)
        rows.append([n, statistics.median(r["rps"] for r in rs), statistics.median(r["p50_ms"] for r in rs),
                     statistics.median(r["p99_ms"] for r in rs), cpu, cpu / base,
                     statistics.median(r["hub_cpu_ms"] for r in rs) * 1000,
                     " ".join(f"{r['cpu_ms']:.3f}" for r in rs),
                     statistics.median(r["bytes_per_s_per_page"] for r in rs),
                     statistics.median(r["snapshots_per_s_per_page"] for r in rs),
                     sum(r["errors"] for r in rs), sum(len(r["page_errors"]) for r in rs)])
    table(f"Proxy with the dashboard closed and open, c={args.concurrency} over stub P/D, 16 streamed tokens, "
          f"{args.duration:.0f} s x {args.repeats} per setting (medians; decode protocol errors: {protocol_errors})",
          ["pages", "req/s", "p50 ms", "p99 ms", "proxy CPU ms/req", "x closed", "dashboard CPU us/req", "each run",
           "bytes/s per page",
           "snapshots/s per page", "errors", "page errors"], rows)
    push, detect = quantiles(latency["push_ms"]), quantiles(latency["detect_ms"])
    table(f"Update latency under c={args.concurrency}, one page open: {latency['events']} events "
          f"(health checks every {HEALTH_INTERVAL_S} s)",
          ["from", "to", "p50 ms", "p99 ms"],
          [["the proxy's event", "the page", push[0], push[1]],
           ["SIGSTOP/SIGCONT of an instance", "the page", detect[0], detect[1]]])
    save("dashboard", {"args": vars(args), "runs": {str(n): rs for n, rs in runs.items()},
                       "latency": latency, "decode_protocol_errors": protocol_errors})


if __name__ == "__main__":
    main()
