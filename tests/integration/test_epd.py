"""Encoder disaggregation (EPD) with every EC connector: example, shm, store (memcached).

One cluster per connector on the tiny VL model: an encoder, a PD, a prefill
and a decode (pull KV; the shm and store clusters share one), and two proxies
(1E1PD; 1E1P1D with fan-out encoding); for vLLM's example connector (the reference, not ours) only the
encoder, the PD and the 1E1PD proxy. Greedy ids through each must equal one plain vLLM instance's,
and the tests prove the hand-off happened: the encoder counts its requests
(vLLM's own request counter), the consumers count the items they loaded
(our ascendserve:ec_hits_total; for vLLM's example connector, its log).
After each cluster stops, nothing may be left: no EC region in /dev/shm,
and no entry in memcached once the killed encoder's entries have expired.
Users' traffic on every cluster: the same image again and again (each repeat within
twice its first run), two requests sharing a system or text prefix with different
images, chat with an image streamed, and the text traffic of tests/traffic.py; and
one 1E1P1D cluster started with no tuning flag at all.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import struct
import subprocess
import time
import zlib
from pathlib import Path

import httpx
import pytest

from ascendserve.connectors.ec import memcached
from ascendserve.launch.children import kill_group
from tests.procs import ascendserve, control, free_port, plain_vllm, start_all, wait_for
from tests.traffic import BF16_TIE_NATS, BLOCK, TIE_NATS, assert_greedy, chat_body, check_repeat_times, check_user_traffic
from tests.traffic import chat as timed_chat
from tests.traffic import text as filler

pytestmark = pytest.mark.integration

MAX_TOKENS = 16
STORE_TTL_S = 20
CONNECTORS = ["example", "shm", "store"]


def png_bytes(width: int, height: int, seed: int, mode: str = "RGB") -> bytes:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4}[mode]
    pixels = (rng.random((height, width, channels)) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels, mode).save(buf, format="PNG")
    return buf.getvalue()


def mp4_bytes(frames: int, width: int, height: int, seed: int) -> bytes:
    import tempfile

    import cv2
    import numpy as np

    rng = np.random.default_rng(seed)
    with tempfile.NamedTemporaryFile(suffix=".mp4") as f:
        writer = cv2.VideoWriter(f.name, cv2.VideoWriter_fourcc(*"mp4v"), 4, (width, height))
        for _ in range(frames):
            writer.write((rng.random((height, width, 3)) * 255).astype("uint8"))
        writer.release()
        return Path(f.name).read_bytes()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def messages(*urls: str, text: str = "Describe these pictures in detail.") -> list:
    return [{"role": "user", "content": [*(image_part(u) for u in urls), {"type": "text", "text": text}]}]


def chat(url: str, model: str, msgs: list, max_tokens: int = MAX_TOKENS) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=300, json={
        "model": model, "messages": msgs, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True})


def chat_ids(url: str, model: str, msgs: list) -> list[int]:
    r = chat(url, model, msgs)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def metric(proc, name: str) -> float:
    text = httpx.get(proc.url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})?\s+([0-9.eE+-]+)$", text, re.M))


def encoder_served(encoder) -> float:
    return metric(encoder, "vllm:request_success_total")


def loaded(proc, connector: str) -> float:
    """Items this consumer loaded from the EC store instead of encoding them."""
    if connector == "example":
        return float(len(re.findall(r"Success load encoder cache for hash", proc.log_text())))
    return metric(proc, "ascendserve:ec_hits_total")


def ec_story(*procs) -> str:
    """The EC lines of these instances' logs (saves, fetches, waits, store errors): what a
    failed hand-off assertion shows, since the logs themselves go with the session's tmp."""
    pattern = re.compile(r"EC |encoder output|EC store|ec_transfer|promised", re.I)
    parts = []
    for p in procs:
        lines = [line[:300] for line in p.log_text().splitlines() if pattern.search(line)]
        parts.append(f"--- {p.name}: {len(lines)} EC lines, the last 30:\n" + "\n".join(lines[-30:]))
    return "\n".join(parts)


