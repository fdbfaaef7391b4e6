"""KV-event-aware routing over two real pd instances (issue 22).

Two pd engines publish vLLM's KV events (on by default for pd): one with vLLM's default
hashing (sha256), one with sha256_cbor, so both algorithms are checked against a real engine.
The proxy routes with `--routing kv` (the default).

  - the proxy's token ids (its local tokenizer for text and its rendering of the chat template,
    or the engine's /tokenize) equal the ids vLLM reports for the same request, and its block hashes equal the ones the engine
    publishes for that prompt: byte for byte where vLLM publishes whole hashes
    (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0), as their 64-bit ints by its default;
  - a conversation's next turn goes to the instance that holds its prefix (vLLM served cached
    tokens there), while unrelated prompts still spread over both;
  - the holder restarted empty: its index is rebuilt (empty) and nothing is predicted there;
  - users' traffic (repeats, shared prefixes, chat/completions/streaming) equals plain vLLM.
"""

from __future__ import annotations

import re
import threading
import time

import httpx
import msgspec
import pytest
import zmq

from ascendserve.protocol.kv_events import BlockStored, CacheInfo, decode_batch
from ascendserve.router.block_hash import BlockHasher
from ascendserve.router.chat_template import LocalChat
from tests.procs import ascendserve, control, start_all
from tests.traffic import BF16_TIE_NATS, check_user_traffic

pytestmark = pytest.mark.integration

SYSTEM = "You are the harbour master of a small northern port. " * 12  # ~650 tokens: five 128-token blocks


def metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (not labels or labels in line) and not line.startswith("#"):
            m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+([0-9.eE+-]+)$", line)
            if m:
                total += float(m.group(2))
    return total


def hits(pd) -> float:
    return metric(pd.url, "vllm:prefix_cache_hits_total")


def served(pd) -> float:
    return metric(pd.url, "vllm:request_success_total")


