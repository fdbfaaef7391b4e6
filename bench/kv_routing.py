"""Proxy routing policies side by side over real vLLM engines: load-only, KV-event-aware
routing, and vllm-router's cache_aware policy as the peer. (The proxy's text-prefix affinity,
measured here on 2026-12-05 at 0.97-1.05x load-only on every workload, was removed.)

    python -m bench.kv_routing [--quick] [--topologies pd,pd2p1d] [--policies load,kv,vllm-router]
        [--workloads chat,system,unrelated] [--users 12] [--turns 6] [--requests 64] [--concurrency 3]
        [--max-tokens 32] [--seed 0] [--rounds 2] [--kv-cache-mib MIB] [--vllm-router BIN]
        [--proxy-arg=--kv-overlap-weight=2] [--log-dir DIR]

The default size (both topologies, all four policies, 2 rounds) takes ~7 minutes on a 2-core
host; `--quick` (4 users x 4 turns, 16 requests, 1 round) is a ~2 minute smoke run. Run it on
an otherwise idle host: the engines are pinned to its cores, and anything else there moves the
TTFTs more than routing does.

Workloads (seeded, chat completions streamed through the router, ignore_eos):
- chat: `--users` conversations of `--turns` turns; each turn sends every previous turn (the
  user's messages and the assistant's actual replies) plus a new user message, so each prompt
  extends the previous one; the first opens with a document of `--context` tokens (2000: ~2.1k
  tokens at turn 1, ~3.4k at turn 6, below the model's 4096; the tiny model is one token a byte, vLLM's CPU KV block
  128 tokens; a miss then costs a prefill of thousands of tokens, as it does on a real model
  with a shorter chat). Users run `--concurrency` at a time, their turns in order.
- system: `--system-prompts` long system prompts (~1.2k tokens), `--requests` short questions,
  each under one of them, in shuffled order, `--concurrency` at a time.
- unrelated: `--requests` distinct random prompts (300-800 tokens), nothing shared: the
  control, where no policy can hit; its ratios are the noise floor (and a policy's own cost).
The engines keep tests/procs.py's 256 MiB KV cache (~131k tokens: nothing is evicted, so
routing only decides the first miss of a prefix on each instance); `--kv-cache-mib 10` (~5k
tokens, the least that holds one 4096-token sequence) adds eviction pressure.
Topologies: `pd`, two pd instances, each pinned to a core of its own (taskset); `pd2p1d`, two
prefill instances (one core each) and one decode (unpinned on a 2-core host), pull connector.
The engines start once per topology; each policy gets a router of its own (started, run,
stopped), and before each workload every engine's prefix cache is reset (POST
/reset_prefix_cache), so every policy sees the same prompts on empty caches. `--rounds` runs
every policy again, in reverse order every other round (load, kv, vllm-router, then
vllm-router, kv, load), and pools its rounds.

Policies: `load` (`--routing load`), `kv` (`--routing kv`: KV-event-aware; the proxy's default),
`vllm-router` (vllm-router `--policy cache_aware`; for pd2p1d its `--vllm-pd-disaggregation`
mode, whose NIXL-style kv_transfer_params our pull connector speaks; PyPI `vllm-router` in a
venv of its own: `--vllm-router BIN`, default /root/.venvs/vllm-router/bin/vllm-router; left
out, with the reason, when it is missing, does not start, or cannot serve a topology).

Reported per topology, workload and policy: prefix-cache hit tokens and hit rate (the engines'
vllm:prefix_cache_hits/queries_total over the run, summed over the instances that compute
prompts: pd, or prefill), how the prompt tokens split over those instances, TTFT through the
router (to the first streamed chunk with content; to the first chunk at all where the
detokenizer held every byte back) p50/p99/mean, requests/s and generated tokens/s over the
run, the ratios load/policy of TTFT mean and p99 (>1: better than load-only),
and the proxy's ascendserve_proxy_prefix_predicted/cached_tokens_total where it exports them.
Results (with every TTFT) go to bench/results/kv_routing-*.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench._report import save, table
from tests.procs import Proc, ascendserve, control, free_port, start_all, wait_for

TOKEN = "bench"  # the cluster token of every engine and proxy here (admin routes, KV side channels)
POLICIES = ("load", "kv", "vllm-router")
TOKENIZE: dict[str, dict] = {}  # per topology: tokenize_cost()
TOPOLOGIES = ("pd", "pd2p1d")
WORKLOADS = ("chat", "system", "unrelated")
DEFAULT_VLLM_ROUTER = "/root/.venvs/vllm-router/bin/vllm-router"
# engines: dev-mode routes on (vLLM serves /reset_prefix_cache only then)
ENGINE_ENV = {"VLLM_SERVER_DEV_MODE": "1", "OMP_NUM_THREADS": "1"}

_ENGINE_COUNTER = re.compile(r"^vllm:prefix_cache_(queries|hits)_total\{[^}]*\}\s+([0-9.eE+-]+)", re.MULTILINE)
_PROXY_COUNTER = re.compile(r"^ascendserve_proxy_prefix_(predicted|cached)_tokens_total(?:\{[^}]*\})?\s+([0-9.eE+-]+)",
                            re.MULTILINE)

WORDS = ("river stone lantern harbor meadow copper violet engine orbit quiet ledger maple cedar falcon "
         "granite willow ember signal canvas thistle beacon marble summit tundra velvet saffron glacier "
         "compass anchor prairie cobalt juniper mosaic nectar obsidian pepper quartz raven sierra").split()


# ---- workloads -------------------------------------------------------------------------------
def words(rng: random.Random, chars: int) -> str:
    """Random words up to about `chars` characters (= tokens: the tiny model's tokenizer is bytes)."""
    out, n = [], 0
    while n < chars:
        w = rng.choice(WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)


def chat_workload(seed: int, users: int, turns: int, context: int = 480) -> list[list[str]]:
    """Per user, the new user message of each turn: an opening of a document of `context` tokens
    and a question, then ~200-token follow-ups."""
    rng = random.Random(f"chat-{seed}")
    convs = []
    for u in range(users):
        first = f"User {u}. Read this report and answer questions about it.\n{words(rng, context)}\nFirst question?"
        convs.append([first] + [f"Follow-up {t} from user {u}: {words(rng, 190)}?" for t in range(1, turns)])
    return convs


def system_workload(seed: int, prompts: int, requests: int) -> list[list[dict]]:
    rng = random.Random(f"system-{seed}")
    systems = [f"You are assistant {i}. Follow this policy handbook.\n{words(rng, 1200)}" for i in range(prompts)]
    out = [[{"role": "system", "content": systems[i % prompts]},
            {"role": "user", "content": f"Question {i}: {words(rng, rng.randint(30, 80))}?"}] for i in range(requests)]
    rng.shuffle(out)
    return out


def unrelated_workload(seed: int, requests: int) -> list[list[dict]]:
    rng = random.Random(f"unrelated-{seed}")
    return [[{"role": "user", "content": f"Request {i}: {words(rng, rng.randint(300, 800))}"}] for i in range(requests)]


# ---- client ----------------------------------------------------------------------------------
async def sse_lines(response: httpx.Response):
    """The stream's lines, split at \\n only: the tiny model's replies hold U+0085, U+2028 and the
    like, which JSON leaves unescaped and httpx's aiter_lines would split at."""
    buffer = b""
    async for data in response.aiter_bytes():
        buffer += data
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r")
    if buffer:
        yield buffer


async def chat_once(client: httpx.AsyncClient, url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat completion: TTFT (to the first chunk with content), the reply's text
    and how many tokens it generated."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = time.monotonic()
    ttft, first_choice, parts, usage = None, None, [], None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in sse_lines(r):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("error"):
                raise RuntimeError(f"error event: {str(chunk['error'])[:300]}")
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                first_choice = first_choice or time.monotonic() - start
                text = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                if text:
                    if ttft is None:
                        ttft = time.monotonic() - start
                    parts.append(text)
    if ttft is None:  # every token held back by the detokenizer (random bytes of the tiny model)
        if first_choice is None:
            raise RuntimeError("stream ended without a token")
        ttft = first_choice
    tokens = usage["completion_tokens"] if usage and usage.get("completion_tokens") is not None else max_tokens
    return {"ttft": ttft, "reply": "".join(parts), "tokens": tokens}


async def drive(url: str, model: str, workload: str, data, concurrency: int, max_tokens: int) -> dict:
    """Run one workload through the router at `url`; TTFTs, generated tokens, errors, wall time."""
    ttfts: list[float] = []
    stats = {"tokens": 0, "errors": 0, "first_error": None}

    async def one(client, messages) -> str:
        try:
            r = await chat_once(client, url, model, messages, max_tokens)
        except Exception as exc:  # counted, reported; the run goes on
            stats["errors"] += 1
            stats["first_error"] = stats["first_error"] or f"{type(exc).__name__}: {exc}"[:400]
            return ""
        ttfts.append(r["ttft"])
        stats["tokens"] += r["tokens"]
        return r["reply"]

    queue = list(data)
    queue.reverse()  # pop() takes them in order

    async def worker(client):
        while queue:
            item = queue.pop()
            if workload == "chat":
                messages: list[dict] = []
                for turn in item:
                    messages.append({"role": "user", "content": turn})
                    messages.append({"role": "assistant", "content": await one(client, list(messages))})
            else:
                await one(client, item)

    started = time.monotonic()
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=64)) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return {"ttfts": ttfts, "wall_s": time.monotonic() - started, **stats}


