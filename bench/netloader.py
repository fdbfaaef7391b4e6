"""NetLoader: weights over loopback vs a raw socket, joiners at once, and time-to-ready.

    python -m bench.netloader [--layers 18] [--joiners 3] [--skip-ready]

One random-weight Qwen2 checkpoint of about 1.1 GB (fp32, built once under
bench/results/). Side by side, in one run:
1. one joiner: the raw loopback socket (one process sends the bytes with
   sendall, another receives them with recv_into into a buffer it zeroed
   before the clock starts: the floor), the same over two sockets (whether
   one socket fills the link) and over two into a buffer allocated inside
   the clock (untouched pages, as a joiner's: their page faults), NetLoader
   from an elastic-server (weights in its RAM; its default streams with every
   tensor held at once, and with each tensor let go of as vLLM's
   load_weights does, so that a later tensor of its size reuses its buffer;
   and one stream) and from a seed that serves the files through the page
   cache (an engine's own seed). GB/s and the ratio to the raw socket.
2. several joiners at once from one elastic-server: aggregate GB/s.
3. time to ready (/v1/models answers) of `ascendserve --role pd`: weights by
   NetLoader from the elastic-server, from disk with the page cache warm,
   and from disk cold when this host lets us drop the page cache.
Receivers run in processes of their own (as joiners do), one thread each.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

from ascendserve.netloader.client import STREAMS
from bench._report import RESULTS, save, table
from tests.procs import ENGINE_ARGS, ENGINE_ENV, PYTHON, REPO, Proc, free_port

TOKEN = "bench-token"
ENV = {**os.environ, **ENGINE_ENV, "PYTHONPATH": str(REPO)}

RAW_SENDER = """
import socket, sys
n = int(sys.argv[1]); buf = bytearray(n)
srv = socket.create_server(("127.0.0.1", 0)); print(srv.getsockname()[1], flush=True)
while True:
    c, _ = srv.accept()
    with c: c.sendall(buf)