def ec_segments(procs=()) -> set[str]:
    """The EC regions in /dev/shm of this test process's clusters: those it named (they end in
    its pid) and the receive buffers of the instances' processes (named by their pid). Another
    worker's clusters have regions at the same time; they are not this test's to check."""
    pids = set()
    for p in procs:
        if p.popen is not None and p.popen.poll() is None:
            pids |= {p.pid, *(d.pid for d in p.descendants())}
    recv = tuple(f"asf-ec-recv-{pid}-" for pid in pids)
    return {n for n in os.listdir("/dev/shm")
            if n.startswith("asf-ec") and (n.endswith(f"-{os.getpid()}") or (recv and n.startswith(recv)))}


class Memcached:
    def __init__(self, port: int):
        self.port = port
        self.url = f"127.0.0.1:{port}"
        self.popen = None

    def start(self) -> "Memcached":
        user = ["-u", "root"] if os.getuid() == 0 else []
        self.popen = subprocess.Popen(["memcached", *user, "-l", "127.0.0.1", "-p", str(self.port), "-U", "0",
                                       "-m", "64", "-I", "1m"])
        client = memcached.Client(self.url)
        wait_for(lambda: _answers(client), 10, "memcached did not start")
        client.close()
        return self

    def stop(self) -> None:
        if self.popen and self.popen.poll() is None:
            self.popen.terminate()
            self.popen.wait(10)


def _answers(client) -> bool:
    try:
        client.stats()
        return True
    except memcached.StoreError:
        return False


@pytest.fixture(scope="module")
def epd_decode():
    """The decode of the shm and store clusters: one instance for both, started with the first of
    them and stopped at the module's end. It neither encodes nor loads encoder outputs, no test
    stops it or counts on it, and the proxy tells it each request's prefill, so it serves
    either cluster's prefill as it would the other's (an engine start fewer)."""
    holder: dict = {}
    yield holder
    if "proc" in holder:
        holder["proc"].stop()


