"""KV transfer between prefill and decode: our transports and connectors next to the floors.

    python -m bench.kv_transfer [--tokens 4096] [--repeat 5] [--skip-e2e] [--only mono,pull,...]
                                [--pull-transports tcp,shm] [--io-compare]

One run measures, on a tiny-but-wide model (16 layers, 8 KV heads of 64, fp32:
64 KiB of KV per token, ~256 MiB for a 4k prompt):

1. Bandwidth of one request's KV (every layer's pages of every block), P and D
   in separate processes: raw loopback TCP socket and memcpy (the floors), then
   our tcp / shm / mooncake transports through the real side channel
   (PullWorker on both sides, vLLM's CPU page layout).
2. TTFT of the same 4k prompt (streamed, max_tokens 2, a fresh prompt each
   time so no prefix cache helps): plain vLLM (monolithic), 1P1D through our
   proxy with our pull connector and our layerwise push connector over each
   transport, vLLM's NixlConnector (`--kv-connector nixl`) and vLLM's ExampleConnector. P computes on core 0 and D on
   core 1 (VLLM_CPU_OMP_THREADS_BIND), as if on two hosts. Each 1P1D figure is checked against
   monolithic TTFT + 1.2 x (KV bytes / that transport's measured bandwidth).
3. For each 1P1D pull: the in-engine pull bandwidth (D's own "KV pulled" log lines) against the
   same transport isolated (1.), over `--engine-pulls` requests that share a prefix P has
   cached (a short prefill, the whole prompt's KV pulled: D runs without prefix caching) and
   over the TTFT requests; and the TTFT's breakdown (bench/_kv_engine.py): P's prefill, D's
   wait for its pull, the pull, D's first step.
   `--io-compare` adds tcp through the Python socket path (ASCENDSERVE_KV_NATIVE=0 on P and D)
   beside the native one (transport/native.py), isolated and in the engines.
vLLM's own MooncakeConnector is not in the table: on CPU-only torch it dies
at start-up (torch.accelerator.current_device_index(), an upstream defect).
What these hosts cannot measure: RDMA, NVLink and HCCS (NIXL and Mooncake run
over loopback TCP here), and device memory.
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from bench._report import save, table

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 64, 128
TRANSPORTS = ("tcp", "shm", "mooncake")
TOKEN = "bench-token"


def kv_caches(num_blocks: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.self_attn.attn": torch.randn((num_blocks, KV_HEADS, BLOCK, 2 * HEAD_DIM), generator=g)
            for i in range(LAYERS)}


# ---- floors ------------------------------------------------------------------
def _source(port_q, nbytes: int, rounds: int) -> None:
    """The producer side of the floor, in its own process like P: sendall on request."""
    srv = socket.create_server(("127.0.0.1", 0))
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    data = memoryview(np.random.randint(0, 255, nbytes, dtype=np.uint8))
    for _ in range(rounds):
        conn.recv(1)
        conn.sendall(data)
    conn.close()


def raw_socket_gbps(nbytes: int, repeat: int) -> float:
    """One request's bytes over one loopback socket: sendall in a child, recv_into here."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_source, args=(q, nbytes, repeat + 1))
    proc.start()
    sock = socket.create_connection(("127.0.0.1", q.get(timeout=30)))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    buf = memoryview(np.empty(nbytes, dtype=np.uint8))
    samples = []
    for i in range(repeat + 1):
        t = time.perf_counter()
        sock.sendall(b"g")
        got = 0
        while got < nbytes:
            got += sock.recv_into(buf[got:], nbytes - got)
        if i:
            samples.append(nbytes / (time.perf_counter() - t) / 1e9)
    sock.close()
    proc.join(10)
    return statistics.median(samples)


