"""Engines sharing a few cores: vLLM's idle spin against the nap (engine/patches/idle_poll.py).

    python -m bench.idle_poll [--engines 3] [--requests 25] [--nap-ms 0.5]

Each case starts plain vLLM engines on one tiny model and drives each with its own client:
`--requests` sequential 16-token completions with random 0 / 50 / 300 ms gaps (the pauses of
real clients, which is when an engine's idle readers spin). Cases, side by side:

  spin   `--engines` engines as vLLM ships (ASCENDSERVE_SHM_NAP_MS unset)
  nap    the same with ASCENDSERVE_SHM_NAP_MS (what engine.host_defaults sets on such hosts)
  alone  one engine with one client: the floor, no neighbour to steal a core

Prints the wall time of the load, the median / p90 / worst request, and the ratios to the
floor. OMP_NUM_THREADS=1 as in the suite.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench._report import save, table
from tests.procs import plain_vllm

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _model(root: Path) -> Path:
    import subprocess

    out = root / "tiny-text"
    subprocess.run([sys.executable, "-m", "ascendserve", "model", "tiny", "--out", str(out)], check=True,
                   capture_output=True, timeout=300)
    return out


def run_case(model: Path, logs: Path, engines: int, requests: int, nap_ms: str | None) -> dict:
    env = {"ASCENDSERVE_SHM_NAP_MS": nap_ms}  # None removes it from the engines' environment
    procs = [plain_vllm(model, logs, name=f"vllm-{nap_ms or 'spin'}-{engines}-{i}", env=env) for i in range(engines)]
    latencies: list[float] = []
    lock = threading.Lock()

    def client(i: int, url: str) -> None:
        rnd = random.Random(i)
        with httpx.Client(base_url=url, timeout=120) as c:
            for k in range(requests):
                started = time.monotonic()
                r = c.post("/v1/completions", json={"model": str(model), "prompt": f"client {i} request {k}",
                                                    "max_tokens": 16, "temperature": 0})
                r.raise_for_status()
                with lock:
                    latencies.append(time.monotonic() - started)
                time.sleep(rnd.choice([0.0, 0.05, 0.3]))

    try:
        for p in procs:
            p.start()
        for p in procs:
            p.wait_ready()
        started = time.monotonic()
        threads = [threading.Thread(target=client, args=(i, p.url)) for i, p in enumerate(procs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - started
    finally:
        for p in procs:
            p.stop()
    latencies.sort()
    return {"wall_s": wall, "median_s": statistics.median(latencies),
            "p90_s": latencies[int(0.9 * (len(latencies) - 1))], "max_s": latencies[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", type=int, default=3)
    parser.add_argument("--requests", type=int, default=25)
    parser.add_argument("--nap-ms", default="0.5")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-idle-") as tmp:
        root = Path(tmp)
        model = _model(root)
        cases = {
            "spin": run_case(model, root, args.engines, args.requests, None),
            "nap": run_case(model, root, args.engines, args.requests, args.nap_ms),
            "alone": run_case(model, root, 1, args.requests, None),
        }
    floor = cases["alone"]
    rows = [[name, f"{r['wall_s']:.2f}", f"{r['median_s'] * 1000:.0f}", f"{r['p90_s'] * 1000:.0f}",
             f"{r['max_s'] * 1000:.0f}", f"{r['wall_s'] / floor['wall_s']:.2f}",
             f"{r['max_s'] / floor['max_s']:.2f}"] for name, r in cases.items()]
    table(f"{args.engines} engines on {os.cpu_count()} cores, {args.requests} requests per client "
          f"(nap {args.nap_ms} ms)", ["case", "wall s", "median ms", "p90 ms", "worst ms", "wall/alone",
                                      "worst/alone"], rows)
    print(f"nap against spin: wall {cases['nap']['wall_s'] / cases['spin']['wall_s']:.2f}x, "
          f"worst request {cases['nap']['max_s'] / cases['spin']['max_s']:.2f}x")
    save("idle_poll", {"args": vars(args), "cases": cases})


if __name__ == "__main__":
    main()