@pytest.fixture(scope="module", params=CONNECTORS)
def epd(request, vl_model, vl_oracle, epd_decode, tmp_path_factory):
    connector = request.param
    logs = tmp_path_factory.mktemp(f"epd-{connector}")
    ec_dir = tmp_path_factory.mktemp(f"ec-{connector}")
    before = ec_segments()
    store = Memcached(free_port()).start() if connector == "store" else None
    ec = ["--ec-connector", connector]
    if connector == "example":
        ec += ["--ec-path", str(ec_dir)]
    if connector == "shm":
        ec += ["--ec-shm-name", f"asf-ec-test-{os.getpid()}", "--ec-shm-size-mb", "64"]
    if connector == "store":
        # tiny embeddings are a few KiB: small chunks so every item is chunked
        ec += ["--ec-store-url", store.url, "--ec-chunk-kb", "8", "--ec-ttl", str(STORE_TTL_S)]
    debug = ["--log-level", "debug"] if connector in ("example", "store") else []  # its loads are only logged
    engine_ec, consumer_ec = ec, [*ec, "--ec-enabled"]
    encoder = ascendserve("encoder", vl_model, logs, *engine_ec, *debug, name="encoder")
    # the shm cluster's PD runs TP=2: each rank loads the items onto its own device
    tp = ["--tensor-parallel-size", "2"] if connector == "shm" else []
    pd = ascendserve("pd", vl_model, logs, *consumer_ec, *tp, *debug, name="pd",
                     env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"} if tp else None)
    prefill = ascendserve("prefill", vl_model, logs, *consumer_ec, "--kv-connector", "pull", *debug,
                          name="prefill")
    # vLLM's example connector is the reference, not ours: its cluster is 1E1PD only (CI time)
    full = connector != "example"
    decode = epd_decode.get("proc")
    engines = [encoder, pd, prefill] if full else [encoder, pd]
    if full and decode is None:
        decode = epd_decode["proc"] = ascendserve("decode", vl_model, tmp_path_factory.mktemp("epd-decode"),
                                                  "--kv-connector", "pull", name="decode")
        engines.append(decode)  # started beside the others
    procs = [p for p in engines if p is not decode]  # this cluster's own: stopped and checked at its end
    # the proxy asks the same store to skip the encoder
    proxy_ec = {"example": ["--ec-connector", "example", "--ec-path", str(ec_dir)],
                "shm": ["--ec-connector", "shm", "--ec-shm-name", f"asf-ec-test-{os.getpid()}",
                        "--ec-shm-size-mb", "64"],
                "store": ["--ec-connector", "store", "--ec-store-url", store.url if store else ""]}[connector]
    try:
        start_all(*engines)
        e = f"127.0.0.1:{encoder.port}"
        proxy_pd = control("proxy", logs, "--encoder", e, "--pd", f"127.0.0.1:{pd.port}", *proxy_ec,
                           name="proxy-1e1pd")
        proxies = [proxy_pd]
        if full:
            proxy_pdd = control("proxy", logs, "--encoder", e, "--prefill", f"127.0.0.1:{prefill.port}",
                                "--decode", f"127.0.0.1:{decode.port}", "--encoder-dispatch", "fanout", *proxy_ec,
                                name="proxy-1e1p1d")
            proxies.append(proxy_pdd)
        else:
            prefill = decode = proxy_pdd = None
        procs += proxies
        start_all(*proxies)
        for proxy in proxies:
            wait_for(lambda: httpx.get(proxy.url + "/health").status_code == 200, 120, f"{proxy.name} unhealthy")
        yield {"connector": connector, "encoder": encoder, "pd": pd, "prefill": prefill, "decode": decode,
               "proxy_1e1pd": proxy_pd, "proxy_1e1p1d": proxy_pdd, "oracle": vl_oracle, "model": str(vl_model),
               "store": store, "ec_dir": ec_dir, "seed": 1000 * CONNECTORS.index(connector)}
    finally:
        live = ec_segments(procs)  # the receive buffers of the instances, by their pids
        for p in procs:
            p.stop()
        try:
            left = {n for n in live if os.path.exists(f"/dev/shm/{n}")} | (ec_segments() - before)
            assert not left, f"EC shared memory left in /dev/shm after every instance stopped: {left}"
            if store is not None:
                _assert_store_drains(store)
        finally:
            if store is not None:
                store.stop()


def _assert_store_drains(store: Memcached) -> None:
    """Entries of the stopped encoder were deleted; those of the killed one expire (every key has a TTL)."""
    client = memcached.Client(store.url)
    try:
        deadline = time.monotonic() + STORE_TTL_S + 15
        while True:
            keys = [k for k in client.keys() if k.startswith(memcached.PREFIX)]
            live = client.get_many(keys) if keys else {}
            if not live:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"EC entries still in memcached {STORE_TTL_S}s after their TTL: {sorted(live)[:5]}")
            time.sleep(1)
    finally:
        client.close()


def needs_p_and_d(c) -> None:
    if c["prefill"] is None:
        pytest.skip(f"the {c['connector']} cluster is 1E1PD only")


# ---- no tuning flags ------------------------------------------------------------------------
# First in the file: pytest runs it before the connectors' module-scoped clusters start (beside
# one of them and its oracle, 4 more engines would not fit in memory), and stops it right after.
@pytest.fixture
def untuned_epd(vl_model, tmp_path_factory):
    """1E1P1D and plain vLLM as a user starts them: no dtype, no eager, no memory setting."""
    logs = tmp_path_factory.mktemp("epd-untuned")
    before = ec_segments()
    # the settings that make the topology: our shm EC connector (a region of its own, so that it
    # cannot meet another cluster's on this host) and pull KV; nothing that tunes an engine
    ec = ["--ec-connector", "shm", "--ec-shm-name", f"asf-ec-untuned-{os.getpid()}"]
    oracle = plain_vllm(vl_model, logs, name="vllm-vl-untuned", tuned=False)
    encoder = ascendserve("encoder", vl_model, logs, *ec, name="encoder-untuned", tuned=False)
    prefill = ascendserve("prefill", vl_model, logs, *ec, "--ec-enabled", "--kv-connector", "pull",
                          name="prefill-untuned", tuned=False)
    decode = ascendserve("decode", vl_model, logs, "--kv-connector", "pull", name="decode-untuned", tuned=False)
    procs = [oracle, encoder, prefill, decode]
    try:
        start_all(*procs)
        proxy = control("proxy", logs, "--encoder", f"127.0.0.1:{encoder.port}", "--prefill",
                        f"127.0.0.1:{prefill.port}", "--decode", f"127.0.0.1:{decode.port}", *ec,
                        name="proxy-untuned")
        procs.append(proxy)
        start_all(proxy)
        wait_for(lambda: httpx.get(proxy.url + "/health").status_code == 200, 120, "proxy-untuned unhealthy")
        yield {"connector": "shm", "encoder": encoder, "pd": None, "prefill": prefill, "decode": decode,
               "proxy_1e1pd": None, "proxy_1e1p1d": proxy, "oracle": oracle, "model": str(vl_model), "seed": 9000}
    finally:
        live = ec_segments(procs)
        for p in procs:
            p.stop()
        left = {n for n in live if os.path.exists(f"/dev/shm/{n}")} | (ec_segments() - before)
        assert not left, f"EC shared memory left in /dev/shm after every instance stopped: {left}"


