"""Security of the control plane as real processes on 127.0.0.1 (no vLLM).

1. Every route of the proxy, the metaserver and the elastic-server, read from
   the apps' own route tables, refuses a missing or wrong credential: internal
   routes want the cluster token, client routes the API key, the push callback
   its one-request ticket; only the listed probe routes are open. A new route
   without a guard fails here. So do the KV side channel and the NetLoader
   seed ports, spoken to frame by frame.
2. Limits: body (413 on every POST route), request head (431), connections
   (a full server makes the next one wait; silent connections are closed).
3. TLS: proxy and metaserver over HTTPS with a self-signed certificate made
   here; the proxy, an engine heartbeat and the client verify it with the CA file.
4. Last: every log line and every response body of this module, plus
   `ascendserve doctor` and a refused start, hold neither token nor API key.
"""

from __future__ import annotations

import json
import secrets
import socket
import ssl
import time
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest

from ascendserve.config import load
from ascendserve.protocol.frames import read_frame, send_frame
from tests.procs import PYTHON, REPO, Proc, control, free_port, start_all, stub, wait_for
from tests.tlstools import write_self_signed

pytestmark = pytest.mark.integration
TOKEN = "clustertok-" + secrets.token_hex(12)
API_KEY = "apikey-" + secrets.token_hex(12)
WRONG = "wrongtok-" + secrets.token_hex(12)
MAX_BODY_MB = 0.05
BODIES: list[tuple[str, bytes]] = []  # every response this module saw, scraped for secrets at the end
LOG_DIRS: list[Path] = []
PROCS: list[Proc] = []


def _keep(response: httpx.Response) -> None:
    response.read()
    BODIES.append((f"{response.request.method} {response.request.url}", response.content))


def client(**kw) -> httpx.Client:
    return httpx.Client(timeout=kw.pop("timeout", 10), event_hooks={"response": [_keep]}, **kw)


def bearer(value: str) -> dict:
    return {"authorization": f"Bearer {value}"}


def tiny_checkpoint(directory: Path) -> Path:
    import numpy as np
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text('{"architectures": ["Tiny"], "model_type": "tiny"}')
    save_file({"w": np.arange(64, dtype=np.float32)}, str(directory / "model.safetensors"))
    return directory


def elastic_server(model: Path, logs: Path, *extra: str) -> Proc:
    port = free_port()
    argv = [PYTHON, "-m", "ascendserve", "--role", "elastic-server", "--model", str(model), "--port", str(port),
            "--netloader-port", str(free_port()), "--log-format", "json", *extra]
    return Proc(f"elastic-{port}", argv, port, logs / f"elastic-{port}.log", {"ASCENDSERVE_CLUSTER_TOKEN": TOKEN},
                "/health")


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    logs = tmp_path_factory.mktemp("security-logs")
    LOG_DIRS.append(logs)
    limited_conf = logs / "limited.toml"
    limited_conf.write_text("[server]\nmax_connections = 2\nheader_timeout_s = 5.0\nmax_header_kb = 16\n")
    meta = control("metaserver", logs, "--max-body-mb", str(MAX_BODY_MB))
    meta.env = {"ASCENDSERVE_CLUSTER_TOKEN": TOKEN}  # the env twin here, the flag for the proxy
    limited = control("metaserver", logs, "--config", str(limited_conf), "--cluster-token", TOKEN, name="limited")
    seed = elastic_server(tiny_checkpoint(logs / "ckpt"), logs)
    PROCS.extend([meta, limited, seed])
    start_all(meta, limited, seed)
    pd = stub("pd", logs, "--metaserver-url", meta.url, "--cluster-token", TOKEN)
    proxy = control("proxy", logs, "--metaserver-url", meta.url, "--cluster-token", TOKEN, "--api-key", API_KEY,
                    "--max-body-mb", str(MAX_BODY_MB))
    PROCS.extend([pd, proxy])
    start_all(pd, proxy)
    wait_for(lambda: httpx.get(proxy.url + "/health").status_code == 200, 30, "proxy never found the stub")
    yield {"proxy": proxy, "metaserver": meta, "elastic-server": seed, "limited": limited, "pd": pd}
    for p in PROCS:
        p.stop(timeout=10)


# ---- 1. every route refuses a missing or wrong credential -----------------------------------------

