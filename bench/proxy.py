"""Proxy overhead: direct (the floor) vs ascendserve with 1 and 2 workers (and 1 worker without
its token ledger, the price of mid-stream migration: --migration-limit 0 turns it off) vs
vllm-ascend's example proxy vs vllm-router; the proxy's CPU per request (all its processes)
beside each. Give every proxy the same cores: run the whole bench under `taskset -c ...`.

    python -m bench.proxy [--duration 5] [--rounds 3] [--concurrency 1 16 64 256] [--workers 1 2]
        [--vllm-ascend-proxy FILE | --vllm-ascend-repo GITDIR] [--vllm-router BIN]
        [--latency-cycles 2000] [--token-delay-ms 0] [--also NAME=SOURCE_TREE ...]

Fast stub P and D instances (tests/stub_backend.py, no model) stand behind
each proxy; the decode stub refuses requests that skipped the prefill hop,
so every proxy is checked to do P then D. "direct" is the client doing both
hops itself: the floor. Each request streams 16 tokens from /v1/completions.
Peers are optional: vllm-ascend's proxy is read from a git checkout of
vllm-ascend (never copied into this repository); vllm-router is looked up on
PATH or in --vllm-router.
Every proxy is started once and stays up; each round measures them all in turn (the order turned
by one each round), and the table gives each point's median over the rounds, its ratios the median
of each round's ratio: vllm-router itself moved between 1,300 and 1,700 req/s at c=64 across
single runs on this 2-core host, so one proxy's minute against another's minutes apart was noise.
The added latency of one request alone is measured apart from the rounds, interleaved: one request
at a time, direct then through each proxy in turn (the order turned each cycle), so each proxy's
p50 and the floor's come from the same seconds (the floor's own p50 moved by 0.3 ms between 5 s
windows, as much as the figure itself). `--also NAME=DIR` adds ascendserve run from another source
tree (a git worktree of an earlier commit, say) beside this one's: a change against its parent in
one run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx
import psutil

from bench._report import save, table
from tests.procs import Proc, control, free_port, start_all, stub

BODY = {"model": "stub-model", "prompt": "benchmark prompt " * 8, "max_tokens": 16, "stream": True}
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


async def _read_all(resp) -> None:
    async for _ in resp.content.iter_any():
        pass


async def one_via_proxy(session, url: str) -> None:
    async with session.post(url + "/v1/completions", json=BODY) as r:
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {(await r.read())[:200]!r}")
        await _read_all(r)


async def one_direct(session, p_url: str, d_url: str) -> None:
    p_body = dict(BODY, max_tokens=1, min_tokens=1, stream=False, kv_transfer_params=PREFILL_PARAMS)
    async with session.post(p_url + "/v1/completions", json=p_body) as r:
        kv = (await r.json())["kv_transfer_params"]
    async with session.post(d_url + "/v1/completions", json=dict(BODY, kv_transfer_params=kv)) as r:
        if r.status != 200:
            raise RuntimeError(f"{r.status}")
        await _read_all(r)


async def load(send, concurrency: int, duration: float, warmup: float = 1.0) -> dict:
    latencies: list[float] = []
    errors = calls = 0
    stop_at = time.monotonic() + warmup + duration
    measure_from = time.monotonic() + warmup
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        async def worker():
            nonlocal errors, calls
            while (now := time.monotonic()) < stop_at:
                try:
                    calls += 1
                    await send(session)
                    if now >= measure_from:
                        latencies.append(time.monotonic() - now)
                except Exception:
                    errors += 1
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    latencies.sort()
    q = statistics.quantiles(latencies, n=100) if len(latencies) > 2 else [float("nan")] * 99
    return {"rps": len(latencies) / duration, "p50_ms": q[49] * 1000, "p99_ms": q[98] * 1000,
            "n": len(latencies), "errors": errors, "calls": calls}


async def interleaved(sends: dict, cycles: int, warmup: int = 50) -> dict:
    """One request at a time, a cycle of one through each of `sends` (name -> send), the order
    turned by one each cycle: every name's latencies (ms) from the same stretch of time."""
    names = list(sends)
    latencies: dict[str, list[float]] = {name: [] for name in names}
    errors = dict.fromkeys(names, 0)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=60)) as session:
        for cycle in range(warmup + cycles):
            turn = cycle % len(names)
            for name in names[turn:] + names[:turn]:
                started = time.monotonic()
                try:
                    await sends[name](session)
                except Exception:
                    errors[name] += 1
                    continue
                if cycle >= warmup:
                    latencies[name].append((time.monotonic() - started) * 1000)
    return {name: {"p50_ms": statistics.median(ms) if ms else float("nan"), "n": len(ms), "errors": errors[name]}
            for name, ms in latencies.items()}


