"""OpenTelemetry traces of the proxy's requests, across its hops; off unless OTEL_* asks.

One trace per client request (ascendserve/otel_env.py says when traces are on and where they go):

    POST /v1/chat/completions  SERVER, the whole request, to the client's last byte; its
                               route, model, stream and request id (ascendserve.request_id,
                               the x-request-id the proxy answers with and sends each engine)
      encode                   CLIENT, one per encoder call (one per item under `fanout`)
      prefill                  CLIENT, P's max_tokens=1 answer
      kv_transfer              from P's answer to D's first byte, while P holds the KV for D:
                               D's request, its pull of the KV and its first step. D's answers
                               carry no transfer timing; vLLM's own spans on D split it.
      decode                   CLIENT, D's (or PD's) stream to its last byte, a first_byte event
Every attempt at a hop is a span of its own: one that fails (and is retried elsewhere) or a
leg that breaks mid-stream (and is continued by a migration) ends with status ERROR and the
error; the legs after a migration carry ascendserve.migration = n. Events on the request's
span: encoder_fallback, encoder_skipped, migration. A client's own traceparent is continued.

Each hop's request carries W3C `traceparent` (and `tracestate`) naming the hop's span, so
an engine started with --otlp-traces-endpoint (the engine roles pass it: otel_env.vllm_args)
hangs vLLM's spans under it. A request the sampler (OTEL_TRACES_SAMPLER) leaves out makes no
spans but its request's traceparent, sampled flag off, still goes to every engine.

Off (the default) this module imports no opentelemetry: the pipeline holds `tracing = None`
and pays an attribute check per hop (NO_HOP's methods do nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
from contextvars import ContextVar
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

from ascendserve import __version__, otel_env
from ascendserve.config import ConfigError
from ascendserve.protocol.openai import APIError

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
HOP_NAMES = {"encoder": "encode", "prefill": "prefill", "decode": "decode", "pd": "decode"}

# The traced request this task serves: set by Tracing.handle for the handler's hops, and again
# by RequestTrace.streamed for what runs while the response streams (a migration's legs).
_request: ContextVar["RequestTrace | None"] = ContextVar("ascendserve_request_trace", default=None)


class NoHop:
    """A hop's span with tracing off: each method does nothing."""

    __slots__ = ()

    def headers(self, headers: dict) -> dict:
        return headers

    def event(self, name: str, **attributes) -> None:
        pass

    def end(self, error: BaseException | None = None) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb) -> None:
        pass


NO_HOP = NoHop()


class Unsampled(NoHop):
    """A hop of a request the sampler left out (OTEL_TRACES_SAMPLER): nothing is recorded, but its
    engine is told so (the request's traceparent, sampled flag off) and samples alike."""

    __slots__ = ("carrier",)

    def __init__(self, carrier: dict):
        self.carrier = carrier

    def headers(self, headers: dict) -> dict:
        return {**headers, **self.carrier}