PUBLIC = {  # probes and scrapes: open on purpose, nothing of the cluster's
    "proxy": {("GET", "/health"), ("GET", "/healthcheck"), ("GET", "/metrics")},
    "metaserver": {("GET", "/health"), ("GET", "/metrics")},
    "elastic-server": {("GET", "/health")},
}
CLIENT = {"proxy": {("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models")}}
TICKET = {"metaserver": {("POST", "/v1/metaserver")}}  # the push callback: its one-request ticket is the key
# the dashboard: open to loopback clients (these tests'), a cluster-token login elsewhere (tests/unit/
# test_dashboard_access.py; from another address in tests/integration/test_dashboard.py)
_DASHBOARD = {("GET", "/dashboard"), ("GET", "/dashboard/events"), ("GET", "/dashboard/snapshot"),
              ("GET", "/dashboard/login"), ("POST", "/dashboard/login"), ("POST", "/dashboard/logout"),
              ("GET", "/dashboard/static/name")}
DASHBOARD = {"proxy": _DASHBOARD, "metaserver": _DASHBOARD}
BODY_IGNORED = {"/start_profile", "/stop_profile", "/reset_prefix_cache"}  # fan-outs that never read a body


def route_table(role: str) -> set[tuple[str, str]]:
    if role == "proxy":
        from ascendserve.router.app import create_app

        app = create_app(load("proxy", None, {}, env={}))
    elif role == "metaserver":
        from ascendserve.metaserver.app import create_app

        app = create_app(load("metaserver", None, {}, env={}))
    else:
        from ascendserve.netloader.elastic import create_app

        app = create_app(None, "unused")  # handlers are only listed, never run
    return {(method, route.path.replace("{", "").replace("}", "").split(":")[0])
            for route in app.routes for method in route.methods if method not in ("OPTIONS", "HEAD")}


def _refusals(http: httpx.Client, method: str, url: str, wrong: list[dict]) -> None:
    for headers in [{}, *wrong]:
        r = http.request(method, url, headers={"content-type": "application/json", **headers}, content=b"{}")
        assert r.status_code == 401, (method, url, headers, r.status_code, r.text)
        assert r.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("role", ["proxy", "metaserver", "elastic-server"])
def test_every_route_refuses_a_missing_or_wrong_credential(plane, role):
    base = plane[role].url
    routes = route_table(role)
    assert PUBLIC[role] <= routes and CLIENT.get(role, set()) <= routes and TICKET.get(role, set()) <= routes
    assert DASHBOARD.get(role, set()) <= routes
    internal = routes - PUBLIC[role] - CLIENT.get(role, set()) - TICKET.get(role, set()) - DASHBOARD.get(role, set())
    assert internal, "no internal route found: is the route table read right?"
    wrong_token = [bearer(WRONG), {"x-cluster-token": WRONG}, bearer(API_KEY), bearer(TOKEN + "x"), bearer(TOKEN[:-1]),
                   {"authorization": f"Basic {TOKEN}"}]
    with client() as http:
        for method, path in sorted(internal):
            _refusals(http, method, base + path, wrong_token)
            for good in (bearer(TOKEN), {"x-cluster-token": TOKEN}):  # the guard lets the token through
                r = http.request(method, base + path, headers={"content-type": "application/json", **good},
                                 content=b"{}")
                assert r.status_code not in (401, 403), (method, path, r.status_code, r.text)
        for method, path in sorted(CLIENT.get(role, set())):
            _refusals(http, method, base + path, [bearer(WRONG), bearer(TOKEN)])
            r = http.request(method, base + path, headers=bearer(API_KEY), content=b"{}")
            assert r.status_code not in (401, 403), (method, path, r.status_code, r.text)
        for method, path in sorted(PUBLIC[role]):
            assert http.request(method, base + path).status_code in (200, 503), (method, path)
        if role in DASHBOARD:  # a loopback client: no credential needed (the event stream never ends: not read)
            assert http.get(base + "/dashboard").status_code == 200
            assert http.get(base + "/dashboard/snapshot").json()["kind"] == role


def test_engine_admin_routes_need_the_token_and_the_proxy_fan_out_sends_it(plane):
    """An engine's admin routes (vLLM's /reset_prefix_cache, ...) are behind engine/middleware.ClusterGuard;
    the proxy's fan-out carries the token beside the backend API key. (tests/unit/test_engine_guard.py
    drives the guard over vLLM's real route table.)"""
    engine = plane["pd"]
    with client() as c:
        for headers in ({}, {"x-cluster-token": WRONG}, bearer(WRONG)):
            assert c.post(engine.url + "/reset_prefix_cache", headers=headers).status_code == 401, headers
        assert c.post(engine.url + "/reset_prefix_cache", headers={"x-cluster-token": TOKEN}).status_code == 200
        assert c.get(engine.url + "/health").status_code == 200  # probes stay open
        r = c.post(plane["proxy"].url + "/reset_prefix_cache", headers=bearer(TOKEN))
        assert r.status_code == 200 and r.json() == {"ok": [engine.url], "failed": []}, r.text


