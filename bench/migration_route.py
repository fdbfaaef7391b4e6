"""Where a P->D request broken mid-stream should continue: on a decode instance alone (it
recomputes the prompt and the tokens so far), or through a prefill instance again (which still
holds the prompt in its prefix cache and computes only the new tail; D pulls the KV).

    python -m bench.migration_route [--generated 64] [--repeats 3]

One prefill, two decodes (pull connector) on the tiny text model. For each prompt length: the
request is sent once through P and the first D (P computes and caches the prompt, as for the
request that later breaks); then the continuation's token-id prompt (prompt + `generated`
tokens) is timed to its first token on the other D, which never saw it: (a) sent to it alone,
(b) through a proxy of P and that D (P computes the tail, D pulls). Its prefix cache is reset
after each.
Results go to bench/results/migration_route-*.json; the ratio b/a says which route is faster.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench._report import save, table
from tests.procs import ascendserve, control, start_all, wait_for
from tests.traffic import LENGTHS, text


def first_token_s(url: str, body: dict) -> float:
    started = time.monotonic()
    with httpx.stream("POST", url + "/v1/completions", json=dict(body, stream=True), timeout=600) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and '"token_ids"' in line:
                return time.monotonic() - started
    raise AssertionError("no token")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--generated", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from tests.conftest import _build

    model = _build("text")
    rows, raw = [], {}
    with tempfile.TemporaryDirectory() as t:
        logs = Path(t)
        common = ("--kv-connector", "pull", "--cluster-token", "bench")
        p = ascendserve("prefill", model, logs, *common)
        d, other = (ascendserve("decode", model, logs, *common, name=f"decode{i}") for i in range(2))
        start_all(p, d, other)
        # the request that breaks ran P -> d; its continuation goes to `other`, which never saw it
        proxy, proxy2 = (control("proxy", logs, "--cluster-token", "bench", "--prefill", f"127.0.0.1:{p.port}",
                                 "--decode", f"127.0.0.1:{x.port}") for x in (d, other))
        start_all(proxy, proxy2)
        for x in (proxy, proxy2):
            wait_for(lambda: httpx.get(x.url + "/health").status_code == 200, 60, "proxy never healthy")
        try:
            for name, prompt in (("short", LENGTHS["short"]), ("multi-block", LENGTHS["multi-block"]),
                                 ("thousands", LENGTHS["thousands"])):
                times: dict[str, list[float]] = {"decode alone": [], "through prefill": []}
                for i in range(args.repeats):
                    fresh = f"{i} {text(i, 8)} {prompt}"  # nothing cached from the previous repeat
                    r = httpx.post(proxy.url + "/v1/completions", timeout=600, json={
                        "model": str(model), "prompt": fresh, "max_tokens": args.generated, "temperature": 0,
                        "ignore_eos": True, "return_token_ids": True}).json()["choices"][0]
                    ids = r["prompt_token_ids"] + r["token_ids"]
                    body = {"model": str(model), "prompt": ids, "max_tokens": 1, "temperature": 0}
                    # one route per repeat first, on its own copy: neither may warm the other's cache
                    order = ("decode alone", "through prefill") if i % 2 == 0 else ("through prefill", "decode alone")
                    for route in order:
                        b = dict(body, prompt=ids) if route == order[0] else dict(body, prompt=ids)
                        url = other.url if route == "decode alone" else proxy2.url
                        times[route].append(first_token_s(url, b))
                        httpx.post(other.url + "/reset_prefix_cache", headers={"x-cluster-token": "bench"})
                a, b = (statistics.median(times[k]) for k in ("decode alone", "through prefill"))
                raw[name] = {"prompt_tokens": len(ids), **times}
                rows.append([name, len(ids), a, b, b / a])
        finally:
            for proc in (proxy, proxy2, p, d, other):
                proc.stop()
    table(f"continuation of a P->D request after {args.generated} tokens: time to its first token (median of "
          f"{args.repeats})", ["prompt", "tokens in", "decode alone s", "through prefill s", "prefill/decode"], rows)
    save("migration_route", {"args": vars(args), "results": raw})


if __name__ == "__main__":
    main()
