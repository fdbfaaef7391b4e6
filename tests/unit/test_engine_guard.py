"""The cluster token guards vLLM's own admin routes in engine processes, and its client API
when the engine is bound off loopback (one front door: the proxy).

vLLM's real HTTP app is built from the arguments an engine role passes
(`build_argv`, so our `--middleware`), with vLLM's dev-mode routes
on (`/collective_rpc`, `/sleep`, ...), and driven in-process (no network, no
engine). Every route it serves outside the client API and the probes must
refuse a missing or wrong token; the right one must get through. Off loopback
the client API wants the token or an API key vLLM accepts (the guard's decision
is also driven over a bare ASGI app); on loopback it stays open.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fastapi.routing import APIRoute

from ascendserve.config import load
from ascendserve.engine.middleware import (API_KEYS_ENV, CLIENT_PATHS, HOST_ENV, PROBE_PATHS, ClusterGuard,
                                           is_client_api, is_open)
from ascendserve.engine.vllm_server import build_argv, guard_env, parse_vllm_args, vllm_http_app
from ascendserve.web.upstream import engine_headers

TOKEN = "engine-guard-test-token-0123456789"


@pytest.fixture(scope="module")
def routes_and_app(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_SERVER_DEV_MODE", "1")  # the riskiest routes exist only then: include them
    mp.setenv("ASCENDSERVE_CLUSTER_TOKEN", TOKEN)
    model = tmp_path_factory.mktemp("model")
    (model / "config.json").write_text("{}")
    try:
        argv = build_argv(load("pd", None, {"model__path": str(model)}, env={}))
        for name, value in guard_env(parse_vllm_args(argv)).items():  # what the role sets: a loopback bind
            mp.setenv(name, value)
        app = vllm_http_app(argv)
        routes = sorted({(r.path, sorted(r.methods)[0]) for r in app.routes if isinstance(r, APIRoute)})
        yield routes, app
    finally:
        mp.undo()


def _status(app, method: str, path: str, headers: dict) -> int:
    async def go():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
            return (await client.request(method, path.replace("{response_id}", "x"), headers=headers,
                                         json={} if method != "GET" else None)).status_code
    return asyncio.run(go())


def test_every_admin_route_refuses_a_missing_or_wrong_token(routes_and_app):
    routes, app = routes_and_app
    guarded = [(p, m) for p, m in routes if not is_open(p)]
    # the routes this guard exists for are really there, so the loop below proves something
    assert {"/reset_prefix_cache", "/collective_rpc", "/sleep", "/pause", "/update_weights"} <= {p for p, _ in guarded}
    for path, method in guarded:
        for headers in ({}, {"x-cluster-token": "wrong"}, {"authorization": "Bearer wrong"}):
            assert _status(app, method, path, headers) == 401, (method, path, headers)


def test_the_token_gets_through(routes_and_app):
    _, app = routes_and_app
    for headers in ({"x-cluster-token": TOKEN}, {"authorization": f"Bearer {TOKEN}"},
                    # the proxy's fan-out: its backend API key in Authorization, the token beside it
                    {"authorization": "Bearer some-api-key", "x-cluster-token": TOKEN}):
        assert _status(app, "POST", "/reset_prefix_cache", headers) != 401, headers


def test_probes_and_the_client_api_stay_open(routes_and_app):
    routes, app = routes_and_app
    assert is_open("/health") and is_open("/metrics") and is_open("/v1/chat/completions")
    assert not is_open("/v1/load_lora_adapter")
    for path in ("/health", "/ping", "/version", "/v1/models"):
        assert _status(app, "GET", path, {}) != 401, path
    assert any(p == "/v1/chat/completions" for p, _ in routes)


def test_without_a_token_nothing_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("ASCENDSERVE_CLUSTER_TOKEN", raising=False)
    (tmp_path / "config.json").write_text("{}")
    app = vllm_http_app(build_argv(load("pd", None, {"model__path": str(tmp_path)}, env={})))
    assert _status(app, "POST", "/reset_prefix_cache", {}) != 401


# ---- one front door: off loopback, the client API takes the token or an API key too ----------------

KEY = "backend-api-key-0123456789"
CLIENT_SAMPLE = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/responses", "/v2/embed",
                 "/inference/v1/generate", *sorted(CLIENT_PATHS))


async def _ok(scope, receive, send):
    if scope["type"] == "websocket":
        return await send({"type": "websocket.accept"})
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"served"})


def _call(guard, path: str, headers: dict | None = None, method: str = "POST") -> tuple[int, bytes]:
    async def go():
        transport = httpx.ASGITransport(app=guard)
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
            r = await client.request(method, path, headers=headers or {})
            return r.status_code, r.content
    return asyncio.run(go())


def _refused_openai_style(status: int, body: bytes) -> bool:
    if status != 401:
        return False
    error = json.loads(body)["error"]
    return (error["type"] == "authentication_error" and error["code"] == "401" and "param" in error
            and "proxy" in error["message"] and TOKEN not in error["message"])


def test_off_loopback_the_client_api_wants_the_token_or_an_api_key():
    guard = ClusterGuard(_ok, token=TOKEN, host="10.231.0.1", api_keys=[KEY])
    for path in CLIENT_SAMPLE:
        assert is_client_api(path), path
        for headers in ({}, {"x-cluster-token": "wrong"}, {"authorization": "Bearer wrong"},
                        {"authorization": f"Basic {TOKEN}"}, {"authorization": TOKEN},
                        {"x-cluster-token": KEY},  # an API key is a Bearer credential, not a token
                        {"authorization": f"Bearer {TOKEN}x"}, {"x-cluster-token": TOKEN[:-1]}):
            assert _refused_openai_style(*_call(guard, path, headers)), (path, headers)
        for headers in ({"x-cluster-token": TOKEN}, {"authorization": f"Bearer {TOKEN}"},
                        {"authorization": f"bearer {KEY}"},
                        # what the proxy sends: its backend API key and the token beside it
                        {"authorization": f"Bearer {KEY}", "x-cluster-token": TOKEN},
                        {"authorization": f"Bearer {KEY}", "x-cluster-token": "stale"}):
            assert _call(guard, path, headers) == (200, b"served"), (path, headers)


def test_off_loopback_probes_stay_open_and_admin_routes_want_the_token_not_a_key():
    guard = ClusterGuard(_ok, token=TOKEN, host="0.0.0.0", api_keys=[KEY])
    assert {"/health", "/ping", "/ready", "/version", "/metrics", "/load", "/kv_info", "/cache_info"} <= PROBE_PATHS
    for path in PROBE_PATHS:
        assert _call(guard, path, method="GET") == (200, b"served"), path
    for path in ("/reset_prefix_cache", "/sleep", "/v1/load_lora_adapter", "/docs", "/cohere/v2/chat"):
        status, body = _call(guard, path, {"authorization": f"Bearer {KEY}"})
        assert status == 401 and b"cluster token" in body, path
        assert _call(guard, path, {"x-cluster-token": TOKEN})[0] == 200, path


def test_every_non_loopback_bind_is_guarded_and_loopback_binds_stay_open():
    for host in ("10.231.0.1", "0.0.0.0", "::", "", "192.168.1.7", "fe80::1", "my-host.example"):
        assert _call(ClusterGuard(_ok, token=TOKEN, host=host), "/v1/completions")[0] == 401, host
    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):
        guard = ClusterGuard(_ok, token=TOKEN, host=host)
        for path in CLIENT_SAMPLE:
            assert _call(guard, path) == (200, b"served"), (host, path)
        assert _call(guard, "/reset_prefix_cache")[0] == 401, host  # admin routes as before


def test_without_a_token_an_engine_off_loopback_stays_open():
    """Nothing to check against (config refuses or warns: security.security_warnings)."""
    guard = ClusterGuard(_ok, token="", host="10.231.0.1", api_keys=[KEY])
    for path in (*CLIENT_SAMPLE, "/reset_prefix_cache"):
        assert _call(guard, path) == (200, b"served"), path


def test_a_websocket_on_the_client_api_off_loopback_is_closed_without_the_token():
    guard = ClusterGuard(_ok, token=TOKEN, host="10.231.0.1")
    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "websocket.connect"}

    def scope(headers):
        return {"type": "websocket", "path": "/v1/realtime", "headers": headers}

    asyncio.run(guard(scope([]), receive, send))
    assert sent == [{"type": "websocket.close", "code": 1008}]
    sent.clear()
    asyncio.run(guard(scope([(b"x-cluster-token", TOKEN.encode())]), receive, send))
    assert sent == [{"type": "websocket.accept"}]


def test_the_guard_reads_what_the_role_sets_in_the_environment(monkeypatch):
    monkeypatch.setenv("ASCENDSERVE_CLUSTER_TOKEN", TOKEN)
    monkeypatch.delenv(HOST_ENV, raising=False)
    monkeypatch.delenv(API_KEYS_ENV, raising=False)
    assert _call(ClusterGuard(_ok), "/v1/completions")[0] == 200  # no bind said: a loopback one (the stubs)
    monkeypatch.setenv(HOST_ENV, "10.231.0.1")
    monkeypatch.setenv(API_KEYS_ENV, f'["{KEY}"]')
    guard = ClusterGuard(_ok)
    assert _call(guard, "/v1/completions")[0] == 401
    assert _call(guard, "/v1/completions", {"authorization": f"Bearer {KEY}"})[0] == 200
    assert _call(guard, "/v1/completions", {"x-cluster-token": TOKEN})[0] == 200


def _engine_argv(tmp_path, **keys) -> list[str]:
    (tmp_path / "config.json").write_text("{}")
    return build_argv(load("pd", None, {"model__path": str(tmp_path), **keys}, env={}))


def test_guard_env_is_vllms_bind_address_and_the_api_keys_vllm_accepts(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    env = guard_env(parse_vllm_args(_engine_argv(tmp_path, server__host="10.231.0.1")))
    assert env == {HOST_ENV: "10.231.0.1", API_KEYS_ENV: "[]"}
    argv = _engine_argv(tmp_path, engine__vllm_args=["--api-key", KEY])
    assert json.loads(guard_env(parse_vllm_args(argv))[API_KEYS_ENV]) == [KEY]
    assert guard_env(parse_vllm_args(argv))[HOST_ENV] == "127.0.0.1"
    monkeypatch.setenv("VLLM_API_KEY", "from-the-environment")  # vLLM's fallback when --api-key is absent
    assert json.loads(guard_env(parse_vllm_args(_engine_argv(tmp_path)))[API_KEYS_ENV]) == ["from-the-environment"]
    assert json.loads(guard_env(parse_vllm_args(argv))[API_KEYS_ENV]) == [KEY]  # --api-key wins, as in vLLM


def test_vllms_real_app_off_loopback(tmp_path, monkeypatch):
    """vLLM's own route table behind our middleware, bound off loopback with vLLM's --api-key: every
    client route refuses an anonymous caller with the OpenAI-style body; the API key gets through
    both guards (ours and vLLM's, which checks /v1 only), the token through ours; probes are open."""
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    monkeypatch.setenv("ASCENDSERVE_CLUSTER_TOKEN", TOKEN)
    argv = _engine_argv(tmp_path, server__host="10.231.0.1", cluster__token=TOKEN,
                        engine__vllm_args=[f"--api-key={KEY}"])
    for name, value in guard_env(parse_vllm_args(argv)).items():
        monkeypatch.setenv(name, value)
    app = vllm_http_app(argv)
    routes = sorted({(r.path, sorted(r.methods)[0]) for r in app.routes if isinstance(r, APIRoute)})
    client = [(p, m) for p, m in routes if is_client_api(p)]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize"} <= {
        p for p, _ in client}

    def request(method, path, headers):
        async def go():
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://engine") as c:
                return await c.request(method, path.replace("{response_id}", "x"), headers=headers,
                                       json={} if method != "GET" else None)
        return asyncio.run(go())

    for path, method in client:
        r = request(method, path, {})
        assert _refused_openai_style(r.status_code, r.content), (method, path, r.status_code, r.text)
        assert request(method, path, {"authorization": f"Bearer {KEY}"}).status_code != 401, (method, path)
    # the token alone passes ours; vLLM's own key check still wants its key on /v1 (the proxy sends both)
    assert request("POST", "/tokenize", {"x-cluster-token": TOKEN}).status_code != 401
    r = request("GET", "/v1/models", {"x-cluster-token": TOKEN})
    assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}  # vLLM's, not ours
    assert request("GET", "/v1/models", {"x-cluster-token": TOKEN, "authorization": f"Bearer {KEY}"}).status_code != 401
    for path in ("/health", "/ping", "/version", "/metrics"):
        assert request("GET", path, {}).status_code != 401, path


def test_the_proxy_sends_the_token_and_the_backend_key_to_engines():
    from ascendserve.router.app import create_app

    assert engine_headers(TOKEN, KEY) == {"x-cluster-token": TOKEN, "authorization": f"Bearer {KEY}"}
    assert engine_headers(TOKEN) == {"x-cluster-token": TOKEN} and engine_headers("") == {}
    guard = ClusterGuard(_ok, token=TOKEN, host="10.231.0.1", api_keys=[KEY])
    assert _call(guard, "/v1/completions", engine_headers(TOKEN, KEY)) == (200, b"served")
    config = load("proxy", None, {"cluster__token": TOKEN}, env={})
    config.proxy.backend_api_key = KEY  # a file's key ([proxy] backend_api_key), no flag
    upstream = create_app(config).state.upstream  # every request to an engine goes through it
    assert upstream._h(None)["x-cluster-token"] == TOKEN and upstream._h(None)["authorization"] == f"Bearer {KEY}"
