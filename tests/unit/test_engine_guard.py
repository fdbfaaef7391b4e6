"""The cluster token guards vLLM's own admin routes in engine processes.

vLLM's real HTTP app is built from the arguments an engine role passes
(`build_argv`, so our `--middleware`), with vLLM's dev-mode routes
on (`/collective_rpc`, `/sleep`, ...), and driven in-process (no network, no
engine). Every route it serves outside the client API and the probes must
refuse a missing or wrong token; the right one must get through.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi.routing import APIRoute

from ascendserve.config import load
from ascendserve.engine.middleware import is_open
from ascendserve.engine.vllm_server import build_argv, vllm_http_app

TOKEN = "engine-guard-test-token-0123456789"


@pytest.fixture(scope="module")
def routes_and_app(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_SERVER_DEV_MODE", "1")  # the riskiest routes exist only then: include them
    mp.setenv("ASCENDSERVE_CLUSTER_TOKEN", TOKEN)
    model = tmp_path_factory.mktemp("model")
    (model / "config.json").write_text("{}")
    try:
        app = vllm_http_app(build_argv(load("pd", None, {"model__path": str(model)}, env={})))
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
