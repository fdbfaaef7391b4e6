"""A backend's SSE stream on its way to the client: whole events only (SSEFramer), their payloads
(payloads) and an event written as vLLM writes it (encode), the error event the proxy writes when a
backend breaks, and the plain relay of requests the ledger does not follow
(they cannot migrate: n > 1, echo, structured output, tools; or migration_limit = 0)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import msgspec
import structlog

from ascendserve.protocol.openai import error_body
from ascendserve.router import tracing
from ascendserve.router.metrics import ProxyMetrics
from ascendserve.router.pools import Lease
from ascendserve.web.upstream import UpstreamError

log = structlog.get_logger("ascendserve.router")
CHOICE = b'"choices":[{'  # in a streamed chunk as vLLM writes it (compact JSON)
DONE = b"data: [DONE]\n\n"


class SSEFramer:
    """Passes a backend's SSE bytes on in whole events only (up to the last blank line), so a
    backend that dies mid-event never leaves the client half an event before our error event.
    An event longer than `max_held` is passed on as it comes (the bound on what is held)."""

    def __init__(self, max_held: int = 1 << 20):
        self.held = b""
        self.max_held = max_held

    def feed(self, chunk: bytes) -> bytes:
        data = self.held + chunk if self.held else chunk
        cut = data.rfind(b"\n\n")
        if cut < 0 and len(data) <= self.max_held:
            self.held = data
            return b""
        end = len(data) if cut < 0 else cut + 2
        self.held = data[end:]
        return data[:end]

    def flush(self) -> bytes:
        """What the backend sent after its last whole event, at a clean end of the stream."""
        out, self.held = self.held, b""
        return out


def payloads(data: bytes) -> tuple[list[bytes], bool]:
    """Whole SSE events (SSEFramer's output) -> their JSON payloads (not decoded), and whether [DONE] came."""
    if data.startswith(b"data: ") and data.endswith(b"\n\n"):  # vLLM's: one "data: " line per event
        parts = data[6:-2].split(b"\n\ndata: ")  # (JSON escapes a newline: no payload holds one)
        if data.count(b"\n") == 2 * len(parts) and b"" not in parts:
            done = parts[-1] == b"[DONE]"
            if done:
                parts.pop()
            if b"[DONE]" not in parts:
                return parts, done
    out, done = [], False
    for block in data.split(b"\n\n"):
        if block.startswith(b"data: {") and b"\n" not in block:  # one line, as vLLM writes every event
            out.append(block[6:])
            continue
        for line in block.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                done = True
            elif payload:
                out.append(payload)
    return out, done


_encode = msgspec.json.Encoder().encode


def encode(event: dict) -> bytes:
    """One event as SSE bytes, compact JSON as vLLM writes it."""
    return b"data: " + _encode(event) + b"\n\n"


def sse_error(message: str, code: int = 502) -> bytes:
    return encode(error_body(message, "server_error", None, str(code))) + DONE


async def first_chunk(response, url: str) -> bytes:
    try:
        chunk = await response.content.readany()
    except Exception as exc:
        raise UpstreamError(url, None, f"stream broke before the first byte: {exc!r}") from None
    if not chunk:
        raise UpstreamError(url, None, "stream ended before the first byte")
    return chunk


async def relay(metrics: ProxyMetrics, lease: Lease, response, first: bytes, started: float, kind: str,
                request_id: str) -> AsyncIterator[bytes]:
    """A backend's stream to the client as it comes, in whole events (a request the ledger does not
    follow: it cannot migrate); an error event if the backend breaks mid-stream."""
    ok = False
    outcome = "backend_failed"
    framer = SSEFramer()
    # vLLM streams a token per chunk: chunks with a choice (not the usage chunk, not [DONE]) stand for tokens
    first_at, chunks = time.monotonic(), 0
    answered = None  # when the client's answer was whole: its [DONE] sent (the engine may end later)
    try:
        if whole := framer.feed(first):
            chunks += whole.count(CHOICE)
            yield whole
            answered = time.monotonic() if whole.endswith(DONE) else None
        async for chunk in response.content.iter_any():
            if whole := framer.feed(chunk):
                chunks += whole.count(CHOICE)
                yield whole
                answered = time.monotonic() if whole.endswith(DONE) else None
        if rest := framer.flush():
            chunks += rest.count(CHOICE)
            yield rest
            answered = None
        ok, outcome = True, "ok"
        metrics.observe_itl(first_at, chunks, answered)
    except (asyncio.CancelledError, GeneratorExit):
        outcome = "client_disconnected"
        metrics.cancelled.inc()
        raise
    except Exception as exc:  # the backend broke mid-stream
        metrics.errors.labels("mid_stream").inc()
        tracing.failed(f"backend failed mid-stream: {exc!r}")
        log.warning("backend failed mid-stream", url=lease.instance.url, error=repr(exc),
                    dropped_partial_event_bytes=len(framer.held))
        yield sse_error(f"backend {lease.instance.role} instance failed mid-stream: {type(exc).__name__}")
    finally:
        response.close()  # on cancellation this aborts the request on the backend
        lease.release(ok=ok)
        if ok:
            metrics.observe_done(started, answered)
        log.info("request", request_id=request_id, route=kind, status=200, stream=True,
                 backend=lease.instance.url, outcome=outcome,
                 duration_ms=round(((answered if ok and answered else time.monotonic()) - started) * 1000, 2))
