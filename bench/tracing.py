"""The price of the proxy's traces (router/tracing.py): the proxy before them, with them off (the
default), on (every request traced, exported over OTLP/HTTP to a receiver process) and on with
1 request in 10 sampled (OTEL_TRACES_SAMPLER=traceidratio), side by side over the same stub P and D; req/s and the proxy's CPU per request. Then the off path's
per-hop hook alone (what a hop pays when traces are off), timed in this process.

    python -m bench.tracing [--duration 5] [--concurrency 16 64] [--rounds 3]
        [--before REV] [--after REV]

`before`: a git revision exported to a temp directory and run from there (default: the parent
of the commit that added router/tracing.py); `after`: the same for "off" and "on" (default: this
checkout as it is). Rounds alternate the three proxies so that drift on a shared host spreads
over all of them. Each request streams 16 tokens from /v1/completions (bench/proxy.py's load).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

import httpx
import psutil

from bench._report import save, table
from bench.proxy import load, one_via_proxy
from tests.procs import PYTHON, REPO, Proc, free_port, start_all, stub

SPANS_PER_REQUEST = 4  # the request, prefill, kv_transfer, decode


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True, text=True).stdout.strip()


def export(rev: str, into: Path) -> Path:
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def default_before() -> str:
    added = _git("log", "--diff-filter=A", "--format=%H", "--", "ascendserve/router/tracing.py").splitlines()
    return f"{added[-1]}^" if added else "HEAD"


def proxy(name: str, tree: Path, tmp: Path, p: Proc, d: Proc, env: dict) -> Proc:
    """A proxy run from `tree` (python -P: not from the current directory)."""
    port = free_port()
    argv = [PYTHON, "-P", "-m", "ascendserve", "--role", "proxy", "--port", str(port), "--log-level", "warning",
            "--prefill", f"127.0.0.1:{p.port}", "--decode", f"127.0.0.1:{d.port}"]
    no_otel = {k: None for k in os.environ if k.startswith("OTEL_")}
    return Proc(name, argv, port, tmp / f"{name}.log", {**no_otel, "PYTHONPATH": str(tree), **env}, "/healthcheck")


def hop_hook_ns() -> float:
    """ns per hop of the hooks a hop runs with traces off (Pipeline._hop, its with, headers)."""
    from ascendserve.router.pipeline import Pipeline
    from ascendserve.router.pools import Pool

    pipeline = Pipeline.__new__(Pipeline)
    pipeline.tracing = None
    pool = Pool("decode")
    inst = pool.add("http://127.0.0.1:1")
    headers = {"x-request-id": "r"}

    def hooked():
        with pipeline._hop(pool, inst) as hop:
            hop.headers(headers)

    n = 1_000_000
    return min(timeit.repeat(hooked, number=n, repeat=5)) / n * 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--before", default="")
    ap.add_argument("--after", default="")
    args = ap.parse_args()
    args.before = args.before or default_before()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        before = export(args.before, tmp / "before")
        after = export(args.after, tmp / "after") if args.after else REPO
        p, d = stub("prefill", tmp), stub("decode", tmp, "--require-kv")
        rport = free_port()
        receiver = Proc("otlp receiver", [PYTHON, "-m", "tests.otlp_receiver", "--port", str(rport)], rport,
                        tmp / "receiver.log", {"PYTHONPATH": str(REPO)}, "/stats")
        start_all(p, d, receiver)
        on = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{receiver.url}/v1/traces"}
        proxies = {"before": proxy("before", before, tmp, p, d, {}),
                   "traces off": proxy("off", after, tmp, p, d, {}),
                   "traces on": proxy("on", after, tmp, p, d, on),
                   "on, 10% sampled": proxy("sampled", after, tmp, p, d, {
                       **on, "OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"})}
        start_all(*proxies.values())
        for proc in proxies.values():
            for _ in range(100):
                if httpx.get(proc.url + "/health").status_code == 200:
                    break
                time.sleep(0.1)
        runs: dict[str, dict[int, list[dict]]] = {name: {c: [] for c in args.concurrency} for name in proxies}
        traced_calls = 0
        try:
            for _ in range(args.rounds):
                for c in args.concurrency:
                    for name, proc in proxies.items():
                        cpu = psutil.Process(proc.pid).cpu_times()
                        r = asyncio.run(load(lambda s, u=proc.url: one_via_proxy(s, u), c, args.duration))
                        spent = psutil.Process(proc.pid).cpu_times()
                        r["cpu_ms"] = 1000 * (spent.user + spent.system - cpu.user - cpu.system) / max(1, r["calls"])
                        runs[name][c].append(r)
                        traced_calls += r["calls"] if name == "traces on" else r["calls"] / 10 if "sampled" in name else 0
            time.sleep(6)  # the batch processor's last export (OTEL_BSP_SCHEDULE_DELAY, 5 s)
            received = httpx.get(receiver.url + "/stats", timeout=120).json()
            protocol_errors = httpx.get(d.url + "/stub/stats").json()["protocol_errors"]
        finally:
            for proc in (*proxies.values(), p, d, receiver):
                proc.stop()
    rows, results = [], {}
    for name, by_c in runs.items():
        for c, rs in by_c.items():
            rps, cpu = statistics.median(r["rps"] for r in rs), statistics.median(r["cpu_ms"] for r in rs)
            base_rps = statistics.median(r["rps"] for r in runs["before"][c])
            base_cpu = statistics.median(r["cpu_ms"] for r in runs["before"][c])
            results.setdefault(name, {})[str(c)] = {"rps": rps, "cpu_ms": cpu, "runs": rs}
            rows.append([name, c, rps, rps / base_rps, cpu, cpu / base_cpu,
                         statistics.median(r["p50_ms"] for r in rs), sum(r["errors"] for r in rs)])
    table(f"proxy P->D, stub backends, 16 streamed tokens, {args.duration:.0f} s x {args.rounds} rounds per point "
          f"(medians; before = {args.before}; decode protocol errors: {protocol_errors})",
          ["proxy", "conc", "req/s", "x before", "proxy CPU ms/req", "x before", "p50 ms", "errors"], rows)
    hook = hop_hook_ns()
    print(f"traces on: {received['spans']} spans received for {traced_calls:.0f} requests traced (10% of the "
          f"sampled proxy's, expected) "
          f"({received['spans'] / max(1, traced_calls):.2f} per request, {SPANS_PER_REQUEST} made), "
          f"{received['posts']} exports, {received['bytes'] / max(1, traced_calls):.0f} bytes per request")
    print(f"traces off: the hop hooks cost {hook:.0f} ns per hop (Pipeline._hop + with + headers, this process)")
    save("tracing", {"args": vars(args), "results": results, "received": received, "traced_calls": traced_calls,
                     "hop_hook_ns_off": hook, "decode_protocol_errors": protocol_errors})


if __name__ == "__main__":
    sys.exit(main())
