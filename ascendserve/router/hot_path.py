"""The client's generation routes (POST /v1/completions, /v1/chat/completions) served on plain ASGI,
in front of the proxy's Litestar app, which serves everything else (and these too, for its test
client and its route listing).

Why: per streamed request Litestar's layers (the signature model, the exception middleware wrapping
every `send`, anyio's task group for the disconnect listener, our body-limit middleware's wrappers)
were a fifth of the proxy's CPU (bench/proxy_profile.py), for two routes whose work is the
pipeline's. What a client sees is the same as through Litestar:
- the body limit first, from Content-Length (400 when malformed, 413 over `max_body_mb`) and while
  reading a body sent without one (413); a refusal before the body was read says
  `connection: close` and drains the rest (web/body_limit.py, why);
- then the API key (`[proxy] api_keys`, web/auth.py: constant time, one warning line, 401);
- errors in OpenAI's shape with the status Litestar's handlers give (web/errors.py);
- a JSON answer with content-length and x-request-id; a stream as text/event-stream, no-cache,
  x-request-id; a client that disconnects mid-stream ends it at once (the engine's request is
  aborted, the lease released: the stream's own finally).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping

import structlog

from ascendserve.protocol.openai import APIError, error_body, parse
from ascendserve.web.auth import matches, presented_token, refused
from ascendserve.web.body_limit import DRAIN_FACTOR, _drain, _refuse, refused_length, send_json

log = structlog.get_logger("ascendserve.proxy")
PATHS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
_SSE = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


async def answer(kind: str, raw: bytes, headers: Mapping, state):
    """One generation request through the pipeline: (request id, pipeline.Reply). Counts it, logs
    its line (a stream logs its own when it ends) and raises APIError for the client."""
    # 32 hex digits, as uuid4().hex gave them, in a third of its time
    request_id = headers.get("x-request-id") or os.urandom(16).hex()
    started = time.monotonic()
    with structlog.contextvars.bound_contextvars(request_id=request_id):
        try:
            body = parse(raw, kind)
            reply = await state.pipeline.handle(kind, body, request_id, headers)
        except APIError as exc:
            state.metrics.requests.labels(kind, str(exc.status)).inc()
            state.metrics.errors.labels("client" if exc.status < 500 else "backend").inc()
            log.info("request", route=kind, status=exc.status, error=exc.message[:200],
                     duration_ms=_ms(started))
            raise
    state.metrics.requests.labels(kind, "200").inc()
    if reply.stream is None:
        log.info("request", request_id=request_id, route=kind, status=200, backend=reply.backend,
                 duration_ms=_ms(started))
    return request_id, reply


def _ms(started: float) -> float:
    return round((time.monotonic() - started) * 1000, 2)


class ClientRoutes:
    """ASGI: the two generation routes here, everything else to `app` (the proxy's Litestar app)."""

    def __init__(self, app):
        self.app = app
        self.state = app.state  # web/server reads its stop hooks
        settings = app.state.settings
        self.accepted = [t for t in settings.api_keys if t]
        self.max_bytes = int(settings.max_body_mb * 1024 * 1024)
        self.drain_limit = DRAIN_FACTOR * max(self.max_bytes, 1 << 20)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            kind = PATHS.get(scope["path"])
            if kind is not None:
                return await self._serve(kind, scope, receive, send)
        return await self.app(scope, receive, send)

    async def _serve(self, kind: str, scope, receive, send) -> None:
        headers: dict[str, str] = {}
        for name, value in scope["headers"]:
            key = name.decode("latin-1").lower()
            if key not in headers:  # the first of repeated fields, as Litestar's Headers.get gives it
                headers[key] = value.decode("latin-1")
        length = headers.get("content-length")
        if length is not None and await refused_length(length, self.max_bytes, self.drain_limit, receive, send) is None:
            return
        presented = presented_token(headers)
        if self.accepted and not matches(presented, self.accepted):
            exc = refused(scope["path"], scope.get("client"), bool(presented), "API key")
            await send_json(send, exc.status, exc.body(), close=True)
            return await _drain(receive, self.drain_limit)
        raw = await self._body(receive, send)
        if raw is None:
            return
        try:
            request_id, reply = await answer(kind, raw, headers, self.state)
        except APIError as exc:
            return await send_json(send, exc.status, exc.body())
        except Exception:
            log.exception("unhandled error", path=scope["path"])
            return await send_json(send, 500, error_body("internal error", "server_error", None, "500"))
        rid = (b"x-request-id", request_id.encode("latin-1", "replace"))
        if reply.stream is None:
            return await send_json(send, 200, reply.body, headers=(rid,))
        await _stream(reply.stream, receive, send, [*_SSE, rid])

    async def _body(self, receive, send) -> bytes | None:
        """The request body, or None when it was refused (413, answered) or the client left."""
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None  # http.disconnect
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await _refuse(send, 413, "request body too large")
                if message.get("more_body", False):
                    await _drain(receive, self.drain_limit)
                return None
            parts.append(chunk)
            if not message.get("more_body", False):
                return parts[0] if len(parts) == 1 else b"".join(parts)


async def _stream(stream, receive, send, fields: list) -> None:
    """The SSE stream to the client. A disconnect (the server's http.disconnect) cancels this task
    where it waits, so the stream's own cleanup runs at once (the engine's request aborted, its lease
    released), as Litestar's disconnect listener did."""
    task = asyncio.current_task()
    state = {"streaming": True, "gone": False}

    def listen(done: asyncio.Future) -> None:
        if done.cancelled() or not state["streaming"]:
            return
        if done.exception() is not None or done.result().get("type") == "http.disconnect":
            state["gone"] = True
            task.cancel()
        else:  # not a disconnect (nothing else is due once the body was read): keep listening
            nonlocal listener
            listener = asyncio.ensure_future(receive())
            listener.add_done_callback(listen)

    async def out(message: dict) -> None:
        try:
            await send(message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the server could not write it: the connection is gone
            raise _ClientGone(repr(exc)) from None

    listener = asyncio.ensure_future(receive())
    listener.add_done_callback(listen)
    try:
        await out({"type": "http.response.start", "status": 200, "headers": fields})
        async for chunk in stream:
            await out({"type": "http.response.body", "body": chunk, "more_body": True})
        state["streaming"] = False
        await out({"type": "http.response.body", "body": b"", "more_body": False})
    except asyncio.CancelledError:
        if not state["gone"]:
            raise
        task.uncancel()  # the client left: this request ends here, normally
    except _ClientGone:
        pass
    finally:
        state["streaming"] = False
        listener.remove_done_callback(listen)
        listener.cancel()
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()  # its cleanup, when it had not ended (GeneratorExit: a client disconnect)


class _ClientGone(Exception):
    pass
