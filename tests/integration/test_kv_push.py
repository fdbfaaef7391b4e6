"""ascendserve's layerwise push KV connector between real prefill and decode roles.

The proxy (mode push) sends the request to D first; D reserves blocks and asks
the metaserver, which dispatches P once; P pushes every layer's pages as the
layer is computed. Greedy ids must equal plain vLLM's, from a 1-token prompt
to thousands of tokens (chunked prefill: several pushes per request), with
32 requests at once and with several prompts in one completion; every block
goes back to the pool afterwards. Last, on the tcp cluster, P is SIGKILLed once
dispatched: D learns it from the metaserver and recomputes long before its deadline.
"""

from __future__ import annotations

import importlib.util
import json
import signal
import threading
import time

import httpx
import pytest

from tests.procs import (completion_ids, concurrent_ids, control, crash, kv_usage, pd_cluster, signal_group, start_all,
                         wait_for)
from tests.traffic import LENGTHS, check_mixed, check_repeats, check_shared_prefixes, text

pytestmark = pytest.mark.integration
TOKEN = "kv-push-token"
MAX_TOKENS = 16
PROMPTS = LENGTHS


TRANSPORTS = ["tcp", "shm", pytest.param("mooncake", marks=pytest.mark.skipif(
    importlib.util.find_spec("mooncake") is None, reason="mooncake-transfer-engine not installed"))]


@pytest.fixture(scope="module", params=TRANSPORTS)
def push_cluster(request, text_model, text_oracle, tmp_path_factory):
    logs = tmp_path_factory.mktemp(f"kv-push-{request.param}")
    meta = control("metaserver", logs, "--cluster-token", TOKEN)
    start_all(meta)
    common = ("--kv-connector", "push", "--kv-transport", request.param, "--cluster-token", TOKEN,
              "--log-format", "json",
              # a small chunk so long prompts take several steps, each pushed layer by layer
              "--vllm-arg=--max-num-batched-tokens=1024")
    try:
        with pd_cluster(text_model, logs, common, common, ("--mode", "push", "--metaserver-url", meta.url,
                                                          "--cluster-token", TOKEN)) as (prefill, decode, proxy):
            yield {"oracle": text_oracle, "prefill": prefill, "decode": decode, "proxy": proxy,
                   "model": str(text_model), "transport": request.param}
    finally:
        meta.stop()


def events(proc, name: str) -> list[dict]:
    return [e for e in (json.loads(line) for line in proc.log_text().splitlines() if f'"{name}"' in line)
            if e.get("event") == name]


def received(c) -> int:
    """Pushes D took in whole over the transport under test."""
    return sum(1 for e in events(c["decode"], "KV received") if e.get("transport") == c["transport"])


@pytest.mark.parametrize("name", list(PROMPTS))
def test_push_equals_plain_vllm(push_cluster, name):
    c, prompt = push_cluster, PROMPTS[name]
    received_before = received(c)
    assert completion_ids(c["proxy"].url, c["model"], prompt, MAX_TOKENS) == \
        completion_ids(c["oracle"].url, c["model"], prompt, MAX_TOKENS)
    # the tokens came from pushed KV, not from a local recompute after a failed push
    assert received(c) == received_before + 1
    assert not events(c["decode"], "pushed KV incomplete")


def test_repeats_and_shared_prefixes_are_pushed_not_recomputed(push_cluster):
    """Prefix-cache hits on P (and D): the blocks P had cached go to D too, so a prompt sent
    again finishes as fast as the first time (a missed push stalled it for the KV TTL)."""
    c = push_cluster
    before = received(c)
    sent = check_repeats(c["proxy"].url, c["oracle"].url, c["model"], text(7, 300))
    sent += check_shared_prefixes(c["proxy"].url, c["oracle"].url, c["model"], seed=7)
    assert received(c) == before + sent
    assert not events(c["decode"], "pushed KV never completed; failing the load")
    assert not events(c["prefill"], "prefill finished before its KV was pushed; decode is told to recompute")


def test_chat_completions_and_streams(push_cluster):
    c = push_cluster
    before = received(c)
    sent = check_mixed(c["proxy"].url, c["oracle"].url, c["model"], seed=8)
    assert received(c) == before + sent
    assert not events(c["decode"], "pushed KV never completed; failing the load")


def test_32_concurrent_requests(push_cluster):
    c = push_cluster
    prompts = [f"Request {i}: tell me a story about the number {i * 7} and the colour of the sky. " * (1 + i % 5)
               for i in range(32)]
    expected = [completion_ids(c["oracle"].url, c["model"], p, MAX_TOKENS) for p in prompts]
    received_before = received(c)
    assert concurrent_ids(c["proxy"].url, c["model"], prompts, MAX_TOKENS) == expected
    assert received(c) == received_before + 32
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


# Last on the tcp cluster: it kills that cluster's P (moved from test_kv_failures, whose P+D pair
# and metaserver were started for this one test).
@pytest.mark.parametrize("push_cluster", ["tcp"], indirect=True)
def test_push_prefill_killed_decode_recomputes_long_before_its_deadline(push_cluster):
    """P dies after the metaserver dispatched it: the metaserver answers D's ask with an
    error, D fails the load at once (not at its deadline, the default 120 s) and recomputes."""
    c = push_cluster
    prompt = "The prefill dies before it pushes a single layer of this prompt. " * 6
    expected = completion_ids(c["oracle"].url, c["model"], prompt, MAX_TOKENS)
    signal_group(c["prefill"], signal.SIGSTOP)
    started = time.monotonic()
    out: dict = {}

    def run():
        out["ids"] = completion_ids(c["proxy"].url, c["model"], prompt, MAX_TOKENS, timeout=120)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    wait_for(lambda: kv_usage(c["decode"]) > 0.0, 60, "decode never reserved blocks for the push")
    time.sleep(1.0)  # D asked the metaserver; the metaserver's dispatch waits on the frozen P
    crash(c["prefill"])
    t.join(90)
    assert not t.is_alive(), "the request hung after its prefill died"
    assert out.get("ids") == expected  # recomputed on D
    assert time.monotonic() - started < 45
    assert "metaserver could not get the prompt prefilled" in c["decode"].log_text()
    wait_for(lambda: kv_usage(c["decode"]) == 0.0, 30, "decode kept blocks after the failed push")