# ---- engines ---------------------------------------------------------------------------------
def engine_counters(urls: list[str]) -> dict[str, dict[str, float]]:
    out = {}
    for url in urls:
        total = {"queries": 0.0, "hits": 0.0}
        for kind, value in _ENGINE_COUNTER.findall(httpx.get(url + "/metrics", timeout=10).text):
            total[kind] += float(value)
        out[url] = total
    return out


def proxy_counters(url: str) -> dict[str, float] | None:
    """The proxy's predicted / cached prefix tokens, where it exports them (None otherwise)."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    found = _PROXY_COUNTER.findall(text)
    if not found:
        return None
    total = {"predicted": 0.0, "cached": 0.0}
    for kind, value in found:
        total[kind] += float(value)
    return total


def reset_prefix_caches(urls: list[str], timeout: float = 30.0) -> None:
    """POST /reset_prefix_cache to every engine until each says success (it fails while blocks are
    held, e.g. a prefill's blocks a decode has yet to pull)."""
    for url in urls:
        deadline = time.monotonic() + timeout
        while True:
            r = httpx.post(url + "/reset_prefix_cache", headers={"x-cluster-token": TOKEN}, timeout=30)
            if r.status_code != 200:
                raise RuntimeError(f"{url}/reset_prefix_cache: HTTP {r.status_code} {r.text[:200]}")
            if r.json().get("success", True):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url}/reset_prefix_cache: still no success after {timeout:.0f} s")
            time.sleep(0.5)


