"""Traces across the proxy's hops (router/tracing.py), exported to an OTLP receiver in the test.

A real proxy process over 1P1D stub engines (tests/stub_backend.py), started with the standard
OTEL_* variables pointing at tests/otlp_receiver.py: a streamed request is one trace whose hop
spans are the request span's children, in hop order, each with the request id; the engines got
a traceparent naming the hop's span. With traces off (no OTEL_* at all, or OTEL_SDK_DISABLED
beside an endpoint) the engines get no traceparent and nothing is exported.
"""

from __future__ import annotations

import os
import time

import httpx
import pytest

from tests.otlp_receiver import Receiver
from tests.procs import control, start_all, stub, wait_for

pytestmark = pytest.mark.integration
pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")
pytest.importorskip("opentelemetry.sdk.trace")

CHAT = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
NO_OTEL = {k: None for k in os.environ if k.startswith("OTEL_")}  # whatever the test's own environment says


def stats(proc) -> dict:
    return httpx.get(proc.url + "/stub/stats", timeout=5).json()


def traceparent(proc) -> tuple[str, str, str, bool] | None:
    """The W3C traceparent of the last request `proc` got: version, trace id, parent id, sampled."""
    header = stats(proc)["last_traceparent"]
    if header is None:
        return None
    version, trace_id, parent, flags = header.split("-")
    return version, trace_id, parent, bool(int(flags, 16) & 1)


def streamed(proxy, request_id: str, headers: dict | None = None) -> str:
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=CHAT, timeout=30,
                      headers={"x-request-id": request_id, **(headers or {})}) as r:
        assert r.status_code == 200, r.read()
        text = "".join(r.iter_text())
    assert text.rstrip().endswith("data: [DONE]"), text
    return text