def memcpy_gbps(nbytes: int, repeat: int) -> float:
    src = np.random.randint(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    samples = []
    for _ in range(repeat + 1):
        t = time.perf_counter()
        np.copyto(dst, src)
        samples.append(nbytes / (time.perf_counter() - t) / 1e9)
    return statistics.median(samples[1:])


# ---- our transports ------------------------------------------------------------
def _producer(port_q, stop_ev, num_blocks: int, holds: int, blocks: list[int]) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    from ascendserve.connectors.kv.pull_plan import PullMetadata, PullSettings
    from ascendserve.connectors.kv.pull_worker import PullWorker

    transport = "mooncake" if _has_mooncake() else "tcp"
    p = PullWorker(PullSettings("127.0.0.1", "127.0.0.1", 0, 600.0, transport), TOKEN, 0, producer=True)
    p.register_kv_caches(kv_caches(num_blocks, 1))
    p.start_load_kv(PullMetadata(send={f"r{i}": (blocks, 600.0) for i in range(holds)}))
    port_q.put(p.server.port)
    while not stop_ev.wait(0.05):
        p.get_transfer_results()
    p.shutdown()


def _has_mooncake() -> bool:
    import importlib.util

    return importlib.util.find_spec("mooncake") is not None


def transport_gbps(num_blocks: int, blocks: list[int], repeat: int, names: list[str] | None = None
                   ) -> dict[str, float]:
    from ascendserve.connectors.kv.pull_plan import PullSettings
    from ascendserve.connectors.kv.pull_worker import PullWorker

    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    names = names or [t for t in TRANSPORTS if t != "mooncake" or _has_mooncake()]
    proc = ctx.Process(target=_producer, args=(q, stop, num_blocks, len(names) * (repeat + 1), blocks))
    proc.start()
    port = q.get(timeout=120)
    out, n = {}, 0
    try:
        for name in names:
            d = PullWorker(PullSettings("127.0.0.1", "127.0.0.1", 0, 600.0, name), TOKEN, 0, producer=False)
            d.register_kv_caches(kv_caches(num_blocks, 2))
            local = list(reversed(blocks))
            samples = []
            for i in range(repeat + 1):
                t = time.perf_counter()
                moved = d.client.pull("127.0.0.1", port, f"r{n}", blocks, local)
                dt = time.perf_counter() - t
                d.client.free("127.0.0.1", port, f"r{n}")
                n += 1
                if i:
                    samples.append(moved / dt / 1e9)
            out[name] = statistics.median(samples)
            d.shutdown()
    finally:
        stop.set()
        proc.join(30)
    return out


# ---- vLLM's NixlConnector's data path: NIXL over UCX --------------------------------
def _page_regions(caches, blocks: list[int]) -> list[tuple[int, int, int]]:
    """(address, bytes, device) of each block's page in each layer, as vLLM's NIXL worker reads them."""
    out = []
    for t in caches.values():
        per_block = t[0].numel() * t.element_size()
        out += [(t.data_ptr() + b * per_block, per_block, 0) for b in blocks]
    return out


def _nixl_agent(name: str):
    from ascendserve.engine.patches import nixl_progress

    os.environ.setdefault(nixl_progress.ENV, "1000")  # as our engine roles set it on a CPU host
    nixl_progress.apply()
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(num_threads=4))  # vLLM's NIXL worker's settings


def _nixl_producer(conn, num_blocks: int, blocks: list[int]) -> None:
    """P: its pages registered with NIXL; sends its agent metadata and page regions (JSON) and
    serves D's reads until told to stop."""
    import json

    os.environ["OMP_NUM_THREADS"] = "1"
    caches = kv_caches(num_blocks, 1)
    agent = _nixl_agent("bench-p")
    agent.register_memory(list(caches.values()))
    conn.send_bytes(agent.get_agent_metadata())
    conn.send_bytes(json.dumps(_page_regions(caches, blocks)).encode())
    conn.recv_bytes()  # stop
    os._exit(0)  # nixl 1.5.1's agent crashes the interpreter's exit


def nixl_gbps(num_blocks: int, blocks: list[int], repeat: int) -> float | None:
    """One request's pages read by D from P through NIXL (what vLLM's NixlConnector does): a
    READ of every (layer, block) page, P and D in separate processes, UCX over tcp."""
    import importlib.util
    import json

    if importlib.util.find_spec("nixl") is None:
        return None
    os.environ.setdefault("UCX_TLS", "tcp,self")  # as engine/kv_args sets it on a CPU host
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_nixl_producer, args=(there, num_blocks, blocks))
    proc.start()
    try:
        caches = kv_caches(num_blocks, 2)
        agent = _nixl_agent("bench-d")
        agent.register_memory(list(caches.values()))
        peer = agent.add_remote_agent(here.recv_bytes())
        remote = agent.get_xfer_descs([tuple(r) for r in json.loads(here.recv_bytes())], "DRAM")
        local = agent.get_xfer_descs(_page_regions(caches, list(reversed(blocks))), "DRAM")
        nbytes = sum(r[1] for r in _page_regions(caches, blocks))
        samples = []
        for i in range(repeat + 1):
            t = time.perf_counter()
            handle = agent.initialize_xfer("READ", local, remote, peer)
            state = agent.transfer(handle)
            while state not in ("DONE", "ERR"):
                state = agent.check_xfer_state(handle)
            dt = time.perf_counter() - t
            agent.release_xfer_handle(handle)
            if state != "DONE":
                raise RuntimeError("NIXL read failed")
            if i:
                samples.append(nbytes / dt / 1e9)
        return statistics.median(samples)
    finally:
        here.send_bytes(b"stop")
        proc.join(30)


