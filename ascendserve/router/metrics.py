"""The proxy's Prometheus metrics, as seen from the proxy."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from ascendserve.router.pools import Pools

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class _PoolCollector:
    def __init__(self, pools: Pools):
        self.pools = pools

    def collect(self):
        in_flight = GaugeMetricFamily("ascendserve_proxy_in_flight", "requests in flight per instance",
                                      labels=["role", "instance"])
        tokens = GaugeMetricFamily("ascendserve_proxy_active_tokens", "estimated tokens in flight per instance",
                                   labels=["role", "instance"])
        healthy = GaugeMetricFamily("ascendserve_proxy_instance_up", "1 when the instance takes requests",
                                    labels=["role", "instance", "state"])
        for inst in self.pools.all_instances():
            in_flight.add_metric([inst.role, inst.url], inst.active_requests)
            tokens.add_metric([inst.role, inst.url], inst.active_tokens)
            healthy.add_metric([inst.role, inst.url, inst.state], 1.0 if inst.state == "active" else 0.0)
        yield from (in_flight, tokens, healthy)


class ProxyMetrics:
    def __init__(self, pools: Pools):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("ascendserve_proxy_requests", "client requests by route and status",
                                ["route", "status"], registry=r)
        self.errors = Counter("ascendserve_proxy_errors", "errors by kind", ["kind"], registry=r)
        self.retries = Counter("ascendserve_proxy_retries", "backend hops retried, by role", ["role"], registry=r)
        self.cancelled = Counter("ascendserve_proxy_client_disconnects", "streams the client abandoned", registry=r)
        self.fallbacks = Counter("ascendserve_proxy_encoder_fallbacks",
                                 "multimodal requests encoded on the PD/P instance because no encoder answered",
                                 registry=r)
        self.encoder_skips = Counter("ascendserve_proxy_encoder_skips",
                                     "multimodal requests whose items were all in the EC store (no encoder hop)",
                                     registry=r)
        self.ec_store_errors = Counter("ascendserve_proxy_ec_store_errors",
                                       "EC store lookups that failed (the encoder was asked instead)", registry=r)
        self.migrations = Counter("ascendserve_proxy_migrations", "requests continued on another instance after "
                                  "a failure mid-generation, by role and reason", ["role", "reason"], registry=r)
        self.migration_gap = Histogram("ascendserve_proxy_migration_gap_seconds", "from an instance's failure to "
                                       "the next token of the continued request", buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("ascendserve_proxy_ttft_seconds", "time to first streamed byte",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("ascendserve_proxy_e2e_seconds", "end-to-end request latency",
                             buckets=LATENCY_BUCKETS, registry=r)
        r.register(_PoolCollector(pools))

    def observe_done(self, started: float) -> None:
        self.e2e.observe(time.monotonic() - started)

    def render(self) -> bytes:
        return generate_latest(self.registry)
