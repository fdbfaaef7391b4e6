"""Block gather/scatter bandwidth: the native ops of native/ next to the floor and the fallbacks.

    native/build.sh && python -m bench.native_ops [--tokens 4096] [--repeat 7]

For the KV of one prompt (random, non-contiguous blocks of a cache twice
its size), in vLLM's CPU page layout, for two models:

- tiny: ascendserve's tiny test model (2 layers, 2 KV heads of 64, fp32):
  128 KiB pages;
- 7B: 28 layers, 4 KV heads of 128, bf16, K and V in one page: 256 KiB pages.

Columns, GB/s of bytes moved, median of --repeat runs, and the ratio to the
floor: memcpy (one numpy copy of a contiguous buffer of the same size: what
no gather can beat); the native op over all layers in one call, on one
thread and with its automatic thread count; the native op per layer through
`ops.gather_pages` (how PagedKV calls it); numpy take per layer (the path
without native/); the torch reference (index_select / index_copy_). One
thread everywhere else (OMP_NUM_THREADS=1, torch.set_num_threads(1)), as in
a vLLM worker's transfer thread. A second table sweeps the copy size for the
native op's thread count, forced (num_threads=n); its automatic choice
(num_threads=0) allows one thread per 8 MiB: kParallelMinBytes in
native/csrc/block_copy_cpu.cpp comes from this table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from bench._report import save, table  # noqa: E402

BLOCK = 128
MODELS = {  # name: (layers, page shape [kv_heads, block, 2 * head_dim], dtype)
    "tiny fp32": (2, (2, BLOCK, 2 * 64), "float32"),
    "7B bf16": (28, (4, BLOCK, 2 * 128), "bfloat16"),
}


_SCRATCH = np.ones(128 * 2**20, np.uint8)


def timed(fns: dict, repeat: int) -> dict:
    """Median seconds of each fn, each run with a cold CPU cache (as a transfer
    thread finds it after an engine step); rounds interleave the fns so that
    load from other processes hits them all alike (the ratios are what counts)."""
    samples: dict = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeat):
        for name, fn in fns.items():
            _SCRATCH[::64] += 1  # touch every cache line of 128 MiB: evicts the caches
            t = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t)
    return {name: statistics.median(s) for name, s in samples.items()}


def one_model(name: str, tokens: int, repeat: int) -> dict:
    import torch

    from ascendserve import ops

    n_layers, page, dtype = MODELS[name]
    n = -(-tokens // BLOCK)
    blocks = 2 * n
    g = torch.Generator().manual_seed(0)
    layers = [torch.randn((blocks, *page), generator=g).to(getattr(torch, dtype)) for _ in range(n_layers)]
    ids = torch.randperm(blocks, generator=g)[:n]
    page_bytes = layers[0][0].numel() * layers[0].element_size()
    nbytes = n_layers * n * page_bytes
    buf = torch.empty((n_layers, n, page_bytes), dtype=torch.uint8)
    views = [t.view(torch.uint8).reshape(blocks, page_bytes).numpy() for t in layers]
    ids_np, buf_np = ids.numpy(), buf.numpy()
    floor_src, floor_dst = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8), np.empty(nbytes, np.uint8)
    native = torch.ops.ascendserve

    def take():
        for l, v in enumerate(views):
            np.take(v, ids_np, axis=0, out=buf_np[l], mode="clip")

    def put():
        for l, v in enumerate(views):
            v[ids_np] = buf_np[l]

    def per_layer(fn):
        return lambda: [fn(v, ids_np, buf_np[l]) for l, v in enumerate(views)]

    cases = {
        "gather": {"memcpy (floor)": lambda: np.copyto(floor_dst, floor_src),
                   "native, 1 thread": lambda: native.gather_blocks(layers, ids, buf, 1),
                   "native, auto threads": lambda: native.gather_blocks(layers, ids, buf, 0),
                   "native per layer (gather_pages)": per_layer(ops.gather_pages),
                   "numpy take per layer": take,
                   "torch reference": lambda: ops.gather_blocks_ref(layers, ids, buf)},
        "scatter": {"memcpy (floor)": lambda: np.copyto(floor_src, floor_dst),
                    "native, 1 thread": lambda: native.scatter_blocks(layers, ids, buf, 1),
                    "native, auto threads": lambda: native.scatter_blocks(layers, ids, buf, 0),
                    "native per layer (scatter_pages)": per_layer(ops.scatter_pages),
                    "numpy put per layer": put,
                    "torch reference": lambda: ops.scatter_blocks_ref(layers, ids, buf)},
    }
    out = {"layers": n_layers, "blocks": n, "page_bytes": page_bytes, "bytes": nbytes, "gbps": {}}
    for op, fns in cases.items():
        out["gbps"][op] = {method: nbytes / secs / 1e9 for method, secs in timed(fns, repeat).items()}
    return out


def thread_sweep(repeat: int) -> dict:
    import torch

    page = 64 * 1024
    out = {}
    for mib in (1, 2, 4, 8, 16, 32, 64):
        n = mib * 2**20 // page
        layer = torch.empty((2 * n, page), dtype=torch.uint8).fill_(1)
        ids = torch.randperm(2 * n)[:n]
        buf = torch.empty((1, n, page), dtype=torch.uint8)
        fns = {t: lambda t=t: torch.ops.ascendserve.gather_blocks([layer], ids, buf, t) for t in (1, 2, 4)}
        out[mib] = {t: mib * 2**20 / secs / 1e9 for t, secs in timed(fns, repeat).items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()

    import torch

    from ascendserve import ops

    torch.set_num_threads(1)
    if not ops.load_native():
        raise SystemExit(f"native ops not available ({ops._why_not}): run native/build.sh first")
    results = {name: one_model(name, args.tokens, args.repeat) for name in MODELS}
    rows = []
    for name, r in results.items():
        for op, by in r["gbps"].items():
            floor = by["memcpy (floor)"]
            for method, gbps in by.items():
                rows.append([f"{name} ({r['layers']}x{r['blocks']}x{r['page_bytes'] // 1024} KiB"
                             f" = {r['bytes'] / 2**20:.0f} MiB)", op, method, gbps, gbps / floor])
    text = table(f"Block copies of one {args.tokens}-token prompt's KV (GB/s, median of {args.repeat}; "
                 f"{os.cpu_count()} cores)", ["model", "op", "method", "GB/s", "x memcpy"], rows)
    sweep = thread_sweep(args.repeat)
    text += "\n" + table("native gather by size and threads (64 KiB pages; GB/s; threads forced)",
                         ["MiB", "1 thread", "2 threads", "4 threads", "2 vs 1", "4 vs 1"],
                         [[mib, by[1], by[2], by[4], by[2] / by[1], by[4] / by[1]] for mib, by in sweep.items()])
    save("native_ops", {"args": vars(args), "results": results, "threads": sweep, "table": text})


if __name__ == "__main__":
    main()
