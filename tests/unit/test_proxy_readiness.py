"""The proxy's /health and /v1/models before and after its topology has healthy instances."""

from __future__ import annotations

import asyncio

import pytest
from litestar.testing import TestClient

from ascendserve.config import ProxyConfig, load
from ascendserve.protocol.kv_connectors import KVInfo
from ascendserve.router.app import create_app
from ascendserve.router.health import HealthMonitor
from ascendserve.router.pools import ACTIVE, EJECTED, Pools

CARD = {"id": "/models/m", "object": "model", "created": 1700000000, "owned_by": "vllm", "root": "/models/m",
        "parent": None, "max_model_len": 4096, "permission": [{"id": "modelperm-1", "object": "model_permission"}]}


@pytest.fixture
def proxy():
    # no static instances, no metaserver: the test puts instances in the pools itself; the health
    # loop's first (empty) round runs at start-up and the next one only after an hour
    app = create_app(load("proxy", None, {"proxy__health_interval_s": 3600.0}, env={}))
    with TestClient(app) as client:
        yield client, app.state.pools


def _instance(pools: Pools, role: str, url: str, state: str = ACTIVE, error: str = ""):
    inst = pools[role].add(url, source="registry")
    inst.cards, inst.models, inst.last_error = (CARD,), (CARD["id"],), error
    pools[role].set_state(inst, state)
    return inst


def _error(r) -> str:
    body = r.json()
    assert set(body["error"]) >= {"message", "type", "code"}  # OpenAI-style
    return body["error"]["message"]


def test_nothing_registered_is_503_on_both_with_the_reason(proxy):
    client, _ = proxy
    health = client.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "degraded"
    assert "no engine instance registered" in health.json()["missing"][0]
    models = client.get("/v1/models")
    assert models.status_code == 503 and "no engine instance registered" in _error(models)
    assert client.get("/healthcheck").status_code == 200  # vllm-ascend's counts: the proxy itself is up


def test_a_prefill_without_decode_is_not_servable(proxy):
    client, pools = proxy
    _instance(pools, "prefill", "http://127.0.0.1:8010")
    health = client.get("/health")
    assert health.status_code == 503
    assert health.json()["missing"] == ["no healthy decode instance: 0 registered"]
    assert health.json()["roles"]["decode"] == {"healthy": 0, "total": 0}
    assert _error(client.get("/v1/models")) == "no healthy decode instance: 0 registered"


def test_an_ejected_decode_is_named_with_its_last_error(proxy):
    client, pools = proxy
    _instance(pools, "prefill", "http://127.0.0.1:8010")
    _instance(pools, "decode", "http://127.0.0.1:8011", EJECTED,
              "GET http://127.0.0.1:8011/health: connection refused")
    message = _error(client.get("/v1/models"))
    assert message == ("no healthy decode instance: 1 registered, 1 ejected "
                       "(last error: GET http://127.0.0.1:8011/health: connection refused)")
    roles = client.get("/health").json()["roles"]
    assert roles["decode"]["ejected"] == 1 and "connection refused" in roles["decode"]["last_error"]


def test_healthy_p_and_d_serve_the_engines_model_cards(proxy):
    client, pools = proxy
    _instance(pools, "prefill", "http://127.0.0.1:8010")
    _instance(pools, "decode", "http://127.0.0.1:8011")
    health = client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert health.json()["roles"]["decode"] == {"healthy": 1, "total": 1}
    models = client.get("/v1/models")
    assert models.status_code == 200
    assert models.json() == {"object": "list", "data": [CARD]}  # vLLM's card, as the engine gave it


def test_mono_needs_only_pd(proxy):
    client, pools = proxy
    _instance(pools, "pd", "http://127.0.0.1:8010", state="probing", error="GET http://127.0.0.1:8010/v1/models: 503")
    assert _error(client.get("/v1/models")).startswith("no healthy pd instance: 1 registered, 1 not answering yet")
    pools["pd"].set_state(pools["pd"].instances["http://127.0.0.1:8010"], ACTIVE)
    assert client.get("/health").status_code == 200
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["/models/m"]


def test_an_encoder_not_checked_yet_holds_health_until_its_first_check(proxy):
    client, pools = proxy
    _instance(pools, "pd", "http://127.0.0.1:8010")
    encoder = _instance(pools, "encoder", "http://127.0.0.1:8011", state="probing")
    assert client.get("/health").json()["missing"] == ["encoder instances not checked yet: 1 probing"]
    encoder.failures = 1  # its first probe failed: known down, local fallback serves
    assert client.get("/health").status_code == 200