def same_chat(proxy, oracle, model: str, msgs: list, what: str, stream: bool = False) -> None:
    """The untuned proxy's greedy ids for a chat are the oracle's, up to bf16 (tests/traffic.py)."""
    expected = timed_chat(oracle.url, model, msgs)[0]
    assert_greedy(timed_chat(proxy.url, model, msgs, stream=stream)[0], expected, oracle.url, chat_body(model, msgs),
                  what, BF16_TIE_NATS)


def test_1e1p1d_with_no_tuning_flags_serves_users(untuned_epd):
    c, model, seed = untuned_epd, untuned_epd["model"], untuned_epd["seed"]
    proxy, oracle = c["proxy_1e1p1d"], c["oracle"]
    for msgs in (messages(data_url(png_bytes(112, 84, seed + 1))),
                 messages(data_url(png_bytes(160, 120, seed + 2)), data_url(png_bytes(96, 128, seed + 3, "RGBA")),
                          text="Compare the two pictures.")):
        served, hits = encoder_served(c["encoder"]), loaded(c["prefill"], "shm")
        same_chat(proxy, oracle, model, msgs, "pictures")
        items = len(msgs[0]["content"]) - 1
        assert encoder_served(c["encoder"]) == served + 1, "the encoder hop did not happen"
        assert loaded(c["prefill"], "shm") == hits + items, \
            f"P encoded instead of loading the encoder's output\n{ec_story(c['encoder'], c['prefill'])}"
    check_same_image_repeated(proxy, oracle.url, model, messages(data_url(png_bytes(120, 90, seed + 4))),
                              tie_nats=BF16_TIE_NATS)
    images = [data_url(png_bytes(96, 72, seed + 5 + i)) for i in range(2)]
    for name, chats in shared_prefix_image_chats(seed + 10, images).items():
        for msgs in chats:
            same_chat(proxy, oracle, model, msgs, name)
    streamed = messages(data_url(png_bytes(104, 80, seed + 7)), text="Stream your answer.")
    same_chat(proxy, oracle, model, streamed, "streamed", stream=True)
    served = encoder_served(c["encoder"])
    check_user_traffic(proxy.url, oracle.url, model, seed=seed, tie_nats=BF16_TIE_NATS)
    assert encoder_served(c["encoder"]) == served
    for proc in (c["encoder"], c["prefill"], c["decode"]):
        argv = next(json.loads(line)["vllm_args"] for line in proc.log_text().splitlines()
                    if '"starting vLLM"' in line)
        assert "--enforce-eager" not in argv, proc.name