def pin(proc: Proc, core: int | None) -> Proc:
    """Run an engine (and every process it starts) on one core: taskset in front of its argv."""
    if core is not None and shutil.which("taskset"):
        proc.argv = ["taskset", "-c", str(core), *proc.argv]
    return proc


def start_engines(topology: str, model: Path, logs: Path, args) -> dict[str, list[Proc]]:
    """The topology's engines, started and ready: {"prompt": [pd or prefill], "decode": [...]}.
    Prompt engines get a core each; a decode one only where a third core is free."""
    cores = sorted(os.sched_getaffinity(0))
    core_of = (lambda i: None) if args.no_pin else (lambda i: cores[i] if i < len(cores) else None)
    # a later --kv-cache-memory-bytes wins over tests/procs.py's ENGINE_ARGS (256 MiB)
    kv = ("--kv-cache-memory-bytes", str(args.kv_cache_mib << 20)) if args.kv_cache_mib else ()
    if topology == "pd":
        prompt = [pin(ascendserve("pd", model, logs, "--cluster-token", TOKEN, *kv, name=f"pd{i}", env=ENGINE_ENV),
                      core_of(i)) for i in range(2)]
        decode: list[Proc] = []
    else:
        common = ("--kv-connector", "pull", "--cluster-token", TOKEN, *kv)
        prompt = [pin(ascendserve("prefill", model, logs, *common, name=f"prefill{i}", env=ENGINE_ENV), core_of(i))
                  for i in range(2)]
        decode = [pin(ascendserve("decode", model, logs, *common, name="decode0", env=ENGINE_ENV), core_of(2))]
    started = time.monotonic()
    start_all(*prompt, *decode)
    cores_used = ", ".join(f"{p.name} on {'core ' + p.argv[2] if p.argv[0] == 'taskset' else 'any core'}"
                           for p in prompt + decode)
    print(f"[{topology}] {len(prompt) + len(decode)} engines ready in {time.monotonic() - started:.0f} s "
          f"({cores_used})", flush=True)
    return {"prompt": prompt, "decode": decode}