class Tracing:
    """The proxy's tracer provider, its exporters as OTEL_* says. Exists only when traces are on."""

    def __init__(self, settings: otel_env.Traces, env: Mapping[str, str]):
        from opentelemetry import context, trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        named = "OTEL_SERVICE_NAME" in env or "service.name=" in env.get("OTEL_RESOURCE_ATTRIBUTES", "")
        resource = Resource.create({"service.version": __version__,
                                    **({} if named else {"service.name": "ascendserve-proxy"})})
        self.provider = TracerProvider(resource=resource)  # the sampler: OTEL_TRACES_SAMPLER[_ARG]
        for exporter in _exporters(settings):
            self.provider.add_span_processor(BatchSpanProcessor(exporter))  # OTEL_BSP_*
        self.tracer = self.provider.get_tracer("ascendserve.router", __version__)
        self.propagator = TraceContextTextMapPropagator()  # W3C, what vLLM reads (vllm/tracing)
        self.api, self.context_api = trace, context  # the API's modules, for the spans made here

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Tracing | None:
        settings = otel_env.traces(dict(env))
        return cls(settings, env) if settings is not None else None

    async def handle(self, kind: str, body: dict, request_id: str, parent: Mapping | None,
                     route: Callable[[str, dict, str], Awaitable]):
        """`route` (the pipeline) under a new request span; a streamed reply's stream ends it."""
        trace = RequestTrace(self, kind, body, request_id, parent)
        token = _request.set(trace)
        try:
            reply = await route(kind, body, request_id)
        except APIError as exc:
            trace.end(exc.status, exc.message)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            trace.end(499, outcome="client_disconnected")
            raise
        except BaseException as exc:
            trace.end(500, repr(exc))
            raise
        finally:
            _request.reset(token)
        if reply.stream is None:
            trace.end(reply.status)
        else:
            reply.stream = trace.streamed(reply.stream)
        return reply

    def hop(self, role: str, url: str):
        """A span for one attempt at a hop of the request this task serves (NO_HOP outside one)."""
        trace = _request.get()
        return trace.hop(role, url) if trace is not None else NO_HOP

    def hold(self, lease, name: str, **attributes):
        """P's KV hold as a span that ends when the hold is released (D's first byte)."""
        trace = _request.get()
        if trace is None or trace.unsampled is not None:
            return lease
        return _TracedHold(lease, trace.span(name, {"ascendserve.instance": lease.instance.url, **attributes}))

    async def close(self) -> None:
        """Export what is left (at shutdown)."""
        await asyncio.to_thread(self.provider.shutdown)


