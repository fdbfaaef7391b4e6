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

The same holds for any response that starts before its request body was read
to the end (a route that ignores its body): it says `connection: close` and
the rest is drained, so the client's next request goes on a new connection.
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
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        has_body = False
        for name, value in scope.get("headers", ()):
            name = name.lower()
            if name == b"content-length":
                size = await refused_length(value, self.max_bytes, self.drain_limit, receive, send)
                if size is None:
                    return
                has_body = has_body or size > 0
            elif name == b"transfer-encoding":
                has_body = True
        if not has_body:
            return await self.app(scope, receive, send)
        await self._unread_body_closes(scope, receive, send)

    @property
    def drain_limit(self) -> int:
        return DRAIN_FACTOR * max(self.max_bytes, 1 << 20)

    async def _unread_body_closes(self, scope, receive, send):
        """A response started before the request body was read to its end (a route that ignores its
        body, a 413 counted while reading): it says `connection: close`, so the client does not send
        its next request on a connection the server drops (measured: "server disconnected without
        sending a response" on the next POST), and the rest is drained before the close."""
        done = False

        async def counted():
            nonlocal done
            message = await receive()
            if message.get("type") != "http.request" or not message.get("more_body", False):
                done = True
            return message

        async def closing(message):
            if message.get("type") == "http.response.start" and not done:
                headers = [h for h in message.get("headers", ()) if h[0].lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        await self.app(scope, counted, closing)
        if not done:
            await drain_body(receive, self.drain_limit)


DRAIN_FACTOR = 4
DRAIN_S = 2.0
TOO_LARGE = "request body too large"


async def drain_body(receive, limit: int) -> None:
    """Read and drop what is left of the request body (ASGI `receive`): up to `limit` bytes, for
    DRAIN_S at most."""
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


def declared_size(value: bytes | str) -> int:
    """A Content-Length's size; -1 when malformed."""
    try:
        size = int(value)
    except ValueError:
        return -1
    return size if size >= 0 else -1


def length_refusal(size: int, max_bytes: int) -> tuple[int, str] | None:
    """What a declared size (declared_size) is refused with, if it is: 400 malformed, 413 too large."""
    if size < 0:
        return 400, "invalid Content-Length header"
    if size > max_bytes:
        return 413, TOO_LARGE
    return None


def refusal_body(status: int, message: str) -> dict:
    return error_body(message, "invalid_request_error", None, str(status))


async def refused_length(value: bytes | str, max_bytes: int, drain_limit: int, receive, send) -> int | None:
    """A request's Content-Length: its size, or None once a malformed one was answered 400, or one
    over `max_bytes` 413 (what the client is still sending drained, up to `drain_limit`)."""
    size = declared_size(value)
    refusal = length_refusal(size, max_bytes)
    if refusal is None:
        return size
    await _refuse(send, *refusal)
    if refusal[0] == 413:
        await drain_body(receive, drain_limit)
    return None


async def _refuse(send, status: int, message: str) -> None:
    await send_json(send, status, refusal_body(status, message), close=True)


async def send_json(send, status: int, body: dict, close: bool = False) -> None:
    """A whole JSON answer on plain ASGI; `close`: say `connection: close` (a body left unread)."""
    payload = msgspec.json.encode(body)
    fields = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(payload))]
    if close:
        fields.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": fields})
    await send({"type": "http.response.body", "body": payload})


def body_limit(max_mb: float) -> DefineMiddleware:
    return DefineMiddleware(BodyLimit, max_bytes=int(max_mb * 1024 * 1024))
