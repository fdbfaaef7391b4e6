"""ASGI middleware vLLM's server loads through `--middleware`.

`ClusterGuard`: with a cluster token, vLLM's routes outside the client API
(`/reset_prefix_cache`, `/start_profile`, `/pause`, `/sleep`,
`/collective_rpc`, LoRA loading, `/docs`, ...: whatever this vLLM serves) need
it, compared in constant time, as `x-cluster-token` or `Authorization:
Bearer`. Always open: the probes (`/health`, `/ping`, `/ready`, `/version`,
`/metrics`, `/load`, `/kv_info`, `/cache_info`). The client API (`/v1/...`,
`/v2/...`, `/inference/...`, `/tokenize`, `/detokenize`, `/pooling`,
`/classify`, `/score`, `/rerank`, `/invocations`) is open on a loopback bind;
bound anywhere else it takes the cluster token or one of the API keys vLLM
itself accepts (`--api-key`, `VLLM_API_KEY`), so that a client on the network
cannot go around the proxy (its API keys, limits and routing): the proxy
sends the token with every request. An allow-list, so a route a new vLLM adds
is guarded until it is listed here.

`RequestContext`: binds the request id (`x-request-id`, generated when absent) into
structlog's context so every log line emitted while serving the request
carries it, echoes it on the response, and writes one canonical line per
request instead of uvicorn's access log.
"""

from __future__ import annotations

import hmac
import json
import os
import time
import uuid

import structlog

from ascendserve.security import is_loopback

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


PROBE_PATHS = frozenset({"/health", "/ping", "/ready", "/readyz", "/version", "/metrics", "/load",
                         "/kv_info", "/cache_info"})
CLIENT_PATHS = frozenset({"/tokenize", "/detokenize", "/pooling", "/classify", "/score", "/rerank",
                          "/invocations"})
CLIENT_PREFIXES = ("/v1/", "/v2/", "/inference/")
# under a client prefix, but they change the running server
GUARDED_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
# What the role tells vLLM's processes (engine/vllm_server.guard_env): the address vLLM binds and
# the API keys vLLM accepts (a JSON list).
HOST_ENV, API_KEYS_ENV = "ASCENDSERVE_ENGINE_HOST", "ASCENDSERVE_ENGINE_API_KEYS"


def _refusal(message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "authentication_error", "param": None,
                                 "code": "401"}}).encode()


_REFUSED = _refusal("missing or invalid cluster token")
_REFUSED_CLIENT = _refusal("missing or invalid cluster token or API key: this engine serves its client API to "
                           "the cluster only; send requests through the proxy")


def is_probe(path: str) -> bool:
    return path in PROBE_PATHS


def is_client_api(path: str) -> bool:
    return path not in GUARDED_PATHS and (path in CLIENT_PATHS or path.startswith(CLIENT_PREFIXES))


def is_open(path: str) -> bool:
    """Open without the token on a loopback bind: the probes and the client API."""
    return is_probe(path) or is_client_api(path)


def _bearer(scope) -> str:
    auth = _header(scope, b"authorization") or ""
    return auth[7:].strip() if auth[:7].lower() == "bearer " else ""


def presented(scope) -> str:
    """x-cluster-token, else a Bearer credential (the proxy sends both: Authorization is the backend API key)."""
    token = _header(scope, b"x-cluster-token")
    return token if token is not None else _bearer(scope)


def _matches(credential: str, accepted: list[bytes]) -> bool:
    ok = False
    for value in accepted:  # no early exit: timing does not tell which one matched
        ok |= hmac.compare_digest(credential.encode(), value)
    return ok


class ClusterGuard:
    """Refuses vLLM's admin routes without the cluster token (ASCENDSERVE_CLUSTER_TOKEN, set by
    the role for vLLM's processes), and its client API too when vLLM is bound off loopback
    (ASCENDSERVE_ENGINE_HOST, set by engine/vllm_server.guard_env; without it, and without `host`,
    the guard takes the bind for a loopback one, as the test stubs' is), unless an API key vLLM
    accepts (ASCENDSERVE_ENGINE_API_KEYS) is presented instead. Passes everything when there is
    no token: nothing to check against (security.security_warnings warns of an engine open off
    loopback)."""

    def __init__(self, app, token: str | None = None, host: str | None = None, api_keys: list[str] | None = None):
        self.app = app
        self.token = (os.environ.get("ASCENDSERVE_CLUSTER_TOKEN", "") if token is None else token).encode()
        host = os.environ.get(HOST_ENV, "127.0.0.1") if host is None else host
        self.client_api_open = not self.token or is_loopback(host)
        if api_keys is None:
            api_keys = json.loads(os.environ.get(API_KEYS_ENV) or "[]")
        self.api_keys = [k.encode() for k in api_keys if k]

    def _admits(self, scope, client_api: bool) -> bool:
        """The token as x-cluster-token or Bearer; on the client API, a Bearer API key too."""
        token = _header(scope, b"x-cluster-token")
        bearer = _bearer(scope)
        ok = _matches(token, [self.token]) if token is not None else False
        ok |= _matches(bearer, [self.token, *(self.api_keys if client_api else [])])
        return ok

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if not self.token or scope["type"] not in ("http", "websocket") or is_probe(path):
            return await self.app(scope, receive, send)
        client_api = is_client_api(path)
        if (client_api and self.client_api_open) or self._admits(scope, client_api):
            return await self.app(scope, receive, send)
        client = (scope.get("client") or ("",))[0]
        _log.warning("authentication failed", credential="cluster token or API key" if client_api else "cluster token",
                     path=path, client=client, presented=bool(presented(scope)))
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        body = _REFUSED_CLIENT if client_api else _REFUSED
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


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
