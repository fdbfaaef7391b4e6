"""ASGI middleware vLLM's server loads through `--middleware`.

Binds the request id (`x-request-id`, generated when absent) into
structlog's context so every log line emitted while serving the request
carries it, echoes it on the response, and writes one canonical line per
request instead of uvicorn's access log.
"""

from __future__ import annotations

import time
import uuid

import structlog

_log = structlog.get_logger("ascendserve.http")
# Probed every few seconds by proxies and scrapers: keep them out of info logs.
_QUIET_PATHS = frozenset({"/health", "/metrics", "/ping", "/v1/models", "/load"})


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