def warm_up(engines: list[Proc], model: str) -> None:
    """A few requests straight to each engine, so that the first policy does not pay for first
    calls; failures are ignored (the caches are reset afterwards anyway)."""
    rng = random.Random("warm-up")

    async def go():
        async with httpx.AsyncClient(timeout=120) as client:
            for e in engines:
                for chars in (200, 1500):
                    try:
                        await chat_once(client, e.url, model, [{"role": "user", "content": words(rng, chars)}], 4)
                    except Exception:
                        pass

    asyncio.run(go())


# ---- routers ---------------------------------------------------------------------------------
def proxy_routing_flags() -> tuple[dict[str, list[str]], list[str]]:
    """Per policy, the proxy's flags, and notes."""
    return {"load": ["--routing", "load"], "kv": ["--routing", "kv"]}, []


def vllm_router_info(binary: str | None) -> dict:
    """Where vllm-router is and its version, or why it is not there."""
    path = binary if binary and Path(binary).exists() else shutil.which("vllm-router")
    if not path:
        return {"error": f"not found ({binary or 'no --vllm-router'}, nor on PATH): "
                         "python3.11 -m venv /root/.venvs/vllm-router && /root/.venvs/vllm-router/bin/pip install "
                         "vllm-router"}
    version = "?"
    py = Path(path).parent / "python"
    if py.exists():
        r = subprocess.run([str(py), "-c", "import importlib.metadata as m; print(m.version('vllm-router'))"],
                           capture_output=True, text=True, timeout=60)
        version = r.stdout.strip() or "?"
    return {"path": path, "version": version}


def make_router(policy: str, topology: str, engines: dict, logs: Path, flags: dict, peer: dict,
                proxy_args: list[str] = ()) -> Proc:
    """The router of one policy run (not started); `proxy_args` go to every ascendserve proxy.
    RuntimeError when it cannot be made."""
    prompt, decode = engines["prompt"], engines["decode"]
    if policy == "vllm-router":
        if "error" in peer:
            raise RuntimeError(f"vllm-router {peer['error']}")
        port = free_port()
        if topology == "pd":
            workers = ["--worker-urls", *(p.url for p in prompt)]
        else:  # its vLLM P/D mode (NIXL-style kv_transfer_params: what our pull connector speaks)
            workers = ["--vllm-pd-disaggregation", *(a for p in prompt for a in ("--prefill", p.url)),
                       *(a for d in decode for a in ("--decode", d.url))]
        argv = [peer["path"], *workers, "--policy", "cache_aware", "--host", "127.0.0.1", "--port", str(port),
                "--prometheus-port", str(free_port()), "--worker-startup-check-interval", "1",
                "--log-level", "warning"]
        return Proc(f"vllm-router-{topology}", argv, port, logs / f"vllm-router-{topology}.log", {}, "/health")
    extra = flags.get(policy)
    if extra is None:
        raise RuntimeError(f"the proxy cannot run policy {policy!r} (no --routing)")
    targets = (["--pd", *(f"127.0.0.1:{p.port}" for p in prompt)] if topology == "pd" else
               ["--prefill", *(f"127.0.0.1:{p.port}" for p in prompt),
                "--decode", *(f"127.0.0.1:{d.port}" for d in decode)])
    return control("proxy", logs, *targets, *extra, *proxy_args, "--cluster-token", TOKEN, "--log-level", "warning",
                   name=f"proxy-{topology}-{policy}")


