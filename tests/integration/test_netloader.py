"""NetLoader with real engines: joiners load weights from seeds, not storage.

- text: an instance whose model directory holds no weights at all loads them
  from an elastic-server and gives plain vLLM's greedy tokens;
- VL: the same from a running pd instance's in-process seed;
- a seed of another model: the joiner loads from disk instead (and says why),
  or, with fallback = fail, does not start;
- scale-out: a 1P1D cluster serves a steady stream through the proxy while a
  second decode joins with `--netloader-source auto` (seeds from the
  metaserver); no request fails, and the proxy routes to the newcomer; then the
  first decode stops and the newcomer alone serves users' traffic.
Every joined instance gets users' traffic (tests/traffic.py: repeats within a
latency bound, shared prefixes, chat, streams; for VL the same image again and
images behind a shared prefix), and one joins with no tuning flag at all.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.test_epd import (chat_ids, check_same_image_repeated, data_url, messages, png_bytes,
                                        shared_prefix_image_chats)
from tests.conftest import host_copy
from tests.procs import PYTHON, Proc, ascendserve, completion_ids, control, free_port, start_all, wait_for
from tests.traffic import chat as timed_chat
from tests.traffic import BF16_TIE_NATS, check_user_traffic

pytestmark = pytest.mark.integration
TOKEN = "netloader-test-token"
AUTH = ("--cluster-token", TOKEN)
PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,"]


WEIGHTS = shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json")


def weightless_copy(model: Path, dest: Path) -> Path:
    """The model directory without its weights: only a seed can provide them."""
    shutil.copytree(model, dest, ignore=WEIGHTS)
    assert not list(dest.glob("*.safetensors"))
    return dest


def elastic_server(model: Path, log_dir: Path, name: str = "elastic") -> Proc:
    port, seed_port = free_port(), free_port()
    argv = [PYTHON, "-m", "ascendserve", "--role", "elastic-server", "--model", str(model), "--port", str(port),
            "--netloader-port", str(seed_port), "--log-format", "json", *AUTH]
    proc = Proc(name, argv, port, log_dir / f"{name}.log", {}, "/health")
    proc.seed = f"127.0.0.1:{seed_port}"
    return proc


def _served(proc: Proc) -> float:
    text = httpx.get(proc.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))


def test_text_joiner_without_weights_equals_plain_vllm(text_model, text_oracle, tmp_path):
    seed = elastic_server(text_model, tmp_path).start()
    joiner = ascendserve("pd", weightless_copy(text_model, tmp_path / "joiner"), tmp_path,
                         "--served-model-name", str(text_model), "--netloader-source", "SEED", *AUTH, name="joiner")
    try:
        seed.wait_ready()
        joiner.argv[joiner.argv.index("SEED")] = seed.seed
        start_all(joiner)
        for prompt in PROMPTS:
            assert completion_ids(joiner.url, str(text_model), prompt) == \
                completion_ids(text_oracle.url, str(text_model), prompt)
        assert f"weights received" in joiner.log_text() and seed.seed in joiner.log_text()
        check_user_traffic(joiner.url, text_oracle.url, str(text_model), seed=21)
        described = httpx.get(seed.url + "/v1/seed", timeout=5, headers={"authorization": f"Bearer {TOKEN}"}).json()
        assert described["transfers_served"] == 1 and described["tensors"] > 0
    finally:
        joiner.stop()
        seed.stop()


def test_vl_joiner_from_a_running_instance_equals_it(vl_model, tmp_path):
    seed_port = free_port()
    source = ascendserve("pd", vl_model, tmp_path, "--netloader-serve", "--netloader-port", str(seed_port), *AUTH,
                         name="vl-seed")
    joiner = ascendserve("pd", weightless_copy(vl_model, tmp_path / "vl-joiner"), tmp_path,
                         "--served-model-name", str(vl_model), "--netloader-source", f"127.0.0.1:{seed_port}", *AUTH,
                         name="vl-joiner")
    try:
        start_all(source)
        start_all(joiner)
        assert "weights received" in joiner.log_text()
        cases = [messages(data_url(png_bytes(112, 84, 41)), text="What is in this picture?"),
                 [{"role": "user", "content": "Say something about the sea."}]]
        for msgs in cases:
            assert chat_ids(joiner.url, str(vl_model), msgs) == chat_ids(source.url, str(vl_model), msgs)
        # users' traffic on the joiner, the seed its oracle (same flags, weights from disk)
        model = str(vl_model)
        check_same_image_repeated(joiner, source.url, model, messages(data_url(png_bytes(120, 90, 42))))
        images = [data_url(png_bytes(96, 72, 43 + i)) for i in range(2)]
        for name, chats in shared_prefix_image_chats(44, images).items():
            for msgs in chats:
                assert timed_chat(joiner.url, model, msgs)[0] == timed_chat(source.url, model, msgs)[0], name
        streamed = messages(data_url(png_bytes(104, 80, 46)), text="Stream your answer.")
        assert timed_chat(joiner.url, model, streamed, stream=True)[0] == timed_chat(source.url, model, streamed)[0]
        check_user_traffic(joiner.url, source.url, model, seed=47)
    finally:
        joiner.stop()
        source.stop()


def test_a_seed_of_another_model_means_disk_or_no_start(text_model, text_oracle, tmp_path):
    other = tmp_path / "other-model"
    shutil.copytree(text_model, other)
    config = json.loads((other / "config.json").read_text())
    config["rope_theta"] = float(config.get("rope_theta", 10000.0)) * 2
    (other / "config.json").write_text(json.dumps(config))
    seed = elastic_server(other, tmp_path).start()
    try:
        seed.wait_ready()
        fallback = ascendserve("pd", text_model, tmp_path, "--netloader-source", seed.seed, *AUTH, name="fallback")
        try:
            start_all(fallback)
            log = fallback.log_text()
            assert "loading the weights from disk instead" in log and "seed serves another model" in log
            for prompt in PROMPTS:
                assert completion_ids(fallback.url, str(text_model), prompt) == \
                    completion_ids(text_oracle.url, str(text_model), prompt)
        finally:
            fallback.stop()

        strict = ascendserve("pd", text_model, tmp_path, "--netloader-source", seed.seed,
                             "--netloader-fallback", "fail", *AUTH, name="strict").start()
        try:
            assert strict.popen.wait(180) != 0  # never serves
            assert "the disk fallback is off" in strict.log_text()
        finally:
            strict.stop()
    finally:
        seed.stop()


def test_scale_out_under_load_joins_by_auto_with_no_failed_request(text_model, text_oracle, tmp_path):
    expected = {p: completion_ids(text_oracle.url, str(text_model), p) for p in PROMPTS}
    meta = control("metaserver", tmp_path, *AUTH)
    meta.start().wait_ready()
    common = ("--kv-connector", "pull", "--metaserver-url", meta.url, *AUTH)
    # The running pair computes on core 0 and the newcomer starts on core 1, as on separate hosts:
    # vLLM's workers busy-poll for a second after every step, and under a steady stream two of
    # them on both cores starve a starting process for minutes.
    core0, core1 = {"VLLM_CPU_OMP_THREADS_BIND": "0"}, {"VLLM_CPU_OMP_THREADS_BIND": "1"}
    prefill = ascendserve("prefill", text_model, tmp_path, *common, name="prefill", env=core0)
    decode1 = ascendserve("decode", text_model, tmp_path, *common, "--netloader-serve",
                          "--netloader-port", str(free_port()), name="decode1", env=core0)
    decode2 = ascendserve("decode", weightless_copy(text_model, tmp_path / "d2"), tmp_path, *common,
                          "--served-model-name", str(text_model), "--netloader-source", "auto", name="decode2",
                          env=core1)
    proxy = control("proxy", tmp_path, "--metaserver-url", meta.url, *AUTH)
    results = {"ok": 0, "failed": []}
    stop = threading.Event()

    def stream():
        i = 0
        while not stop.is_set():
            prompt = PROMPTS[i % len(PROMPTS)]
            i += 1
            try:
                r = httpx.post(proxy.url + "/v1/completions", timeout=120, json={
                    "model": str(text_model), "prompt": prompt, "max_tokens": 16, "temperature": 0,
                    "return_token_ids": True})
                if r.status_code == 200 and r.json()["choices"][0]["token_ids"] == expected[prompt]:
                    results["ok"] += 1
                else:
                    results["failed"].append(f"{r.status_code} {r.text[:200]}")
            except httpx.HTTPError as exc:
                results["failed"].append(repr(exc))
            stop.wait(0.3)  # steady, not saturating: two cores also have to start the newcomer

    worker = threading.Thread(target=stream, daemon=True)
    try:
        start_all(prefill, decode1)
        proxy.start().wait_ready()
        wait_for(lambda: httpx.get(proxy.url + "/health", timeout=5).status_code == 200, 60, "proxy not serving")
        worker.start()
        wait_for(lambda: results["ok"] >= 3, 120, "the stream did not start")
        decode2.start().wait_ready(timeout=420)
        wait_for(lambda: _served(decode2) >= 2, 120, "the proxy never routed to the new decode instance")
        time.sleep(1.0)
        stop.set()
        worker.join(150)
        # the first decode goes: users' traffic now reaches the joined instance only
        decode1.stop()
        wait_for(lambda: _active_decodes(proxy) == {decode2.url}, 90, "the proxy kept the stopped decode")
        served = _served(decode2)
        users = check_user_traffic(proxy.url, text_oracle.url, str(text_model), seed=31)
        assert _served(decode2) == served + users, "the joined decode did not serve the users' requests"
    finally:
        stop.set()
        worker.join(150)
        for p in (decode2, proxy, decode1, prefill, meta):
            p.stop()
    assert results["failed"] == [] and results["ok"] >= 5, results
    log = decode2.log_text()
    assert "weights received" in log and "loading the weights from disk instead" not in log


def _active_decodes(proxy: Proc) -> set[str]:
    listed = httpx.get(proxy.url + "/instances", timeout=5, headers={"authorization": f"Bearer {TOKEN}"}).json()
    return {i["url"] for i in listed["instances"] if i["state"] == "active" and i.get("role") == "decode"}


def test_untuned_joiner_serves_user_traffic(text_model, untuned_text_oracle, tmp_path):
    """A joiner started as a user starts one: no dtype, no eager, no memory setting (vLLM
    compiles the weights it received, or loads what an earlier start on this path compiled:
    the weights are the compiled graph's inputs); only the flags that make it a joiner. Its
    weightless model directory stays where it is between sessions, as a user's does."""
    seed = elastic_server(text_model, tmp_path).start()
    model = host_copy(text_model, "weightless-joiner", ignore=WEIGHTS)
    assert not list(model.glob("*.safetensors"))
    joiner = ascendserve("pd", model, tmp_path,
                         "--served-model-name", str(text_model), "--netloader-source", "SEED", *AUTH,
                         name="joiner-untuned", tuned=False)
    try:
        seed.wait_ready()
        joiner.argv[joiner.argv.index("SEED")] = seed.seed
        start_all(joiner)
        assert "weights received" in joiner.log_text() and "loading the weights from disk instead" not in \
            joiner.log_text()
        check_user_traffic(joiner.url, untuned_text_oracle.url, str(text_model), seed=51, tie_nats=BF16_TIE_NATS)
    finally:
        joiner.stop()
        seed.stop()


def test_auto_joiner_finds_its_seed_through_etcd(text_model, text_oracle, tmp_path):
    """The registry on etcd: the elastic-server registers its seed there (a key on its lease), a
    weightless pd joiner with `--netloader-source auto` finds it there, and a proxy on the same etcd
    routes to the joiner."""
    from ascendserve.discovery import etcd as registry
    from tests.etcd_cluster import EtcdCluster, registry_flags

    etcd = EtcdCluster(tmp_path / "etcd", members=1).start()
    reg = registry_flags(etcd, ttl_s=5, name="netloader")
    seed = elastic_server(text_model, tmp_path)
    seed.argv += reg
    joiner = ascendserve("pd", weightless_copy(text_model, tmp_path / "joiner"), tmp_path,
                         "--served-model-name", str(text_model), "--netloader-source", "auto", *AUTH, *reg,
                         name="joiner-etcd")
    proxy = control("proxy", tmp_path, *AUTH, *reg)
    try:
        seed.start().wait_ready()
        # the seed is in etcd before the joiner looks (it registers once its /health answers)
        settings = registry.EtcdSettings(tuple(etcd.endpoints), "netloader")
        wait_for(lambda: any(i.get("seed") == seed.seed for i in registry.instances(settings)), 30,
                 "the elastic-server registered its seed in etcd")
        start_all(joiner, proxy)
        log = joiner.log_text()
        assert "weights received" in log and "loading the weights from disk instead" not in log
        wait_for(lambda: httpx.get(proxy.url + "/health", timeout=5).status_code == 200, 60, "proxy routes")
        check_user_traffic(proxy.url, text_oracle.url, str(text_model), seed=61)
    finally:
        for p in (proxy, joiner, seed):
            p.stop()
        etcd.stop()
