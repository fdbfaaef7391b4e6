"""The proxy's HTTP API (Litestar). Client routes take the API key; admin routes the cluster token.

Client:  POST /v1/chat/completions, POST /v1/completions, GET /v1/models
Ops:     GET /health (per role; 503 saying what is missing until every role the topology needs has a
         healthy instance; GET /v1/models answers the same 503 until then),
         GET /healthcheck (vllm-ascend's counts), GET /metrics (Prometheus)
Admin:   POST /instances/add, POST /instances/remove (vllm-ascend bodies), GET /instances,
         POST /start_profile, /stop_profile, /reset_prefix_cache (fan-out)
Dashboard: GET /dashboard (+ /dashboard/events, SSE): open on loopback, elsewhere a cluster-token login
         (ascendserve/dashboard/)
"""

from __future__ import annotations

import asyncio
import contextlib

import msgspec
import structlog
from litestar import Litestar, Request, Response, Router, get, post
from litestar.datastructures import State
from litestar.response import Stream

from ascendserve.config import Config, ConfigError, environ
from ascendserve.config_checks import instance_url
from ascendserve.dashboard.dashboard import Dashboard
from ascendserve.dashboard.events import compose
from ascendserve.protocol.openai import APIError, error_body
from ascendserve.protocol.wire import decode_json
from ascendserve.discovery.etcd import EtcdSettings
from ascendserve.router.discovery import EtcdWatch, MetaserverWatch
from ascendserve.router.health import HealthMonitor
from ascendserve.router.hot_path import answer
from ascendserve.router.kv_index import KVEvents, follow_states, reachable, sync
from ascendserve.router.kv_route import KVRouter
from ascendserve.router.ec import ECLookup
from ascendserve.router.metrics import ProxyMetrics
from ascendserve.router.pipeline import Pipeline
from ascendserve.router.pools import ACTIVE, DRAINING, ROLES, Pools, Readiness
from ascendserve.router.tracing import Tracing
from ascendserve.router.workers import Leader, Mirror, Relay, SharedSessions, Worker
from ascendserve.tls import client_context
from ascendserve.web.auth import bearer_guard
from ascendserve.web.body_limit import body_limit
from ascendserve.web.errors import EXCEPTION_HANDLERS
from ascendserve.web.upstream import Upstream, UpstreamError, engine_headers

log = structlog.get_logger("ascendserve.proxy")
ADMIN_TYPES = ("prefill", "decode", "encoder", "pd")
ADMIN_CONFIRM_S = 5.0  # a follower worker waits this long for worker 0 to make an admin change


async def _serve(kind: str, request: Request, state: State) -> Response | Stream:
    """Through Litestar (its test client, the route listing); a running proxy serves these two routes
    on plain ASGI in front of it (router/hot_path.py), with the same answers."""
    request_id, reply = await answer(kind, await request.body(), request.headers, state)
    headers = {"x-request-id": request_id}
    if reply.stream is None:
        return Response(msgspec.json.encode(reply.body), media_type="application/json", headers=headers)
    # The stream writes its own canonical line when it ends (pipeline._relay).
    return Stream(reply.stream, media_type="text/event-stream", headers={**headers, "cache-control": "no-cache"})


@post("/v1/chat/completions", status_code=200)
async def chat(request: Request, state: State) -> Response | Stream:
    return await _serve("chat", request, state)


@post("/v1/completions", status_code=200)
async def completions(request: Request, state: State) -> Response | Stream:
    return await _serve("completions", request, state)


@get("/v1/models")
async def models(state: State) -> dict:
    """The engines' model list, as vLLM gives it; 503 with what is missing until the topology can serve."""
    ready = _readiness(state)
    if not ready.ok:
        raise APIError(503, ready.message, type="service_unavailable", code="no_healthy_instance")
    return {"object": "list", "data": state.pools.model_cards()}


