"""ascendserve's pull KV connector over TCP, between real prefill and decode roles.

Checks the oracle (greedy ids equal plain vLLM's, from a 1-token prompt to
thousands of tokens, and 32 requests at once), that every block goes back
to the pool (vLLM's kv_cache_usage_perc back to 0), P holding blocks until
D frees them, and the side channel's refusals.
"""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest

from tests.procs import ascendserve, completion_ids, control, kv_usage, start_all, wait_for

pytestmark = pytest.mark.integration
TOKEN = "kv-test-token"
MAX_TOKENS = 16


def ids(url: str, model: str, prompt: str, max_tokens: int = MAX_TOKENS, **extra) -> list[int]:
    return completion_ids(url, model, prompt, max_tokens, **extra)


@pytest.fixture(scope="module")
def pull_cluster(text_model, text_oracle, tmp_path_factory):
    logs = tmp_path_factory.mktemp("kv-pull-logs")
    common = ("--kv-connector", "pull", "--cluster-token", TOKEN, "--log-format", "json")
    prefill = ascendserve("prefill", text_model, logs, *common, "--kv-ttl", "120", "--log-level", "debug")
    decode = ascendserve("decode", text_model, logs, *common, "--log-level", "debug")
    procs = [prefill, decode]
    try:
        start_all(*procs)
        proxy = control("proxy", logs, "--prefill", f"127.0.0.1:{prefill.port}", "--decode", f"127.0.0.1:{decode.port}")
        procs.append(proxy)
        start_all(proxy)
        wait_for(lambda: httpx.get(proxy.url + "/health").status_code == 200, 60, "proxy never healthy")
        yield {"oracle": text_oracle, "prefill": prefill, "decode": decode, "proxy": proxy, "model": str(text_model)}
    finally:
        for p in procs:
            p.stop()


def pulls(decode) -> int:
    return decode.log_text().count('"event": "KV pulled"')


@pytest.mark.parametrize("prompt", [
    "a",
    "Short prompt about the sea.",
    "The lighthouse keeper climbed the stairs every night. " * 12,
    "".join(f"Line {i}: the quick brown fox jumps over the lazy dog. " for i in range(60)),  # ~3.3k tokens
], ids=["1-token", "short", "multi-block", "thousands"])
def test_pull_equals_plain_vllm(pull_cluster, prompt):
    c = pull_cluster
    before = pulls(c["decode"])
    expected = ids(c["oracle"].url, c["model"], prompt)
    assert ids(c["proxy"].url, c["model"], prompt) == expected
    assert pulls(c["decode"]) == before + 1, "decode did not pull the KV from prefill"


def test_32_concurrent_requests(pull_cluster):
    c = pull_cluster
    prompts = [f"Request {i}: tell me a story about the number {i * 7} and the colour of the sky. " * (1 + i % 5)
               for i in range(32)]
    expected = [ids(c["oracle"].url, c["model"], p) for p in prompts]
    before = pulls(c["decode"])

    async def one(client, prompt):
        r = await client.post(c["proxy"].url + "/v1/completions", json={
            "model": c["model"], "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    async def all_at_once():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    got = asyncio.run(all_at_once())
    assert got == expected
    assert pulls(c["decode"]) == before + 32


def test_blocks_return_to_idle(pull_cluster):
    c = pull_cluster
    ids(c["proxy"].url, c["model"], "Warm the cache once more. " * 20)
    wait_for(lambda: kv_usage(c["prefill"]) == 0.0 and kv_usage(c["decode"]) == 0.0, 30,
             "KV blocks still allocated after the requests finished")


def test_prefill_holds_kv_until_decode_frees_it(pull_cluster):
    """P keeps the blocks of a finished prefill (delayed free) until D pulls and frees
    them; the deadline path is covered by tests/unit/test_kv_pull_worker.py."""
    c = pull_cluster
    r = httpx.post(c["prefill"].url + "/v1/completions", timeout=120, json={
        "model": c["model"], "prompt": "Nobody will come for this KV. " * 30, "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}})
    params = r.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_block_ids"] and params["remote_port"]
    assert kv_usage(c["prefill"]) > 0.0
    from ascendserve.connectors.transport.tcp import TcpClient

    TcpClient(TOKEN, None).free("127.0.0.1", params["remote_port"], params["remote_request_id"])
    wait_for(lambda: kv_usage(c["prefill"]) == 0.0, 60, "prefill kept the KV after it was freed")


def test_side_channel_refuses_garbage_and_bad_tokens(pull_cluster):
    from ascendserve.protocol import frames

    c = pull_cluster
    host, port = "127.0.0.1", c["prefill"].port + 1000
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = frames.read_frame(s, 0)
        assert answer["type"] == "ERR" and "bad frame" in answer["reason"]
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(frames.PREFIX.pack(frames.MAGIC, 2**31))  # a header size meant to exhaust memory
        assert frames.read_frame(s, 0)["type"] == "ERR"
    for token in ("wrong", ""):
        with socket.create_connection((host, port), timeout=10) as s:
            frames.send_frame(s, {"type": "HELLO", "token": token, "layout": {}})
            answer = frames.read_frame(s, 0)
            assert answer["type"] == "ERR" and answer["reason"] == "invalid cluster token"
    with socket.create_connection((host, port), timeout=10) as s:
        frames.send_frame(s, {"type": "READ", "request_id": "x", "blocks": [0]})  # no HELLO first
        assert frames.read_frame(s, 0)["type"] == "ERR"
    log = c["prefill"].log_text()
    assert log.count("KV side channel rejected a connection") >= 5 and TOKEN not in log
    # and it keeps serving
    prompt = "Still serving after the garbage. " * 10
    assert ids(c["proxy"].url, c["model"], prompt) == ids(c["oracle"].url, c["model"], prompt)
