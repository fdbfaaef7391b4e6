"""Concurrent streams through one proxy worker: errors, latency, and whether its memory and sockets come back.

    python -m bench.load [--concurrency 100,500,1500,3000,5000] [--tokens 8] [--timeout 120]
                         [--dashboard-pages N [--pairs 2]]

1P1D pull topology on 127.0.0.1: the ascendserve proxy (one worker) in front
of a fast stub P and a stub D that refuses requests which skipped P
(tests/stub_backend.py). At each step, N clients each open one streaming
completion at once; D holds every stream after its first token until all N
are open, so N is the real number of concurrent streams. A warm-up round of
the same size comes first; the proxy's RSS and open files, read once it holds
no connection, are "start"; the same after the measured round is "end".
The stubs' counters must show every request went P then D. Steps stop at the
first with errors, or before one that a limit of this machine (open files,
ephemeral ports, memory) could not hold, and say which. The proxy's CPU per request is read over
each measured round. With --dashboard-pages N, each step also runs `--pairs` pairs of rounds of
the same size, one with no dashboard open and one with N pages subscribed to /dashboard/events
(tests/dashboard_pages.py, in a process of their own), in turn: errors must stay 0 and the pages connected, and the table
gives the proxy's CPU per request with the pages against without them (the issue's bound: within
5 %) and the bytes each page received per second.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import tempfile
from pathlib import Path

import psutil

from ascendserve.web.limits import raise_open_files_limit
from bench._report import save, table
from tests.dashboard_pages import PagesProcess, hub_cpu_ms
from tests.loadgen import reset_stubs, run_round, stub_cluster, stub_stats, wait_idle

SLACK = 0.10
# Per stream: the client's socket, the proxy's two ends (client, D) and a pooled P socket, D's and P's ends.
PROXY_FDS_PER_STREAM = 3
PORTS_PER_STREAM = 3  # ephemeral ports: client -> proxy, proxy -> P, proxy -> D
MIB_PER_STREAM = 0.2  # proxy, client and stubs together; an upper estimate (the proxy's own share is ~0.05)


def port_range() -> int:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return high - low + 1
    except (OSError, ValueError):
        return 28232


def limit_for(c: int, proxy_pid: int, client_fds: int) -> str:
    """Which limit of this machine `c` streams would exceed, or ""."""
    proxy_fds = psutil.Process(proxy_pid).rlimit(psutil.RLIMIT_NOFILE)[0]
    if PROXY_FDS_PER_STREAM * c + 100 > proxy_fds:
        return f"proxy open files limit ({proxy_fds})"
    if c + 100 > client_fds:
        return f"client open files limit ({client_fds})"
    if PORTS_PER_STREAM * c > port_range():
        return f"ephemeral ports ({port_range()})"
    if MIB_PER_STREAM * c > psutil.virtual_memory().available / 2**20 * 0.8:
        return "memory"
    return ""


def limit_named_by(errors: dict) -> str:
    kinds = " ".join(errors)
    for needle, name in (("EMFILE", "open files limit"), ("ENFILE", "system open files limit"),
                         ("EADDRNOTAVAIL", "ephemeral ports"), ("MemoryError", "memory"),
                         ("ECONNREFUSED", "listen backlog / proxy down"), ("timeout", "time (round timeout)")):
        if needle in kinds:
            return name
    return "errors: " + kinds


def cpu_s(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def measured_round(c: int, args, p, d, proxy, pages: int = 0) -> tuple:
    """One round of c streams, with `pages` dashboard pages open; (result, proxy CPU ms per request, pages)."""
    reset_stubs(p.url, d.url, gate=c)
    with PagesProcess(proxy.url, pages) as open_pages:
        hub_before = hub_cpu_ms(proxy.url) if pages else 0.0
        before = cpu_s(proxy.popen.pid)
        r = run_round(proxy.url, c, args.tokens, args.timeout)
        cpu_ms = (cpu_s(proxy.popen.pid) - before) * 1000 / c
        if pages:
            time.sleep(1.1)  # the next snapshot has the round's ticks
            open_pages.hub_cpu_ms = (hub_cpu_ms(proxy.url) - hub_before) / c
    return r, cpu_ms, open_pages


def dashboard_pairs(c: int, args, p, d, proxy) -> dict:
    """--pairs rounds without and with --dashboard-pages pages open, in turn (the order alternates)."""
    without, with_, bytes_s, hub, errors, page_errors = [], [], [], [], {}, []
    for pair in range(args.pairs):
        for pages in (0, args.dashboard_pages) if pair % 2 == 0 else (args.dashboard_pages, 0):  # drift cancels
            r, cpu_ms, open_pages = measured_round(c, args, p, d, proxy, pages)
            (with_ if pages else without).append(cpu_ms)
            for kind, n in r.errors.items():
                errors[kind] = errors.get(kind, 0) + n
            if pages:
                bytes_s.append(open_pages.bytes_per_second())
                hub.append(open_pages.hub_cpu_ms)
                page_errors += open_pages.errors + ([f"{open_pages.ended} streams ended"] if open_pages.ended else [])
    ratio = statistics.median(with_) / statistics.median(without)
    return {"pages": args.dashboard_pages, "cpu_ms_without": without, "cpu_ms_with": with_, "ratio": ratio,
            "within_5pct": ratio <= 1.05, "bytes_per_s_per_page": bytes_s, "dashboard_cpu_ms_per_request": hub, "errors": errors, "page_errors": page_errors}


def step(c: int, args, p, d, proxy) -> tuple[list, dict]:
    pid = proxy.popen.pid
    reset_stubs(p.url, d.url, gate=c)
    warm = run_round(proxy.url, c, args.tokens, args.timeout)
    start = wait_idle(pid, args.settle)
    r, cpu_ms, _ = measured_round(c, args, p, d, proxy)
    ps, ds = stub_stats(p.url), stub_stats(d.url)
    dash = dashboard_pairs(c, args, p, d, proxy) if args.dashboard_pages else None
    end = wait_idle(pid, args.settle, within=start, slack=SLACK)
    p_then_d = (ps["prefills"] == ds["decodes"] == c and ps["protocol_errors"] == ds["protocol_errors"] == 0)
    back = end.sockets == 0 and end.fds <= start.fds * (1 + SLACK) and end.rss_mb <= start.rss_mb * (1 + SLACK)
    errors = dict(warm.errors + r.errors)
    for kind, n in (dash["errors"] if dash else {}).items():
        errors[kind] = errors.get(kind, 0) + n
    row = [c, r.ok, r.error_count + warm.error_count, ds["peak_active"],
           r.quantile_ms("ttft_s", 50), r.quantile_ms("ttft_s", 99),
           r.quantile_ms("total_s", 50), r.quantile_ms("total_s", 99),
           f"{ps['prefills']}/{ds['decodes']}", ds["protocol_errors"] + ps["protocol_errors"],
           start.rss_mb, end.rss_mb, start.fds, end.fds, "yes" if back else "NO", cpu_ms]
    if args.dashboard_pages:
        row += [statistics.median(dash["cpu_ms_with"]), dash["ratio"],
                statistics.median(dash["dashboard_cpu_ms_per_request"]) * 1000,
                statistics.median(dash["bytes_per_s_per_page"]), len(dash["page_errors"])]
    record = {"concurrency": c, "ok": r.ok, "errors": errors, "wall_s": r.wall_s, "peak_active": ds["peak_active"],
              "gate_timeouts": ds["gate_timeouts"], "client_peak_open": r.peak_open,
              "ttft_ms": {"p50": row[4], "p99": row[5]}, "total_ms": {"p50": row[6], "p99": row[7]},
              "prefill_stats": ps, "decode_stats": ds, "p_then_d": p_then_d,
              "start": vars(start), "end": vars(end), "back_within_10pct": back, "proxy_cpu_ms_per_request": cpu_ms,
              "dashboard": dash}
    return row, record


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="100,500,1500,3000,5000", help="comma-separated steps")
    ap.add_argument("--max-concurrency", type=int, default=5000)
    ap.add_argument("--tokens", type=int, default=8, help="streamed tokens per request")
    ap.add_argument("--timeout", type=float, default=120.0, help="limit on one round, seconds")
    ap.add_argument("--settle", type=float, default=30.0, help="longest wait for the proxy to go idle, seconds")
    ap.add_argument("--log-dir", default="", help="keep the proxy's and the stubs' logs here")
    ap.add_argument("--dashboard-pages", type=int, default=0,
                    help="also run each step with this many dashboard pages subscribed (/dashboard/events)")
    ap.add_argument("--pairs", type=int, default=2, help="rounds without and with the pages, in turn")
    args = ap.parse_args()
    steps = [c for c in (int(x) for x in args.concurrency.split(",")) if c <= args.max_concurrency]
    _, client_fds = raise_open_files_limit()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows, records, stopped = [], [], ""
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(args.log_dir or t)
        tmp.mkdir(parents=True, exist_ok=True)
        with stub_cluster(tmp, gate_timeout_s=args.timeout / 2) as (p, d, proxy):
            fresh = wait_idle(proxy.popen.pid, args.settle)
            print(f"proxy pid {proxy.popen.pid}: {fresh.rss_mb:.1f} MiB, {fresh.fds} open files before any "
                  f"request; open files limit {psutil.Process(proxy.popen.pid).rlimit(psutil.RLIMIT_NOFILE)}",
                  flush=True)
            for c in steps:
                if limit := limit_for(c, proxy.popen.pid, client_fds):
                    stopped = f"not run at {c}: {limit}"
                    break
                print(f"{c} concurrent streams ...", flush=True)
                row, record = step(c, args, p, d, proxy)
                rows.append(row)
                records.append(record)
                dash = record["dashboard"]
                if dash and (dash["page_errors"] or not dash["within_5pct"]):
                    print(f"dashboard at {c}: CPU x{dash['ratio']:.3f} with {dash['pages']} pages "
                          f"(bound 1.05), page errors {dash['page_errors'][:3]}", flush=True)
                if record["errors"] or not record["p_then_d"] or record["peak_active"] != c:
                    stopped = f"stopped at {c}: {limit_named_by(record['errors'])}" if record["errors"] else \
                        f"stopped at {c}: P/D counts or concurrency not reached"
                    break
                if proxy.popen.poll() is not None:
                    stopped = f"proxy exited with {proxy.popen.returncode} at {c}"
                    break
    reached = max((r["concurrency"] for r in records if not r["errors"] and r["p_then_d"]
                   and r["peak_active"] == r["concurrency"]), default=0)
    if not stopped:
        stopped = f"all steps ran (cap {args.max_concurrency})"
    table(f"Concurrent streams through one proxy worker, stub P/D (1P1D pull), {args.tokens} tokens each; "
          f"start/end = proxy idle after the warm-up / after the run",
          ["conc", "ok", "errors", "peak open", "ttft p50 ms", "ttft p99 ms", "total p50 ms", "total p99 ms",
           "P/D", "proto err", "RSS start MiB", "RSS end MiB", "fds start", "fds end", "back <=10%",
           "proxy CPU ms/req", *([f"CPU ms/req, {args.dashboard_pages} pages", "x no pages",
                                  "dashboard's own CPU us/req", "bytes/s per page",
                                  "page errors"] if args.dashboard_pages else [])], rows)
    print(f"highest concurrency with 0 errors: {reached}; {stopped}")
    save("load", {"args": vars(args), "steps": records, "highest_ok": reached, "stopped": stopped})


if __name__ == "__main__":
    main()
