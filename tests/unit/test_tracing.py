"""Traces: when the OTEL_* variables turn them on (otel_env), what the engines are told, and the
spans router/tracing.py makes of a request (the SDK's in-memory exporter; no process started).
The proxy as a process, exporting to a receiver: tests/integration/test_traces.py."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ascendserve import otel_env
from ascendserve.config import ConfigError, load
from ascendserve.engine.vllm_server import build_argv
from ascendserve.router.pipeline import Reply

URL = "http://collector:4318/v1/traces"


@pytest.mark.parametrize("env", [
    {},
    {"OTEL_SERVICE_NAME": "proxy", "OTEL_TRACES_SAMPLER": "always_on"},  # no exporter, no endpoint
    {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": URL, "OTEL_SDK_DISABLED": "true"},
    {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_TRACES_EXPORTER": "none"},
])
def test_off_by_default_and_when_told(env):
    assert otel_env.traces(env) is None
    assert otel_env.vllm_args(env, []) == [] and otel_env.vllm_env(env) == {}


@pytest.mark.parametrize("env, exporters, protocol, endpoint", [
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": URL}, ("otlp",), "http/protobuf", URL),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/"}, ("otlp",), "http/protobuf", URL),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, ("otlp",),
     "grpc", "http://collector:4317"),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, ("otlp",), "http/protobuf", "http://localhost:4318/v1/traces"),
    ({"OTEL_TRACES_EXPORTER": "console,otlp", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": URL,
      "OTEL_EXPORTER_OTLP_ENDPOINT": "http://elsewhere:4318"}, ("console", "otlp"), "http/protobuf", URL),
])
def test_on_where_and_how(env, exporters, protocol, endpoint):
    assert otel_env.traces(env) == otel_env.Traces(exporters, protocol, endpoint)


@pytest.mark.parametrize("env", [{"OTEL_TRACES_EXPORTER": "zipkin"},
                                 {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}])
def test_what_this_build_cannot_export_is_refused(env):
    with pytest.raises(ConfigError, match="OTEL_"):
        otel_env.traces(env)


@pytest.fixture()
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


def test_engines_send_vllm_spans_where_the_proxys_go(model_dir):
    config = load("decode", None, {"model__path": model_dir}, env={})
    argv = build_argv(config, env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert argv[argv.index("--otlp-traces-endpoint") + 1] == URL
    assert "--otlp-traces-endpoint" not in build_argv(config, env={})
    # vLLM picks its exporter by this variable alone, grpc unless told
    assert otel_env.vllm_env({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": URL}) == {
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
    # the user's own endpoint wins
    mine = load("decode", None, {"model__path": model_dir,
                                 "engine__vllm_args": ["--otlp-traces-endpoint=http://mine:4318/v1/traces"]}, env={})
    argv = build_argv(mine, env={"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": URL})
    assert [a for a in argv if "otlp" in a] == ["--otlp-traces-endpoint=http://mine:4318/v1/traces"]


def test_the_option_is_vllms():
    spec = importlib.util.find_spec("vllm")  # located, not imported
    if spec is None or spec.origin is None:
        pytest.skip("no vLLM installed")
    assert '"--otlp-traces-endpoint"' in (Path(spec.origin).parent / "engine" / "arg_utils.py").read_text()


def test_off_the_proxy_imports_no_opentelemetry_sdk():
    # Litestar's app constructor imports the opentelemetry API package and its semconv when they are
    # installed (litestar/app.py _patch_opentelemetry_middleware), with or without us: not counted
    code = ("import sys\n"
            "from ascendserve.config import load\n"
            "from ascendserve.router.app import create_app\n"
            "app = create_app(load('proxy', None, {}, env={}))\n"
            "ours = ('opentelemetry.sdk', 'opentelemetry.exporter', 'opentelemetry.trace', 'opentelemetry.context')\n"
            "print('TRACING', app.state.pipeline.tracing, [m for m in sys.modules if m.startswith(ours)])\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                       cwd=Path(__file__).resolve().parents[2])
    assert "TRACING None []" in r.stdout, r.stdout + r.stderr


# ---- the spans of one request, in process ----------------------------------------------------
@pytest.fixture()
def traced():
    pytest.importorskip("opentelemetry.sdk.trace")
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from ascendserve.router.tracing import Tracing

    tracing = Tracing(otel_env.Traces((), "http/protobuf", ""), {})
    memory = InMemorySpanExporter()
    tracing.provider.add_span_processor(SimpleSpanProcessor(memory))
    yield tracing, memory
    tracing.provider.shutdown()


def test_hops_attempts_and_a_migration(traced):
    from ascendserve.router import tracing as tracing_mod

    tracing, memory = traced
    sent = {}

    async def route(kind, body, request_id):
        with tracing.hop("prefill", "http://p") as hop:
            sent["prefill"] = hop.headers({"x-request-id": request_id})
        failed = tracing.hop("decode", "http://d1")
        failed.end(ConnectionResetError("gone"))  # an attempt that failed before its first byte
        first = tracing.hop("decode", "http://d2")  # streams: ends with the stream

        async def stream():
            yield b"data: 1\n\n"
            tracing_mod.leg_failed("stall", "no event for 30 s")  # d2 went silent; continued on d1
            tracing_mod.migration("stall", "http://d2", 1)
            tracing.hop("decode", "http://d1")
            yield b"data: 2\n\n"
        return Reply(stream=stream())

    async def client():
        reply = await tracing.handle("completions", {"model": "m", "stream": True}, "req-1", None, route)
        return [chunk async for chunk in reply.stream]

    assert asyncio.run(client()) == [b"data: 1\n\n", b"data: 2\n\n"]
    spans = {(s.name, s.attributes.get("server.address")): s for s in memory.get_finished_spans()}
    root = spans[("POST /v1/completions", None)]
    assert root.parent is None and root.attributes["ascendserve.request_id"] == "req-1"
    assert root.attributes["ascendserve.outcome"] == "ok" and [e.name for e in root.events] == ["migration"]
    prefill = spans[("prefill", "http://p")]
    trace_id = f"{root.context.trace_id:032x}"
    version, trace, parent, flags = sent["prefill"]["traceparent"].split("-")
    assert (version, trace, parent) == ("00", trace_id, f"{prefill.context.span_id:016x}") and int(flags, 16) & 1
    decodes = [s for s in memory.get_finished_spans() if s.name == "decode"]
    assert [(s.attributes["server.address"], s.status.status_code.name, s.attributes.get("ascendserve.migration"))
            for s in decodes] == [("http://d1", "ERROR", None), ("http://d2", "ERROR", None),
                                  ("http://d1", "UNSET", 1)]
    assert decodes[1].attributes["ascendserve.failure"] == "stall"
    for span in memory.get_finished_spans():
        assert span.context.trace_id == root.context.trace_id
        assert span is root or span.parent.span_id == root.context.span_id
        assert span.end_time <= root.end_time


def test_a_client_gone_an_error_before_the_stream_and_one_in_it(traced):
    from ascendserve.protocol.openai import APIError
    from ascendserve.router import tracing as tracing_mod

    tracing, memory = traced

    async def streaming(kind, body, request_id):
        tracing.hop("pd", "http://pd")

        async def stream():
            yield b"data: 1\n\n"
            yield b"data: 2\n\n"
        return Reply(stream=stream())

    async def refused(kind, body, request_id):
        raise APIError(503, "no healthy instance")

    async def broken(kind, body, request_id):
        tracing.hop("decode", "http://d")

        async def stream():
            yield b"data: 1\n\n"
            tracing_mod.failed("backend decode instance failed mid-stream; not continued: n > 1")
            yield b"data: {error}\n\n"
        return Reply(stream=stream())

    async def client():
        reply = await tracing.handle("chat", {"model": "m"}, "gone", None, streaming)
        async for _ in reply.stream:
            break
        await reply.stream.aclose()
        with pytest.raises(APIError):
            await tracing.handle("chat", {"model": "m"}, "refused", None, refused)
        reply = await tracing.handle("chat", {"model": "m"}, "broken", None, broken)
        assert len([chunk async for chunk in reply.stream]) == 2

    asyncio.run(client())
    roots = {s.attributes["ascendserve.request_id"]: s for s in memory.get_finished_spans() if s.parent is None}
    assert roots["gone"].attributes["ascendserve.outcome"] == "client_disconnected"
    assert roots["refused"].status.status_code.name == "ERROR"
    assert roots["refused"].attributes["http.response.status_code"] == 503
    assert roots["broken"].status.status_code.name == "ERROR"
    assert roots["broken"].attributes["ascendserve.outcome"] == "backend_failed"
    pd, d = [s for s in memory.get_finished_spans() if s.name == "decode"]
    assert pd.end_time <= roots["gone"].end_time and pd.status.status_code.name == "UNSET"
    assert d.status.status_code.name == "ERROR" and d.end_time <= roots["broken"].end_time


def test_a_request_the_sampler_leaves_out_records_nothing_and_says_so(monkeypatch):
    pytest.importorskip("opentelemetry.sdk.trace")
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from ascendserve.router.tracing import Tracing

    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")  # the SDK reads its sampler itself
    tracing = Tracing(otel_env.Traces((), "http/protobuf", ""), {})
    memory = InMemorySpanExporter()
    tracing.provider.add_span_processor(SimpleSpanProcessor(memory))
    sent = []

    async def route(kind, body, request_id):
        for role in ("prefill", "decode"):
            with tracing.hop(role, "http://x") as hop:
                sent.append(hop.headers({"x-request-id": request_id}))
        return Reply(body={})

    asyncio.run(tracing.handle("completions", {"model": "m"}, "r", None, route))
    tracing.provider.shutdown()
    assert memory.get_finished_spans() == ()
    assert len({h["traceparent"] for h in sent}) == 1
    assert int(sent[0]["traceparent"].split("-")[3], 16) & 1 == 0  # the sampled flag off
