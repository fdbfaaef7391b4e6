"""vLLM's serving benchmark against `ascendserve --role pd` and plain vLLM.

    python -m bench.serve [--num-prompts 64] [--concurrency 8] [--rounds 2]

One run, same tiny model, same engine settings, random dataset. The two
servers are measured alternately (A B B A ...) so that machine drift hits
both; the ratio ours / plain is what to read, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench._report import save, table
from tests.procs import ascendserve, plain_vllm


def bench_serve(url: str, model: Path, args) -> dict:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as serve_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    ns = parser.parse_args([
        "--backend", "vllm", "--base-url", url, "--model", str(model), "--tokenizer", str(model),
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
        "--max-concurrency", str(args.concurrency), "--ignore-eos", "--seed", "0", "--disable-tqdm",
    ])
    return serve_main(ns)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="ABBA rounds")
    args = ap.parse_args()
    results: dict[str, list[dict]] = {"plain vLLM": [], "ascendserve pd": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = root / "tiny-text"
        subprocess.run([sys.executable, "-m", "ascendserve", "model", "tiny", "--kind", "text", "--out", str(model)],
                       check=True, capture_output=True)
        makers = {"plain vLLM": lambda: plain_vllm(model, root), "ascendserve pd": lambda: ascendserve("pd", model, root)}
        order = []
        for r in range(args.rounds):
            order += ["plain vLLM", "ascendserve pd"] if r % 2 == 0 else ["ascendserve pd", "plain vLLM"]
        for name in order:
            proc = makers[name]()
            proc.start().wait_ready()
            try:
                bench_serve(proc.url, model, args)  # warm-up pass, discarded
                results[name].append(bench_serve(proc.url, model, args))
            finally:
                proc.stop()
    keys = ("output_throughput", "request_throughput", "median_ttft_ms", "median_tpot_ms")
    med = {name: {k: statistics.median(r[k] for r in runs) for k in keys} for name, runs in results.items()}
    base = med["plain vLLM"]
    rows = [[name, m["output_throughput"], m["output_throughput"] / base["output_throughput"],
             m["median_ttft_ms"], m["median_tpot_ms"]] for name, m in med.items()]
    table(f"vllm bench serve, random {args.input_len}->{args.output_len}, {args.num_prompts} prompts, "
          f"concurrency {args.concurrency}, median of {args.rounds}",
          ["server", "output tok/s", "x plain vLLM", "median TTFT ms", "median TPOT ms"], rows)
    save("serve", {"args": vars(args), "median": med, "runs": {k: [{kk: r[kk] for kk in keys} for r in v]
                                                               for k, v in results.items()}})


if __name__ == "__main__":
    main()