# ---- end to end ----------------------------------------------------------------
def build_model(root: Path) -> Path:
    from ascendserve.models.tiny import TinySpec, build

    spec = TinySpec(layers=LAYERS, hidden=KV_HEADS * HEAD_DIM, heads=KV_HEADS, kv_heads=KV_HEADS, intermediate=1024)
    return build(root / "wide", spec)


def prompt(tokens: int, salt: int) -> str:
    # ~1 token per character with the tiny byte-level tokenizer; the salt keeps caches cold
    body = "".join(f"{(salt * 7919 + i) % 100003} bottles of ink on the wall. " for i in range(tokens))
    return body[:tokens - 8]


def ttft(url: str, model: str, text: str) -> float:
    import httpx

    t = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", timeout=600, json={
            "model": model, "prompt": text, "max_tokens": 2, "temperature": 0, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                return time.perf_counter() - t
    raise RuntimeError("no token streamed")


def measure(url: str, model: str, tokens: int, repeat: int, salt: int) -> float:
    ttft(url, model, prompt(64, salt))  # warm the path
    return statistics.median(ttft(url, model, prompt(tokens, salt * 100 + i)) for i in range(repeat))


PYTHON_IO = {"ASCENDSERVE_KV_NATIVE": "0"}  # transport/native.py off: Python's socket calls