def _readiness(state: State) -> Readiness:
    """What /health and /v1/models report: the roles this proxy's topology needs, each with a healthy
    instance? Encoders are optional unless the proxy may not fall back to local encoding."""
    ready = state.pools.readiness(encoders_required=state.settings.encoder_fallback == "fail")
    if ready.ok and (why := state.pipeline.push_missing()):
        ready.ok = False
        ready.missing.append(why)
    watch = state.watch
    if not ready.ok and watch is not None and not watch.reachable:
        ready.missing.append(f"{watch.where} unreachable")
    return ready


@get("/healthcheck")
async def healthcheck(state: State) -> dict:
    pools: Pools = state.pools
    return {"status": "ok", **{f"{r}_instances": len(pools[r].active()) for r in ROLES},
            "request_num": pools.in_flight()}


@get("/health")
async def health(state: State) -> Response:
    """200 once every role the topology needs has a healthy instance; else 503 saying what is missing
    (`missing`, and as an OpenAI-style `error`)."""
    ready = _readiness(state)
    if ready.ok:
        return Response({"status": "ok", "roles": ready.roles}, status_code=200)
    return Response({"status": "degraded", "roles": ready.roles, "missing": ready.missing,
                     **error_body(ready.message, "service_unavailable", None, "no_healthy_instance")},
                    status_code=503)


@get("/metrics", media_type="text/plain; version=0.0.4")
async def metrics(state: State) -> bytes:
    return state.metrics.render()


class _AdminBody(msgspec.Struct, forbid_unknown_fields=False):
    type: str
    instances: list[str] | str


def _admin_body(raw: bytes) -> tuple[str, list[str]]:
    try:
        body = decode_json(raw, _AdminBody)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise APIError(400, f"invalid body: {exc}; expected {{\"type\": \"prefill\"|\"decode\", "
                            "\"instances\": [\"host:port\", ...]}") from None
    if body.type not in ADMIN_TYPES:
        raise APIError(400, f"Instance type '{body.type}' is not supported. Only "
                            f"{', '.join(repr(t) for t in ADMIN_TYPES)} are allowed.", param="type")
    addresses = [body.instances] if isinstance(body.instances, str) else body.instances
    try:
        return body.type, [instance_url("instances", a) for a in addresses]
    except ConfigError as exc:
        raise APIError(400, str(exc), param="instances") from None


def _current(pools: Pools) -> dict:
    return {f"current_{r}_instances": [i.url for i in pools[r].instances.values() if i.state != "draining"]
            for r in ADMIN_TYPES}


@post("/instances/add", status_code=200)
async def instances_add(request: Request, state: State) -> dict:
    role, urls = _admin_body(await request.body())
    if state.mirror is not None:  # another worker than 0: worker 0 adds them, and this one waits to see it
        await _through_worker_0(state, "add", role, urls,
                                lambda: all(u in state.pools[role].instances for u in urls))
    else:
        for url in urls:
            _add(state.pools, state.health, state.dashboard, role, url, "through /instances/add")
        if state.leader is not None:
            state.leader.publish()  # the other workers see it within their next look
    log.info("instances added (probing)", role=role, urls=urls)
    return {"message": f"Instances {urls} are waiting to be added.", **_current(state.pools)}


@post("/instances/remove", status_code=200)
async def instances_remove(request: Request, state: State) -> dict:
    role, urls = _admin_body(await request.body())
    draining = [u for u in urls if (i := state.pools[role].instances.get(u)) is not None and i.total_requests]
    if state.mirror is not None:
        pool = state.pools[role]
        await _through_worker_0(state, "drain", role, urls, lambda: all(
            (i := pool.instances.get(u)) is None or i.state == DRAINING for u in urls))
    else:
        for url in urls:
            _drain(state.pools, state.dashboard, role, url)
        if state.leader is not None:
            state.leader.publish()
    log.info("instances removed", role=role, urls=urls, draining=draining)
    message = (f"Instances {draining} are isolated and waiting to be removed." if draining
               else f"remove {role} instances: {urls}.")
    return {"message": message, **_current(state.pools)}


