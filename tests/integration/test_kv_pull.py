"""ascendserve's pull KV connector over TCP, between real prefill and decode roles.

Checks the oracle (greedy ids equal plain vLLM's, from a 1-token prompt to
thousands of tokens, and 32 requests at once), that every block goes back
to the pool (vLLM's kv_cache_usage_perc back to 0), P holding blocks until
D frees them, and the side channel's refusals. Users' traffic too (tests/traffic.py):
the same prompt again (prefix-cache hits on P and D), shared prefixes, chat and
streams, each pulled, not recomputed, and a repeat as fast as its first run; and
one cluster started with no tuning flag at all (vLLM compiles, KV sized by the host).
"""

from __future__ import annotations

import importlib.util
import json
import socket

import httpx
import pytest

from tests.procs import ascendserve, completion_ids, concurrent_ids, control, kv_usage, start_all, wait_for
from tests.traffic import (BF16_TIE_NATS, LENGTHS, assert_greedy, check_mixed, check_repeats,
                           check_shared_prefixes, check_user_traffic, completion_body, text)

pytestmark = pytest.mark.integration
TOKEN = "kv-test-token"
MAX_TOKENS = 16


def ids(url: str, model: str, prompt: str, max_tokens: int = MAX_TOKENS, **extra) -> list[int]:
    return completion_ids(url, model, prompt, max_tokens, **extra)


TRANSPORTS = ["tcp", "shm", pytest.param("mooncake", marks=pytest.mark.skipif(
    importlib.util.find_spec("mooncake") is None, reason="mooncake-transfer-engine not installed"))]
COMMON = ("--kv-connector", "pull", "--cluster-token", TOKEN, "--log-format", "json")


@pytest.fixture(scope="module")
def prefill(text_model, tmp_path_factory):
    """One P for every transport: configured for mooncake, it offers tcp and shm too."""
    transport = "mooncake" if importlib.util.find_spec("mooncake") else "tcp"
    p = ascendserve("prefill", text_model, tmp_path_factory.mktemp("kv-pull-p"), *COMMON, "--kv-ttl", "120",
                    "--kv-transport", transport,
                    "--vllm-arg=--max-num-batched-tokens=1024")  # long prompts prefill in several chunks
    start_all(p)
    yield p
    p.stop()


@pytest.fixture(scope="module", params=TRANSPORTS)
def pull_cluster(request, prefill, text_model, text_oracle, tmp_path_factory):
    logs = tmp_path_factory.mktemp(f"kv-pull-{request.param}")
    decode = ascendserve("decode", text_model, logs, *COMMON, "--kv-transport", request.param)
    procs = [decode]
    try:
        start_all(decode)
        proxy = control("proxy", logs, "--prefill", f"127.0.0.1:{prefill.port}", "--decode", f"127.0.0.1:{decode.port}",
                        "--cluster-token", TOKEN)
        procs.append(proxy)
        start_all(proxy)
        wait_for(lambda: httpx.get(proxy.url + "/health").status_code == 200, 60, "proxy never healthy")
        yield {"oracle": text_oracle, "prefill": prefill, "decode": decode, "proxy": proxy, "model": str(text_model),
               "transport": request.param}
    finally:
        for p in procs:
            p.stop()


def pulls(c) -> int:
    """Transfers D logged, each with the transport the test selected."""
    lines = (json.loads(line) for line in c["decode"].log_text().splitlines() if '"KV pulled"' in line)
    return sum(1 for e in lines if e.get("event") == "KV pulled" and e.get("transport") == c["transport"])


def events(proc, name: str) -> list[dict]:
    return [e for e in (json.loads(line) for line in proc.log_text().splitlines() if f'"{name}"' in line)
            if e.get("event") == name]


def metric(proc, name: str) -> float:
    text = httpx.get(proc.url + "/metrics", timeout=10).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")]
    assert values, f"{name} not exported"
    return sum(values)


@pytest.mark.parametrize("prompt", list(LENGTHS.values()), ids=list(LENGTHS))
def test_pull_equals_plain_vllm(pull_cluster, prompt):
    c = pull_cluster
    before = pulls(c)
    expected = ids(c["oracle"].url, c["model"], prompt)
    assert ids(c["proxy"].url, c["model"], prompt) == expected
    assert pulls(c) == before + 1, "decode did not pull the KV from prefill"


def test_32_concurrent_requests(pull_cluster):
    c = pull_cluster
    prompts = [f"Request {i}: tell me a story about the number {i * 7} and the colour of the sky. " * (1 + i % 5)
               for i in range(32)]
    expected = [ids(c["oracle"].url, c["model"], p) for p in prompts]
    before = pulls(c)
    assert concurrent_ids(c["proxy"].url, c["model"], prompts, MAX_TOKENS) == expected
    assert pulls(c) == before + 32