def vllm_ascend_proxy(args, tmp: Path, p: Proc, d: Proc) -> Proc | None:
    source = Path(args.vllm_ascend_proxy) if args.vllm_ascend_proxy else None
    if source is None and args.vllm_ascend_repo and Path(args.vllm_ascend_repo).exists():
        source = tmp / "load_balance_proxy_server_example.py"
        rel = "examples/disaggregated_prefill_v1/load_balance_proxy_server_example.py"
        with open(source, "wb") as f:
            if subprocess.run(["git", "-C", args.vllm_ascend_repo, "show", f"HEAD:{rel}"], stdout=f).returncode:
                return None
    if source is None or not source.exists():
        return None
    port = free_port()
    argv = [sys.executable, str(source), "--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING",
            "--prefiller-hosts", "127.0.0.1", "--prefiller-ports", str(p.port),
            "--decoder-hosts", "127.0.0.1", "--decoder-ports", str(d.port)]
    return Proc("vllm-ascend proxy", argv, port, tmp / "vllm-ascend-proxy.log", {}, "/healthcheck")


def vllm_router(args, tmp: Path, p: Proc, d: Proc) -> Proc | None:
    binary = args.vllm_router or shutil.which("vllm-router")
    if not binary or not Path(binary).exists():
        return None
    port = free_port()
    argv = [binary, "--vllm-pd-disaggregation", "--prefill", p.url, "--decode", d.url, "--host", "127.0.0.1",
            "--port", str(port), "--policy", "round_robin", "--prometheus-port", str(free_port()),
            "--worker-startup-check-interval", "1"]
    return Proc("vllm-router", argv, port, tmp / "vllm-router.log", {}, "/health")


