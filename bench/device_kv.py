"""KV pages in device memory through the staging path, for every vLLM KV layout: bit-exact, and
how fast next to the floors. Torch only (no vLLM): runs on a GPU host as it comes.

    python -m bench.device_kv [--device cuda|cpu] [--mib 256] [--repeat 5]

For each KVCacheLayout (LBHNC, LBNHC, LHBNC, BLHNC, BLNHC, BHLNC: the physical order of the
logical [L, B, H, N, C], laid out here the way vLLM 0.32 describes it, by permuting one
backing buffer) it builds a cache of 16 layers x 8 KV heads x 128-token blocks (fp16, head
128) on the device, then:

1. staging out: `PagedKV.gather_layer_into` of one request's pages (`--mib` of KV, every
   layer, random blocks) into host memory, against a plain device -> pinned host copy of the
   same bytes (the floor: "staging >= 80% of it" is the target);
2. gather on the device: the page gather alone (torch index ops on the device) against a
   device-to-device copy of the same bytes;
3. staging in: `scatter_layer` of those bytes into a second cache, whose pages must then
   equal the first's, bit for bit (checked for half the heads too: heterogeneous TP).

On `--device cpu` the same code runs on host memory with staging forced (what CI runs,
tests/unit/test_bench_smoke.py); the floors are then memcpy.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from ascendserve.connectors.kv.pages import PagedKV
from bench._report import save, table

LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
LAYERS, HEADS, BLOCK, HEAD = 16, 8, 128, 128


def build(layout: str, num_blocks: int, device: str, seed: int) -> dict[str, torch.Tensor]:
    """One backing buffer in `layout`'s physical order, viewed per layer as [B, H, N, C]."""
    content = 2 * HEAD  # K and V packed, fp16 elements
    logical = {"L": LAYERS, "B": num_blocks, "H": HEADS, "N": BLOCK, "C": content}
    physical = [logical[a] for a in layout]
    g = torch.Generator(device="cpu").manual_seed(seed)
    raw = torch.randint(-30000, 30000, physical, dtype=torch.int16, generator=g).view(torch.float16).to(device)
    five = raw.permute(*[layout.index(a) for a in "LBHNC"])  # logical [L, B, H, N, C]
    return {f"model.layers.{i}.self_attn.attn": five[i] for i in range(LAYERS)}


def _sync(device: str) -> None:
    if device != "cpu":
        torch.accelerator.synchronize()


def _median(fn, repeat: int, device: str) -> float:
    times = []
    for _ in range(repeat):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run(device: str, mib: int, repeat: int) -> tuple[list[list], dict]:
    page_bytes = HEADS * BLOCK * 2 * HEAD * 2
    n = max(1, (mib << 20) // (LAYERS * page_bytes))
    num_blocks = 2 * n + 8
    rng = np.random.default_rng(0)
    blocks = [int(b) for b in rng.choice(num_blocks, size=n, replace=False)]
    nbytes = LAYERS * n * page_bytes
    pin = device != "cpu"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    dev_src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev_dst = torch.empty_like(dev_src)
    floor_out = _median(lambda: host.copy_(dev_src, non_blocking=pin), repeat, device)
    floor_d2d = _median(lambda: dev_dst.copy_(dev_src), repeat, device)
    rows, raw = [], {}
    for layout in LAYOUTS:
        src = PagedKV(build(layout, num_blocks, device, seed=1), num_blocks, staging=True)
        dst = PagedKV(build(layout, num_blocks, device, seed=2), num_blocks, staging=True)
        assert src.layout_name == layout, (src.layout_name, layout)
        out = np.empty((LAYERS, n, src.page_bytes), dtype=np.uint8)

        def stage_out():
            for layer in range(LAYERS):
                src.gather_layer_into(layer, blocks, out[layer])

        def gather_only():
            idx = src._index_t(blocks)
            for layer in range(LAYERS):
                src._strided_t(layer, None).index_select(0, idx)

        def stage_in():
            for layer in range(LAYERS):
                dst.scatter_layer(layer, blocks, out[layer])

        t_out = _median(stage_out, repeat, device)
        t_gather = _median(gather_only, repeat, device)
        t_in = _median(stage_in, repeat, device)
        bits = lambda t: t.view(torch.int16)  # noqa: E731 - random bits include NaNs: compare bits
        exact = all(torch.equal(bits(a[blocks]), bits(b[blocks])) for a, b in zip(src.layers, dst.layers))
        half = np.empty((n, HEADS // 2 * src.head_bytes), dtype=np.uint8)  # heads 4..7 of P -> 0..3 of D
        src.gather_layer_into(3, blocks, half, (HEADS // 2, HEADS // 2))
        dst.scatter_layer(3, blocks, half, (0, HEADS // 2))
        exact_heads = torch.equal(bits(src.layers[3][blocks][:, HEADS // 2:]), bits(dst.layers[3][blocks][:, :HEADS // 2]))
        gbps = lambda t: nbytes / t / 1e9  # noqa: E731
        rows.append([layout, gbps(t_out), f"{floor_out / t_out:.2f}x", gbps(t_gather), f"{floor_d2d / t_gather:.2f}x",
                     gbps(t_in), "yes" if exact and exact_heads else "NO"])
        raw[layout] = {"out_s": t_out, "gather_s": t_gather, "in_s": t_in, "exact": exact, "exact_heads": exact_heads}
    raw["floors"] = {"to_host_s": floor_out, "d2d_s": floor_d2d, "bytes": nbytes}
    return rows, raw


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    rows, raw = run(args.device, args.mib, args.repeat)
    floor = "pinned copy" if args.device != "cpu" else "memcpy"
    text = table(f"KV pages through staging on {args.device}, one {args.mib} MiB request (GB/s, median of "
                 f"{args.repeat}; ratios against the floors: {floor} to host, device-to-device copy)",
                 ["layout", "stage out", f"vs {floor}", "gather", "vs d2d copy", "stage in", "bit-exact"], rows)
    save("device_kv", {"args": vars(args), "results": raw, "table": text})
    if any(r[-1] != "yes" for r in rows):
        raise SystemExit("pages differ after staging")


if __name__ == "__main__":
    main()
