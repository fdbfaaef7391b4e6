"""The standard OTEL_* variables, as far as traces are concerned: on or off, which exporters, where.

Read by the proxy (router/tracing.py: its own spans) and by the engine roles (vLLM's
`--otlp-traces-endpoint`, so that vLLM continues the proxy's traces). Pure: no opentelemetry
import, the environment passed in (config.environ()). Everything else the OpenTelemetry SDK
reads itself from the same variables (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES,
OTEL_TRACES_SAMPLER[_ARG], OTEL_BSP_*, OTEL_EXPORTER_OTLP_[TRACES_]HEADERS / TIMEOUT /
COMPRESSION / CERTIFICATE).

Off unless asked: OTEL_TRACES_EXPORTER names an exporter, or an OTLP endpoint is set
(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_EXPORTER_OTLP_ENDPOINT; exporter `otlp` then).
OTEL_SDK_DISABLED=true or an exporter list with `none` keeps it off whatever else is set.
"""

from __future__ import annotations

from dataclasses import dataclass

from ascendserve.config import ConfigError

EXPORTERS = ("otlp", "console")
PROTOCOLS = ("http/protobuf", "grpc")
# the SDK's defaults where no endpoint is set (the OTLP spec's ports)
DEFAULT_ENDPOINTS = {"http/protobuf": "http://localhost:4318/v1/traces", "grpc": "http://localhost:4317"}


@dataclass(frozen=True)
class Traces:
    exporters: tuple[str, ...]  # of EXPORTERS
    protocol: str  # the otlp exporter's, of PROTOCOLS
    endpoint: str  # where the otlp exporter sends: the full /v1/traces URL (http), or host:port's URL (grpc)


def traces(env: dict[str, str]) -> Traces | None:
    """What the environment asks for traces; None: off (the default). ConfigError for values
    this build cannot honour (an unknown exporter or protocol)."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    names = tuple(n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip())
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    if "none" in names or (not names and not (endpoint or base)):
        return None
    names = names or ("otlp",)
    unknown = [n for n in names if n not in EXPORTERS]
    if unknown:
        raise ConfigError(f"OTEL_TRACES_EXPORTER={','.join(names)}: ascendserve exports traces with "
                          f"{' or '.join(EXPORTERS)} (or none), not {', '.join(unknown)}")
    protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "http/protobuf").strip()
    if protocol not in PROTOCOLS:
        raise ConfigError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol}: use one of {', '.join(PROTOCOLS)}")
    if not endpoint and base:  # the spec: the signal's path is appended to the base URL for http
        endpoint = base.rstrip("/") + "/v1/traces" if protocol == "http/protobuf" else base
    return Traces(names, protocol, endpoint or DEFAULT_ENDPOINTS[protocol])


def vllm_args(env: dict[str, str], user_args: list[str]) -> list[str]:
    """vLLM's own spans, sent where the proxy's go: `--otlp-traces-endpoint` when traces are on
    with the otlp exporter and the user did not pass one (theirs wins)."""
    settings = traces(env)
    if settings is None or "otlp" not in settings.exporters:
        return []
    if any(a.split("=", 1)[0].replace("_", "-") == "--otlp-traces-endpoint" for a in user_args):
        return []
    return ["--otlp-traces-endpoint", settings.endpoint]


def vllm_env(env: dict[str, str]) -> dict[str, str]:
    """vLLM picks its OTLP exporter by OTEL_EXPORTER_OTLP_TRACES_PROTOCOL alone, default grpc
    (vllm/tracing/otel.py); the SDK's default, and ours, is http/protobuf: say which."""
    settings = traces(env)
    if settings is None or "otlp" not in settings.exporters:
        return {}
    return {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": settings.protocol}
