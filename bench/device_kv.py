"""KV pages in device memory through the staging path, for every vLLM KV layout: bit-exact, and
how fast next to the floors. Torch only (no vLLM): runs on a GPU host as it comes.

    python -m bench.device_kv [--device cuda|cpu] [--mib 256] [--repeat 5] [--no-transfer]

For each KVCacheLayout (LBHNC, LBNHC, LHBNC, BLHNC, BLNHC, BHLNC: the physical order of the
logical [L, B, H, N, C], laid out here the way vLLM 0.32 describes it, by permuting one
backing buffer) it builds a cache of 16 layers x 8 KV heads x 128-token blocks (fp16, head
128) on the device, then:

1. staging out: one request's pages (`--mib` of KV, every layer, random blocks) through
   kv/staging.py's pipeline (gather on the device, copy to pinned host buffers on a side
   stream, the next unit copied while the current one is handed on), against one plain
   device -> pinned host copy of the same bytes (the floor: "staging >= 80% of it");
2. gather on the device: the page gather alone, torch index ops and (when built and the
   self-test passed on this device) the CUDA kernel of native/, against a device-to-device
   copy of the same bytes ("gather >= 80% of it");
3. staging in: the same bytes through the receiving pipeline into a second cache, whose
   pages must then equal the first's, bit for bit (checked for half the heads too:
   heterogeneous TP);
4. (unless --no-transfer) the request moved between two processes over the tcp transport
   (side channel, READ, staged pages on both sides) against a raw socket floor: the same
   bytes from host memory to host memory over one loopback connection.

On `--device cpu` the same code runs on host memory with staging forced (what CI runs,
tests/unit/test_bench_device_kv.py); the floors are then memcpy.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import threading
import time

import numpy as np
import torch

from ascendserve.connectors.kv.pages import PagedKV
from ascendserve.connectors.kv.staging import recv_units, send_units
from bench._report import save, table

LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
LAYERS, HEADS, BLOCK, HEAD = 16, 8, 128, 128
STAGING = 256 << 20  # [kv] staging_mib's default


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


def cuda_kernels(device: str) -> tuple[bool, str]:
    """Whether native/'s CUDA kernels are loaded and passed their self-test on `device`."""
    if not device.startswith("cuda"):
        return False, "not a CUDA device"
    from ascendserve import ops_cuda

    if not ops_cuda.load_cuda():
        return False, ops_cuda.cuda_why_not()
    failed = ops_cuda.cuda_self_test(torch.device(device))
    return (not failed), failed or "passed"


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
    kernels, why = cuda_kernels(device)
    rows, raw = [], {"cuda_kernels": why}
    for layout in LAYOUTS:
        src = PagedKV(build(layout, num_blocks, device, seed=1), num_blocks, staging=True, staging_budget=STAGING)
        dst = PagedKV(build(layout, num_blocks, device, seed=2), num_blocks, staging=True, staging_budget=STAGING)
        assert src.layout_name == layout, (src.layout_name, layout)
        wire = np.empty(nbytes, dtype=np.uint8)  # what a socket would carry, in transfer order

        def stage_out():
            at = [0]

            def hand_on(view):  # a socket's send: the next unit's copy runs meanwhile
                wire[at[0]:at[0] + len(view)] = np.frombuffer(view, dtype=np.uint8)
                at[0] += len(view)

            send_units(hand_on, src, blocks, None)

        def stage_in():
            at = [0]

            def arrive(view):
                np.frombuffer(view, dtype=np.uint8)[:] = wire[at[0]:at[0] + len(view)]
                at[0] += len(view)

            recv_units(arrive, dst, blocks, None)

        idx = torch.tensor(blocks, device=device)
        views = [src._strided_t(layer, None) for layer in range(LAYERS)]

        def gather_torch():
            for view in views:
                view.index_select(0, idx)

        def gather_cuda():
            from ascendserve import ops_cuda

            ops_cuda.gather_runs_cuda(views, blocks, dev_dst[:nbytes])

        t_out = _median(stage_out, repeat, device)
        t_gather = _median(gather_torch, repeat, device)
        t_kernel = _median(gather_cuda, repeat, device) if kernels else None
        t_in = _median(stage_in, repeat, device)
        bits = lambda t: t.view(torch.int16)  # noqa: E731 - random bits include NaNs: compare bits
        exact = all(torch.equal(bits(a[blocks]), bits(b[blocks])) for a, b in zip(src.layers, dst.layers))
        half = np.empty((n, HEADS // 2 * src.head_bytes), dtype=np.uint8)  # heads 4..7 of P -> 0..3 of D
        src.gather_layer_into(3, blocks, half, (HEADS // 2, HEADS // 2))
        dst.scatter_layer(3, blocks, half, (0, HEADS // 2))
        exact_heads = torch.equal(bits(src.layers[3][blocks][:, HEADS // 2:]), bits(dst.layers[3][blocks][:, :HEADS // 2]))
        exact_kernel = None
        if kernels:  # the kernel's pages, layer-major, equal the torch gather's
            gather_cuda()
            exact_kernel = torch.equal(dev_dst[:nbytes], torch.cat([v.index_select(0, idx).reshape(-1) for v in views]))
        gbps = lambda t: nbytes / t / 1e9  # noqa: E731
        rows.append([layout, gbps(t_out), f"{floor_out / t_out:.2f}x", gbps(t_gather), f"{floor_d2d / t_gather:.2f}x",
                     "-" if t_kernel is None else f"{gbps(t_kernel):.3f}",
                     "-" if t_kernel is None else f"{floor_d2d / t_kernel:.2f}x", gbps(t_in),
                     "yes" if exact and exact_heads and exact_kernel is not False else "NO"])
        raw[layout] = {"out_s": t_out, "gather_s": t_gather, "kernel_s": t_kernel, "in_s": t_in, "exact": exact,
                       "exact_heads": exact_heads, "exact_kernel": exact_kernel,
                       "staging": {"src": src.staging.stats(), "dst": dst.staging.stats()}}
    raw["floors"] = {"to_host_s": floor_out, "d2d_s": floor_d2d, "bytes": nbytes}
    return rows, raw


# ---- one request between two processes over tcp ---------------------------------------------
class _Holds:
    """The serving side's holds: request "req" holds every block."""

    def acquire(self, request_id: str, block_ids: list[int]) -> None:
        if request_id != "req":
            raise KeyError(request_id)

    def release(self, request_id: str) -> None:
        pass

    def free(self, request_id: str) -> None:
        pass

    def announce(self, request_id: str, block_ids: list[int], ttl_s: float, age_s: float) -> bool:
        return False


def serve(args) -> None:
    """The producer process: a side channel over a device cache, and a raw socket that sends
    the same number of bytes from host memory (the floor); ports on stdout, until stdin closes."""
    from ascendserve.connectors.transport.channel import ChannelServer
    from ascendserve.connectors.transport.tcp import TcpTransport

    kv = PagedKV(build(args.layout, args.num_blocks, args.device, seed=1), args.num_blocks, staging=True,
                 staging_budget=STAGING)
    server = ChannelServer("127.0.0.1", 0, _Holds(), kv, "bench", {"tcp": TcpTransport()})
    server.start()
    raw = socket.create_server(("127.0.0.1", 0))
    payload = np.ones(args.nbytes, dtype=np.uint8)

    def floor_loop():
        while True:
            conn, _ = raw.accept()
            with conn:
                conn.sendall(memoryview(payload))

    threading.Thread(target=floor_loop, daemon=True).start()
    print("PORTS " + json.dumps({"channel": server.port, "raw": raw.getsockname()[1]}), flush=True)
    sys.stdin.read()
    server.stop()


def transfer(device: str, mib: int, repeat: int, layouts=("LBHNC", "BLHNC")) -> tuple[list[list], dict]:
    from ascendserve.connectors.transport.channel import ChannelClient
    from ascendserve.connectors.transport.tcp import TcpTransport

    page_bytes = HEADS * BLOCK * 2 * HEAD * 2
    n = max(1, (mib << 20) // (LAYERS * page_bytes))
    num_blocks = n + 4
    blocks = list(range(n))
    nbytes = LAYERS * n * page_bytes
    rows, raw = [], {}
    for layout in layouts:
        proc = subprocess.Popen([sys.executable, "-m", "bench.device_kv", "--serve", "--layout", layout,
                                 "--device", device, "--num-blocks", str(num_blocks), "--nbytes", str(nbytes)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            for line in proc.stdout:  # its log lines, then the ports
                if line.startswith("PORTS "):
                    break
            else:
                raise RuntimeError(f"the {layout} producer process died before serving")
            ports = json.loads(line[6:])
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep its pipe drained
            kv = PagedKV(build(layout, num_blocks, device, seed=2), num_blocks, staging=True, staging_budget=STAGING)
            client = ChannelClient("bench", kv, TcpTransport())
            t_ours = _median(lambda: client.pull("127.0.0.1", ports["channel"], "req", blocks, blocks), repeat, device)
            sink = bytearray(nbytes)

            def floor():
                with socket.create_connection(("127.0.0.1", ports["raw"])) as s:
                    view, got = memoryview(sink), 0
                    while got < nbytes:
                        k = s.recv_into(view[got:])
                        if not k:
                            raise ConnectionError("floor server closed early")
                        got += k

            t_floor = _median(floor, repeat, device)
            expected = build(layout, num_blocks, device, seed=1)
            bits = lambda t: t.view(torch.int16)  # noqa: E731
            exact = all(torch.equal(bits(kv.layers[i][blocks]), bits(v[blocks]))
                        for i, v in enumerate(expected[k] for k in sorted(expected)))
            client.close()
        finally:
            proc.stdin.close()
            proc.wait(30)
        rows.append([layout, nbytes >> 20, t_ours * 1e3, t_floor * 1e3, f"{t_ours / t_floor:.2f}x",
                     "yes" if exact else "NO"])
        raw[layout] = {"ours_s": t_ours, "floor_s": t_floor, "bytes": nbytes, "exact": exact}
    return rows, raw


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-transfer", action="store_true", help="skip the two-process tcp transfer")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the transfer's producer
    ap.add_argument("--layout", default="LBHNC", help=argparse.SUPPRESS)
    ap.add_argument("--num-blocks", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--nbytes", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args)
        return
    rows, raw = run(args.device, args.mib, args.repeat)
    floor = "pinned copy" if args.device != "cpu" else "memcpy"
    text = table(f"KV pages through staging on {args.device}, one {args.mib} MiB request (GB/s, median of "
                 f"{args.repeat}; ratios against the floors: {floor} to host, device-to-device copy; "
                 f"CUDA kernels: {raw['cuda_kernels']})",
                 ["layout", "stage out", f"vs {floor}", "gather (torch)", "vs d2d copy", "gather (cuda)",
                  "vs d2d copy", "stage in", "bit-exact"], rows)
    result = {"args": vars(args), "results": raw, "table": text}
    bad = any(r[-1] != "yes" for r in rows)
    if not args.no_transfer:
        t_rows, t_raw = transfer(args.device, args.mib, args.repeat)
        result["transfer"], result["transfer_table"] = t_raw, table(
            f"One request between two processes on {args.device} over the tcp transport (staged on both "
            f"sides) against a raw socket from host memory (ms, median of {args.repeat})",
            ["layout", "MiB", "ours", "raw socket", "ours / floor", "bit-exact"], t_rows)
        bad = bad or any(r[-1] != "yes" for r in t_rows)
    save("device_kv", result)
    if bad:
        raise SystemExit("pages differ after staging")


if __name__ == "__main__":
    main()
