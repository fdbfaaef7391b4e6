"""In-engine KV pull figures for bench/kv_transfer.py: what D's own log says its pulls ran at,
and where a 1P1D TTFT goes (P's prefill, D's wait for its pull to start, the pull, D's first
step after it).

The breakdown plays the proxy's pull flow itself (P with max_tokens 1 and our pull params, then
D streaming with P's kv_transfer_params, as router/kv_flow.py does), timing each hop from this
client, and places D's pull on the same clock from the "KV pulled" line D's worker logs (JSON:
its timestamp is when the pull ended, `ms` how long it ran). Same host, same wall clock.
"""

from __future__ import annotations

import json
import statistics
import time
from datetime import datetime
from pathlib import Path


def pulled_events(log_path: Path, since: float = 0.0) -> list[dict]:
    """D's "KV pulled" events logged at or after `since` (epoch seconds), with `end` (epoch)."""
    out = []
    for line in log_path.read_text(errors="replace").splitlines():
        if '"KV pulled"' not in line:
            continue
        try:
            event = json.loads(line[line.index("{"):])
        except ValueError:
            continue
        if event.get("event") != "KV pulled" or "timestamp" not in event:
            continue
        event["end"] = datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()
        if event["end"] >= since:
            out.append(event)
    return out


def in_engine_gbps(log_path: Path, since: float, min_bytes: int) -> tuple[float | None, int]:
    """Median GB/s of D's pulls of at least `min_bytes` since `since`, and how many there were."""
    rates = [e["bytes"] / (e["ms"] / 1e3) / 1e9 for e in pulled_events(log_path, since)
             if e.get("bytes", 0) >= min_bytes and e.get("ms", 0) > 0]
    return (statistics.median(rates) if rates else None), len(rates)


def _first_token(url: str, body: dict) -> float:
    """Epoch time of the first streamed token of `body` at `url`."""
    import httpx

    with httpx.stream("POST", url + "/v1/completions", timeout=600, json={**body, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                return time.time()
    raise RuntimeError("no token streamed")


def breakdown(p_url: str, d_url: str, d_log: Path, model: str, prompts: list[str], min_bytes: int) -> dict:
    """Medians over `prompts` (each fresh) of: P's prefill (its answer, from this client), D's
    wait from its request to the start of its pull, the pull, D after the pull to its first
    token (its first step and the stream), and the whole (P's request to D's first token)."""
    import httpx

    from ascendserve.protocol.kv_params import pull_prefill_params

    parts: dict[str, list[float]] = {k: [] for k in ("total", "prefill", "d_wait", "pull", "d_first_step")}
    for text in prompts:
        body = {"model": model, "prompt": text, "temperature": 0}
        t0 = time.time()
        r = httpx.post(p_url + "/v1/completions", timeout=600, json={
            **body, "max_tokens": 1, "min_tokens": 1, "kv_transfer_params": pull_prefill_params()})
        r.raise_for_status()
        t1 = time.time()
        params = r.json().get("kv_transfer_params")
        if not params:
            raise RuntimeError(f"P answered no kv_transfer_params: {r.text[:300]}")
        t2 = _first_token(d_url, {**body, "max_tokens": 2, "kv_transfer_params": params})
        time.sleep(0.2)  # the worker's log line may trail the token by a moment
        pulls = [e for e in pulled_events(d_log, t1) if e.get("bytes", 0) >= min_bytes and e["end"] <= t2 + 0.05]
        if len(pulls) != 1:
            raise RuntimeError(f"expected one pull of >= {min_bytes} bytes in D's log, found {len(pulls)}")
        end, seconds = pulls[0]["end"], pulls[0]["ms"] / 1e3
        parts["total"].append(t2 - t0)
        parts["prefill"].append(t1 - t0)
        parts["d_wait"].append(max(0.0, end - seconds - t1))
        parts["pull"].append(seconds)
        parts["d_first_step"].append(max(0.0, t2 - end))
    return {k: statistics.median(v) for k, v in parts.items()}


def pull_series(p_url: str, d_url: str, d_log: Path, model: str, base: str, n: int, min_bytes: int) -> list[float]:
    """GB/s of `n` in-engine pulls of the whole prompt's KV, quickly: `base` is prefilled on P
    once, then each request is `base` plus a few fresh words, so P recomputes only those (its
    prefix cache) while D, started without prefix caching, pulls every block of the prompt."""
    import httpx

    from ascendserve.protocol.kv_params import pull_prefill_params

    httpx.post(p_url + "/v1/completions", timeout=600,
               json={"model": model, "prompt": base, "max_tokens": 1}).raise_for_status()
    since = time.time()
    for i in range(n):
        body = {"model": model, "prompt": base + "".join(f" s{i}w{j}" for j in range(8)), "temperature": 0}
        r = httpx.post(p_url + "/v1/completions", timeout=600, json={
            **body, "max_tokens": 1, "min_tokens": 1, "kv_transfer_params": pull_prefill_params()})
        r.raise_for_status()
        _first_token(d_url, {**body, "max_tokens": 2, "kv_transfer_params": r.json()["kv_transfer_params"]})
    time.sleep(0.2)
    return [e["bytes"] / (e["ms"] / 1e3) / 1e9 for e in pulled_events(d_log, since)
            if e.get("bytes", 0) >= min_bytes and e.get("ms", 0) > 0]