def tree_cpu(pid: int) -> float:
    """CPU seconds of a process and its live descendants (a proxy's workers)."""
    total = 0.0
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=3, help="measure every proxy this many times, in turn")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="ascendserve's [proxy] workers to run")
    ap.add_argument("--vllm-ascend-proxy", default="")
    ap.add_argument("--vllm-ascend-repo", default="/work/.mirror/vllm-project+vllm-ascend/repo")
    ap.add_argument("--vllm-router", default="/root/.venvs/vllm-router/bin/vllm-router")
    ap.add_argument("--latency-cycles", type=int, default=2000,
                    help="c=1 added latency, interleaved: this many requests through each (0: skip)")
    ap.add_argument("--token-delay-ms", type=float, default=0.0,
                    help="the decode stub's pause before each token: 0 sends a stream's events in one burst, "
                         "which the proxies read a few at a time; a real engine sends one a step, and a proxy "
                         "reads each on its own (what a token costs it shows then)")
    ap.add_argument("--also", nargs="*", default=[], metavar="NAME=DIR",
                    help="ascendserve (1 worker) from another source tree too, beside this one")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        p, d = stub("prefill", tmp), stub("decode", tmp, "--require-kv", "--token-delay-ms", str(args.token_delay_ms))
        start_all(p, d)
        ours = [(f"ascendserve, {n} worker{'s' if n > 1 else ''}", ("--workers", str(n))) for n in args.workers]
        ours.append(("ascendserve, no ledger", ("--workers", "1", "--migration-limit", "0")))
        candidates = {name: control("proxy", tmp, "--prefill", f"127.0.0.1:{p.port}", "--decode",
                                    f"127.0.0.1:{d.port}", "--log-level", "warning", *extra)
                      for name, extra in ours}
        for spec in args.also:
            name, _, tree = spec.partition("=")
            proc = control("proxy", tmp, "--prefill", f"127.0.0.1:{p.port}", "--decode", f"127.0.0.1:{d.port}",
                           "--log-level", "warning", "--workers", "1", name=f"also-{len(candidates)}")
            proc.argv.insert(1, "-P")  # not the working directory's ascendserve: the tree's, on PYTHONPATH
            proc.env["PYTHONPATH"] = str(Path(tree).resolve())
            candidates[name] = proc
        for name, make in (("vllm-ascend proxy", vllm_ascend_proxy), ("vllm-router", vllm_router)):
            proc = make(args, tmp, p, d)
            if proc is None:
                print(f"{name}: not found, skipped")
            else:
                candidates[name] = proc
        runs: dict[str, dict[int, list[dict]]] = {"direct (floor)": {c: [] for c in args.concurrency}}
        up: dict[str, Proc] = {}
        alone: dict = {}
        try:
            for name, proc in candidates.items():
                try:
                    start_all(proc)
                    ready = proc.url + ("/health" if name != "vllm-ascend proxy" else "/healthcheck")
                    for _ in range(50):
                        if httpx.get(ready).status_code == 200:
                            break
                        time.sleep(0.2)
                    up[name] = proc
                    runs[name] = {c: [] for c in args.concurrency}
                except Exception as exc:
                    print(f"{name}: failed to start: {exc}")
                    proc.stop()
            # every proxy stays up (idle between its turns) and each round measures them all, in an
            # order that turns by one each round: the host's drift over minutes lands on all alike
            names = list(up)
            for rnd in range(args.rounds):
                order = names[rnd % len(names):] + names[:rnd % len(names)] if names else []
                for c in args.concurrency:
                    runs["direct (floor)"][c].append(
                        asyncio.run(load(lambda s: one_direct(s, p.url, d.url), c, args.duration)))
                    for name in order:
                        proc = up[name]
                        cpu = tree_cpu(proc.pid)
                        r = asyncio.run(load(lambda s, u=proc.url: one_via_proxy(s, u), c, args.duration))
                        # the proxy's CPU per request, every process of it (its warm-up second in both terms)
                        r["cpu_ms"] = 1000 * (tree_cpu(proc.pid) - cpu) / max(1, r["calls"])
                        runs[name][c].append(r)
            sends = {"direct (floor)": lambda s: one_direct(s, p.url, d.url)}
            sends.update({name: (lambda s, u=proc.url: one_via_proxy(s, u)) for name, proc in up.items()})
            alone = asyncio.run(interleaved(sends, args.latency_cycles)) if args.latency_cycles else {}
        finally:
            for proc in up.values():
                proc.stop()
        protocol_errors = httpx.get(d.url + "/stub/stats").json()["protocol_errors"]
        p.stop(), d.stop()
    results = {name: {c: _median(rs) for c, rs in by_c.items() if rs} for name, by_c in runs.items()}
    floor, base = runs["direct (floor)"], results["direct (floor)"]
    rows = []
    for name, by_c in results.items():
        for c, r in by_c.items():
            mine = runs[name][c]
            rows.append([name, c, r["rps"], r["p50_ms"], r["p99_ms"], r["p50_ms"] - base[c]["p50_ms"],
                         r["p99_ms"] - base[c]["p99_ms"], _ratio(mine, floor[c]),
                         _ratio(mine, runs.get("vllm-ascend proxy", {}).get(c)),
                         _ratio(mine, runs.get("vllm-router", {}).get(c)), r.get("cpu_ms", float("nan")),
                         _ratio(mine, runs.get("ascendserve, no ledger", {}).get(c)), r["errors"]])
    paced = f" {args.token_delay_ms:g} ms apart" if args.token_delay_ms else ""
    table(f"P->D through each proxy, stub backends, 16 streamed tokens{paced}, {args.duration:.0f} s per point, "
          f"median of {args.rounds} round(s); x columns: the median of each round's ratio (decode protocol errors: "
          f"{protocol_errors})",
          ["proxy", "conc", "req/s", "p50 ms", "p99 ms", "+p50 ms", "+p99 ms", "x floor", "x vllm-ascend",
           "x vllm-router", "proxy CPU ms/req", "x no ledger", "errors"],
          rows)
    if alone:
        floor_ms = alone["direct (floor)"]["p50_ms"]
        table(f"One request at a time, interleaved: {args.latency_cycles} through each, in turn",
              ["proxy", "p50 ms", "added p50 ms", "errors"],
              [[name, r["p50_ms"], r["p50_ms"] - floor_ms, r["errors"]] for name, r in alone.items()])
    save("proxy", {"args": vars(args), "alone": alone,
                   "results": {k: {str(c): v for c, v in by.items()} for k, by in results.items()},
                   "rounds": {k: {str(c): v for c, v in by.items()} for k, by in runs.items()},
                   "decode_protocol_errors": protocol_errors})


def _median(rs: list[dict]) -> dict:
    """A point's figures over the rounds: the median of each (errors: the sum)."""
    out = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "errors" and k in rs[-1]}
    out["errors"] = sum(r["errors"] for r in rs)
    return out


def _ratio(mine: list[dict], theirs: list[dict] | None) -> float:
    """req/s over a peer's, the median of the rounds' ratios (each round measured both minutes apart
    at most), nan without the peer."""
    if not theirs:
        return float("nan")
    return statistics.median(a["rps"] / b["rps"] for a, b in zip(mine, theirs))


if __name__ == "__main__":
    main()
