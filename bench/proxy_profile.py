"""Where the proxy's CPU goes on the streamed P->D hot path: py-spy samples one proxy worker
under bench.proxy's load (stub engines) and this prints the functions by own time and by
inclusive time, grouped by package.

    python -m bench.proxy_profile [--concurrency 64] [--seconds 10] [--workers 1] [--top 25]
                                  [--proxy-args "--migration-limit 0"]

Needs py-spy (pip install py-spy; not a dependency of ascendserve) and the right to ptrace
the proxy (root, or kernel.yama.ptrace_scope = 0).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import psutil

from bench.proxy import load, one_via_proxy
from tests.procs import control, start_all, stub


def _path(frame: str) -> str:
    return frame[frame.rfind("(") + 1:].split(":")[0].rstrip(")")


def function_of(frame: str) -> str:
    """'func (path/to/file.py:12)' -> 'func (path/to/file.py)': one entry per function, not per line."""
    return f"{frame[:frame.rfind('(')].strip()} ({_path(frame)})"


def ours(frame: str) -> bool:
    path = _path(frame)
    return path.startswith(("ascendserve/", "roles/")) or "/ascendserve/" in path


def package_of(frame: str) -> str:
    """A short owner: our module (py-spy writes paths short), or a library's top package."""
    path = _path(frame)
    if ours(frame):
        return path.rsplit(".", 1)[0]
    if "site-packages/" in path:
        path = path.split("site-packages/", 1)[1]
    if "/lib/python3" in path or "/" not in path:
        return "stdlib/" + path.rsplit("/", 1)[-1].rsplit(".", 1)[0]
    return path.split("/")[0]


def summarize(collapsed: Path, top: int) -> None:
    own: collections.Counter = collections.Counter()
    inclusive: collections.Counter = collections.Counter()
    packages: collections.Counter = collections.Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        frames = stack.split(";")
        total += n
        own[function_of(frames[-1])] += n
        packages[package_of(frames[-1])] += n
        for frame in {function_of(f) for f in frames}:
            inclusive[frame] += n
    if not total:
        print("no samples")
        return
    print(f"{total} samples")
    print(f"\nown time by package (top {top})")
    for name, n in packages.most_common(top):
        print(f"  {100 * n / total:5.1f}%  {name}")
    print(f"\nown time by function (top {top})")
    for name, n in own.most_common(top):
        print(f"  {100 * n / total:5.1f}%  {name}")
    print(f"\ninclusive time, ascendserve functions (top {top})")
    mine = [(f, n) for f, n in inclusive.items() if ours(f)]
    for name, n in sorted(mine, key=lambda x: -x[1])[:top]:
        print(f"  {100 * n / total:5.1f}%  {name}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--proxy-args", default="", help="more flags for the proxy, e.g. '--migration-limit 0' "
                    "(bench.proxy's row without the ledger)")
    ap.add_argument("--token-delay-ms", type=float, default=0.0,
                    help="the decode stub's pause before each token (bench/proxy.py: what it shows)")
    ap.add_argument("--save", default="", help="keep py-spy's collapsed stacks here (flamegraph.pl, speedscope)")
    args = ap.parse_args()
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        sys.exit("py-spy not found: pip install py-spy")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        p, d = stub("prefill", tmp), stub("decode", tmp, "--require-kv", "--token-delay-ms", str(args.token_delay_ms))
        proxy = control("proxy", tmp, "--prefill", f"127.0.0.1:{p.port}", "--decode", f"127.0.0.1:{d.port}",
                        "--log-level", "warning", "--workers", str(args.workers), *args.proxy_args.split())
        start_all(p, d, proxy)
        try:
            kids = psutil.Process(proxy.pid).children()
            target = kids[0].pid if kids else proxy.pid  # one worker (the single process with --workers 1)
            out = tmp / "collapsed.txt"
            record = [spy, "record", "--pid", str(target), "--duration", str(int(args.seconds)), "--rate", "250",
                      "--format", "raw", "--nonblocking", "--output", str(out)]
            result: dict = {}
            runner = threading.Thread(target=lambda: result.update(
                asyncio.run(load(lambda s: one_via_proxy(s, proxy.url), args.concurrency, args.seconds + 2, 1.0))))
            runner.start()
            subprocess.run(record, check=True, capture_output=True)
            runner.join()
            print(f"load: c={args.concurrency}, {result.get('rps', 0):.0f} req/s, errors {result.get('errors')}")
            summarize(out, args.top)
            if args.save:
                shutil.copy(out, args.save)
        finally:
            for proc in (proxy, p, d):
                proc.stop()


if __name__ == "__main__":
    main()