class RequestTrace:
    """One client request's span and its hops' spans."""

    def __init__(self, tracing: Tracing, kind: str, body: dict, request_id: str, parent: Mapping | None):
        self.tracing, self.request_id = tracing, request_id
        trace = tracing.api
        incoming = tracing.propagator.extract(parent) if parent is not None and "traceparent" in parent \
            else tracing.context_api.Context()
        self.root = tracing.tracer.start_span(
            f"POST {PATHS[kind]}", context=incoming, kind=trace.SpanKind.SERVER,
            attributes={"http.request.method": "POST", "http.route": PATHS[kind], "ascendserve.route": kind,
                        "gen_ai.request.model": str(body.get("model", "")), "ascendserve.stream": body.get("stream") is True,
                        "ascendserve.request_id": request_id, "http.response.header.x-request-id": (request_id,)})
        self.context = trace.set_span_in_context(self.root)
        self.unsampled = None  # the sampler said no: one hop object for all, no spans made
        if not self.root.is_recording():
            carrier: dict = {}
            tracing.propagator.inject(carrier, context=self.context)
            self.unsampled = Unsampled(carrier)
        self.hops: list[Hop] = []
        self.migrations = 0
        self.error = ""
        self.ended = False

    def span(self, name: str, attributes: dict, kind=None):
        attributes = {"ascendserve.request_id": self.request_id, **attributes}
        if self.migrations:
            attributes["ascendserve.migration"] = self.migrations
        return self.tracing.tracer.start_span(name, context=self.context, attributes=attributes,
                                              kind=kind or self.tracing.api.SpanKind.INTERNAL)

    def hop(self, role: str, url: str) -> Hop | Unsampled:
        if self.unsampled is not None:
            return self.unsampled
        hop = Hop(self, self.span(HOP_NAMES.get(role, role), {"ascendserve.role": role, "server.address": url},
                                  self.tracing.api.SpanKind.CLIENT))
        self.hops.append(hop)
        return hop

    def event(self, name: str, **attributes) -> None:
        self.root.add_event(name, attributes)

    def leg_failed(self, reason: str, detail: str) -> None:
        """The decode leg streaming now broke mid-stream: its span ends with the error."""
        for hop in reversed(self.hops):
            if not hop.ended and hop.span.name == "decode":
                hop.span.set_attribute("ascendserve.failure", reason)
                hop.end(f"{reason}: {detail}")
                break

    def migration(self, reason: str, source: str, tokens: int) -> None:
        """The request continues elsewhere: the hops from here on carry ascendserve.migration."""
        self.migrations += 1
        self.event("migration", reason=reason, source=source, tokens=tokens, migration=self.migrations)

    def failed(self, message: str) -> None:
        self.error = message

    async def streamed(self, stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """The reply's stream; the request's and its open hops' spans end with its last byte."""
        _request.set(self)  # the response streams in a task of its own: a migration's hops find us
        status, outcome = 200, ""
        try:
            async with contextlib.aclosing(stream) as chunks:
                async for chunk in chunks:
                    yield chunk
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "client_disconnected"
            raise
        except BaseException as exc:
            status, self.error = 500, self.error or repr(exc)
            raise
        finally:
            self.end(status, outcome=outcome)

    def end(self, status: int, error: str = "", outcome: str = "") -> None:
        if self.ended:
            return
        self.ended = True
        for hop in self.hops:  # still open: the decode stream's, to the last byte
            hop.end(self.error or None)
        error = error or self.error
        root, api = self.root, self.tracing.api
        root.set_attribute("http.response.status_code", status)
        root.set_attribute("ascendserve.outcome",
                           outcome or ("backend_failed" if self.error else "error" if error else "ok"))
        if status >= 500 or self.error:
            root.set_status(api.Status(api.StatusCode.ERROR, error[:300]))
        elif status >= 400:
            root.set_attribute("error.type", str(status))
        root.end()


class Hop:
    """One attempt at a hop: a CLIENT span, its traceparent for the engine's request."""

    __slots__ = ("trace", "span", "ended")

    def __init__(self, trace: RequestTrace, span):
        self.trace, self.span, self.ended = trace, span, False

    def headers(self, headers: dict) -> dict:
        carrier = dict(headers)
        tracing = self.trace.tracing
        tracing.propagator.inject(carrier, context=tracing.api.set_span_in_context(self.span))
        return carrier

    def event(self, name: str, **attributes) -> None:
        self.span.add_event(name, attributes)

    def end(self, error: BaseException | str | None = None) -> None:
        if self.ended:
            return
        self.ended = True
        if error is not None:
            status = getattr(error, "status", None)
            if isinstance(status, int):
                self.span.set_attribute("http.response.status_code", status)
            self.span.set_attribute("error.type", str(status) if status else
                                    type(error).__name__ if isinstance(error, BaseException) else "mid_stream")
            api = self.trace.tracing.api
            self.span.set_status(api.Status(api.StatusCode.ERROR, str(error)[:300] or type(error).__name__))
        self.span.end()

    def __enter__(self) -> Hop:
        return self

    def __exit__(self, kind, error, tb) -> None:
        self.end(error)


class _TracedHold:
    """A Lease (P's KV hold) whose release also ends its span."""

    __slots__ = ("lease", "span")

    def __init__(self, lease, span):
        self.lease, self.span = lease, span

    @property
    def instance(self):
        return self.lease.instance

    def release(self, ok: bool = True) -> None:
        if not self.lease.released:
            self.span.end()
        self.lease.release(ok=ok)


# ---- from code that runs inside a traced request; nothing happens outside one (tracing off) ----
def event(name: str, **attributes) -> None:
    """An event on the request's span (an encoder fallback)."""
    if (trace := _request.get()) is not None:
        trace.event(name, **attributes)


def leg_failed(reason: str, detail: str) -> None:
    if (trace := _request.get()) is not None:
        trace.leg_failed(reason, detail)


def migration(reason: str, source: str, tokens: int) -> None:
    if (trace := _request.get()) is not None:
        trace.migration(reason, source, tokens)


def failed(message: str) -> None:
    """The request could not be completed after its first byte (a mid-stream failure)."""
    if (trace := _request.get()) is not None:
        trace.failed(message)


def _exporters(settings: otel_env.Traces) -> list:
    out = []
    for name in settings.exporters:
        if name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            out.append(ConsoleSpanExporter())
        elif settings.protocol == "grpc":
            try:
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            except ImportError:
                raise ConfigError("OTLP over grpc needs opentelemetry-exporter-otlp-proto-grpc; or use "
                                  "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf") from None
            out.append(OTLPSpanExporter(endpoint=settings.endpoint))
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            out.append(OTLPSpanExporter(endpoint=settings.endpoint))
    return out