def start_router(router: Proc, model: str) -> None:
    """Start it and wait until it serves one request end to end (a router's /health may answer
    before its workers are usable)."""
    start_all(router)
    wait_for(lambda: _healthy(router.url), 60, f"{router.name} never healthy")
    deadline = time.monotonic() + 60
    while True:
        try:
            asyncio.run(_probe(router.url, model))
            return
        except Exception as exc:
            if time.monotonic() > deadline or router.popen.poll() is not None:
                raise RuntimeError(f"{router.name} cannot serve a request: {exc}") from None
            time.sleep(1.0)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


async def _probe(url: str, model: str) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        await chat_once(client, url, model, [{"role": "user", "content": "probe " * 20}], 8)


# ---- one topology ----------------------------------------------------------------------------
def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def summarize(raw: dict) -> dict:
    """The reported numbers of one policy on one workload, from its runs' raw deltas (merged
    over the rounds)."""
    queries, hits, ttfts = raw["queries"], raw["hits"], raw["ttfts"]
    total_q, total_h = sum(queries.values()), sum(hits.values())
    out = {
        "requests": len(ttfts), "errors": raw["errors"], "first_error": raw["first_error"], "rounds": raw["rounds"],
        "hit_tokens": total_h, "query_tokens": total_q, "hit_rate": total_h / total_q if total_q else 0.0,
        "prompt_tokens_mean": total_q / len(ttfts) if ttfts else 0.0,
        "prompt_token_split": [queries[u] / total_q if total_q else 0.0 for u in queries],
        "ttft_p50_ms": quantile(ttfts, 0.5) * 1000, "ttft_p99_ms": quantile(ttfts, 0.99) * 1000,
        "ttft_mean_ms": statistics.mean(ttfts) * 1000 if ttfts else float("nan"),
        "wall_s": raw["wall_s"], "req_per_s": len(ttfts) / raw["wall_s"],
        "gen_tok_per_s": raw["tokens"] / raw["wall_s"], "generated_tokens": raw["tokens"],
        "ttfts_ms": [t * 1000 for t in ttfts],
    }
    if raw.get("proxy") is not None:
        out["proxy_predicted_tokens"] = raw["proxy"]["predicted"]
        out["proxy_cached_tokens"] = raw["proxy"]["cached"]
    if raw["decode_queries"]:  # a decode's own prefix cache (the KV it pulled counts as external)
        out["decode_hit_tokens"], out["decode_query_tokens"] = raw["decode_hits"], raw["decode_queries"]
    return out


def merge(a: dict | None, b: dict) -> dict:
    """Two rounds' raw deltas of the same policy and workload as one."""
    if a is None:
        return b
    add = lambda x, y: {k: x[k] + y[k] for k in x}  # noqa: E731
    return {"ttfts": a["ttfts"] + b["ttfts"], "tokens": a["tokens"] + b["tokens"], "errors": a["errors"] + b["errors"],
            "first_error": a["first_error"] or b["first_error"], "wall_s": a["wall_s"] + b["wall_s"],
            "rounds": a["rounds"] + b["rounds"], "queries": add(a["queries"], b["queries"]),
            "hits": add(a["hits"], b["hits"]),
            "proxy": add(a["proxy"], b["proxy"]) if a["proxy"] is not None and b["proxy"] is not None else None,
            "decode_hits": a["decode_hits"] + b["decode_hits"],
            "decode_queries": a["decode_queries"] + b["decode_queries"]}


