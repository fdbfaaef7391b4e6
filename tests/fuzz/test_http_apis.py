"""Property-based fuzzing (schemathesis) of the proxy's and the metaserver's HTTP APIs.

The OpenAPI documents are the ones Litestar builds for the real apps, with
their request bodies added (openapi.py). The apps under test are real
processes on 127.0.0.1: the proxy in front of stub engines (encoder, prefill,
decode in pull mode; tests/stub_backend.py), so generated requests go all the
way through the pipeline, and the metaserver on its own. Every generated
request is sent twice, without credentials and with the right ones, and:

- nothing answers 5xx (the one documented exception: GET /health's 503
  "degraded" probe answer, which never happens here since every role is up);
- every 4xx carries an OpenAI-style error body;
- a guarded route refuses the request without credentials (401);
- 2xx bodies match the documented response schema;
- the metaserver rejects every body its wire types do not allow (negative
  generation), since its documented bodies are exactly those types.
A case that fails is printed by schemathesis with a curl line to replay it.
Cases run per operation are printed at the end (`pytest -s`).
"""

from __future__ import annotations

import collections

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import negative_data_rejection, not_a_server_error, response_schema_conformance  # noqa: E402

from ascendserve.config import load  # noqa: E402
from tests.fuzz.openapi import admin_body, app_schema, openai_bodies, wire_bodies, with_bodies  # noqa: E402
from tests.procs import control, start_all, stub  # noqa: E402

pytestmark = pytest.mark.integration
API_KEY, TOKEN = "fuzz-client-key", "fuzz-cluster-token"
MODEL = "stub-model"
EXAMPLES = 50  # generated requests per operation and mode (each sent twice)
PUBLIC = {"/health", "/healthcheck", "/metrics", "/v1/metaserver"}  # the push callback's ticket is its key
CLIENT = {"/v1/chat/completions", "/v1/completions", "/v1/models"}
SENT: collections.Counter = collections.Counter()


def _proxy_document() -> dict:
    from ascendserve.router.app import ADMIN_TYPES, create_app

    doc = app_schema(create_app(load("proxy", None, {}, env={})), "ascendserve proxy")
    roles = tuple(t for t in ADMIN_TYPES if t != "pd")  # the roles that have stubs: /health stays "ok"
    admin = admin_body(roles, "127.0.0.2")
    return with_bodies(doc, {**openai_bodies(MODEL), ("post", "/instances/add"): admin,
                             ("post", "/instances/remove"): admin})


def _metaserver_document() -> dict:
    from ascendserve.metaserver.app import _Expect, create_app
    from ascendserve.protocol.kv_params import PushPrefillRequest
    from ascendserve.protocol.registry import Deregistration, Heartbeat, Registration

    doc = app_schema(create_app(load("metaserver", None, {}, env={})), "ascendserve metaserver")
    bodies, components = wire_bodies({
        ("post", "/v1/registry/register"): Registration, ("post", "/v1/registry/heartbeat"): Heartbeat,
        ("post", "/v1/registry/deregister"): Deregistration, ("post", "/v1/metaserver/expect"): _Expect,
        ("post", "/v1/metaserver"): PushPrefillRequest})
    return with_bodies(doc, bodies, components)


PROXY = schemathesis.openapi.from_dict(_proxy_document())
METASERVER = schemathesis.openapi.from_dict(_metaserver_document())
PROXY.config.generation.update(modes=[GenerationMode.POSITIVE])  # its bodies pass through to the engines
METASERVER.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


def no_server_error(ctx, response, case):
    if case.path == "/health" and response.status_code == 503 and response.json().get("status") == "degraded":
        return None  # the documented probe answer when a role has no healthy instance
    return not_a_server_error(ctx, response, case)


def openai_error_body(ctx, response, case):
    if response.status_code >= 400:
        error = response.json().get("error")
        assert isinstance(error, dict) and {"message", "type", "code"} <= error.keys(), \
            f"{response.status_code} without an OpenAI-style error body: {response.text[:300]}"


def documented_2xx_body(ctx, response, case):
    """Litestar documents its own 400 shape, which our error handler replaces: 2xx only."""
    if response.status_code < 300:
        return response_schema_conformance(ctx, response, case)


CHECKS = [no_server_error, openai_error_body, documented_2xx_body]


def _credentials(path: str) -> dict:
    if path in PUBLIC:
        return {}
    return {"authorization": f"Bearer {API_KEY if path in CLIENT else TOKEN}"}


def _send(case, url: str) -> None:
    SENT[case.operation.label] += 1
    anonymous = case.call(base_url=url, timeout=60)
    case.validate_response(anonymous, checks=CHECKS)
    if _credentials(case.path) and case.method.upper() == case.operation.method.upper():  # (not a 405 probe)
        assert anonymous.status_code == 401, f"{case.operation.label} answered {anonymous.status_code} " \
                                             "without credentials"
    extra = [negative_data_rejection] if case.meta and case.meta.generation.mode == GenerationMode.NEGATIVE else []
    case.call_and_validate(base_url=url, headers=_credentials(case.path), timeout=60, checks=CHECKS + extra)


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    for label, n in sorted(SENT.items()):
        print(f"schemathesis {label}: {n} generated requests (x2: without and with credentials)")


@pytest.fixture(scope="module")
def proxy_url(tmp_path_factory):
    logs = tmp_path_factory.mktemp("fuzz-proxy-logs")
    conf = logs / "proxy.toml"
    conf.write_text("[proxy]\nmax_body_mb = 1.0\nhealth_interval_s = 0.5\neject_after = 2\nmax_retries = 1\n"
                    "retry_backoff_s = 0.01\n")
    e, p, d = stub("encoder", logs), stub("prefill", logs), stub("decode", logs, "--require-kv")
    start_all(e, p, d)
    proxy = control("proxy", logs, "--config", str(conf), "--encoder", f"127.0.0.1:{e.port}",
                    "--prefill", f"127.0.0.1:{p.port}", "--decode", f"127.0.0.1:{d.port}",
                    "--api-key", API_KEY, "--cluster-token", TOKEN)
    try:
        start_all(proxy)
        _wait_healthy(proxy.url)
        yield proxy.url
        stats = {s.name: httpx.get(s.url + "/stub/stats", timeout=5).json() for s in (e, p, d)}
        print(f"stub engines behind the fuzzed proxy: encodes {stats[e.name]['encodes']}, "
              f"prefills {stats[p.name]['prefills']}, decodes {stats[d.name]['decodes']}")
        assert all(s["protocol_errors"] == 0 for s in stats.values()), stats
        assert stats[d.name]["decodes"] and stats[p.name]["prefills"], "no generated request reached the engines"
    finally:
        for proc in (proxy, e, p, d):
            proc.stop()


@pytest.fixture(scope="module")
def metaserver_url(tmp_path_factory):
    logs = tmp_path_factory.mktemp("fuzz-metaserver-logs")
    ms = control("metaserver", logs, "--cluster-token", TOKEN)
    try:
        start_all(ms)
        yield ms.url
    finally:
        ms.stop()


def _wait_healthy(url: str, timeout: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if httpx.get(url + "/health", timeout=5).status_code == 200:
            return
        time.sleep(0.2)
    raise AssertionError(f"proxy at {url} never became healthy")


@PROXY.parametrize()
@FUZZ
def test_proxy_api(case, proxy_url):
    _send(case, proxy_url)


@METASERVER.parametrize()
@FUZZ
def test_metaserver_api(case, metaserver_url):
    _send(case, metaserver_url)