class Listener:
    """vLLM's events of one engine, as they come (a raw SUB socket: what the engine sends)."""

    def __init__(self, endpoint: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.stored: list[BlockStored] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        time.sleep(0.5)  # the SUB connection

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(100):
                _, _, payload = self.sock.recv_multipart()
                self.stored += [e for e in decode_batch(payload).events if isinstance(e, BlockStored)]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture(scope="module")
def cluster(text_model, text_oracle, tmp_path_factory):
    logs = tmp_path_factory.mktemp("kv-routing")
    a = ascendserve("pd", text_model, logs, name="pd-sha256")
    # b publishes whole hashes (bytes); a vLLM's default, their last 64 bits as ints
    b = ascendserve("pd", text_model, logs, "--vllm-arg=--prefix-caching-hash-algo=sha256_cbor", name="pd-cbor",
                    env={"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0"})
    start_all(a, b)
    proxy = control("proxy", logs, "--pd", f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}", name="proxy-kv")
    try:
        proxy.start().wait_ready()
        deadline = time.monotonic() + 60
        while metric(proxy.url, "ascendserve_proxy_kv_index_known") < 2:  # both followed, replayed
            assert time.monotonic() < deadline, "the proxy does not follow both instances' KV events"
            time.sleep(0.5)
        yield {"a": a, "b": b, "proxy": proxy, "model": str(text_model), "oracle": text_oracle}
    finally:
        for p in (proxy, a, b):
            p.stop()


def cache_info(pd) -> CacheInfo:
    return msgspec.json.decode(httpx.get(pd.url + "/cache_info", timeout=10).content, type=CacheInfo)


def test_token_ids_and_block_hashes_equal_the_engines(cluster):
    model = cluster["model"]
    for pd, algo in ((cluster["a"], "sha256"), (cluster["b"], "sha256_cbor")):
        info = cache_info(pd)
        assert info.hash_algo == algo and info.hash_seed == "vllm-none-hash" and info.details_added
        assert info.endpoints == [f"tcp://127.0.0.1:{pd.port + 1500}"]
        listen = Listener(info.endpoints[0])
        try:
            prompt = f"{algo}: " + "The tide comes in over the harbour wall, slowly. " * 9
            r = httpx.post(pd.url + "/v1/completions", timeout=120, json={
                "model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0, "return_token_ids": True})
            engine_ids = r.json()["choices"][0]["prompt_token_ids"]
            from tokenizers import Tokenizer

            local = Tokenizer.from_file(f"{model}/tokenizer.json").encode(prompt, add_special_tokens=True).ids
            assert local == engine_ids
            msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{algo}: who are you?"}]
            tok = httpx.post(pd.url + "/tokenize", json={"model": model, "messages": msgs}, timeout=60).json()["tokens"]
            r = httpx.post(pd.url + "/v1/chat/completions", timeout=120, json={
                "model": model, "messages": msgs, "max_tokens": 2, "temperature": 0, "return_token_ids": True})
            assert tok == r.json()["prompt_token_ids"]
            text = LocalChat.load(model).render({"messages": msgs})  # what the proxy renders itself
            assert Tokenizer.from_file(f"{model}/tokenizer.json").encode(text, add_special_tokens=False).ids == tok
            time.sleep(1.0)
        finally:
            listen.close()
        hasher = BlockHasher(algo, info.hash_seed)
        full = [e for e in listen.stored if e.parent_block_hash is None]
        block = max(e.block_size for e in full)
        for ids in (engine_ids, tok):
            mine = hasher.hashes(ids, block)
            assert len(mine) == len(ids) // block >= 3
            theirs = next((e for e in full if e.token_ids == ids[:len(e.token_ids)] and len(e.block_hashes) >= 3),
                          None)
            assert theirs is not None, f"no stored event for the prompt among {len(full)}"
            if algo == "sha256":  # vLLM's default: the last 64 bits of each hash, as an int
                assert theirs.block_hashes == hasher.keys(ids, block)[:len(theirs.block_hashes)]
            else:
                assert theirs.block_hashes == mine[:len(theirs.block_hashes)]


def turn(proxy_url: str, model: str, msgs: list[dict]) -> str:
    r = httpx.post(proxy_url + "/v1/chat/completions", timeout=120, json={
        "model": model, "messages": msgs, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"].get("prompt_tokens_details") is None  # as plain vLLM: the client did not ask
    return body["choices"][0]["message"]["content"]


def test_the_next_turn_goes_where_its_prefix_is_cached_and_unrelated_ones_spread(cluster):
    proxy, model, pds = cluster["proxy"], cluster["model"], (cluster["a"], cluster["b"])
    predicted0 = metric(proxy.url, "ascendserve_proxy_prefix_predicted_tokens_total")
    holders = []
    for user in range(4):
        msgs = [{"role": "system", "content": f"User {user}. " + SYSTEM},
                {"role": "user", "content": f"Question {user}: when is high tide?"}]
        before = [served(p) for p in pds]
        msgs.append({"role": "assistant", "content": turn(proxy.url, model, msgs)})
        holder = next(i for i, p in enumerate(pds) if served(p) > before[i])
        holders.append(holder)
        msgs.append({"role": "user", "content": "And the low tide after it?"})
        before, hit0 = [served(p) for p in pds], hits(pds[holder])
        turn(proxy.url, model, msgs)
        went = [i for i, p in enumerate(pds) if served(p) > before[i]]
        assert went == [holder], f"user {user}: the second turn went to {went}, its prefix is on {holder}"
        assert hits(pds[holder]) - hit0 >= 5 * 128, "vLLM served no cached tokens for the second turn"
    assert metric(proxy.url, "ascendserve_proxy_prefix_predicted_tokens_total") - predicted0 >= 4 * 5 * 128
    assert metric(proxy.url, "ascendserve_proxy_prefix_cached_tokens_total") >= 4 * 5 * 128
    # unrelated prompts, sent concurrently, go to both
    before = [served(p) for p in pds]
    with httpx.Client(timeout=120) as client:
        threads = [threading.Thread(target=lambda n=n: client.post(proxy.url + "/v1/completions", json={
            "model": model, "prompt": f"{n} unrelated " * 60, "max_tokens": 16, "temperature": 0}))
            for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    spread = [served(p) - before[i] for i, p in enumerate(pds)]
    assert sum(spread) == 8 and min(spread) >= 2, f"unrelated prompts did not spread by load: {spread}"


def test_a_holder_restarted_empty_is_not_preferred(cluster):
    proxy, model, a = cluster["proxy"], cluster["model"], cluster["a"]
    msgs = [{"role": "system", "content": "Restart. " + SYSTEM}, {"role": "user", "content": "Tide?"}]
    # make `a` the holder: send the first turn straight to it
    r = httpx.post(a.url + "/v1/chat/completions", timeout=120, json={"model": model, "messages": msgs,
                                                                        "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200
    label = f'instance="http://127.0.0.1:{a.port}"'
    deadline = time.monotonic() + 30
    while metric(proxy.url, "ascendserve_proxy_kv_index_blocks", label) < 5:
        assert time.monotonic() < deadline, "the proxy never learned a's blocks"
        time.sleep(0.2)
    a.stop()
    start_all(a)
    deadline = time.monotonic() + 90
    while not (metric(proxy.url, "ascendserve_proxy_kv_index_known", label) == 1
               and metric(proxy.url, "ascendserve_proxy_instance_up", label) == 1):
        assert time.monotonic() < deadline, "the restarted instance's index was not rebuilt"
        time.sleep(0.5)
    assert metric(proxy.url, "ascendserve_proxy_kv_index_blocks", label) == 0
    predicted = metric(proxy.url, "ascendserve_proxy_prefix_predicted_tokens_total")
    turn(proxy.url, model, msgs)
    assert metric(proxy.url, "ascendserve_proxy_prefix_predicted_tokens_total") == predicted, \
        "a prefix was predicted on an instance that restarted empty"


def test_users_traffic_equals_plain_vllm(cluster):
    check_user_traffic(cluster["proxy"].url, cluster["oracle"].url, cluster["model"], seed=2200)


# ---- the same, the way a user starts it ------------------------------------------------------
@pytest.fixture(scope="module")
def untuned(text_model, untuned_text_oracle, tmp_path_factory):
    """Two pd engines and the proxy with no tuning flag at all (KV events are on by default)."""
    logs = tmp_path_factory.mktemp("kv-routing-untuned")
    pds = [ascendserve("pd", text_model, logs, name=f"pd-untuned-{i}", tuned=False) for i in range(2)]
    start_all(*pds)
    proxy = control("proxy", logs, "--pd", *(f"127.0.0.1:{p.port}" for p in pds), name="proxy-kv-untuned")
    try:
        proxy.start().wait_ready()
        deadline = time.monotonic() + 60
        while metric(proxy.url, "ascendserve_proxy_kv_index_known") < 2:
            assert time.monotonic() < deadline, "the proxy does not follow the untuned instances' KV events"
            time.sleep(0.5)
        yield {"pds": pds, "proxy": proxy, "model": str(text_model), "oracle": untuned_text_oracle}
    finally:
        for p in (proxy, *pds):
            p.stop()


def test_untuned_engines_are_routed_by_their_cache_and_serve_users(untuned):
    proxy, model, pds = untuned["proxy"], untuned["model"], untuned["pds"]
    msgs = [{"role": "system", "content": "Untuned. " + SYSTEM}, {"role": "user", "content": "When is high tide?"}]
    before = [served(p) for p in pds]
    msgs.append({"role": "assistant", "content": turn(proxy.url, model, msgs)})
    holder = next(i for i, p in enumerate(pds) if served(p) > before[i])
    msgs.append({"role": "user", "content": "And the low tide?"})
    before, hit0 = [served(p) for p in pds], hits(pds[holder])
    turn(proxy.url, model, msgs)
    assert [i for i, p in enumerate(pds) if served(p) > before[i]] == [holder]
    assert hits(pds[holder]) - hit0 >= 5 * 128
    check_user_traffic(proxy.url, untuned["oracle"].url, model, seed=2300, tie_nats=BF16_TIE_NATS)