def run_workload(name: str, data, router: Proc, engines: dict, args) -> dict:
    """One workload through one router, on freshly reset prefix caches: its raw deltas."""
    prompt_urls = [p.url for p in engines["prompt"]]
    decode_urls = [d.url for d in engines["decode"]]
    reset_prefix_caches(prompt_urls + decode_urls)
    before, d_before = engine_counters(prompt_urls), engine_counters(decode_urls)
    p_before = proxy_counters(router.url)
    run = asyncio.run(drive(router.url, args.model, name, data, args.concurrency, args.max_tokens))
    after, d_after, p_after = engine_counters(prompt_urls), engine_counters(decode_urls), proxy_counters(router.url)
    delta = lambda a, b, kind: {u: a[u][kind] - b[u][kind] for u in a}  # noqa: E731
    return {**run, "rounds": 1, "queries": delta(after, before, "queries"), "hits": delta(after, before, "hits"),
            "proxy": ({k: p_after[k] - p_before[k] for k in p_after}
                      if p_before is not None and p_after is not None else None),
            "decode_hits": sum(delta(d_after, d_before, "hits").values()),
            "decode_queries": sum(delta(d_after, d_before, "queries").values())}


def run_policy(policy: str, topology: str, engines: dict, workloads: dict, args, logs: Path, flags: dict,
               peer: dict, notes: list[str], round_: int = 0) -> dict | None:
    """One router of `policy` over every workload: {workload: raw deltas}; None when it cannot
    run (the note says why)."""
    try:
        router = make_router(policy, topology, engines, logs, flags, peer, args.proxy_arg)
    except RuntimeError as exc:
        notes.append(f"[{topology}] {policy}: left out: {exc}")
        print(notes[-1], flush=True)
        return None
    out = {}
    try:
        try:
            start_router(router, args.model)
        except Exception as exc:
            tail = router.log_text()[-1500:] if router.log_path.exists() else ""
            notes.append(f"[{topology}] {policy}: left out: did not start: {str(exc)[:500]}")
            print(notes[-1], "\n", tail, flush=True)
            return None
        for name, data in workloads.items():
            try:
                raw = run_workload(name, data, router, engines, args)
            except Exception as exc:
                notes.append(f"[{topology}] {policy} {name}: failed: {type(exc).__name__}: {str(exc)[:500]}")
                print(notes[-1], flush=True)
                continue
            out[name] = raw
            r = summarize(raw)
            print(f"[{topology} r{round_ + 1}] {policy:<11} {name:<9} {r['requests']} ok, {r['errors']} failed, "
                  f"~{r['prompt_tokens_mean']:.0f} prompt tokens each, hit rate {r['hit_rate']:.3f}, "
                  f"TTFT mean {r['ttft_mean_ms']:.1f} ms, {r['wall_s']:.1f} s"
                  + (f" (first error: {r['first_error']})" if r["errors"] else ""), flush=True)
            if r["errors"]:
                notes.append(f"[{topology}] {policy} {name}: {r['errors']} requests failed, the first: "
                             f"{r['first_error']}")
    finally:
        router.stop()
    return out


def run_topology(topology: str, args, model: Path, logs: Path, workloads: dict, flags: dict, peer: dict,
                 notes: list[str]) -> dict:
    """Every policy over the topology's engines (started once), `--rounds` times, in reverse
    order every other round; a policy that cannot run is left out with a note, the others go on."""
    raws: dict[str, dict[str, dict]] = {w: {} for w in workloads}
    try:
        engines = start_engines(topology, model, logs, args)
    except Exception as exc:
        notes.append(f"[{topology}] left out: its engines did not start: {str(exc)[:1500]}")
        print(notes[-1], flush=True)
        return {}
    skipped: set[str] = set()
    try:
        warm_up(engines["prompt"] + engines["decode"], args.model)
        if topology == "pd" and "chat" in workloads:
            TOKENIZE[topology] = tokenize_cost(engines["prompt"][0], args.model, workloads["chat"], notes)
        for round_ in range(args.rounds):
            order = args.policies if round_ % 2 == 0 else args.policies[::-1]
            for policy in order:
                if policy in skipped:
                    continue
                by_workload = run_policy(policy, topology, engines, workloads, args, logs, flags, peer, notes, round_)
                if by_workload is None:
                    skipped.add(policy)
                    continue
                for name, raw in by_workload.items():
                    raws[name][policy] = merge(raws[name].get(policy), raw)
    finally:
        for p in engines["prompt"] + engines["decode"]:
            p.stop()
    return {name: {policy: summarize(raws[name][policy]) for policy in args.policies if policy in raws[name]}
            for name in workloads}