def test_the_push_callback_needs_its_ticket(plane):
    meta = plane["metaserver"].url
    with client() as http:
        ticket = http.post(meta + "/v1/metaserver/expect", headers=bearer(TOKEN), json={
            "request_id": "sec-1", "engine_request_ids": ["chatcmpl-sec-1"], "path": "/v1/chat/completions",
            "body": {"messages": []}, "prefill_url": "http://127.0.0.1:9"}).json()["ticket"]
        ask = {"request_id": "chatcmpl-sec-1", "remote_host": "127.0.0.1", "remote_port": 1}
        for query in ("", "?ticket=", f"?ticket={WRONG}", f"?ticket={ticket[:-1]}", f"?ticket={TOKEN}"):
            r = http.post(meta + "/v1/metaserver" + query, json=ask, headers=bearer(TOKEN))
            assert r.status_code == 403, (query, r.text)
        assert http.get(meta + "/health").json()["push_pending"] == 1  # nothing was dispatched


def test_kv_side_channel_refuses_a_missing_or_wrong_token():
    from ascendserve.connectors.kv.pull_plan import PullSettings
    from ascendserve.connectors.kv.pull_worker import PullWorker

    import torch

    producer = PullWorker(PullSettings(host="127.0.0.1", bind_host="127.0.0.1", port=0, ttl_s=30.0), TOKEN,
                          tp_rank=0, producer=True)
    producer.register_kv_caches({"layers.0.attn": torch.zeros((4, 2, 32, 64))})
    port = producer.server.port

    def hello(frame: dict) -> dict:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            send_frame(sock, frame)
            answer = read_frame(sock, 0)
            if answer["type"] == "OK":
                send_frame(sock, {"type": "FREE", "request_id": "nothing-held"})
                answer = read_frame(sock, 0)
            return answer

    layout = producer.kv.layout()
    try:
        refused = [{"type": "HELLO"}, {"type": "HELLO", "token": ""}, {"type": "HELLO", "token": WRONG},
                   {"type": "HELLO", "token": TOKEN + "x"}, {"type": "HELLO", "token": WRONG, "layout": layout},
                   {"type": "HELLO", "token": 12345}, {"type": "FREE", "request_id": "x", "token": TOKEN}]
        for frame in refused:
            answer = hello(frame)
            assert answer["type"] == "ERR" and WRONG not in answer["reason"], (frame, answer)
        assert producer.server.rejected == len(refused)
        assert hello({"type": "HELLO", "token": TOKEN}) == {"type": "OK"}  # and it kept serving
    finally:
        producer.shutdown()


def test_netloader_seed_refuses_a_missing_or_wrong_token_and_floods(tmp_path):
    from ascendserve.netloader.checkpoint import CheckpointIndex, MemorySource
    from ascendserve.netloader.seed import MAX_HANDSHAKES, Seed
    from ascendserve.netloader.wire import MAX_MANIFEST_BYTES, WIRE_VERSION

    seed = Seed(MemorySource(CheckpointIndex.scan(tiny_checkpoint(tmp_path / "ckpt"))), TOKEN, "127.0.0.1", 0,
                max_clients=1, handshake_s=60.0).start()

    def join(frame: dict) -> dict:
        with socket.create_connection(("127.0.0.1", seed.port), timeout=10) as sock:
            send_frame(sock, frame)
            return read_frame(sock, MAX_MANIFEST_BYTES)  # a JOIN_ACK's payload is the manifest

    try:
        for frame in ({"type": "JOIN"}, {"type": "JOIN", "token": ""}, {"type": "JOIN", "token": WRONG},
                      {"type": "JOIN", "token": TOKEN[:-1]}, {"type": "GET", "token": TOKEN}):
            answer = join(frame)
            assert answer["type"] == "JOIN_NACK" and "token" in answer["reason"], (frame, answer)
            assert WRONG not in answer["reason"]
        assert join({"type": "JOIN", "token": TOKEN, "version": WIRE_VERSION})["type"] == "JOIN_ACK"
        # silent connections: past max_clients + MAX_HANDSHAKES the seed closes new ones at once
        silent = [socket.create_connection(("127.0.0.1", seed.port), timeout=10)
                  for _ in range(1 + MAX_HANDSHAKES)]
        refused_before = seed.refused
        with socket.create_connection(("127.0.0.1", seed.port), timeout=10) as extra:
            assert extra.recv(1) == b""  # closed without an answer
        wait_for(lambda: seed.refused > refused_before, 10, "the extra connection was not counted")
        for sock in silent:
            sock.close()
        wait_for(lambda: _joins(seed.port), 10, "the seed never served again after the flood")
    finally:
        seed.stop()