async def _through_worker_0(state: State, op: str, role: str, urls: list[str], done) -> None:
    """An admin change made by worker 0, which decides membership for every worker; answered
    once this worker's copy of its table shows it (the others look as often)."""
    for url in urls:
        state.relay.tell(op, role, url)
    if not await state.mirror.until(done, ADMIN_CONFIRM_S):
        raise APIError(503, f"proxy worker 0 did not confirm the change within {ADMIN_CONFIRM_S:.0f} s "
                            "(it may be restarting); send it again", type="service_unavailable",
                       code="worker_unavailable")


def _add(pools: Pools, health, dashboard: Dashboard, role: str, url: str, how: str) -> None:
    pools[role].add(url, source="admin")
    dashboard.feed.add("added", role, url, "probing", how)
    health.wake()


def _drain(pools: Pools, dashboard: Dashboard, role: str, url: str):
    inst = pools[role].drain(url)
    if inst is not None:
        dashboard.feed.add("draining", role, url, inst.state, "through /instances/remove")
    return inst


@get("/instances")
async def instances_list(state: State) -> dict:
    return {"instances": [i.summary() for i in state.pools.all_instances()],
            "metaservers": state.pipeline.metaservers()}


async def _fan_out(state: State, path: str) -> Response:
    targets = [i for i in state.pools.all_instances() if i.state == ACTIVE]

    async def one(url: str):
        try:
            # engines guard their admin routes with the cluster token (engine/middleware.ClusterGuard):
            # every request to an engine carries it (web/upstream.engine_headers)
            status, _ = await state.upstream.post(url + path, 30.0)
            return url, status
        except UpstreamError:
            return url, None

    results = await asyncio.gather(*(one(i.url) for i in targets))
    failed = [url for url, status in results if status is None or status >= 300]
    return Response({"ok": [u for u, _ in results if u not in failed], "failed": failed},
                    status_code=500 if failed else 200)


@post("/start_profile", status_code=200)
async def start_profile(state: State) -> Response:
    return await _fan_out(state, "/start_profile")


@post("/stop_profile", status_code=200)
async def stop_profile(state: State) -> Response:
    return await _fan_out(state, "/stop_profile")


@post("/reset_prefix_cache", status_code=200)
async def reset_prefix_cache(state: State) -> Response:
    return await _fan_out(state, "/reset_prefix_cache")


