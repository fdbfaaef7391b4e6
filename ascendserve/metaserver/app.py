"""The metaserver's HTTP API (Litestar).

Registry (cluster token):
    POST /v1/registry/register    Registration        -> 200
    POST /v1/registry/heartbeat   Heartbeat           -> 200, 404 when unknown (register again)
    POST /v1/registry/deregister  Deregistration      -> 200
    GET  /v1/registry/instances[?role=R]              -> RegistryView
Push mode:
    POST /v1/metaserver/expect    (cluster token; the proxy)  -> {"ticket": T}
    POST /v1/metaserver?ticket=T  (decode instances; the ticket is the credential) -> {"status": "ok"} once P is done
Ops (open): GET /health, GET /metrics
Dashboard: GET /dashboard (+ /dashboard/events, SSE): the registry; open on loopback, elsewhere a
    cluster-token login (ascendserve/dashboard/)
Bodies over proxy.max_body_mb get 413 on every route (/expect carries the client's request).
"""

from __future__ import annotations

import asyncio
import contextlib

import msgspec
import structlog
from litestar import Litestar, Request, Response, Router, get, post
from litestar.datastructures import State
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from ascendserve.config import Config
from ascendserve.dashboard.dashboard import Dashboard
from ascendserve.metaserver.push import PushDispatcher, PushError
from ascendserve.metaserver.registry import Registry
from ascendserve.protocol.kv_params import PushPrefillRequest
from ascendserve.protocol.openai import APIError
from ascendserve.protocol.registry import Deregistration, Heartbeat, Registration
from ascendserve.protocol.wire import decode_json
from ascendserve.tls import client_context
from ascendserve.web.auth import bearer_guard
from ascendserve.web.body_limit import body_limit
from ascendserve.web.errors import EXCEPTION_HANDLERS
from ascendserve.web.upstream import Upstream, UpstreamError, engine_headers

log = structlog.get_logger("ascendserve.metaserver")


def _decode(raw: bytes, type_):
    try:
        return decode_json(raw, type_)
    except msgspec.ValidationError as exc:
        raise APIError(400, f"invalid body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise APIError(400, f"body is not valid JSON: {exc}") from None


class _Expect(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    request_id: str
    engine_request_ids: list[str]
    path: str
    body: dict
    prefill_url: str


@post("/v1/registry/register", status_code=200)
async def register(request: Request, state: State) -> dict:
    reg = _decode(await request.body(), Registration)
    if (problem := reg.check()) is not None:
        raise APIError(400, problem)
    state.registry.register(reg)
    log.info("registered", instance=reg.instance_id, role=reg.role, url=reg.url, model=reg.model)
    return {"status": "ok", "heartbeat_timeout_s": state.registry.timeout}


@post("/v1/registry/heartbeat", status_code=200)
async def heartbeat(request: Request, state: State) -> dict:
    hb = _decode(await request.body(), Heartbeat)
    if not state.registry.heartbeat(hb.instance_id, hb.load):
        raise APIError(404, f"unknown instance {hb.instance_id!r}; register again", code="unknown_instance")
    return {"status": "ok"}


@post("/v1/registry/deregister", status_code=200)
async def deregister(request: Request, state: State) -> dict:
    d = _decode(await request.body(), Deregistration)
    if state.registry.remove(d.instance_id):
        log.info("deregistered", instance=d.instance_id)
    return {"status": "ok"}


@get("/v1/registry/instances")
async def instances(state: State, role: str | None = None) -> Response:
    return Response(msgspec.json.encode(state.registry.view(role)), media_type="application/json")


@post("/v1/metaserver/expect", status_code=200)
async def expect(request: Request, state: State) -> dict:
    e = _decode(await request.body(), _Expect)
    try:
        ticket = state.push.expect(e.request_id, e.engine_request_ids, e.path, e.body, e.prefill_url)
    except PushError as exc:
        raise APIError(exc.status, str(exc)) from None
    return {"ticket": ticket}


@post("/v1/metaserver", status_code=200)
async def metaserver(request: Request, state: State, ticket: str = "") -> dict:
    req = _decode(await request.body(), PushPrefillRequest)
    state.metrics_push_asks.inc()
    try:
        return await state.push.ask(ticket, req)
    except PushError as exc:
        log.warning("push prefill refused or failed", request=req.request_id, status=exc.status, error=str(exc))
        raise APIError(exc.status, str(exc), type="server_error" if exc.status >= 500 else "invalid_request_error") from None


@get("/health")
async def health(state: State) -> dict:
    view = state.registry.view()
    counts: dict[str, int] = {}
    for inst in view.instances:
        counts[inst.role] = counts.get(inst.role, 0) + 1
    return {"status": "ok", "instances": counts, "revision": view.revision, "push_pending": state.push.pending()}


@get("/metrics", media_type="text/plain; version=0.0.4")
async def metrics(state: State) -> bytes:
    view = state.registry.view()
    state.metrics_instances.clear()
    for inst in view.instances:
        state.metrics_instances.labels(inst.role).inc()
    return generate_latest(state.metrics_registry)


async def _sweep(state: State, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        for instance_id in state.registry.expire():
            log.warning("instance missed its heartbeat deadline; removed", instance=instance_id)
        state.push.expire()


def create_app(config: Config) -> Litestar:
    ms = config.metaserver
    # push dispatch calls prefill's client API: an engine bound off loopback wants the cluster token there
    upstream = Upstream(request_timeout_s=config.proxy.request_timeout_s,
                        connect_timeout_s=config.proxy.connect_timeout_s,
                        headers=engine_headers(config.cluster.token, config.proxy.backend_api_key),
                        ssl_context=client_context(config.cluster.tls_ca))

    async def post_json(url: str, body: dict, headers: dict) -> dict:
        try:
            return await upstream.post_json(url, body, headers)
        except UpstreamError as exc:
            raise PushError(502, str(exc)) from None

    @contextlib.asynccontextmanager
    async def lifespan(app: Litestar):
        await upstream.start()
        sweeper = asyncio.ensure_future(_sweep(app.state, min(1.0, ms.heartbeat_timeout_s / 3)))
        live = asyncio.ensure_future(dashboard.run())
        try:
            yield
        finally:
            sweeper.cancel()
            live.cancel()
            await asyncio.gather(live, return_exceptions=True)
            await upstream.close()

    registry = CollectorRegistry(auto_describe=True)
    instances_ = Registry(ms.heartbeat_timeout_s)
    push_asks = Counter("ascendserve_metaserver_push_asks", "decode callbacks", registry=registry)
    dashboard = Dashboard.for_metaserver(config, instances_, upstream, push_asks)
    state = State({
        "registry": instances_,
        "push": PushDispatcher(post_json, ms.push_expect_ttl_s),
        "metrics_registry": registry,
        "metrics_instances": Gauge("ascendserve_metaserver_instances", "registered instances", ["role"],
                                   registry=registry),
        "metrics_push_asks": push_asks,
        "stop_hooks": [dashboard.hub.stop],  # web/server: end the dashboard's event streams on SIGTERM
    })
    guard = bearer_guard([config.cluster.token], "cluster token")
    protected = Router(path="/", route_handlers=[register, heartbeat, deregister, instances, expect], guards=[guard])
    return Litestar(
        route_handlers=[protected, metaserver, health, metrics, dashboard.router],
        state=state,
        lifespan=[lifespan],
        exception_handlers=EXCEPTION_HANDLERS,
        request_max_body_size=int(config.proxy.max_body_mb * 1024 * 1024),
        middleware=[body_limit(config.proxy.max_body_mb)],
        openapi_config=None,  # no unauthenticated /schema pages
    )
