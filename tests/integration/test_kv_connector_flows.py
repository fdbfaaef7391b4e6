"""The proxy's flow for each KV connector, with stub engines that speak it (tests/stub_backend.py
--kv-connector): which hop goes first, the kv_transfer_params each hop gets (the engines' own
field names, tests/kv_wire.py), what the proxy does for P's blocks when D fails, and that P and
D of different connectors are never paired. The engines' connectors themselves run in
test_kv_nixl.py (NIXL, real vLLM); the others need hardware these hosts lack.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.procs import control, start_all, stub
from tests.procs import wait_for as wait_until

pytestmark = pytest.mark.integration
TOKEN = "flow-token"
CHAT = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
COMPLETION = {"model": "stub-model", "prompt": "hello", "max_tokens": 4}


def stats(proc) -> dict:
    return httpx.get(proc.url + "/stub/stats", timeout=5).json()


def healthy(proxy) -> None:
    wait_until(lambda: httpx.get(proxy.url + "/health").status_code == 200, 30, "proxy never healthy")


def cluster(tmp_path, connector: str, *d_extra: str, children: str = "", push: bool = False, ready: bool = True):
    """Stub P and D of `connector` behind a proxy (and a metaserver for push flows); `ready`: wait
    until the proxy's /health is 200."""
    kv = ["--kv-connector", connector, *(["--kv-connectors", children] if children else [])]
    p = stub("prefill", tmp_path, *kv)
    d = stub("decode", tmp_path, "--require-kv", *kv, *d_extra)
    procs = [p, d]
    meta_args: list[str] = []
    if push:
        meta = control("metaserver", tmp_path, "--cluster-token", TOKEN)
        procs.append(meta)
        meta_args = ["--metaserver-url", meta.url]
    start_all(*procs)
    proxy = control("proxy", tmp_path, "--cluster-token", TOKEN, *meta_args, "--max-retries", "0",
                    "--prefill", f"127.0.0.1:{p.port}", "--decode", f"127.0.0.1:{d.port}")
    procs.append(proxy)
    start_all(proxy)
    if ready:
        healthy(proxy)
    return proxy, p, d, procs


def send_mixed(proxy) -> None:
    """A completion, a chat and a stream of each: every one served."""
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        for stream in (False, True):
            r = httpx.post(proxy.url + path, json=dict(body, stream=stream), timeout=30)
            assert r.status_code == 200, r.text
            assert ("[DONE]" in r.text) if stream else r.json()["choices"][0]["finish_reason"] == "length"


# connector, its children (multi), flow
FLOWS = [
    ("pull", "", "pull"),
    ("nixl", "", "pull"),
    ("ascend-mooncake", "", "pull"),
    ("mooncake", "", "named"),
    ("ascend-store", "", "store"),
    ("lmcache", "", "store"),
    ("multi", "nixl,lmcache", "pull"),
    ("multi", "ascend-mooncake,ascend-store", "pull"),
    ("multi", "lmcache,ascend-store", "store"),
]


@pytest.mark.parametrize("connector,children,flow", FLOWS, ids=[f"{c}-{k}" if k else c for c, k, _ in FLOWS])
def test_prefill_first_flows_give_each_hop_its_params(tmp_path, connector, children, flow):
    proxy, p, d, procs = cluster(tmp_path, connector, children=children)
    try:
        send_mixed(proxy)
        ps, ds = stats(p), stats(d)
        assert ps["prefills"] == 4 and ds["decodes"] == 4
        assert ps["protocol_errors"] == ds["protocol_errors"] == 0  # each stub checked what it got
        assert ps["last_request_at"] < ds["last_request_at"], "P must be asked first"
        p_params, d_params = ps["last_kv_transfer_params"], ds["last_kv_transfer_params"]
        if flow == "store":
            assert p_params is None and d_params is None
        elif flow == "named":
            tid = p_params["transfer_id"]
            assert tid.startswith("xfer-") and d_params["transfer_id"] == tid
            assert d_params["remote_bootstrap_addr"] == f"http://127.0.0.1:{p_kv_port(p)}"
        else:
            assert p_params["do_remote_decode"] is True and d_params["do_remote_prefill"] is True
            assert d_params["remote_port"] == p_kv_port(p)  # P's answer, handed to D verbatim
    finally:
        for proc in procs:
            proc.stop()


def p_kv_port(p) -> int:
    return httpx.get(p.url + "/kv_info", timeout=5).json()["port"]


@pytest.mark.parametrize("connector", ["push", "ascend-layerwise"])
def test_push_flows_ask_decode_first_and_the_metaserver_dispatches_prefill(tmp_path, connector):
    proxy, p, d, procs = cluster(tmp_path, connector, push=True)
    try:
        send_mixed(proxy)
        ps, ds = stats(p), stats(d)
        assert ds["push_callbacks"] == 4 and ps["prefills"] == 4
        assert ps["protocol_errors"] == ds["protocol_errors"] == 0
        assert set(ds["last_kv_transfer_params"]) == {"do_remote_decode", "do_remote_prefill", "metaserver"}
        assert ps["last_kv_transfer_params"]["do_remote_decode"] is True  # D's body, relayed by the metaserver
    finally:
        for proc in procs:
            proc.stop()