def end_to_end(model: Path, logs: Path, tokens: int, repeat: int, only: set[str], pull_transports: list[str],
               io_compare: bool, kv_bytes: int, series_n: int) -> tuple[dict[str, float], dict[str, dict]]:
    """(TTFT per topology, in-engine figures per 1P1D pull: D's pull GB/s and the breakdown)."""
    from bench._kv_engine import breakdown, in_engine_gbps, pull_series
    from tests.procs import ascendserve, control, plain_vllm, start_all

    # P (and the monolithic instance) compute on core 0, D waits on core 1, as on separate
    # hosts: two vLLM workers bound to one core would halve each other (vLLM's workers
    # busy-poll for a second after every step)
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0"}
    d_env = {**env, "VLLM_CPU_OMP_THREADS_BIND": "1"}
    m = str(model)
    out: dict[str, float] = {}
    engine: dict[str, dict] = {}
    salt = 1
    if "mono" in only:
        mono = plain_vllm(model, logs, env=env)
        start_all(mono)
        try:
            out["monolithic (plain vLLM)"] = measure(mono.url, m, tokens, repeat, salt)
        finally:
            mono.stop()

    def pair(label_transport: list[tuple[str, str]], connector: str, p_extra=(), proxy_extra=(), io_env=None):
        nonlocal salt
        io_env = io_env or {}
        common = ("--kv-connector", connector, "--cluster-token", TOKEN, "--log-format", "json")
        p = ascendserve("prefill", model, logs, *common, *p_extra, name=f"prefill-{connector}-{salt}",
                        env={**env, **io_env})
        start_all(p)
        try:
            for label, transport in label_transport:
                # a pull D without prefix caching: pull_series's requests share a prefix on P and
                # still move the whole prompt (the TTFT prompts are fresh: it changes nothing there)
                no_cache = ("--vllm-arg=--no-enable-prefix-caching",) if connector == "pull" else ()
                d = ascendserve("decode", model, logs, *common, "--kv-transport", transport, *no_cache,
                                name=f"decode-{connector}-{transport}-{salt}", env={**d_env, **io_env})
                start_all(d)
                try:
                    proxy = control("proxy", logs, "--prefill", f"127.0.0.1:{p.port}", "--decode",
                                    f"127.0.0.1:{d.port}", "--cluster-token", TOKEN, *proxy_extra)
                    start_all(proxy)
                    try:
                        salt += 1
                        since = time.time()
                        out[label] = measure(proxy.url, m, tokens, repeat, salt)
                        if connector == "pull":
                            gbps, n = in_engine_gbps(d.log_path, since, kv_bytes // 2)
                            salt += 1
                            fresh = [prompt(tokens, salt * 100 + i) for i in range(repeat)]
                            parts = breakdown(p.url, d.url, d.log_path, m, fresh, kv_bytes // 2)
                            series = pull_series(p.url, d.url, d.log_path, m, prompt(tokens - 64, salt * 100 + 99),
                                                 series_n, kv_bytes // 2) if series_n else []
                            engine[label] = {"gbps": gbps, "pulls": n, "breakdown": parts, "series_gbps": series}
                    finally:
                        proxy.stop()
                finally:
                    d.stop()
        finally:
            p.stop()

    if "pull" in only:
        pair([(f"1P1D pull {t}", t) for t in pull_transports], "pull",
             p_extra=("--kv-transport", "mooncake" if _has_mooncake() else "tcp"))
        if io_compare:
            pair([("1P1D pull tcp (python I/O)", "tcp")], "pull", p_extra=("--kv-transport", "tcp"),
                 io_env=PYTHON_IO)
    if "push" in only:
        meta = control("metaserver", logs, "--cluster-token", TOKEN)
        start_all(meta)
        try:
            for t in TRANSPORTS:
                if t != "mooncake" or _has_mooncake():
                    pair([(f"1P1D push {t} (layerwise)", t)], "push", p_extra=("--kv-transport", t),
                         proxy_extra=("--mode", "push", "--metaserver-url", meta.url))
        finally:
            meta.stop()
    if "nixl" in only and importlib.util.find_spec("nixl") is not None:
        pair([("1P1D nixl (vLLM NixlConnector)", "tcp")], "nixl")
    if "example" in only:
        kv_dir = logs / "example-kv"
        pair([("1P1D vLLM ExampleConnector", "tcp")], "example", p_extra=("--kv-path", str(kv_dir)))
    return out, engine


def _isolated_key(label: str) -> str | None:
    """The isolated bandwidth (transport_gbps' key) a 1P1D label's bound and ratio use."""
    if "python I/O" in label:
        return "tcp (python I/O)"
    return next((t for t in (*TRANSPORTS, "nixl") if f" {t}" in label), None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096 - 16)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--skip-e2e", action="store_true", help="bandwidth only (no vLLM instances)")
    ap.add_argument("--keep-logs", default="", help="directory to keep the instances' logs in")
    ap.add_argument("--only", default="mono,pull,push,nixl,example",
                    help="which TTFT topologies to run (comma-separated: mono, pull, push, nixl, example)")
    ap.add_argument("--pull-transports", default=",".join(TRANSPORTS),
                    help="D's transports in the 1P1D pull runs (mooncake only where installed)")
    ap.add_argument("--io-compare", action="store_true",
                    help="also tcp through the Python socket path (ASCENDSERVE_KV_NATIVE=0), isolated and 1P1D")
    ap.add_argument("--engine-pulls", type=int, default=16,
                    help="in-engine pulls per 1P1D pull run with a short prefill (P's prefix cache), for the GB/s")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    pull_transports = [t for t in args.pull_transports.split(",") if t in TRANSPORTS
                       and (t != "mooncake" or _has_mooncake())]
    blocks_n = -(-args.tokens // BLOCK)
    num_blocks = blocks_n + 8
    kv_bytes = LAYERS * blocks_n * KV_HEADS * BLOCK * 2 * HEAD_DIM * 4
    blocks = list(range(3, 3 + blocks_n))
    print(f"KV of a {args.tokens}-token prompt: {blocks_n} blocks x {LAYERS} layers = {kv_bytes / 2**20:.0f} MiB",
          flush=True)
    try:
        from ascendserve.connectors.transport import native

        io = "native" if native.enabled() else "python: " + native.why_not()
    except ImportError:  # a tree from before the native data path
        io = "python (no native data path in this tree)"
    print(f"KV transfer I/O here: {io}", flush=True)
    floors = {"raw TCP socket (loopback)": raw_socket_gbps(kv_bytes, args.repeat),
              "memcpy (numpy, 1 thread)": memcpy_gbps(kv_bytes, args.repeat)}
    ours = transport_gbps(num_blocks, blocks, args.repeat)
    if args.io_compare:
        os.environ.update(PYTHON_IO)  # the producer process inherits it
        try:
            ours["tcp (python I/O)"] = transport_gbps(num_blocks, blocks, args.repeat, ["tcp"])["tcp"]
        finally:
            os.environ.pop("ASCENDSERVE_KV_NATIVE")
    nixl = nixl_gbps(num_blocks, blocks, args.repeat)
    if nixl is not None:
        ours["nixl"] = nixl
    tcp_floor, mem_floor = floors["raw TCP socket (loopback)"], floors["memcpy (numpy, 1 thread)"]
    rows = [[k, v, "floor"] for k, v in floors.items()]
    for name, v in ours.items():
        ref = mem_floor if name == "shm" else tcp_floor
        label = "vLLM NixlConnector's path: NIXL 1.5.1, UCX tcp" if name == "nixl" else f"ascendserve {name}"
        rows.append([label, v, f"{v / ref:.2f}x {'memcpy' if name == 'shm' else 'raw socket'}"])
    text = table(f"KV bandwidth, one {kv_bytes / 2**20:.0f} MiB request (GB/s, median of {args.repeat})",
                 ["path", "GB/s", "ratio"], rows)
    result = {"tokens": args.tokens, "kv_bytes": kv_bytes, "floors_gbps": floors, "transports_gbps": ours}
    if not args.skip_e2e:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            logs = Path(args.keep_logs) if args.keep_logs else root / "logs"
            logs.mkdir(parents=True, exist_ok=True)
            model = build_model(root)
            e2e, engine = end_to_end(model, logs, args.tokens, args.repeat, only, pull_transports,
                                     args.io_compare, kv_bytes, args.engine_pulls)
        text += "\n" + _e2e_tables(e2e, engine, ours, kv_bytes, args.tokens, args.repeat)
        result["ttft_s"], result["in_engine"] = e2e, engine
    save("kv_transfer", {**result, "table": text})


def _e2e_tables(e2e: dict, engine: dict, ours: dict, kv_bytes: int, tokens: int, repeat: int) -> str:
    mono = e2e.get("monolithic (plain vLLM)")
    rows = []
    for label, v in e2e.items():
        key = _isolated_key(label)
        bound = mono + 1.2 * kv_bytes / (ours[key] * 1e9) if mono and key in ours and "1P1D" in label else None
        rows.append([label, v, f"{v / mono:.2f}x" if mono else "-", f"{bound:.3f}" if bound else "-",
                     ("ok" if v <= bound else "over") if bound else "-"])
    text = table(f"TTFT of a {tokens}-token prompt (s, median of {repeat})",
                 ["topology", "TTFT s", "x monolithic", "bound s", "within"], rows)
    if not engine:
        return text
    rows = []
    for label, e in engine.items():
        iso = ours.get(_isolated_key(label))
        series = e.get("series_gbps") or []
        gbps = statistics.median(series) if series else e["gbps"]
        rows.append([label, gbps if gbps is not None else "-", len(series) or e["pulls"],
                     f"{min(series):.2f}-{max(series):.2f}" if series else "-",
                     e["gbps"] if e["gbps"] is not None else "-", iso if iso else "-",
                     f"{gbps / iso:.2f}x" if gbps and iso else "-"])
    text += "\n" + table(f"In-engine pull of a {kv_bytes / 2**20:.0f} MiB KV (D's 'KV pulled' lines; median of the "
                         "short-prefill series, and of the TTFT runs) vs the same transport isolated (GB/s)",
                         ["1P1D", "in-engine GB/s", "pulls", "range", "in TTFT runs", "isolated GB/s",
                          "in-engine / isolated"], rows)
    rows = []
    for label, e in engine.items():
        b = e["breakdown"]
        rows.append([label, e2e.get(label, "-"), b["total"], b["prefill"], b["d_wait"], b["pull"], b["d_first_step"],
                     mono if mono else "-"])
    text += "\n" + table(f"1P1D TTFT breakdown, {tokens}-token prompt (s, median of {repeat}; P then D "
                         "from this client, as the proxy's pull flow)",
                         ["1P1D", "TTFT via proxy", "direct total", "P prefill", "D wait", "D pull",
                          "D first step", "monolithic"], rows)
    return text


if __name__ == "__main__":
    main()