def test_encoders_are_optional_with_local_fallback():
    for fallback, status in (("local", 200), ("fail", 503)):
        app = create_app(load("proxy", None, {"proxy__health_interval_s": 3600.0,
                                              "proxy__encoder_fallback": fallback}, env={}))
        with TestClient(app) as client:
            pools = app.state.pools
            _instance(pools, "pd", "http://127.0.0.1:8010")
            _instance(pools, "encoder", "http://127.0.0.1:8011", EJECTED, "connection refused")
            health = client.get("/health")
            assert health.status_code == status, (fallback, health.json())
            assert health.json()["roles"]["encoder"]["healthy"] == 0
            if status == 503:
                assert "no healthy encoder instance" in _error(client.get("/v1/models"))


class _Upstream:
    """Answers GETs from a table: url -> (status, body) or an exception."""

    def __init__(self, table):
        self.table = table

    async def get(self, url, timeout_s, headers=None):
        answer = self.table.get(url, (404, b'{"detail": "Not Found"}'))  # a route it does not serve
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_health_checks_record_why_an_instance_failed():
    from ascendserve.web.upstream import UpstreamError

    pools = Pools()
    inst = pools["decode"].add("http://d", source="registry")
    upstream = _Upstream({"http://d/v1/models": UpstreamError("http://d/v1/models", None, "connection refused")})
    health = HealthMonitor(pools, upstream, ProxyConfig(eject_after=3))
    asyncio.run(health.check_all())
    assert inst.last_error == "GET http://d/v1/models: connection refused"
    upstream.table["http://d/v1/models"] = (200, b'{"object": "list", "data": [{"id": "m", "root": "/m", "x": 1}]}')
    asyncio.run(health.check_all())
    assert inst.state == ACTIVE and inst.last_error == "" and inst.cards == ({"id": "m", "root": "/m", "x": 1},)
    upstream.table["http://d/health"] = (500, b"engine dead")
    for _ in range(3):
        asyncio.run(health.check_all())
    assert inst.state == EJECTED and inst.last_error == "GET http://d/health: 500 engine dead"


def test_admission_reads_the_kv_connector_from_kv_info_and_a_plain_vllm_says_none():
    pools = Pools()
    ours = pools["prefill"].add("http://p", source="static")
    plain = pools["decode"].add("http://d", source="static")
    models = (200, b'{"object": "list", "data": [{"id": "m"}]}')
    upstream = _Upstream({"http://p/v1/models": models, "http://d/v1/models": models,
                          "http://p/kv_info": (200, b'{"connector": "nixl", "flow": "pull", "engine_id": "e1"}')})
    asyncio.run(HealthMonitor(pools, upstream, ProxyConfig()).check_all())
    assert ours.state == plain.state == ACTIVE
    assert (ours.kv.connector, ours.kv.flow, ours.kv.engine_id) == ("nixl", "pull", "e1")
    assert plain.kv is None and plain.kv_connector == ""  # 404: pairs with any connector


def test_push_pairs_are_not_ready_until_a_metaserver_is_known(proxy):
    """Measured: a metaserver announces itself in etcd a beat after P and D; the proxy said 200 on
    /health while every request got 503 no_metaserver. Now /health waits for one."""
    client, pools = proxy
    pipeline = client.app.state.pipeline
    for role, url in (("prefill", "http://127.0.0.1:8010"), ("decode", "http://127.0.0.1:8011")):
        _instance(pools, role, url).kv = KVInfo(connector="push", flow="push", free="ttl")
    known: list[str] = []
    pipeline.metaservers = lambda: known
    health = client.get("/health")
    assert health.status_code == 503
    assert health.json()["missing"] == [
        "no metaserver known: prefill and decode run a push connector (push) and the proxy has no "
        "metaserver to announce requests to"]
    assert client.get("/instances").json()["metaservers"] == []
    known.append("http://127.0.0.1:8001")
    assert client.get("/health").status_code == 200
    assert client.get("/instances").json()["metaservers"] == ["http://127.0.0.1:8001"]
    # a pull pair needs no metaserver
    known.clear()
    for inst in pools.all_instances():
        inst.kv = KVInfo(connector="pull", flow="pull")
    assert client.get("/health").status_code == 200
