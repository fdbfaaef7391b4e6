"""ascendserve's layerwise push KV connector between real prefill and decode roles.

The proxy (mode push) sends the request to D first; D reserves blocks and asks
the metaserver, which dispatches P once; P pushes every layer's pages as the
layer is computed. Greedy ids must equal plain vLLM's, from a 1-token prompt
to thousands of tokens (chunked prefill: several pushes per request), with
32 requests at once and with several prompts in one completion; every block
goes back to the pool afterwards.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.procs import ascendserve, completion_ids, control, kv_usage, start_all, wait_for

pytestmark = pytest.mark.integration
TOKEN = "kv-push-token"
MAX_TOKENS = 16
PROMPTS = {
    "1-token": "a",
    "short": "Short prompt about the sea.",
    "multi-block": "The lighthouse keeper climbed the stairs every night. " * 12,
    "thousands": "".join(f"Line {i}: the quick brown fox jumps over the lazy dog. " for i in range(60)),
}


@pytest.fixture(scope="module")
def push_cluster(text_model, text_oracle, tmp_path_factory):
    logs = tmp_path_factory.mktemp("kv-push-logs")
    meta = control("metaserver", logs, "--cluster-token", TOKEN)
    start_all(meta)
    common = ("--kv-connector", "push", "--cluster-token", TOKEN, "--log-format", "json",
              # a small chunk so long prompts take several steps, each pushed layer by layer
              "--vllm-arg=--max-num-batched-tokens=1024")
    prefill = ascendserve("prefill", text_model, logs, *common)
    decode = ascendserve("decode", text_model, logs, *common)
    procs = [meta, prefill, decode]
    try:
        start_all(prefill, decode)
        proxy = control("proxy", logs, "--mode", "push", "--metaserver-url", meta.url, "--cluster-token", TOKEN,
                        "--prefill", f"127.0.0.1:{prefill.port}", "--decode", f"127.0.0.1:{decode.port}")
        procs.append(proxy)
        start_all(proxy)
        wait_for(lambda: httpx.get(proxy.url + "/health").status_code == 200, 60, "proxy never healthy")
        yield {"oracle": text_oracle, "prefill": prefill, "decode": decode, "proxy": proxy, "model": str(text_model)}
    finally:
        for p in procs:
            p.stop()


def events(proc, name: str) -> list[dict]:
    return [e for e in (json.loads(line) for line in proc.log_text().splitlines() if f'"{name}"' in line)
            if e.get("event") == name]


@pytest.mark.parametrize("name", list(PROMPTS))
def test_push_equals_plain_vllm(push_cluster, name):
    c, prompt = push_cluster, PROMPTS[name]
    received_before = len(events(c["decode"], "KV received"))
    assert completion_ids(c["proxy"].url, c["model"], prompt, MAX_TOKENS) == \
        completion_ids(c["oracle"].url, c["model"], prompt, MAX_TOKENS)
    # the tokens came from pushed KV, not from a local recompute after a failed push
    assert len(events(c["decode"], "KV received")) == received_before + 1
    assert not events(c["decode"], "pushed KV incomplete")


def test_32_concurrent_requests(push_cluster):
    c = push_cluster
    prompts = [f"Request {i}: tell me a story about the number {i * 7} and the colour of the sky. " * (1 + i % 5)
               for i in range(32)]
    expected = [completion_ids(c["oracle"].url, c["model"], p, MAX_TOKENS) for p in prompts]

    async def one(client, prompt):
        r = await client.post(c["proxy"].url + "/v1/completions", json={
            "model": c["model"], "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    async def all_at_once():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    received_before = len(events(c["decode"], "KV received"))
    assert asyncio.run(all_at_once()) == expected
    assert len(events(c["decode"], "KV received")) == received_before + 32
    assert not events(c["decode"], "pushed KV never completed; failing the load")


def test_several_prompts_in_one_completion(push_cluster):
    c = push_cluster
    prompts = ["First of a batch. " * 5, "Second of a batch, a bit longer. " * 9]
    r = httpx.post(c["proxy"].url + "/v1/completions", timeout=300, json={
        "model": c["model"], "prompt": prompts, "max_tokens": MAX_TOKENS, "temperature": 0,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    got = [ch["token_ids"] for ch in sorted(r.json()["choices"], key=lambda ch: ch["index"])]
    assert got == [completion_ids(c["oracle"].url, c["model"], p, MAX_TOKENS) for p in prompts]
    assert not events(c["decode"], "pushed KV incomplete")


def test_blocks_return_to_idle_and_nothing_failed(push_cluster):
    c = push_cluster
    wait_for(lambda: kv_usage(c["prefill"]) == 0.0 and kv_usage(c["decode"]) == 0.0, 30,
             "KV blocks still allocated after the requests finished")
    assert not events(c["prefill"], "KV push failed; decode will recompute or fail the request by policy")
    assert not events(c["decode"], "pushed KV incomplete")