def create_app(config: Config, worker: Worker | None = None) -> Litestar:
    """The proxy's app; `worker`: one of several proxy processes (router/workers.py), worker 0
    deciding health and membership for all, the others mirroring it."""
    settings = config.proxy
    pools = Pools()
    if worker is not None:
        counters = worker.counters()
        pools.share(counters)
    for role in ROLES:
        for url in getattr(settings, role):
            pools[role].add(url, source="static")
    follower = worker is not None and not worker.leader
    backend_headers = engine_headers(config.cluster.token, settings.backend_api_key)
    upstream = Upstream(settings.request_timeout_s, settings.connect_timeout_s, backend_headers,
                        client_context(config.cluster.tls_ca))
    metrics_ = ProxyMetrics(pools, worker.metrics_dir if worker is not None else None)
    events = kv_router = None
    if settings.routing == "kv":
        events = KVEvents(settings.kv_index_max_blocks, can_reach=reachable)
        kv_router = KVRouter(pools, upstream, events, settings, metrics_)
        metrics_.watch_kv(events)
    kv_hooks = (follow_states(events), lambda: sync(events, pools)) if events is not None else ()
    health_ = Relay(worker) if follower else HealthMonitor(pools, upstream, settings, *kv_hooks)
    if follower:
        counters.on_learned = lambda inst: health_.tell("fingerprint", inst.role, inst.url, inst.fingerprint or "")
    if follower and events is not None:
        health_.on_state = kv_hooks[0]
    dashboard = Dashboard.for_proxy(config, pools, metrics_, upstream,
                                    SharedSessions(worker.shared) if worker is not None else None)
    health_.on_state = compose(health_.on_state, dashboard.feed.on_state)  # beside the KV index's hook
    watch = mirror = leader = None
    static = [config.cluster.metaserver_url.rstrip("/")] if config.cluster.metaserver_url else []
    if follower:
        mirror = Mirror(worker, pools, on_state=health_.on_state, after=kv_hooks[1] if kv_hooks else None)
    elif config.registry.backend == "etcd":
        watch = EtcdWatch(pools, health_, EtcdSettings.from_config(config), settings.health_timeout_s)
    elif config.cluster.metaserver_url:
        watch = MetaserverWatch(pools, upstream, health_, config.cluster.metaserver_url, config.cluster.token,
                                settings.registry_poll_s, settings.health_timeout_s,
                                2 * config.metaserver.heartbeat_timeout_s)
    if watch is not None:
        watch.on_event = dashboard.feed.on_registry  # joins, leaves, restarts: the dashboard's feed
    metaservers = None
    if config.registry.backend == "etcd":
        metaservers = (lambda: mirror.metaservers) if follower else (lambda: watch.metaservers or static)
    pipeline = Pipeline(pools, upstream, settings, metrics_, health_.report_failure,
                        config.cluster.metaserver_url, config.cluster.token,
                        ECLookup.from_config(config.ec, settings.mm_hash_algorithm), health_.suspect,
                        health_.wake, kv_router, metaservers=metaservers,
                        tracer=Tracing.from_env(environ()))  # None unless OTEL_* turns traces on
    if worker is not None and worker.leader:
        leader = Leader(worker, pools, health_, pipeline.metaservers)
        leader.on_add = lambda role, url: _add(pools, health_, dashboard, role, url, "through another worker")
        leader.on_drain = lambda role, url: _drain(pools, dashboard, role, url)
        # a P/D connector mismatch is logged once, here, whichever worker's requests meet it
        leader.on_change = lambda: pipeline.pairing.check(pools["prefill"].active(), pools["decode"].active())
        health_.on_state = compose(health_.on_state, lambda inst, state, before: leader.publish())
    pipeline.pairing.quiet = follower

    @contextlib.asynccontextmanager
    async def lifespan(app: Litestar):
        await upstream.start()
        if mirror is not None:
            mirror.poll()  # the leader's table before the first request, when it has one
        tasks = [asyncio.ensure_future(mirror.run() if mirror is not None else health_.run())]
        if leader is not None:
            tasks.append(asyncio.ensure_future(leader.run()))
        tasks.append(asyncio.ensure_future(dashboard.run()))
        if watch is not None:
            tasks.append(asyncio.ensure_future(watch.run()))
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if events is not None:
                await events.close()
            await upstream.close()
            if pipeline.ec_lookup is not None:
                pipeline.ec_lookup.close()
            if pipeline.tracing is not None:
                await pipeline.tracing.close()  # what is left is exported

    state = State({"pools": pools, "pipeline": pipeline, "metrics": metrics_, "health": health_,
                   "upstream": upstream, "watch": watch, "settings": settings, "dashboard": dashboard,
                   "relay": health_ if follower else None, "mirror": mirror, "leader": leader,
                   "stop_hooks": [dashboard.hub.stop]})  # web/server: end the event streams on SIGTERM
    client = Router(path="/", route_handlers=[chat, completions, models],
                    guards=[bearer_guard(settings.api_keys, "API key")])
    admin = Router(path="/", route_handlers=[instances_add, instances_remove, instances_list, start_profile,
                                             stop_profile, reset_prefix_cache],
                   guards=[bearer_guard([config.cluster.token], "cluster token")])
    return Litestar(
        route_handlers=[client, admin, healthcheck, health, metrics, dashboard.router],
        state=state,
        lifespan=[lifespan],
        exception_handlers=EXCEPTION_HANDLERS,
        request_max_body_size=int(settings.max_body_mb * 1024 * 1024),
        middleware=[body_limit(settings.max_body_mb)],
        openapi_config=None,  # no unauthenticated /schema pages
    )
