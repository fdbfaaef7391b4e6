"""The client's generation routes (POST /v1/completions, /v1/chat/completions) served on granian's
RSGI interface directly, in front of the proxy's Litestar app, which serves everything else (over
web/rsgi.py's ASGI adapter) and these too when it is served on ASGI (its test client, its route
listing).

Why: per streamed request Litestar's layers (the signature model, the exception middleware wrapping
every `send`, anyio's task group for the disconnect listener, our body-limit middleware's wrappers)
were a fifth of the proxy's CPU (bench/proxy_profile.py), for two routes whose work is the
pipeline's; ASGI's own messages, even through the adapter, another twentieth. What a client sees is
the same as through Litestar:
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
from granian.rsgi import ProtocolClosed

from ascendserve.protocol.openai import APIError, error_body, parse
from ascendserve.router.sse import DONE
from ascendserve.web.auth import matches, presented_token, refused
from ascendserve.web.body_limit import DRAIN_FACTOR, TOO_LARGE, declared_size, length_refusal, refusal_body
from ascendserve.web.rsgi import ASGIOverRSGI, address, drain, next_chunk, respond_json

log = structlog.get_logger("ascendserve.proxy")
PATHS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
_SSE = [("content-type", "text/event-stream; charset=utf-8"), ("cache-control", "no-cache")]


async def answer(kind: str, raw: bytes, headers: Mapping, state):
    """One generation request through the pipeline: (request id, pipeline.Reply). Counts it, logs
    its line (a stream logs its own when it ends) and raises APIError for the client."""
    # 32 hex digits, as uuid4().hex gave them, in a third of its time
    request_id = headers.get("x-request-id") or os.urandom(16).hex()
    started = time.monotonic()
    # bound for the rest of this request's task, its stream included (each request is a task of its
    # own, with its own copy of the context): no reset, which would read every bound variable first
    structlog.contextvars.bind_contextvars(request_id=request_id)
    try:
        body = parse(raw, kind)
        reply = await state.pipeline.handle(kind, body, request_id, headers)
    except APIError as exc:
        state.metrics.requests.labels(kind, str(exc.status)).inc()
        state.metrics.errors.labels("client" if exc.status < 500 else "backend").inc()
        log.info("request", route=kind, status=exc.status, error=exc.message[:200], duration_ms=_ms(started))
        raise
    state.metrics.requests.labels(kind, "200").inc()
    if reply.stream is None:
        log.info("request", request_id=request_id, route=kind, status=200, backend=reply.backend,
                 duration_ms=_ms(started))
    return request_id, reply


def _ms(started: float) -> float:
    return round((time.monotonic() - started) * 1000, 2)


class ClientRoutes:
    """RSGI: the two generation routes here, everything else to `app` (the proxy's Litestar app,
    ASGI). web/server serves it through `over_rsgi`; on ASGI (`__call__`) it is the app alone."""

    def __init__(self, app):
        self.app = app
        self.state = app.state  # web/server reads its stop hooks
        settings = app.state.settings
        self.accepted = [t for t in settings.api_keys if t]
        self.max_bytes = int(settings.max_body_mb * 1024 * 1024)
        self.drain_limit = DRAIN_FACTOR * max(self.max_bytes, 1 << 20)
        self.others = ASGIOverRSGI(app)

    def __call__(self, scope, receive, send):  # ASGI: the lifespan, or a server without RSGI
        return self.app(scope, receive, send)

    def over_rsgi(self, state: dict) -> ClientRoutes:
        """What web/server hands granian: this, the app's other routes given the lifespan's state."""
        self.others = ASGIOverRSGI(self.app, state)
        return self

    async def __rsgi__(self, scope, proto) -> None:
        if scope.proto == "http" and scope.method == "POST":
            kind = PATHS.get(scope.path)
            if kind is not None:
                return await self._serve(kind, scope, proto)
        return await self.others.__rsgi__(scope, proto)

    async def _serve(self, kind: str, scope, proto) -> None:
        headers = scope.headers  # granian's: get() gives the first of repeated fields, as Litestar's does
        length = headers.get("content-length")
        refusal = None if length is None else length_refusal(declared_size(length), self.max_bytes)
        if refusal is not None:
            respond_json(proto, refusal[0], refusal_body(*refusal), close=True)
            return await drain(proto, self.drain_limit) if refusal[0] == 413 else None
        presented = presented_token(headers)
        if self.accepted and not matches(presented, self.accepted):
            exc = refused(scope.path, address(scope.client), bool(presented), "API key")
            respond_json(proto, exc.status, exc.body(), close=True)
            return await drain(proto, self.drain_limit)
        raw = await self._body(proto)
        if raw is None:
            return
        try:
            request_id, reply = await answer(kind, raw, headers, self.state)
        except APIError as exc:
            return respond_json(proto, exc.status, exc.body())
        except Exception:
            log.exception("unhandled error", path=scope.path)
            return respond_json(proto, 500, error_body("internal error", "server_error", None, "500"))
        rid = ("x-request-id", request_id)
        if reply.stream is None:
            return respond_json(proto, 200, reply.body, headers=(rid,))
        await _stream(reply.stream, proto, [*_SSE, rid])

    async def _body(self, proto) -> bytes | None:
        """The request body, or None when it was refused (413, answered) or the client left."""
        parts, size = [], 0
        body = proto.__aiter__()  # the protocol itself, which may be iterated once only
        while True:
            try:
                chunk = await next_chunk(body)
            except ProtocolClosed:  # the client went while sending it
                return None
            if not chunk:
                return parts[0] if len(parts) == 1 else b"".join(parts)
            size += len(chunk)
            if size > self.max_bytes:
                respond_json(proto, 413, refusal_body(413, TOO_LARGE), close=True)
                await drain(proto, self.drain_limit, body)
                return None
            parts.append(chunk)


async def _stream(stream, proto, fields: list) -> None:
    """The SSE stream to the client. The client's disconnect cancels this task where it waits, so
    the stream's own cleanup runs at once (the engine's request aborted, its lease released), as
    Litestar's disconnect listener did."""
    task = asyncio.current_task()
    state = {"streaming": True, "gone": False}

    def listen(done: asyncio.Future) -> None:
        if not done.cancelled() and state["streaming"]:
            state["gone"] = True
            task.cancel()

    listener = asyncio.ensure_future(proto.client_disconnect())
    listener.add_done_callback(listen)
    transport = proto.response_stream(200, fields)
    warned = False  # of what a stream sent after its [DONE]
    try:
        async for chunk in stream:
            if transport is None:
                if not warned:  # once a stream
                    log.warning("stream went on after its [DONE]; dropped", bytes=len(chunk))
                    warned = True
                continue
            await transport.send_bytes(chunk)
            if chunk.endswith(DONE):
                # the client's answer is whole: it ends now (the transport released), and the
                # stream's own bookkeeping after it (the engine's connection back to its pool, the
                # lease, the metrics, the request's log line) is no longer on the client's wait
                state["streaming"] = False  # a client leaving now no longer cancels that bookkeeping
                transport = None
    except asyncio.CancelledError:
        if not state["gone"]:
            raise
        task.uncancel()  # the client left: this request ends here, normally
    except ProtocolClosed:  # granian could not write it: the client is gone
        pass
    finally:
        state["streaming"] = False
        listener.remove_done_callback(listen)
        listener.cancel()
        transport = None  # what ends the response (web/rsgi.py: a transport still referred to keeps it open)
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()  # its cleanup, when it had not ended (GeneratorExit: a client disconnect)