def spans_of(receiver, request_id: str, timeout: float = 15.0) -> list:
    """The spans of the trace whose request span (kind server) carries `request_id`, once it is in."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        spans = receiver.spans()
        roots = [s for s in spans if s.kind == 2 and s.attributes.get("ascendserve.request_id") == request_id]
        if roots:
            time.sleep(0.3)  # anything exported in the same breath
            return [s for s in receiver.spans() if s.trace_id == roots[0].trace_id]
        time.sleep(0.05)
    raise AssertionError(f"no trace for {request_id} within {timeout}s: {[s.name for s in receiver.spans()]}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("traces-logs")
    p = stub("prefill", logs)
    d = stub("decode", logs, "--require-kv", "--token-delay-ms", "2")
    bad_d = stub("decode", logs, "--fail-status", "503")
    with Receiver() as receiver:
        on = {**NO_OTEL, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "50",
              "OTEL_SERVICE_NAME": "proxy-under-test"}
        topology = ("--prefill", f"127.0.0.1:{p.port}", "--decode")
        proxies = {
            "traced": (control("proxy", logs, *topology, f"127.0.0.1:{d.port}", name="proxy-traced"), on),
            "failing": (control("proxy", logs, *topology, f"127.0.0.1:{bad_d.port}", "--max-retries", "2",
                                name="proxy-failing"), on),
            "plain": (control("proxy", logs, *topology, f"127.0.0.1:{d.port}", name="proxy-plain"), NO_OTEL),
            "disabled": (control("proxy", logs, *topology, f"127.0.0.1:{d.port}", name="proxy-disabled"),
                         {**on, "OTEL_SDK_DISABLED": "true"}),
        }
        for proc, env in proxies.values():
            proc.env.update(env)
        procs = [proc for proc, _ in proxies.values()]
        try:
            start_all(p, d, bad_d)
            start_all(*procs)
            for proc in procs:  # its instances probed and healthy
                wait_for(lambda: httpx.get(proc.url + "/health", timeout=5).status_code == 200, 30, f"{proc.name} healthy")
            yield {"receiver": receiver, "p": p, "d": d, **{name: proc for name, (proc, _) in proxies.items()}}
        finally:
            for proc in (*procs, p, d, bad_d):
                proc.stop()


def test_a_streamed_request_is_one_trace_in_hop_order(cluster):
    receiver, p, d = cluster["receiver"], cluster["p"], cluster["d"]
    receiver.clear()
    streamed(cluster["traced"], "trace-1")
    spans = spans_of(receiver, "trace-1")
    assert len({s.trace_id for s in receiver.spans()}) == 1, "one request, one trace"
    (root,) = [s for s in spans if not s.parent_id]
    assert root.name == "POST /v1/chat/completions" and root.kind == 2 and root.service == "proxy-under-test"
    assert root.attributes["ascendserve.stream"] is True and root.attributes["gen_ai.request.model"] == "stub-model"
    assert root.attributes["http.response.status_code"] == 200 and root.attributes["ascendserve.outcome"] == "ok"
    hops = {s.name: s for s in spans if s is not root}
    assert sorted(hops) == ["decode", "kv_transfer", "prefill"], [s.name for s in spans]
    prefill, transfer, decode = hops["prefill"], hops["kv_transfer"], hops["decode"]
    for hop in hops.values():
        assert hop.parent_id == root.span_id and hop.attributes["ascendserve.request_id"] == "trace-1"
        assert hop.status != 2, hop
    assert prefill.attributes["server.address"] == p.url and decode.attributes["server.address"] == d.url
    # in hop order: P answers, then D is asked; P's hold of the KV ends at D's first byte; the
    # request ends with the last byte of D's stream
    assert root.start_ns <= prefill.start_ns < prefill.end_ns <= transfer.start_ns <= decode.start_ns
    assert decode.start_ns < transfer.end_ns <= decode.end_ns <= root.end_ns
    assert "first_byte" in decode.events
    # each hop's span covers the engine's receipt of the hop's request (the stubs' wall clock, as the spans')
    for hop, engine in ((prefill, p), (decode, d)):
        assert hop.start_ns <= stats(engine)["last_request_at"] * 1e9 <= hop.end_ns, hop.name
    # each engine was asked under its hop's span (W3C: version-trace id-parent id-flags, sampled)
    assert traceparent(p) == ("00", root.trace_id, prefill.span_id, True)
    assert traceparent(d) == ("00", root.trace_id, decode.span_id, True)


def test_a_clients_traceparent_is_continued(cluster):
    receiver = cluster["receiver"]
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    streamed(cluster["traced"], "trace-2", {"traceparent": f"00-{trace_id}-{parent}-01"})
    (root,) = [s for s in spans_of(receiver, "trace-2") if s.attributes.get("ascendserve.request_id") == "trace-2"
               and s.kind == 2]
    assert (root.trace_id, root.parent_id) == (trace_id, parent)
    assert traceparent(cluster["d"])[:2] == ("00", trace_id)


def test_each_failed_attempt_is_a_span_with_its_error(cluster):
    receiver = cluster["receiver"]
    r = httpx.post(cluster["failing"].url + "/v1/chat/completions", json=CHAT, timeout=30,
                   headers={"x-request-id": "trace-3"})
    assert r.status_code == 502
    spans = spans_of(receiver, "trace-3")
    (root,) = [s for s in spans if not s.parent_id]
    assert root.status == 2 and root.attributes["http.response.status_code"] == 502
    decodes = sorted((s for s in spans if s.name == "decode"), key=lambda s: s.start_ns)
    assert len(decodes) == 3  # the first try and --max-retries 2
    for attempt in decodes:
        assert attempt.status == 2 and attempt.attributes["http.response.status_code"] == 503
        assert attempt.parent_id == root.span_id
    (prefill,) = [s for s in spans if s.name == "prefill"]
    assert prefill.end_ns <= decodes[0].start_ns


@pytest.mark.parametrize("proxy", ["plain", "disabled"])
def test_off_no_traceparent_and_nothing_exported(cluster, proxy):
    receiver, p, d = cluster["receiver"], cluster["p"], cluster["d"]
    receiver.clear()
    streamed(cluster[proxy], f"quiet-{proxy}")
    assert traceparent(p) is None and traceparent(d) is None
    time.sleep(0.5)  # ten times the traced proxies' export delay
    assert receiver.spans() == []