def test_repeats_and_shared_prefixes_are_pulled_not_recomputed(pull_cluster):
    """Prefix-cache hits on P and on D: D still pulls what it lacks, and a prompt sent
    again finishes within twice its first run (a stalled pull waits for the KV TTL)."""
    c = pull_cluster
    before = pulls(c)
    sent = check_repeats(c["proxy"].url, c["oracle"].url, c["model"], text(5, 300))
    sent += check_shared_prefixes(c["proxy"].url, c["oracle"].url, c["model"], seed=5)
    assert pulls(c) == before + sent, "a repeated or shared-prefix prompt was not pulled"
    assert not events(c["decode"], "KV pull failed")


def test_chat_completions_and_streams(pull_cluster):
    c = pull_cluster
    before = pulls(c)
    sent = check_mixed(c["proxy"].url, c["oracle"].url, c["model"], seed=6)
    assert pulls(c) == before + sent


def test_blocks_return_to_idle_and_metrics_count_the_bytes(pull_cluster):
    c = pull_cluster
    ids(c["proxy"].url, c["model"], "Warm the cache once more. " * 20)
    wait_for(lambda: kv_usage(c["prefill"]) == 0.0 and kv_usage(c["decode"]) == 0.0, 30,
             "KV blocks still allocated after the requests finished")
    wait_for(lambda: metric(c["decode"], "ascendserve:kv_transfer_bytes_total") > 0, 30,
             "decode exported no transferred bytes")
    assert metric(c["decode"], "ascendserve:kv_transfer_seconds_count") >= 1
    wait_for(lambda: metric(c["prefill"], "ascendserve:kv_blocks_held_remote") == 0, 30,
             "prefill reports blocks still held")


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
    from ascendserve.connectors.transport.channel import free_remote

    assert free_remote(TOKEN, "127.0.0.1", params["remote_port"], params["remote_request_id"]) == 1
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
    with socket.create_connection((host, port), timeout=10) as s:  # an oversized READ
        frames.send_frame(s, {"type": "HELLO", "token": TOKEN})
        assert frames.read_frame(s, 0)["type"] == "OK"
        s.sendall(frames.encode({"type": "READ", "request_id": "x", "blocks": [0]}, payload_len=1 << 40))
        assert "exceeds" in frames.read_frame(s, 0)["reason"]
    log = c["prefill"].log_text()
    assert log.count("KV side channel rejected a connection") >= 6 and TOKEN not in log
    # and it keeps serving
    prompt = "Still serving after the garbage. " * 10
    assert ids(c["proxy"].url, c["model"], prompt) == ids(c["oracle"].url, c["model"], prompt)


@pytest.fixture  # one test: stopped right after it, not kept beside the other clusters
def untuned_pull_cluster(text_model, untuned_text_oracle, tmp_path_factory):
    """P and D as a user starts them: no dtype, no eager, no memory setting (see tests/procs.py)."""
    logs = tmp_path_factory.mktemp("kv-pull-untuned")
    # the flags that make this topology (the pull connector, the token it requires) and json
    # logs for the test to count the pulls; none tunes the engine
    topology = ("--kv-connector", "pull", "--cluster-token", TOKEN, "--log-format", "json")
    prefill = ascendserve("prefill", text_model, logs, *topology, name="prefill-untuned", tuned=False)
    decode = ascendserve("decode", text_model, logs, *topology, name="decode-untuned", tuned=False)
    procs = [prefill, decode]
    try:
        start_all(prefill, decode)
        proxy = control("proxy", logs, "--prefill", f"127.0.0.1:{prefill.port}", "--decode", f"127.0.0.1:{decode.port}",
                        "--cluster-token", TOKEN)
        procs.append(proxy)
        start_all(proxy)
        wait_for(lambda: httpx.get(proxy.url + "/health").status_code == 200, 60, "proxy never healthy")
        yield {"oracle": untuned_text_oracle, "prefill": prefill, "decode": decode, "proxy": proxy,
               "model": str(text_model), "transport": "tcp"}
    finally:
        for p in procs:
            p.stop()


def test_untuned_pull_serves_user_traffic(untuned_pull_cluster):
    c = untuned_pull_cluster
    argv = next(json.loads(line)["vllm_args"] for line in c["prefill"].log_text().splitlines()
                if '"starting vLLM"' in line)
    assert "--enforce-eager" not in argv and "--kv-cache-memory-bytes" in argv  # compiled, KV sized by the host
    before = pulls(c)
    sent = check_user_traffic(c["proxy"].url, c["oracle"].url, c["model"], seed=9, tie_nats=BF16_TIE_NATS)
    assert pulls(c) == before + sent, "a request of the untuned cluster was recomputed on D"
    for name in ("1-token", "thousands"):
        prompt = {"1-token": "a", "thousands": "".join(f"Line {i}: the quick brown fox. " for i in range(100))}[name]
        assert_greedy(ids(c["proxy"].url, c["model"], prompt), ids(c["oracle"].url, c["model"], prompt), c["oracle"].url,
                      completion_body(c["model"], prompt, MAX_TOKENS), name, BF16_TIE_NATS)
    wait_for(lambda: kv_usage(c["prefill"]) == 0.0 and kv_usage(c["decode"]) == 0.0, 30,
             "KV blocks still allocated after the requests finished")