def _joins(port: int) -> bool:
    from ascendserve.netloader.wire import MAX_MANIFEST_BYTES, WIRE_VERSION

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            send_frame(sock, {"type": "JOIN", "token": TOKEN, "version": WIRE_VERSION})
            return read_frame(sock, MAX_MANIFEST_BYTES)["type"] == "JOIN_ACK"
    except OSError:
        return False


# ---- 2. limits ------------------------------------------------------------------------------------

@pytest.mark.parametrize("role", ["proxy", "metaserver"])
def test_every_post_route_refuses_an_oversized_body(plane, role):
    base = plane[role].url
    big = b'{"x": "' + b"a" * int(MAX_BODY_MB * 1024 * 1024 + 1024) + b'"}'
    def post(http, path, kind, **kw):
        # this test failed twice under load with no message: say which request and how
        try:
            return http.post(base + path, **kw)
        except httpx.TransportError as exc:
            pytest.fail(f"{role} POST {path} ({kind} body): {exc!r}")

    with client() as http:
        for method, path in sorted(route_table(role)):
            if method != "POST":
                continue
            credential = bearer(API_KEY) if (method, path) in CLIENT.get(role, set()) else bearer(TOKEN)
            r = post(http, path, "declared", content=big, headers={"content-type": "application/json", **credential})
            assert r.status_code == 413, (path, r.status_code, r.text[:200])
            assert r.json()["error"]["message"] == "request body too large"
            # no Content-Length (chunked): counted as the handler reads it; these routes never read theirs
            r = post(http, path, "chunked", content=iter([big[:40000], big[40000:]]), headers=credential)
            assert r.status_code == (200 if path in BODY_IGNORED else 413), (path, "chunked", r.status_code)


def test_oversized_request_head_gets_431(plane):
    with client() as http:
        assert http.get(plane["limited"].url + "/health", headers={"x-filler": "a" * 8000}).status_code == 200
        assert http.get(plane["limited"].url + "/health", headers={"x-filler": "a" * 20000}).status_code == 431


def test_a_full_server_makes_the_next_connection_wait_and_closes_silent_ones(plane):
    url = plane["limited"].url + "/health"  # max_connections = 2, header_timeout_s = 5
    for _ in range(3):  # a stalled machine may let the server close the silent sockets too early: retry
        silent = [socket.create_connection(("127.0.0.1", plane["limited"].port), timeout=30) for _ in range(2)]
        try:
            httpx.get(url, timeout=1.0)
            blocked = False
        except httpx.TimeoutException:
            blocked = True
        for sock in silent:
            assert sock.recv(1) == b"", "a silent connection was not closed"  # header_timeout_s
            sock.close()
        assert httpx.get(url, timeout=10).status_code == 200  # slots came back
        if blocked:
            return
    pytest.fail("a third connection was served while two held both slots")


# ---- 3. TLS ---------------------------------------------------------------------------------------