# ---- correctness --------------------------------------------------------------------
def test_1e1pd_equals_plain_vllm(epd):
    c, model, seed = epd, epd["model"], epd["seed"]
    proxy, oracle, pd, encoder = c["proxy_1e1pd"], c["oracle"], c["pd"], c["encoder"]
    one = data_url(png_bytes(112, 84, seed + 1))
    two = [data_url(png_bytes(160, 120, seed + 2)), data_url(png_bytes(96, 128, seed + 3, "RGBA"))]
    video = [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": data_url(mp4_bytes(8, 112, 112, seed + 12), "video/mp4")}},
        {"type": "text", "text": "What happens in this clip?"}]}]
    cases = [messages(one), messages(*two, text="Compare the two pictures."), video]
    for msgs in cases:
        served, hits = encoder_served(encoder), loaded(pd, c["connector"])
        expected = chat_ids(oracle.url, model, msgs)
        assert len(expected) == MAX_TOKENS and len(set(expected)) > 3
        assert chat_ids(proxy.url, model, msgs) == expected
        assert encoder_served(encoder) == served + 1, "the encoder hop did not happen (single dispatch)"
        items = len(msgs[0]["content"]) - 1
        assert loaded(pd, c["connector"]) == hits + items, \
            f"PD encoded instead of loading the encoder's output\n{ec_story(encoder, pd)}"
    served = encoder_served(encoder)
    text_only = [{"role": "user", "content": "Just text, no picture here."}]
    assert chat_ids(proxy.url, model, text_only) == chat_ids(oracle.url, model, text_only)
    assert encoder_served(encoder) == served, "a text-only request went to the encoder"


def test_1e1p1d_fanout_equals_plain_vllm(epd):
    c, model, seed = epd, epd["model"], epd["seed"]
    needs_p_and_d(c)
    proxy, oracle, prefill, encoder = c["proxy_1e1p1d"], c["oracle"], c["prefill"], c["encoder"]
    cases = [messages(data_url(png_bytes(224, 112, seed + 4)), text="What colours dominate this picture?"),
             messages(data_url(png_bytes(84, 84, seed + 5)), data_url(png_bytes(140, 70, seed + 6)),
                      data_url(png_bytes(70, 140, seed + 7)), text="Three pictures: which is noisiest?")]
    for msgs in cases:
        served, hits = encoder_served(encoder), loaded(prefill, c["connector"])
        items = len(msgs[0]["content"]) - 1
        assert chat_ids(proxy.url, model, msgs) == chat_ids(oracle.url, model, msgs)
        assert encoder_served(encoder) == served + items, "fan-out: one encoder request per item"
        assert loaded(prefill, c["connector"]) == hits + items, \
            f"P encoded instead of loading the encoder's output\n{ec_story(encoder, prefill)}"
    text_only = [{"role": "user", "content": "Only words travel through prefill and decode."}]
    assert chat_ids(proxy.url, model, text_only) == chat_ids(oracle.url, model, text_only)


def test_same_image_again_skips_the_encoder(epd):
    """The proxy finds the item in the store (hashing it as vLLM does) and skips the encoder."""
    c, model, seed = epd, epd["model"], epd["seed"]
    needs_p_and_d(c)
    image = data_url(png_bytes(128, 96, seed + 8))
    first = messages(image, text="First look at this picture.")
    second = messages(image, text="A second, different question about the same picture.")
    assert chat_ids(c["proxy_1e1pd"].url, model, first) == chat_ids(c["oracle"].url, model, first)
    served = encoder_served(c["encoder"])
    hits = loaded(c["prefill"], c["connector"])
    # through the other proxy and the prefill, which has never seen this image
    assert chat_ids(c["proxy_1e1p1d"].url, model, second) == chat_ids(c["oracle"].url, model, second)
    assert encoder_served(c["encoder"]) == served, "the encoder was asked for an item the store already held"
    assert metric(c["proxy_1e1p1d"], "ascendserve_proxy_encoder_skips_total") >= 1
    assert loaded(c["prefill"], c["connector"]) == hits + 1, "P did not load the stored item\n" + \
        ec_story(c["encoder"], c["prefill"])


# ---- users' traffic ------------------------------------------------------------------------
def proxies(c) -> list:
    return [p for p in (c["proxy_1e1pd"], c["proxy_1e1p1d"]) if p is not None]


def consumer(c, proxy):
    return c["pd"] if proxy is c["proxy_1e1pd"] else c["prefill"]


