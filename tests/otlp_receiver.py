"""An OTLP/HTTP trace receiver on 127.0.0.1, for tests and benchmarks: what a collector is to the proxy.

    with Receiver() as receiver:           # receiver.url: http://127.0.0.1:PORT/v1/traces
        ...                                # a process started with OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=receiver.url
        receiver.spans()                   # every span received so far, decoded

POST /v1/traces bodies are kept as they come (gzip undone) and decoded only when asked, with
opentelemetry-proto's ExportTraceServiceRequest, so receiving costs a benchmark's process little.
As a process of its own (bench/tracing.py):

    python -m tests.otlp_receiver --port N      # GET /stats: {"posts", "bytes", "spans"}
"""

from __future__ import annotations

import argparse
import gzip
import json
import signal
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Span:
    name: str
    trace_id: str  # hex
    span_id: str
    parent_id: str  # "" for a root
    kind: int  # OTLP's SpanKind: 2 server, 3 client
    start_ns: int
    end_ns: int
    attributes: dict
    events: list[str]
    status: int  # OTLP's StatusCode: 0 unset, 1 ok, 2 error
    status_message: str
    service: str
    resource: dict = field(default_factory=dict)


class Receiver:
    def __init__(self, port: int = 0):
        self.bodies: list[bytes] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                ok = self.path == "/v1/traces"
                if ok:
                    with receiver.lock:
                        receiver.bodies.append(body)
                self.send_response(200 if ok else 404)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def do_GET(self):  # noqa: N802
                with receiver.lock:
                    posts, size = len(receiver.bodies), sum(map(len, receiver.bodies))
                spans = len(receiver.spans()) if self.path == "/stats" else 0
                body = json.dumps({"posts": posts, "bytes": size, "spans": spans}).encode()
                self.send_response(200 if self.path == "/stats" else 404)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Receiver:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def clear(self) -> None:
        with self.lock:
            self.bodies.clear()

    def spans(self) -> list[Span]:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        with self.lock:
            bodies = list(self.bodies)
        out = []
        for body in bodies:
            request = ExportTraceServiceRequest.FromString(body)
            for rs in request.resource_spans:
                resource = _attributes(rs.resource.attributes)
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        out.append(Span(s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.kind,
                                        s.start_time_unix_nano, s.end_time_unix_nano, _attributes(s.attributes),
                                        [e.name for e in s.events], s.status.code, s.status.message,
                                        str(resource.get("service.name", "")), resource))
        return out


def _attributes(pairs) -> dict:
    return {kv.key: _value(kv.value) for kv in pairs}


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    return getattr(v, kind) if kind else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    receiver = Receiver(args.port)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=receiver.server.shutdown).start())
    receiver.server.serve_forever()


if __name__ == "__main__":
    main()
