"""Failure semantics of the pull KV connector, with real prefill and decode roles.

- 50 clients that disconnect mid-request: no hang, every block back to the
  pool on both sides within the hold deadline.
- D SIGKILLed while it holds reserved blocks and waits for P: P frees the
  held blocks at its deadline and keeps serving.
- P SIGKILLed while D is pulling: D reports the failed load to vLLM, which
  recomputes the prompt locally (policy "recompute"); the answer still
  equals plain vLLM's and D's blocks go back to the pool.
(Push mode, P SIGKILLed once dispatched, is the last test on test_kv_push's tcp cluster.)
To pin a transfer "in flight" deterministically, P's process group is
SIGSTOPped after it answered: D's pull connects and waits on the frozen P.
A crash SIGKILLs every process of the instance but multiprocessing's resource
tracker, which then unlinks vLLM's shared memory; the tests check that
nothing of ours or vLLM's is left in /dev/shm.
"""

from __future__ import annotations

import asyncio
import random
import signal
import threading
import time

import httpx
import pytest

from tests.procs import completion_ids, crash, kv_usage, pd_cluster, signal_group, wait_for

pytestmark = pytest.mark.integration
TOKEN = "kv-failure-token"
TTL_S = 10
MAX_TOKENS = 12
LONG = "".join(f"Sentence {i} of a long prompt that keeps the prefill busy for a while. " for i in range(38))


@pytest.fixture(scope="module")
def cluster(text_model, text_oracle, tmp_path_factory):
    common = ("--kv-connector", "pull", "--cluster-token", TOKEN, "--log-format", "json")
    with pd_cluster(text_model, tmp_path_factory.mktemp("kv-failure-logs"), (*common, "--kv-ttl", str(TTL_S)),
                    common, ("--cluster-token", TOKEN)) as (prefill, decode, proxy):
        yield {"oracle": text_oracle, "prefill": prefill, "decode": decode, "proxy": proxy, "model": str(text_model)}


def restart(proc) -> None:
    """Start a killed instance again on the same ports (the proxy's static list names them)."""
    proc.stop(timeout=5)
    proc.start()
    proc.wait_ready()


def prefill_and_hold(c, prompt: str) -> dict:
    """What the proxy does first in pull mode: P computes the prompt and keeps its blocks."""
    r = httpx.post(c["prefill"].url + "/v1/completions", timeout=120, json={
        "model": c["model"], "prompt": prompt, "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}})
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params["remote_block_ids"]
    return params


def decode_in_background(c, prompt: str, params: dict) -> dict:
    out: dict = {}

    def run():
        try:
            out["response"] = httpx.post(c["decode"].url + "/v1/completions", timeout=240, json={
                "model": c["model"], "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "return_token_ids": True, "kv_transfer_params": params})
        except httpx.HTTPError as exc:
            out["error"] = exc

    out["thread"] = threading.Thread(target=run, daemon=True)
    out["thread"].start()
    return out


def test_fifty_client_disconnects_leave_nothing_allocated(cluster):
    c = cluster
    rng = random.Random(7)

    async def one(client, i):
        body = {"model": c["model"], "prompt": f"Client {i}. " + LONG[: rng.randint(200, len(LONG))],
                "max_tokens": 64, "stream": bool(i % 2)}
        try:
            await asyncio.wait_for(client.post(c["proxy"].url + "/v1/completions", json=body),
                                   timeout=rng.uniform(0.02, 1.0))
        except (asyncio.TimeoutError, httpx.HTTPError):
            return "disconnected"
        return "finished"

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(50)))

    outcomes = asyncio.run(run())
    assert outcomes.count("disconnected") >= 35, outcomes  # most really went away mid-request
    prompt = "After the storm of disconnects. " * 8
    assert completion_ids(c["proxy"].url, c["model"], prompt, MAX_TOKENS, timeout=120) == \
        completion_ids(c["oracle"].url, c["model"], prompt, MAX_TOKENS)
    wait_for(lambda: kv_usage(c["prefill"]) == 0.0 and kv_usage(c["decode"]) == 0.0, TTL_S + 30,
             "KV blocks still allocated after 50 client disconnects")


def test_decode_killed_while_waiting_prefill_frees_at_deadline(cluster):
    c = cluster
    prompt = "The decode instance dies while it waits for this KV. " * 10
    params = prefill_and_hold(c, prompt)
    assert kv_usage(c["prefill"]) > 0.0
    signal_group(c["prefill"], signal.SIGSTOP)
    try:
        pending = decode_in_background(c, prompt, params)
        wait_for(lambda: kv_usage(c["decode"]) > 0.0, 60, "decode never reserved blocks for the pull")
        time.sleep(1.0)  # the pull is now connected to the frozen P
        crash(c["decode"])
    finally:
        signal_group(c["prefill"], signal.SIGCONT)
    pending["thread"].join(30)
    assert "response" not in pending or pending["response"].status_code != 200
    killed_at = time.monotonic()
    wait_for(lambda: kv_usage(c["prefill"]) == 0.0, TTL_S + 30, "prefill kept the KV of a dead decode")
    assert time.monotonic() - killed_at < TTL_S + 30
    assert "KV held for decode past its deadline; freeing" in c["prefill"].log_text()
    # P keeps serving
    r = httpx.post(c["prefill"].url + "/v1/completions", timeout=60,
                   json={"model": c["model"], "prompt": "still alive", "max_tokens": 2})
    assert r.status_code == 200
    restart(c["decode"])


def test_prefill_killed_mid_transfer_decode_recomputes(cluster):
    c = cluster
    prompt = "The prefill instance dies while the decode pulls this KV. " * 12
    expected = completion_ids(c["oracle"].url, c["model"], prompt, MAX_TOKENS)
    params = prefill_and_hold(c, prompt)
    signal_group(c["prefill"], signal.SIGSTOP)
    pending = decode_in_background(c, prompt, params)
    wait_for(lambda: kv_usage(c["decode"]) > 0.0, 60, "decode never reserved blocks for the pull")
    time.sleep(1.0)
    crash(c["prefill"])
    pending["thread"].join(120)
    assert not pending["thread"].is_alive(), "decode hung after its prefill peer died"
    response = pending["response"]
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["token_ids"] == expected  # recomputed locally, same tokens
    assert "KV pull failed" in c["decode"].log_text()
    wait_for(lambda: kv_usage(c["decode"]) == 0.0, 30, "decode kept blocks after the failed pull")
    restart(c["prefill"])
    # the pair works again end to end once the proxy's health check has re-admitted P
    wait_for(lambda: served(c["proxy"].url, c["model"]), 60, "the proxy never served through the restarted P")
    assert completion_ids(c["proxy"].url, c["model"], prompt, MAX_TOKENS) == expected


def served(url: str, model: str) -> bool:
    r = httpx.post(url + "/v1/completions", timeout=60, json={"model": model, "prompt": "ping", "max_tokens": 1})
    return r.status_code == 200
