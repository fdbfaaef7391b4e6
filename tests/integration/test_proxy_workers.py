"""Two proxy workers (`--workers 2`, router/workers.py) in front of one prefill and two decode stubs:
one view of the instances across workers, leases released exactly once under 100 client
disconnects, counters summed over workers, and a worker that dies restarted with its load dropped.
The rest of the proxy's tests run with the default, the cores given to it (2 on the CI host)."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import httpx
import psutil
import pytest

from tests.integration.test_proxy_stubs import one_p_two_d, stats, wait_for
from tests.procs import control, start_all, stub

pytestmark = pytest.mark.integration
API_KEY, TOKEN = "client-key-w", "cluster-secret-w"
AUTH = {"authorization": f"Bearer {API_KEY}"}
ADMIN = {"authorization": f"Bearer {TOKEN}"}
STREAMS = 100


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    procs = one_p_two_d(tmp_path_factory.mktemp("proxy-workers-logs"),
                        "health_interval_s = 0.5\neject_after = 2\nworkers = 2\n",
                        ("--tokens", "2000", "--token-delay-ms", "20"), API_KEY, TOKEN)
    yield procs
    for proc in procs:
        proc.stop()


def workers_of(proxy) -> list[psutil.Process]:
    return psutil.Process(proxy.pid).children()


def views(proxy, times: int = 8) -> list[dict]:
    """/instances `times` over fresh connections: the kernel spreads them over both workers."""
    out = []
    for _ in range(times):
        with httpx.Client() as client:
            out.append({i["url"]: i for i in client.get(proxy.url + "/instances", headers=ADMIN).json()["instances"]})
    return out


def decode_in_flight(proxy, d) -> set[int]:
    return {view[d.url]["active_requests"] for view in views(proxy)}


def test_two_workers_serve_and_share_one_view_through_a_hundred_disconnects(cluster):
    proxy, p, d1, d2 = cluster
    assert len(workers_of(proxy)) == 2
    aborted = stats(d1)["aborted"] + stats(d2)["aborted"]
    opened = asyncio.Event()
    first = 0
    held: dict = {}

    async def one(client: httpx.AsyncClient, release: asyncio.Event):
        nonlocal first
        async with client.stream("POST", proxy.url + "/v1/completions", headers=AUTH,
                                 json={"model": "stub-model", "prompt": "x", "max_tokens": 400, "stream": True}) as r:
            assert r.status_code == 200
            chunks = r.aiter_bytes()  # held: a dropped iterator closes the stream when collected
            assert b"data: " in await chunks.__anext__()
            first += 1
            if first == STREAMS:
                opened.set()
            await release.wait()  # then hang up mid-stream

    async def main():
        release = asyncio.Event()
        # one connection per stream: both workers take some
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=STREAMS,
                                                                     max_keepalive_connections=0)) as client:
            tasks = [asyncio.ensure_future(one(client, release)) for _ in range(STREAMS)]
            await asyncio.wait_for(opened.wait(), 30)
            held["stubs"] = (stats(d1)["active"], stats(d2)["active"])
            held["views"] = await asyncio.to_thread(views, proxy)
            release.set()
            await asyncio.gather(*tasks)

    asyncio.run(main())
    a1, a2 = held["stubs"]
    assert a1 + a2 == STREAMS and a1 > 0 and a2 > 0, held["stubs"]  # both instances used
    # every worker sees every worker's streams: the totals match what the stubs hold
    for view in held["views"]:
        assert (view[d1.url]["active_requests"], view[d2.url]["active_requests"]) == (a1, a2)
    # balanced by load
    assert abs(a1 - a2) <= STREAMS // 5, held["stubs"]

    wait_for(lambda: stats(d1)["aborted"] + stats(d2)["aborted"] - aborted == STREAMS)
    wait_for(lambda: decode_in_flight(proxy, d1) | decode_in_flight(proxy, d2) == {0})
    assert stats(d1)["active"] == stats(d2)["active"] == 0
    for view in views(proxy):  # released exactly once: never below zero, in any worker
        assert all(i["active_requests"] == 0 and i["active_tokens"] == 0 for i in view.values())
    # the workers' counters are summed at each scrape, whichever worker answers
    for _ in range(4):
        with httpx.Client() as client:
            text = client.get(proxy.url + "/metrics").text
        line = next(x for x in text.splitlines() if x.startswith("ascendserve_proxy_client_disconnects_total"))
        assert float(line.split()[-1]) >= STREAMS
    served_by = {json.loads(line).get("worker") for line in proxy.log_text().splitlines()
                 if line.startswith("{") and '"event": "request"' in line}
    assert served_by == {0, 1}


def test_removing_an_instance_through_any_worker_reaches_all(cluster):
    proxy, p, d1, d2 = cluster
    body = {"type": "decode", "instances": [f"127.0.0.1:{d2.port}"]}
    with httpx.Client() as client:
        assert client.post(proxy.url + "/instances/remove", json=body, headers=ADMIN).status_code == 200
    wait_for(lambda: all(d2.url not in view for view in views(proxy)))
    before = stats(d2)["requests"]
    for _ in range(6):
        with httpx.Client() as client:
            r = client.post(proxy.url + "/v1/completions", headers=AUTH,
                            json={"model": "stub-model", "prompt": "y", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text
    assert stats(d2)["requests"] == before
    with httpx.Client() as client:
        assert client.post(proxy.url + "/instances/add", json=body, headers=ADMIN).status_code == 200
    wait_for(lambda: all(view.get(d2.url, {}).get("state") == "active" for view in views(proxy)))


def test_a_worker_that_dies_is_restarted_and_the_proxy_keeps_serving(cluster):
    proxy, p, d1, d2 = cluster
    before = {w.pid for w in workers_of(proxy)}
    victim = max(before)
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: len(workers_of(proxy)) == 2 and victim not in {w.pid for w in workers_of(proxy)})
    for _ in range(6):
        with httpx.Client() as client:
            r = client.post(proxy.url + "/v1/completions", headers=AUTH,
                            json={"model": "stub-model", "prompt": "z", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text
    wait_for(lambda: decode_in_flight(proxy, d1) == {0})
    assert "proxy worker died; restarting it" in proxy.log_text()


def test_sigterm_ends_every_worker(tmp_path):
    p = stub("pd", tmp_path)
    start_all(p)
    proxy = control("proxy", tmp_path, "--workers", "3", "--pd", f"127.0.0.1:{p.port}")
    try:
        start_all(proxy)
        kids = workers_of(proxy)
        assert len(kids) == 3
        proxy.popen.send_signal(signal.SIGTERM)
        assert proxy.popen.wait(20) == 0
        gone, alive = psutil.wait_procs(kids, timeout=10)
        assert not alive
    finally:
        proxy.stop()
        p.stop()
