"""Refuse an oversized request body on every route, before guards and handlers.

Litestar's `request_max_body_size` counts a body as a handler reads it, which
covers bodies sent without a Content-Length; a route that never reads its
body would take any declared size. This middleware answers 413 (400 for a
malformed Content-Length) from the header alone, on every route.
"""

from __future__ import annotations

import msgspec
from litestar.middleware import DefineMiddleware

from ascendserve.protocol.openai import error_body


class BodyLimit:
    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            for name, value in scope.get("headers", ()):
                if name.lower() == b"content-length":
                    try:
                        size = int(value)
                    except ValueError:
                        size = -1
                    if size < 0:
                        return await _refuse(send, 400, "invalid Content-Length header")
                    if size > self.max_bytes:
                        return await _refuse(send, 413, "request body too large")
        await self.app(scope, receive, send)


async def _refuse(send, status: int, message: str) -> None:
    body = msgspec.json.encode(error_body(message, "invalid_request_error", None, str(status)))
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def body_limit(max_mb: float) -> DefineMiddleware:
    return DefineMiddleware(BodyLimit, max_bytes=int(max_mb * 1024 * 1024))
