"""A prompt sent again: the latency of repeats and shared prefixes through each topology.

    python -m bench.repeats [--tokens 300] [--times 3]

Users send the same prompt twice and share system prompts, so prefix-cache hits
are the common case; a KV hand-off that misses them falls back silently (the
tokens stay right, only the latency shows it: push mode once stalled for the KV
TTL, 120 s, on every repeat). One run, side by side on the tiny text model:
plain vLLM (the floor: one instance, its own prefix cache), 1P1D through our
proxy with the pull connector, and with the layerwise push connector (tcp). Each
topology gets a fresh prompt `--times` times one after another, then two prompts
sharing all but their last token; the table gives each repeat as a ratio of the
first run, and the first run as a ratio of plain vLLM's.
"""

from __future__ import annotations

import argparse
import tempfile
from contextlib import ExitStack
from pathlib import Path

from bench._report import save, table
from tests.procs import control, pd_cluster, plain_vllm, start_all
from tests.traffic import completion, text

TOKEN = "bench-repeats-token"


def run(url: str, model: str, tokens: int, times: int, seed: int) -> dict:
    prompt = text(seed, tokens)
    runs = [completion(url, model, prompt)[1] for _ in range(times)]
    shared = text(seed + 1, tokens)
    completion(url, model, shared + "x")
    return {"runs": runs, "shared_prefix": completion(url, model, shared + "y")[1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--times", type=int, default=3)
    args = ap.parse_args()
    import subprocess
    import sys

    root = Path(tempfile.mkdtemp(prefix="bench-repeats-"))
    model = root / "model"
    subprocess.run([sys.executable, "-m", "ascendserve", "model", "tiny", "--out", str(model)], check=True,
                   capture_output=True)
    results: dict[str, dict] = {}
    with ExitStack() as stack:
        floor = plain_vllm(model, root)
        start_all(floor)
        stack.callback(floor.stop)
        results["plain vLLM"] = run(floor.url, str(model), args.tokens, args.times, seed=1)
    common = ("--kv-transport", "tcp", "--cluster-token", TOKEN)
    with pd_cluster(model, root, ("--kv-connector", "pull", *common), ("--kv-connector", "pull", *common),
                    ("--cluster-token", TOKEN)) as (_, _, proxy):
        results["1P1D pull"] = run(proxy.url, str(model), args.tokens, args.times, seed=1)
    meta = control("metaserver", root, "--cluster-token", TOKEN)
    start_all(meta)
    try:
        push = ("--kv-connector", "push", *common)
        with pd_cluster(model, root, push, push, ("--mode", "push", "--metaserver-url", meta.url,
                                                  "--cluster-token", TOKEN)) as (_, _, proxy):
            results["1P1D push"] = run(proxy.url, str(model), args.tokens, args.times, seed=1)
    finally:
        meta.stop()
    base = results["plain vLLM"]["runs"][0]
    header = ["topology", "1st s"] + [f"run {i + 1} / 1st" for i in range(1, args.times)] + \
        ["shared prefix / 1st", "1st / plain vLLM 1st"]
    rows = []
    for name, r in results.items():
        first = r["runs"][0]
        rows.append([name, first, *[s / first for s in r["runs"][1:]], r["shared_prefix"] / first, first / base])
    table(f"{args.tokens}-token prompt sent {args.times} times, then two sharing all but the last token", header,
          rows)
    save("repeats", {"tokens": args.tokens, "times": args.times, "results": results})


if __name__ == "__main__":
    main()
