"""ASGI middleware vLLM's server loads through `--middleware`.

`ClusterGuard`: with a cluster token, vLLM's routes outside the client API
(`/reset_prefix_cache`, `/start_profile`, `/pause`, `/sleep`,
`/collective_rpc`, LoRA loading, `/docs`, ...: whatever this vLLM serves) need
it, compared in constant time, as `x-cluster-token` or `Authorization:
Bearer`. Open: probes (`/health`, `/ping`, `/ready`, `/version`, `/metrics`,
`/load`) and the client API (`/v1/...`, `/v2/...`, `/inference/...`,
`/tokenize`, `/detokenize`, `/pooling`, `/classify`, `/score`, `/rerank`,
`/invocations`), which vLLM's own `--api-key` guards. An allow-list, so a
route a new vLLM adds is guarded until it is listed here.

`RequestContext`: binds the request id (`x-request-id`, generated when absent) into
structlog's context so every log line emitted while serving the request
carries it, echoes it on the response, and writes one canonical line per
request instead of uvicorn's access log.
"""

from __future__ import annotations

import hmac
import os
import time
import uuid

import structlog

_log = structlog.get_logger("ascendserve.http")
# Probed every few seconds by proxies and scrapers: keep them out of info logs.
_QUIET_PATHS = frozenset({"/health", "/metrics", "/ping", "/v1/models", "/load", "/kv_info", "/cache_info"})


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


class RequestContext:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = _header(scope, b"x-request-id")
        if not request_id:
            request_id = uuid.uuid4().hex
            scope["headers"] = [*scope.get("headers", ()), (b"x-request-id", request_id.encode())]
        status = 500
        start = time.perf_counter()

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", request_id.encode())]
            await send(message)

        with structlog.contextvars.bound_contextvars(request_id=request_id):
            try:
                await self.app(scope, receive, send_with_id)
            finally:
                emit = _log.debug if scope.get("path") in _QUIET_PATHS else _log.info
                emit(
                    "request",
                    method=scope.get("method"),
                    path=scope.get("path"),
                    status=status,
                    duration_ms=round((time.perf_counter() - start) * 1000, 2),
                )


OPEN_PATHS = frozenset({"/health", "/ping", "/ready", "/readyz", "/version", "/metrics", "/load",
                        "/tokenize", "/detokenize", "/pooling", "/classify", "/score", "/rerank", "/invocations"})
OPEN_PREFIXES = ("/v1/", "/v2/", "/inference/")
# under an open prefix, but they change the running server
GUARDED_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
_REFUSED = (b'{"error": {"message": "missing or invalid cluster token", "type": "authentication_error", '
            b'"param": null, "code": "401"}}')


def is_open(path: str) -> bool:
    if path in GUARDED_PATHS:
        return False
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


def presented(scope) -> str:
    """x-cluster-token, else a Bearer credential (the proxy sends both: Authorization is the backend API key)."""
    token = _header(scope, b"x-cluster-token")
    if token is not None:
        return token
    auth = _header(scope, b"authorization") or ""
    return auth[7:].strip() if auth[:7].lower() == "bearer " else ""


class ClusterGuard:
    """Refuses vLLM's admin routes without the cluster token (ASCENDSERVE_CLUSTER_TOKEN,
    set by the role for vLLM's processes); passes everything when there is none."""

    def __init__(self, app, token: str | None = None):
        self.app = app
        self.token = (os.environ.get("ASCENDSERVE_CLUSTER_TOKEN", "") if token is None else token).encode()

    async def __call__(self, scope, receive, send):
        if (not self.token or scope["type"] not in ("http", "websocket")
                or is_open(scope.get("path", ""))
                or hmac.compare_digest(presented(scope).encode(), self.token)):
            return await self.app(scope, receive, send)
        client = (scope.get("client") or ("",))[0]
        _log.warning("authentication failed", credential="cluster token", path=scope.get("path"), client=client,
                     presented=bool(presented(scope)))
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(_REFUSED)).encode())]})
        await send({"type": "http.response.body", "body": _REFUSED})


class InfoRoute:
    """GET `path`: a JSON body the role set in the environment for vLLM's processes, 404 (vLLM's)
    where it set none. /kv_info (ASCENDSERVE_KV_INFO): the KV connector (connector, flow,
    engine_id, kv_port), which the proxy reads when it admits an instance so that it pairs P and
    D of one connector only. /cache_info (ASCENDSERVE_CACHE_INFO): where the instance publishes
    its KV cache events and how it hashes blocks (engine/kv_events.py), for the proxy's routing."""

    def __init__(self, app, path: str, env: str, info: str | None = None):
        self.app, self.path = app, path
        self.body = (os.environ.get(env, "") if info is None else info).encode()

    async def __call__(self, scope, receive, send):
        if not (self.body and scope["type"] == "http" and scope.get("path") == self.path
                and scope.get("method") == "GET"):
            return await self.app(scope, receive, send)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(self.body)).encode())]})
        await send({"type": "http.response.body", "body": self.body})


def KVInfo(app, info: str | None = None) -> InfoRoute:
    return InfoRoute(app, "/kv_info", "ASCENDSERVE_KV_INFO", info)


def CacheInfo(app, info: str | None = None) -> InfoRoute:
    return InfoRoute(app, "/cache_info", "ASCENDSERVE_CACHE_INFO", info)


class EngineMiddleware:
    """What engine roles pass as vLLM's one `--middleware` (vLLM warns on a repeated flag):
    the request context outermost, so refused requests are logged with their id too."""

    def __init__(self, app):
        self.app = RequestContext(KVInfo(CacheInfo(ClusterGuard(app))))

    async def __call__(self, scope, receive, send):
        return await self.app(scope, receive, send)
