"""Refuse an oversized request body on every route, before guards and handlers.

Litestar's `request_max_body_size` counts a body as a handler reads it, which
covers bodies sent without a Content-Length; a route that never reads its
body would take any declared size. This middleware answers 413 (400 for a
malformed Content-Length) from the header alone, on every route.

After a refusal the body the client is still sending is read and dropped (up
to DRAIN_FACTOR times the limit, for at most DRAIN_S) before the connection
closes: closing a socket with unread bytes makes the kernel send a reset,
which discards the refusal from the client's receive buffer, so a client that
had not read it yet saw "server disconnected without a response" instead of
the 413 (a loaded host, test_security's oversized-body test, once in CI).
"""

from __future__ import annotations

import asyncio
import time

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
                        await _refuse(send, 413, "request body too large")
                        return await _drain(receive, DRAIN_FACTOR * max(self.max_bytes, 1 << 20))
        await self.app(scope, receive, send)


DRAIN_FACTOR = 4
DRAIN_S = 2.0


async def _drain(receive, limit: int) -> None:
    """Read and drop what is left of the request body: up to `limit` bytes, for DRAIN_S at most."""
    deadline = time.monotonic() + DRAIN_S
    read = 0
    while read <= limit:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            message = await asyncio.wait_for(receive(), left)
        except (asyncio.TimeoutError, OSError, RuntimeError):
            return
        if message.get("type") != "http.request":
            return
        read += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


async def _refuse(send, status: int, message: str) -> None:
    body = msgspec.json.encode(error_body(message, "invalid_request_error", None, str(status)))
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def body_limit(max_mb: float) -> DefineMiddleware:
    return DefineMiddleware(BodyLimit, max_bytes=int(max_mb * 1024 * 1024))