def test_a_push_connector_without_a_metaserver_is_a_clear_503(tmp_path):
    proxy, p, d, procs = cluster(tmp_path, "ascend-layerwise", ready=False)
    try:
        # not ready, and /health says why (it said 200 before, while every request got this 503)
        wait_until(lambda: "no metaserver known" in str(httpx.get(proxy.url + "/health").json().get("missing")),
                   30, "the proxy's /health never named the missing metaserver")
        assert httpx.get(proxy.url + "/health").status_code == 503
        r = httpx.post(proxy.url + "/v1/completions", json=COMPLETION, timeout=30)
        assert r.status_code == 503 and "--metaserver-url" in r.json()["error"]["message"]
        assert stats(p)["requests"] == stats(d)["requests"] == 0
    finally:
        for proc in procs:
            proc.stop()


@pytest.mark.parametrize("connector,frees", [("pull", True), ("nixl", False), ("ascend-mooncake", False),
                                             ("mooncake", False)])
def test_a_failed_decode_frees_prefill_through_our_side_channel_only(tmp_path, connector, frees):
    """D answers 500: the client gets an error; ours tells P at once (a FREE on P's side
    channel), the engines' connectors free by lease or TTL and their side channels are never
    spoken to by the proxy."""
    proxy, p, d, procs = cluster(tmp_path, connector, "--fail-status", "500")
    try:
        for stream in (False, True):
            r = httpx.post(proxy.url + "/v1/completions", json=dict(COMPLETION, stream=stream), timeout=30)
            assert r.status_code >= 500
        assert stats(p)["prefills"] == 2
        if frees:
            wait_until(lambda: stats(p)["side_channel_connections"] >= 2, 10, "the proxy did not free P's hold")
        else:
            assert stats(p)["side_channel_connections"] == 0
    finally:
        for proc in procs:
            proc.stop()


def test_prefill_and_decode_of_different_connectors_are_refused_with_a_log_line(tmp_path):
    p = stub("prefill", tmp_path, "--kv-connector", "pull")
    d = stub("decode", tmp_path, "--require-kv", "--kv-connector", "nixl")
    start_all(p, d)
    proxy = control("proxy", tmp_path, "--cluster-token", TOKEN, "--prefill", f"127.0.0.1:{p.port}",
                    "--decode", f"127.0.0.1:{d.port}")
    try:
        start_all(proxy)
        healthy(proxy)
        for _ in range(3):
            r = httpx.post(proxy.url + "/v1/completions", json=COMPLETION, timeout=30)
            assert r.status_code == 503, r.text
            message = r.json()["error"]["message"]
            assert "prefill runs pull" in message and "decode runs nixl" in message
        assert stats(p)["requests"] == stats(d)["requests"] == 0
        lines = [json.loads(line) for line in proxy.log_text().splitlines() if "KV connectors of prefill" in line]
        assert len(lines) == 1, "one log line per mismatch, not one per request"
        assert lines[0]["prefill"] == ["pull"] and lines[0]["decode"] == ["nixl"]
    finally:
        for proc in (proxy, p, d):
            proc.stop()


def test_mixed_pools_pair_only_equal_connectors(tmp_path):
    """P of two connectors, D of one: every request goes through the P that matches D."""
    p_pull = stub("prefill", tmp_path, "--kv-connector", "pull")
    p_nixl = stub("prefill", tmp_path, "--kv-connector", "nixl")
    d = stub("decode", tmp_path, "--require-kv", "--kv-connector", "nixl")
    start_all(p_pull, p_nixl, d)
    proxy = control("proxy", tmp_path, "--cluster-token", TOKEN, "--decode", f"127.0.0.1:{d.port}",
                    "--prefill", f"127.0.0.1:{p_pull.port}", f"127.0.0.1:{p_nixl.port}")
    try:
        start_all(proxy)
        healthy(proxy)
        for _ in range(6):
            r = httpx.post(proxy.url + "/v1/completions", json=COMPLETION, timeout=30)
            assert r.status_code == 200, r.text
        assert stats(p_pull)["requests"] == 0 and stats(p_nixl)["prefills"] == 6
        assert stats(d)["protocol_errors"] == 0
    finally:
        for proc in (proxy, p_pull, p_nixl, d):
            proc.stop()


def test_the_registry_carries_the_connector(tmp_path):
    """An instance known from the registry alone (the proxy reads no /kv_info of a stub that
    says nothing) pairs by what it registered."""
    meta = control("metaserver", tmp_path, "--cluster-token", TOKEN)
    start_all(meta)
    reg = {"instance_id": "p-reg", "role": "prefill", "url": "http://127.0.0.1:9", "model": "m",
           "kv": {"connector": "nixl", "flow": "pull", "free": "lease", "engine_id": "e", "host": "127.0.0.1",
                  "port": 5600}}
    try:
        r = httpx.post(meta.url + "/v1/registry/register", json=reg, headers={"authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200, r.text
        view = httpx.get(meta.url + "/v1/registry/instances", headers={"authorization": f"Bearer {TOKEN}"}).json()
        assert view["instances"][0]["kv"]["connector"] == "nixl" and view["instances"][0]["kv"]["port"] == 5600
        bad = dict(reg, kv=dict(reg["kv"], flow="teleport"))
        r = httpx.post(meta.url + "/v1/registry/register", json=bad, headers={"authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 400 and "flow" in r.text
    finally:
        meta.stop()