def tokenize_cost(engine: Proc, model: str, convs: list[list[str]], notes: list[str]) -> dict:
    """What the KV router's token ids cost per chat: rendered and tokenized in the proxy
    (router/chat_template.py + tokenizers) against a round trip to the engine's /tokenize, on the
    chat workload's openings and their second turns (medians, idle engines), and whether both
    give the same ids."""
    from tokenizers import Tokenizer

    from ascendserve.router.chat_template import LocalChat

    chat, tok = LocalChat.load(model), Tokenizer.from_file(f"{model}/tokenizer.json")
    chats = [[{"role": "user", "content": c[0]}] for c in convs]
    chats += [m + [{"role": "assistant", "content": "An answer."}, {"role": "user", "content": c[1]}]
              for m, c in zip(chats, convs) if len(c) > 1]
    local, remote, same = [], [], 0
    with httpx.Client(timeout=60) as client:
        for msgs in chats:
            t0 = time.perf_counter()
            ids = tok.encode(chat.render({"messages": msgs}), add_special_tokens=False).ids
            t1 = time.perf_counter()
            r = client.post(engine.url + "/tokenize", json={"model": model, "messages": msgs})
            t2 = time.perf_counter()
            local.append(t1 - t0)
            remote.append(t2 - t1)
            same += r.json()["tokens"] == ids
    out = {"chats": len(chats), "local_ms": statistics.median(local) * 1000,
           "engine_ms": statistics.median(remote) * 1000, "same_ids": same}
    line = (f"token ids of a chat ({out['chats']} chats, median): in the proxy {out['local_ms']:.2f} ms, engine "
            f"/tokenize {out['engine_ms']:.2f} ms ({out['engine_ms'] / out['local_ms']:.1f}x); same ids "
            f"{same}/{len(chats)}")
    print(line, flush=True)
    notes.append(line)
    return out