"""
RAW_SPLIT_SENDER = """
import socket, sys, threading
n = int(sys.argv[1]); buf = bytearray(n); view = memoryview(buf)
srv = socket.create_server(("127.0.0.1", 0), backlog=16); print(srv.getsockname()[1], flush=True)
def serve(c):
    with c:
        part, parts = c.recv(2)
        c.sendall(view[n * part // parts:n * (part + 1) // parts])
while True:
    c, _ = srv.accept(); threading.Thread(target=serve, args=(c,), daemon=True).start()
"""
RAW_SPLIT_RECEIVER = """
import mmap, socket, sys, threading, time
n, port, parts, fresh = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:] == ["fresh"]
t = time.perf_counter()  # a fresh buffer: untouched pages inside the clock, as a joiner has
view = memoryview(mmap.mmap(-1, n) if fresh else bytearray(n))
def one(part):
    lo, hi = n * part // parts, n * (part + 1) // parts
    s = socket.create_connection(("127.0.0.1", port)); s.sendall(bytes([part, parts])); got = lo
    while got < hi:
        k = s.recv_into(view[got:hi]); got += k
        if k == 0: raise SystemExit("short")
t = t if fresh else time.perf_counter(); threads = [threading.Thread(target=one, args=(p,)) for p in range(parts)]
[x.start() for x in threads]; [x.join() for x in threads]
print(time.perf_counter() - t)
"""
RAW_RECEIVER = """
import socket, sys, time
n, port = int(sys.argv[1]), int(sys.argv[2]); buf = bytearray(n); view = memoryview(buf)
t = time.perf_counter(); s = socket.create_connection(("127.0.0.1", port)); got = 0
while got < n:
    k = s.recv_into(view[got:]); got += k
    if k == 0: raise SystemExit("short")
print(time.perf_counter() - t)
"""
FETCHER = """
import sys, time
from ascendserve.netloader.checkpoint import identity
from ascendserve.netloader.client import fetch, open_transfer
model, address, flags = sys.argv[1], sys.argv[2], sys.argv[3:]
verify = "--no-verify" not in flags
streams = {"streams": int(flags[flags.index("--streams") + 1])} if "--streams" in flags else {}
import torch  # imported before the clock starts, as in a vLLM worker
t = time.perf_counter()
if "--consume" in flags:  # each tensor taken and let go of, as load_weights does: buffers reused
    for name, tensor in open_transfer(address, "%s", identity(model), {}, 60.0, verify=verify, recycle=True,
                                      **streams):
        del tensor
else:  # every tensor held at once
    out = fetch(address, "%s", identity(model), {}, 60.0, verify=verify, **streams)
print(time.perf_counter() - t)
""" % (TOKEN, TOKEN)
MAPPED_SEED = """
import sys, time
from ascendserve.netloader.checkpoint import CheckpointIndex, MappedSource
from ascendserve.netloader.seed import Seed
s = Seed(MappedSource(CheckpointIndex.scan(sys.argv[1])), "%s", "127.0.0.1", 0).start()
print(s.port, flush=True); time.sleep(3600)
""" % TOKEN


def build_model(layers: int, hidden: int) -> Path:
    from ascendserve.models.tiny import TinySpec, build

    path = RESULTS / f"netloader-model-{layers}x{hidden}"
    if not (path / "config.json").is_file():
        print(f"building {path} ...", flush=True)
        build(path, TinySpec(layers=layers, hidden=hidden, heads=hidden // 64, kv_heads=max(1, hidden // 256),
                             intermediate=4 * hidden))
    return path


def _spawn(code: str, *args: str) -> tuple[subprocess.Popen, int]:
    p = subprocess.Popen([PYTHON, "-c", code, *args], stdout=subprocess.PIPE, text=True, env=ENV,
                         start_new_session=True)
    for line in p.stdout:  # the seed logs a line before it prints its port
        if line.strip().isdigit():
            return p, int(line)
    raise RuntimeError(f"{code[:60]!r} exited before printing its port")


def _run(code: str, *args: str) -> float:
    return float(subprocess.run([PYTHON, "-c", code, *args], capture_output=True, text=True, env=ENV,
                                check=True).stdout.strip().splitlines()[-1])


def _elastic(model: Path, log_dir: Path) -> Proc:
    port, seed_port = free_port(), free_port()
    proc = Proc("elastic", [PYTHON, "-m", "ascendserve", "--role", "elastic-server", "--model", str(model),
                            "--port", str(port), "--netloader-port", str(seed_port), "--cluster-token", TOKEN,
                            "--log-format", "json"], port, log_dir / "elastic.log", {}, "/health")
    proc.seed = f"127.0.0.1:{seed_port}"
    return proc


def transfer(model: Path, total: int, elastic: Proc, repeat: int, joiners: int) -> tuple[list, list]:
    sender, raw_port = _spawn(RAW_SENDER, str(total))
    split, split_port = _spawn(RAW_SPLIT_SENDER, str(total))
    mapped, mapped_port = _spawn(MAPPED_SEED, str(model))
    runs = {  # interleaved, best of `repeat`: the floor and ours see the same noise
        "raw": (RAW_RECEIVER, str(total), str(raw_port)),
        "raw2": (RAW_SPLIT_RECEIVER, str(total), str(split_port), "2"),
        "raw2fresh": (RAW_SPLIT_RECEIVER, str(total), str(split_port), "2", "fresh"),
        "elastic": (FETCHER, str(model), elastic.seed),
        "consumed": (FETCHER, str(model), elastic.seed, "--consume"),
        "elastic1": (FETCHER, str(model), elastic.seed, "--streams", "1"),
        "mapped": (FETCHER, str(model), f"127.0.0.1:{mapped_port}"),
        "unverified": (FETCHER, str(model), elastic.seed, "--no-verify"),
    }
    try:
        best = {k: 1e9 for k in runs}
        for _ in range(repeat):
            for k, args in runs.items():
                best[k] = min(best[k], _run(*args))
    finally:
        for p in (sender, split, mapped):
            os.killpg(p.pid, 9)
    gbs = {k: total / v / 1e9 for k, v in best.items()}
    names = {"raw": "raw loopback socket (floor)", "raw2": "raw loopback, 2 sockets",
             "raw2fresh": "raw loopback, 2 sockets, into a fresh buffer",
             "elastic": f"netloader, elastic-server (RAM), {STREAMS} streams, all tensors held",
             "consumed": f"netloader, elastic-server (RAM), {STREAMS} streams, each let go of (a loader's way)",
             "elastic1": "netloader, elastic-server (RAM), 1 stream",
             "mapped": f"netloader, seed from page cache, {STREAMS} streams",
             "unverified": f"netloader, elastic-server, {STREAMS} streams, CRC checks off (bench only)"}
    rows = [[names[k], round(best[k], 3), gbs[k], gbs[k] / gbs["raw"]] for k in runs]
    start = time.perf_counter()
    procs = [subprocess.Popen([PYTHON, "-c", FETCHER, str(model), elastic.seed], stdout=subprocess.PIPE, text=True,
                              env=ENV) for _ in range(joiners)]
    each = [float(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    wall = time.perf_counter() - start
    many = [[joiners, round(wall, 3), joiners * total / 1e9 / max(each), round(max(each), 3),
             total / 1e9 / (sum(each) / len(each))]]
    return rows, many


def _ready_time(role_args: list[str], model: Path, log_dir: Path, name: str) -> tuple[float, float]:
    """Seconds to ready (polled every 0.5 s), and the weight phase vLLM logs ("Loading weights took")."""
    port = free_port()
    proc = Proc(name, [PYTHON, "-m", "ascendserve", "--role", "pd", "--model", str(model), "--port", str(port),
                       *ENGINE_ARGS, "--cluster-token", TOKEN, *role_args], port, log_dir / f"{name}.log")
    start = time.perf_counter()
    proc.start()
    try:
        proc.wait_ready(600)
        ready_s = time.perf_counter() - start
    finally:
        proc.stop()
    found = re.findall(r"Loading weights took ([0-9.]+) seconds", proc.log_text())
    return ready_s, float(found[-1]) if found else float("nan")


def _drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def ready(model: Path, elastic: Proc, log_dir: Path) -> list:
    joiner_dir = log_dir / "weightless"
    if not joiner_dir.exists():
        shutil.copytree(model, joiner_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    rows = []
    (model / "model.safetensors").read_bytes()  # warm
    disk, disk_w = _ready_time([], model, log_dir, "disk-warm")
    net, net_w = _ready_time(["--served-model-name", str(model), "--netloader-source", elastic.seed], joiner_dir,
                             log_dir, "netloader")
    rows += [["disk, page cache warm", disk, 1.0, disk_w, 1.0],
             ["netloader (elastic-server)", net, net / disk, net_w, net_w / disk_w]]
    if _drop_caches():
        cold, cold_w = _ready_time([], model, log_dir, "disk-cold")
        rows.append(["disk, page cache dropped", cold, cold / disk, cold_w, cold_w / disk_w])
    else:
        rows.append(["disk, page cache dropped", "n/a (not permitted here)", "-", "-", "-"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--joiners", type=int, default=3)
    ap.add_argument("--skip-ready", action="store_true", help="no vLLM start-up comparison")
    args = ap.parse_args()
    model = build_model(args.layers, args.hidden)
    total = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    log_dir = RESULTS / "netloader-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    elastic = _elastic(model, log_dir).start()
    try:
        elastic.wait_ready(300)
        one, many = transfer(model, total, elastic, args.repeat, args.joiners)
        out = {"model_bytes": total}
        out["one_joiner"] = table(f"one joiner, {total / 1e9:.2f} GB over loopback (best of {args.repeat})",
                                  ["path", "seconds", "GB/s", "x raw socket"], one)
        out["joiners"] = table("several joiners at once from one elastic-server",
                               ["joiners", "wall s", "aggregate GB/s", "slowest s", "mean per-joiner GB/s"], many)
        if not args.skip_ready:
            out["ready"] = table("time to ready of ascendserve --role pd (s), and vLLM's weight phase in it",
                                 ["weights from", "seconds", "x disk warm", "weights s", "x disk warm"],
                                 ready(model, elastic, log_dir))
    finally:
        elastic.stop()
    save("netloader", out)


if __name__ == "__main__":
    sys.exit(main())