def check_same_image_repeated(proxy, oracle_url: str, model: str, msgs: list, times: int = 3,
                              tie_nats: float = TIE_NATS) -> list[float]:
    """The same chat `times` times in a row: each equals the oracle's and finishes within
    the bound of the first (a stalled EC or KV hand-off that falls back leaves the tokens right)."""
    expected, _ = timed_chat(oracle_url, model, msgs)
    seconds = []
    for i in range(times):
        got, s = timed_chat(proxy.url, model, msgs)
        assert_greedy(got, expected, oracle_url, chat_body(model, msgs), f"{proxy.name}: repeat {i + 1} of the same image",
                      tie_nats)
        seconds.append(s)
    check_repeat_times(seconds, lambda: timed_chat(proxy.url, model, msgs)[1], f"{proxy.name}: the same image")
    return seconds


def shared_prefix_image_chats(seed: int, images: list[str]) -> dict[str, list[list]]:
    """Chats that share a system prompt, or a text prefix before the image, and differ in the image."""
    system = {"role": "system", "content": filler(seed, 2 * BLOCK)}
    lead = filler(seed + 1, BLOCK + 30)
    return {
        "system prompt": [[system, *messages(image, text="What is in this picture?")] for image in images],
        "text before the image": [[{"role": "user", "content": [{"type": "text", "text": lead}, image_part(image),
                                                                 {"type": "text", "text": "And this one?"}]}]
                                  for image in images],
    }


def test_same_image_again_and_again(epd):
    c, model, seed = epd, epd["model"], epd["seed"]
    for k, proxy in enumerate(proxies(c)):
        msgs = messages(data_url(png_bytes(120, 90, seed + 30 + k)), text="Tell me about this picture.")
        served, hits = encoder_served(c["encoder"]), loaded(consumer(c, proxy), c["connector"])
        check_same_image_repeated(proxy, c["oracle"].url, model, msgs)
        assert loaded(consumer(c, proxy), c["connector"]) >= hits + 1, "the consumer never loaded the item"
        # one encoding; the repeats find the item in the store (or hit the prefix cache)
        assert encoder_served(c["encoder"]) == served + 1, f"{proxy.name}: the same image encoded again"


def test_shared_prefixes_with_different_images(epd):
    c, model, seed = epd, epd["model"], epd["seed"]
    for k, proxy in enumerate(proxies(c)):
        images = [data_url(png_bytes(96, 72, seed + 40 + 2 * k + i)) for i in range(2)]
        for name, chats in shared_prefix_image_chats(seed + 50 + 10 * k, images).items():
            for msgs in chats:
                served, hits = encoder_served(c["encoder"]), loaded(consumer(c, proxy), c["connector"])
                assert timed_chat(proxy.url, model, msgs)[0] == timed_chat(c["oracle"].url, model, msgs)[0], \
                    f"{proxy.name}, shared {name}"
                if name == "system prompt":  # each image is new here: encoded once, loaded once
                    assert encoder_served(c["encoder"]) == served + 1, f"{proxy.name}, shared {name}"
                    assert loaded(consumer(c, proxy), c["connector"]) == hits + 1, \
                        f"{proxy.name}, shared {name}\n" + ec_story(c["encoder"], consumer(c, proxy))


def test_chat_with_an_image_streamed(epd):
    c, model, seed = epd, epd["model"], epd["seed"]
    for k, proxy in enumerate(proxies(c)):
        for msgs in (messages(data_url(png_bytes(104, 80, seed + 70 + k)), text="Stream your answer."),
                     messages(data_url(png_bytes(64, 96, seed + 72 + k)), data_url(png_bytes(80, 64, seed + 74 + k)),
                              text="Two pictures, streamed.")):
            expected, _ = timed_chat(c["oracle"].url, model, msgs)
            assert timed_chat(proxy.url, model, msgs, stream=True)[0] == expected, f"{proxy.name}, streamed"


def test_text_traffic_through_the_encoder_proxies(epd):
    """Text only: repeats, shared prefixes, chat, streams; none of it goes to the encoder."""
    c = epd
    for k, proxy in enumerate(proxies(c)):
        served = encoder_served(c["encoder"])
        check_user_traffic(proxy.url, c["oracle"].url, c["model"], seed=c["seed"] + 80 + k)
        assert encoder_served(c["encoder"]) == served, f"{proxy.name} sent text-only requests to the encoder"


# ---- bad input ------------------------------------------------------------------------
def _png_header_only(width: int, height: int) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", len(ihdr)) + chunk + struct.pack(">I", zlib.crc32(chunk))