def report(topology: str, results: dict, args) -> None:
    label = {"pd": "2 pd instances, one core each",
             "pd2p1d": "2 prefill (one core each) + 1 decode, pull connector"}[topology]
    rows = []
    for workload, by_policy in results.items():
        base = by_policy.get("load")
        for policy, r in by_policy.items():
            ratio = (lambda k: base[k] / r[k] if base and r[k] and r[k] == r[k] else float("nan"))
            predicted = (f"{r['proxy_predicted_tokens']:.0f}/{r['proxy_cached_tokens']:.0f}"
                         if "proxy_predicted_tokens" in r else "-")
            rows.append([workload, "vllm-router cache_aware" if policy == "vllm-router" else policy,
                         r["requests"], r["errors"], int(r["hit_tokens"]), r["hit_rate"],
                         "/".join(f"{s * 100:.0f}" for s in r["prompt_token_split"]),
                         r["ttft_p50_ms"], r["ttft_p99_ms"], r["ttft_mean_ms"], r["req_per_s"], r["gen_tok_per_s"],
                         ratio("ttft_mean_ms"), ratio("ttft_p99_ms"), predicted])
    sizes = {"chat": f"chat {args.users} users x {args.turns} turns",
             "system": f"{args.requests} requests under {args.system_prompts} system prompts",
             "unrelated": f"{args.requests} unrelated"}
    table(f"routing policies, {label}: {', '.join(sizes[w] for w in args.workloads)}; concurrency "
          f"{args.concurrency}, {args.max_tokens} tokens out; caches reset before each run; {args.rounds} round(s)",
          ["workload", "policy", "ok", "err", "hit tokens", "hit rate", "prompt split %", "TTFT p50 ms",
           "TTFT p99 ms", "TTFT mean ms", "req/s", "gen tok/s", "x mean (load/it)", "x p99 (load/it)",
           "proxy predicted/cached"], rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--topologies", default=",".join(TOPOLOGIES), help="comma-separated: pd, pd2p1d")
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated: load, kv, vllm-router")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: chat, system, unrelated")
    ap.add_argument("--users", type=int, default=12, help="chat: conversations")
    ap.add_argument("--turns", type=int, default=6, help="chat: turns per conversation")
    ap.add_argument("--context", type=int, default=2000, help="chat: tokens of the document each conversation "
                    "opens with (a long context makes a prefill, and so a cache miss, cost what it costs on a "
                    "real model; 480: a short chat, where the tiny model's prefill is cheap)")
    ap.add_argument("--requests", type=int, default=64, help="system and unrelated: requests each")
    ap.add_argument("--system-prompts", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=None,
                    help="each policy's runs this many times, the order of the policies reversed every other round "
                         "(default 2, --quick 1)")
    ap.add_argument("--quick", action="store_true", help="smoke size: 4 users x 4 turns, 16 requests")
    ap.add_argument("--kv-cache-mib", type=int, default=None,
                    help="each engine's KV cache (default tests/procs.py's 256 MiB, ~131k tokens: nothing is evicted; "
                         "10 MiB, ~5k tokens, the least for one 4096-token sequence, evicts)")
    ap.add_argument("--no-pin", action="store_true", help="leave every engine on every core")
    ap.add_argument("--vllm-router", default=DEFAULT_VLLM_ROUTER, help="vllm-router binary (else from PATH)")
    ap.add_argument("--proxy-arg", action="append", default=[],
                    help="extra argument of every ascendserve proxy, repeatable: --proxy-arg=--kv-overlap-weight=2")
    ap.add_argument("--log-dir", default=None, help="keep the processes' logs here (default: a temp dir)")
    args = ap.parse_args()
    if args.quick:
        args.users, args.turns, args.requests = 4, 4, 16
    if args.rounds is None:
        args.rounds = 1 if args.quick else 2
    args.topologies = [t for t in args.topologies.split(",") if t]
    args.policies = [p for p in args.policies.split(",") if p]
    args.workloads = [w for w in args.workloads.split(",") if w]
    for kind, given, known in (("topology", args.topologies, TOPOLOGIES), ("policy", args.policies, POLICIES),
                               ("workload", args.workloads, WORKLOADS)):
        if unknown := [x for x in given if x not in known]:
            ap.error(f"unknown {kind}: {', '.join(unknown)} (known: {', '.join(known)})")
    if "load" in args.policies:  # the baseline first
        args.policies = ["load"] + [p for p in args.policies if p != "load"]
    os.environ["OMP_NUM_THREADS"] = "1"

    started = time.monotonic()
    flags, notes = proxy_routing_flags()
    for n in notes:
        print(n, flush=True)
    peer = vllm_router_info(args.vllm_router) if "vllm-router" in args.policies else {"error": "not asked for"}
    if "vllm-router" in args.policies:
        print(f"vllm-router: {peer.get('path', '')} {peer.get('version', '')} {peer.get('error', '')}".strip(),
              flush=True)
    all_workloads = {"chat": chat_workload(args.seed, args.users, args.turns, args.context),
                     "system": system_workload(args.seed, args.system_prompts, args.requests),
                     "unrelated": unrelated_workload(args.seed, args.requests)}
    workloads = {w: all_workloads[w] for w in args.workloads}
    results = {}
    with tempfile.TemporaryDirectory() as t:
        logs = Path(args.log_dir) if args.log_dir else Path(t)
        logs.mkdir(parents=True, exist_ok=True)
        model = Path(t) / "tiny-text"
        args.model = str(model)
        subprocess.run([sys.executable, "-m", "ascendserve", "model", "tiny", "--kind", "text", "--out", str(model)],
                       check=True, capture_output=True)
        for topology in args.topologies:
            results[topology] = run_topology(topology, args, model, logs, workloads, flags, peer, notes)
    for topology, by_workload in results.items():
        report(topology, by_workload, args)
    for n in notes:
        print("note:", n)
    print(f"total {time.monotonic() - started:.0f} s; load average {os.getloadavg()[1]:.2f} over the last 5 min "
          f"(about {len(os.sched_getaffinity(0))} here when nothing else runs)")
    save("kv_routing", {"args": vars(args), "notes": notes, "vllm_router": peer, "results": results,
                        "tokenize": TOKENIZE,
                        "elapsed_s": time.monotonic() - started, "loadavg": os.getloadavg()})


if __name__ == "__main__":
    main()
