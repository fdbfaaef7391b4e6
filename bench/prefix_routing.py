"""Prefix-aware routing: load-only vs prefix affinity, over two real pd instances.

    python -m bench.prefix_routing [--prefixes 6] [--requests 48]

Workload: a few long shared prefixes (a "document" each), many requests that
append a different question to one of them, in shuffled order, two at a
time. Two proxies front the same two vLLM instances (prefix caching on):
one balancing by load only, one with --prefix-aware. Each gets its own
prefixes, so neither benefits from the other's cache. Reported: vLLM's
prefix-cache hit rate over the run and the TTFT seen through the proxy.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench._report import save, table
from tests.procs import ascendserve, control, start_all

_COUNTER = re.compile(r"^vllm:prefix_cache_(queries|hits)_total\{[^}]*\}\s+([0-9.eE+-]+)", re.MULTILINE)


def cache_counters(urls: list[str]) -> dict:
    total = {"queries": 0.0, "hits": 0.0}
    for url in urls:
        for kind, value in _COUNTER.findall(httpx.get(url + "/metrics", timeout=10).text):
            total[kind] += float(value)
    return total


def workload(seed: int, prefixes: int, requests: int) -> list[str]:
    rng = random.Random(seed)
    words = "river stone lantern harbor meadow copper violet engine orbit quiet ledger maple".split()
    docs = [" ".join(rng.choice(words) for _ in range(220)) for _ in range(prefixes)]
    prompts = [f"{docs[i % prefixes]}\nQuestion {i}: what is word {rng.randint(1, 200)}?" for i in range(requests)]
    rng.shuffle(prompts)
    return prompts


async def run(proxy_url: str, model: str, prompts: list[str], concurrency: int) -> list[float]:
    ttfts: list[float] = []
    queue = list(prompts)

    async def worker(client):
        while queue:
            prompt = queue.pop()
            start = time.monotonic()
            async with client.stream("POST", proxy_url + "/v1/completions", json={
                    "model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}) as r:
                r.raise_for_status()
                chunks = r.aiter_bytes()
                await chunks.__anext__()
                ttfts.append(time.monotonic() - start)
                async for _ in chunks:
                    pass

    async with httpx.AsyncClient(timeout=120) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return ttfts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefixes", type=int, default=6)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--slack", type=float, default=None, help="proxy.prefix_slack_tokens (default: the proxy's)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        model = tmp / "tiny-text"
        subprocess.run([sys.executable, "-m", "ascendserve", "model", "tiny", "--kind", "text", "--out", str(model)],
                       check=True, capture_output=True)
        pds = [ascendserve("pd", model, tmp, name=f"pd{i}") for i in range(2)]
        start_all(*pds)
        targets = [f"127.0.0.1:{p.port}" for p in pds]
        extra = []
        if args.slack is not None:
            (tmp / "slack.toml").write_text(f"[proxy]\nprefix_slack_tokens = {args.slack}\n")
            extra = ["--config", str(tmp / "slack.toml")]
        proxies = {"load only": control("proxy", tmp, "--pd", *targets, "--log-level", "warning", name="px-load"),
                   "prefix-aware": control("proxy", tmp, "--pd", *targets, "--prefix-aware", "--log-level", "warning",
                                           *extra, name="px-prefix")}
        results = {}
        try:
            start_all(*proxies.values())
            time.sleep(1.0)
            for seed, (name, proxy) in enumerate(proxies.items()):
                prompts = workload(seed, args.prefixes, args.requests)
                before = cache_counters([p.url for p in pds])
                ttfts = asyncio.run(run(proxy.url, str(model), prompts, args.concurrency))
                after = cache_counters([p.url for p in pds])
                queries = after["queries"] - before["queries"]
                results[name] = {"hit_rate": (after["hits"] - before["hits"]) / queries if queries else 0.0,
                                 "ttft_mean_ms": statistics.mean(ttfts) * 1000,
                                 "ttft_p50_ms": statistics.median(ttfts) * 1000}
        finally:
            for proc in (*proxies.values(), *pds):
                proc.stop()
    base = results["load only"]
    table(f"prefix-aware routing (slack {args.slack if args.slack is not None else 'default'} tokens), "
          f"2 pd instances, {args.prefixes} shared ~1.3k-token prefixes, "
          f"{args.requests} requests, concurrency {args.concurrency}",
          ["routing", "prefix-cache hit rate", "TTFT mean ms", "TTFT p50 ms", "x load-only TTFT"],
          [[n, r["hit_rate"], r["ttft_mean_ms"], r["ttft_p50_ms"], r["ttft_mean_ms"] / base["ttft_mean_ms"]]
           for n, r in results.items()])
    save("prefix_routing", {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