def _wait_https(url: str, context: ssl.SSLContext, proc: Proc, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited:\n{proc.log_text()[-3000:]}")
        try:
            if httpx.get(url, verify=context, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{proc.name} not ready:\n{proc.log_text()[-3000:]}")


def test_tls_round_trip_with_a_self_signed_certificate(tmp_path_factory):
    from ascendserve.discovery.heartbeat import Heartbeat, MetaserverRegistrar

    logs = tmp_path_factory.mktemp("tls-logs")
    LOG_DIRS.append(logs)
    cert, key = write_self_signed(logs)
    tls = ("--tls-cert", str(cert), "--tls-key", str(key))
    context = ssl.create_default_context(cafile=str(cert))
    meta = control("metaserver", logs, *tls, "--cluster-token", TOKEN)
    PROCS.append(meta)
    meta.start()
    meta_url = f"https://127.0.0.1:{meta.port}"
    pd = stub("pd", logs)
    proxy = control("proxy", logs, *tls, "--tls-ca", str(cert), "--metaserver-url", meta_url,
                    "--cluster-token", TOKEN, "--api-key", API_KEY)
    PROCS.extend([pd, proxy])
    pd.start(), proxy.start()
    heartbeat = None
    try:
        _wait_https(meta_url + "/health", context, meta)
        pd.wait_ready()
        # an engine's heartbeat, verifying the metaserver with the CA file
        heartbeat = Heartbeat(MetaserverRegistrar(meta_url, TOKEN, tls_ca=str(cert)), "tls-pd", "pd", pd.url,
                              pd.url, "stub-model", 0.5).start()
        proxy_url = f"https://127.0.0.1:{proxy.port}"
        _wait_https(proxy_url + "/healthcheck", context, proxy)
        with client(verify=context) as http:
            def registered():
                view = http.get(meta_url + "/v1/registry/instances", headers=bearer(TOKEN)).json()
                return [i["url"] for i in view["instances"]] == [pd.url]

            wait_for(registered, 30, "the heartbeat never registered over https")
            # the proxy found the stub through the https registry, and serves over https
            wait_for(lambda: http.get(proxy_url + "/health").status_code == 200, 30, "proxy never saw the stub")
            r = http.post(proxy_url + "/v1/completions", headers=bearer(API_KEY),
                          json={"model": "stub-model", "prompt": "hi", "max_tokens": 3})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
            assert http.post(proxy_url + "/v1/completions", json={"prompt": "hi"}).status_code == 401
        with pytest.raises(httpx.ConnectError):  # a client that does not trust the certificate
            httpx.get(proxy_url + "/health", timeout=5)
        with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port
            httpx.get(f"http://127.0.0.1:{proxy.port}/health", timeout=5)
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        for p in (proxy, pd, meta):
            p.stop(timeout=10)


# ---- 4. no secret in any log or reply (runs last) ---------------------------------------------------

def _forms(secret: str) -> set[str]:
    return {secret, json.dumps(secret)[1:-1], quote(secret, safe="")}


def test_no_log_line_or_reply_holds_a_secret(plane, tmp_path):
    import subprocess

    proxy, meta = plane["proxy"].url, plane["metaserver"].url
    with client() as http:  # what this test needs even when run alone: refusals, successes, bad requests
        for base, path in ((proxy, "/instances"), (meta, "/v1/registry/instances")):
            assert http.get(base + path, headers=bearer(WRONG)).status_code == 401
            assert http.get(base + path, headers=bearer(TOKEN)).status_code == 200
        assert http.post(meta + "/v1/registry/register", headers=bearer(TOKEN), content=b"{oops").status_code == 400
        assert http.post(proxy + "/v1/completions", headers=bearer(WRONG), json={}).status_code == 401
        assert http.post(proxy + "/v1/completions", headers=bearer(API_KEY), content=b"[").status_code == 400
        assert http.post(proxy + "/v1/completions", headers=bearer(API_KEY),
                         json={"model": "stub-model", "prompt": "hi", "max_tokens": 2}).status_code == 200
    conf = tmp_path / "proxy.toml"
    conf.write_text(f'role = "proxy"\n[cluster]\ntoken = "{TOKEN}"\n[proxy]\napi_keys = ["{API_KEY}"]\n'
                    f'backend_api_key = "{WRONG}"\n')
    outputs = []
    for argv in (["doctor", "--config", str(conf)], ["doctor", "--config", str(conf), "--json"],
                 ["--role", "proxy", "--config", str(conf), "--port", "0"],  # refused: port 0
                 ["--role", "proxy", "--config", str(conf), "--host", "0.0.0.0", "--cluster-token", ""]):
        r = subprocess.run([PYTHON, "-m", "ascendserve", *argv], capture_output=True, text=True, timeout=120,
                           cwd=REPO)
        outputs.append((" ".join(argv), r.stdout + r.stderr))
    assert "is invalid" in outputs[2][1]
    for p in PROCS:
        p.stop(timeout=10)  # their last lines are written
    logs = [(str(f), f.read_text(errors="replace")) for d in LOG_DIRS for f in sorted(d.glob("*.log"))]
    text = "\n".join(t for _, t in logs)
    # the logs saw what this module did: effective configs, refused credentials, served requests
    assert text.count('"effective config"') >= 4 and '"authentication failed"' in text  # 6 with the TLS test
    assert '"request"' in text and len(BODIES) >= 8
    everything = [*logs, *outputs, *((where, body.decode(errors="replace")) for where, body in BODIES)]
    for secret in (TOKEN, API_KEY, WRONG):
        for form in _forms(secret):
            leaks = [where for where, content in everything if form in content]
            assert not leaks, f"a secret appears in: {leaks}"
