"""Correctness oracle: greedy token ids through every topology equal plain vLLM's.

Engines are real ascendserve roles on tiny models; each topology is checked
hop by hop (direct) and through the proxy. Hand-offs use vLLM's example
connectors (shared filesystem); the tests also prove the hand-off happened
(files written by the producer, the consumer's log saying it loaded them),
so a consumer that silently recomputed everything could not pass.
Push mode needs a layerwise KV connector (the connectors issue); its proxy
and metaserver side is covered over stubs in test_proxy_stubs.py. Topologies
with an encoder (1E1PD, 1E1P1D) are in test_epd.py, once per EC connector.
Both proxies also get users' traffic (tests/traffic.py): repeats within a latency
bound, shared prefixes, chat, streams. The same topologies with no tuning flag:
the pd role and `all` 1P1D (pull, push) in test_defaults.py, P and D of the pull
connector in test_kv_pull.py.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.procs import ascendserve, control, start_all, wait_for
from tests.traffic import check_user_traffic

pytestmark = pytest.mark.integration

MAX_TOKENS = 24
PROMPTS = [
    "The history of the lighthouse keeper begins on a small rocky island. " * 3,
    "In a quiet village at the edge of the forest, the old clockmaker repaired "
    "everything from pocket watches to the great tower bell. " * 4,
    "".join(f"Step {i}: add {i} to the running total and write it down. " for i in range(1, 15)),
]


def token_ids(url: str, path: str, body: dict) -> list[int]:
    r = httpx.post(url + path, timeout=120, json={**body, "temperature": 0, "return_token_ids": True})
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


def completion_ids(url: str, model: str, prompt: str, max_tokens: int) -> list[int]:
    return token_ids(url, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens})


def chat_ids(url: str, model: str, messages: list, max_tokens: int) -> list[int]:
    return token_ids(url, "/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": max_tokens})


@pytest.fixture(scope="module")
def text_cluster(text_model, text_oracle, tmp_path_factory):
    logs = tmp_path_factory.mktemp("text-logs")
    kv = tmp_path_factory.mktemp("kv-store")
    meta = control("metaserver", logs)
    start_all(meta)
    oracle = text_oracle
    prefill = ascendserve("prefill", text_model, logs, "--kv-path", str(kv))
    decode = ascendserve("decode", text_model, logs, "--kv-path", str(kv))
    pd = ascendserve("pd", text_model, logs, "--metaserver-url", meta.url)  # found through the registry
    procs = [meta, prefill, decode, pd]
    try:
        start_all(prefill, decode, pd)
        proxy_1p1d = control("proxy", logs, "--prefill", f"127.0.0.1:{prefill.port}",
                             "--decode", f"127.0.0.1:{decode.port}", name="proxy-1p1d")
        proxy_mono = control("proxy", logs, "--metaserver-url", meta.url, name="proxy-mono")
        procs += [proxy_1p1d, proxy_mono]
        start_all(proxy_1p1d, proxy_mono)
        for proxy in (proxy_1p1d, proxy_mono):
            wait_healthy(proxy)
        yield {"oracle": oracle, "prefill": prefill, "decode": decode, "pd": pd, "kv": kv,
               "proxy_1p1d": proxy_1p1d, "proxy_mono": proxy_mono}
    finally:
        for p in procs:
            p.stop()


def wait_healthy(proxy, timeout=120.0):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if httpx.get(proxy.url + "/health", timeout=5).status_code == 200:
            return
        time.sleep(0.5)
    raise TimeoutError(f"{proxy.name} never became healthy:\n{proxy.log_text()[-3000:]}")


def stream_text(url: str, path: str, body: dict) -> str:
    text = ""
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, event
                for choice in event.get("choices", []):
                    text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


def test_1p1d_direct_equals_plain_vllm(text_cluster, text_model):
    oracle, prefill, decode, kv = (text_cluster[k] for k in ("oracle", "prefill", "decode", "kv"))
    model = str(text_model)
    for i, prompt in enumerate(PROMPTS, start=1):
        expected = completion_ids(oracle.url, model, prompt, MAX_TOKENS)
        assert len(expected) == MAX_TOKENS and len(set(expected)) > 4
        first = completion_ids(prefill.url, model, prompt, 1)
        assert first == expected[:1]
        assert len(list(kv.iterdir())) == i, "prefill did not publish this prompt's KV"
        assert completion_ids(decode.url, model, prompt, MAX_TOKENS) == expected
        assert decode.log_text().count("External Cache Hit!") == i, "decode recomputed instead of loading KV"


def test_1p1d_through_proxy_equals_plain_vllm(text_cluster, text_model):
    c, model = text_cluster, str(text_model)
    proxy, decode = c["proxy_1p1d"], c["decode"]
    for prompt in PROMPTS:
        prompt = "Through the proxy: " + prompt
        hits = decode.log_text().count("External Cache Hit!")
        expected = completion_ids(c["oracle"].url, model, prompt, MAX_TOKENS)
        assert completion_ids(proxy.url, model, prompt, MAX_TOKENS) == expected
        assert decode.log_text().count("External Cache Hit!") == hits + 1, "the proxy skipped the P hop"
    messages = [{"role": "user", "content": PROMPTS[1]}]
    body = {"model": model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    assert stream_text(proxy.url, "/v1/chat/completions", body) == \
        stream_text(c["oracle"].url, "/v1/chat/completions", body)


def test_mono_through_proxy_found_via_registry(text_cluster, text_model):
    c, model = text_cluster, str(text_model)
    for prompt in PROMPTS[:2]:
        assert completion_ids(c["proxy_mono"].url, model, prompt, MAX_TOKENS) == \
            completion_ids(c["oracle"].url, model, prompt, MAX_TOKENS)
    body = {"model": model, "prompt": PROMPTS[2], "max_tokens": MAX_TOKENS, "temperature": 0}
    assert stream_text(c["proxy_mono"].url, "/v1/completions", body) == \
        stream_text(c["oracle"].url, "/v1/completions", body)
    assert '"path": "/v1/completions"' in c["pd"].log_text()


def test_1p1d_through_proxy_serves_user_traffic(text_cluster, text_model):
    """Repeats, shared prefixes, chat and streams: every request's KV comes from P's files."""
    c = text_cluster
    hits = c["decode"].log_text().count("External Cache Hit!")
    sent = check_user_traffic(c["proxy_1p1d"].url, c["oracle"].url, str(text_model), seed=11)
    assert c["decode"].log_text().count("External Cache Hit!") == hits + sent, "a request skipped the P hop"


def test_mono_through_proxy_serves_user_traffic(text_cluster, text_model):
    c = text_cluster
    served = _generations(c["pd"])
    sent = check_user_traffic(c["proxy_mono"].url, c["oracle"].url, str(text_model), seed=12)
    # a stream's access-log line comes once its ASGI call returns, which may be after the client saw [DONE]
    wait_for(lambda: _generations(c["pd"]) >= served + sent, 10, "the registry's pd did not serve them")
    assert _generations(c["pd"]) == served + sent


def _generations(proc) -> int:
    log = proc.log_text()
    return log.count('"path": "/v1/completions"') + log.count('"path": "/v1/chat/completions"')