def test_bad_images_get_a_4xx(epd):
    c, model = epd, epd["model"]
    if c["connector"] != "shm":
        pytest.skip("bad input is checked once, on the shm cluster")
    good = png_bytes(64, 64, 77)
    closed = free_port()
    bad = {
        "truncated": data_url(good[: len(good) // 2]),
        "not an image": data_url(b"this is plain text, not a picture" * 10),
        "huge dimensions": data_url(_png_header_only(30000, 30000)),
        "unreachable url": f"http://127.0.0.1:{closed}/picture.png",
    }
    for what, url in bad.items():
        for target in (c["proxy_1e1pd"], c["proxy_1e1p1d"], c["encoder"], c["pd"]):
            r = chat(target.url, model, messages(url), max_tokens=4)
            assert 400 <= r.status_code < 500, f"{what} via {target.name}: {r.status_code} {r.text[:300]}"
            assert r.json()["error"]["message"], f"{what} via {target.name}: no message"
    for proc in (c["encoder"], c["pd"], c["prefill"], c["decode"]):
        assert proc.popen.poll() is None, f"{proc.name} died on bad input"
    ok = messages(data_url(good))
    assert chat_ids(c["proxy_1e1pd"].url, model, ok) == chat_ids(c["oracle"].url, model, ok)


# ---- failures (after users' traffic, which then runs on an undisturbed store; last: the encoder
# stays dead) ----------------------------------------------------------------------------------
def test_store_restarted_empty(epd):
    """Store down: requests still succeed (encoded locally); restarted empty: the encoder republishes."""
    c, model, seed = epd, epd["model"], epd["seed"]
    if c["connector"] == "shm":
        pytest.skip("the shm region lives as long as an instance on the host holds it; it cannot be restarted alone")
    needs_p_and_d(c)
    seen = messages(data_url(png_bytes(112, 112, seed + 9)), text="Seen once by the PD.")
    assert chat_ids(c["proxy_1e1pd"].url, model, seen) == chat_ids(c["oracle"].url, model, seen)
    if c["connector"] == "store":
        c["store"].stop()
        fresh = messages(data_url(png_bytes(100, 60, seed + 10)), text="The store is down right now.")
        assert chat_ids(c["proxy_1e1pd"].url, model, fresh) == chat_ids(c["oracle"].url, model, fresh)
        assert metric(c["proxy_1e1pd"], "ascendserve_proxy_ec_store_errors_total") >= 1
        c["store"].start()  # empty
    else:
        for entry in c["ec_dir"].iterdir():
            for f in entry.iterdir():
                f.unlink()
            entry.rmdir()
    served, hits = encoder_served(c["encoder"]), loaded(c["prefill"], c["connector"])
    again = messages(*[p["image_url"]["url"] for p in seen[0]["content"][:1]], text="Now through P and D.")
    assert chat_ids(c["proxy_1e1p1d"].url, model, again) == chat_ids(c["oracle"].url, model, again)
    assert encoder_served(c["encoder"]) == served + 1, "the store is empty: the encoder must be asked"
    if c["connector"] == "store":
        # the encoder had it in its own cache and republished it; P loaded it
        assert loaded(c["prefill"], c["connector"]) == hits + 1, ec_story(c["encoder"], c["prefill"])


def test_encoder_sigkill_falls_back_to_local_encoding(epd):
    c, model, seed = epd, epd["model"], epd["seed"]
    encoder = c["encoder"]
    kill_group(encoder.popen.pid, grace_s=0, tracker_grace_s=10)
    encoder.popen.wait(10)
    for proxy, consumer in ((c["proxy_1e1pd"], c["pd"]), (c["proxy_1e1p1d"], c["prefill"])):
        if proxy is None:
            continue
        msgs = messages(data_url(png_bytes(150, 100, seed + 11 + len(proxy.name))), text="After the encoder died.")
        assert chat_ids(proxy.url, model, msgs) == chat_ids(c["oracle"].url, model, msgs)
        assert metric(proxy, "ascendserve_proxy_encoder_fallbacks_total") >= 1
        assert consumer.popen.poll() is None

