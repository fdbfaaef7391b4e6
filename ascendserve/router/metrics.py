"""The proxy's Prometheus metrics, as seen from the proxy."""

from __future__ import annotations

import functools
import os
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ascendserve.router.pools import Pools

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1,
               2.5, 5)


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
            in_flight.add_metric([inst.role, inst.url], inst.total_requests)
            tokens.add_metric([inst.role, inst.url], inst.active_tokens + inst.peer_load()[1])
            healthy.add_metric([inst.role, inst.url, inst.state], 1.0 if inst.state == "active" else 0.0)
        yield from (in_flight, tokens, healthy)


class _KVIndexCollector:
    """Each followed instance's KV index (router/kv_index.py): size, memory, state, events."""

    def __init__(self, events):
        self.events = events

    def collect(self):
        blocks = GaugeMetricFamily("ascendserve_proxy_kv_index_blocks", "blocks an instance's prefix cache holds, "
                                   "as its KV events say", labels=["instance"])
        nbytes = GaugeMetricFamily("ascendserve_proxy_kv_index_bytes", "memory of the KV indexes (estimate)")
        known = GaugeMetricFamily("ascendserve_proxy_kv_index_known", "1 when the instance's index is known "
                                  "(routing by its cache), 0 while it is rebuilt (routing by load)", labels=["instance"])
        events = CounterMetricFamily("ascendserve_proxy_kv_event_batches", "KV event batches applied",
                                     labels=["instance"])
        trouble = CounterMetricFamily("ascendserve_proxy_kv_event_problems", "sequence gaps, gaps the replay could "
                                      "not fill, publisher restarts and disconnections", labels=["instance", "kind"])
        total = 0
        for url, idx in list(self.events.indexes.items()):
            blocks.add_metric([url], len(idx.blocks))
            known.add_metric([url], 1.0 if idx.known else 0.0)
            events.add_metric([url], idx.events)
            for kind in ("gaps", "lost", "restarts", "disconnects"):
                trouble.add_metric([url, kind], getattr(idx, kind))
            total += idx.nbytes()
        nbytes.add_metric([], total)
        yield from (blocks, nbytes, known, events, trouble)


class ProxyMetrics:
    def __init__(self, pools: Pools, multiprocess_dir: str | None = None):
        """`multiprocess_dir`: several proxy workers (router/workers.py) count into files there, and a
        scrape of any of them sums every worker's counters."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.scrape = self.registry
        if multiprocess_dir:
            from prometheus_client import multiprocess, values

            os.environ["PROMETHEUS_MULTIPROC_DIR"] = multiprocess_dir
            values.ValueClass = values.MultiProcessValue()  # read when each metric below is made
            self._summed = multiprocess.MultiProcessCollector(None, path=multiprocess_dir)
            self.scrape = CollectorRegistry()
            self.scrape.register(_AllWorkers(self._summed, self.registry))
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
        self.itl = Histogram("ascendserve_proxy_itl_seconds", "inter-token latency of streamed requests: per "
                             "request, the mean gap between its streamed tokens after the first ((end - first "
                             "token) / (tokens - 1))", buckets=ITL_BUCKETS, registry=r)
        self.kv_routing = Counter("ascendserve_proxy_kv_routing", "pd/prefill choices by the engines' cached "
                                  "blocks (by=kv) or by load, and why (single, unknown, unsupported, no_token_ids, "
                                  "short, unhashable)", ["role", "by"], registry=r)
        self.kv_tokenize = Histogram("ascendserve_proxy_kv_tokenize_seconds", "getting a prompt's token ids for "
                                     "routing, by source (ids, local, engine)", ["source"], buckets=LATENCY_BUCKETS,
                                     registry=r)
        self.kv_tokenizer_mismatch = Counter("ascendserve_proxy_kv_tokenizer_mismatches", "models whose local "
                                             "token ids differed from the engine's", registry=r)
        self.prefix_predicted = Counter("ascendserve_proxy_prefix_predicted_tokens", "prompt tokens the chosen "
                                        "instance was predicted to hold in its prefix cache", ["role"], registry=r)
        self.prefix_cached = Counter("ascendserve_proxy_prefix_cached_tokens", "prompt tokens the engine served "
                                     "from its prefix cache (vLLM's usage cached_tokens)", ["role"], registry=r)
        self.prefix_prompt = Counter("ascendserve_proxy_prefix_prompt_tokens", "prompt tokens of the requests "
                                     "whose cached_tokens the engine reported", ["role"], registry=r)
        self.scrape.register(_PoolCollector(pools))
        for metric in vars(self).values():
            if isinstance(metric, (Counter, Histogram)) and metric._labelnames:  # noqa: SLF001
                # a label set's child, found once: labels() takes a lock and builds its key per call
                # (1.2 us; a few per request). No label set is ever removed, so none goes stale.
                metric.labels = functools.lru_cache(maxsize=1024)(metric.labels)

    def watch_kv(self, events) -> None:
        self.scrape.register(_KVIndexCollector(events))

    def observe_cached(self, role: str, usage) -> None:
        """vLLM's usage with prompt_tokens_details (the roles turn it on with KV events)."""
        details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            self.prefix_cached.labels(role).inc(details["cached_tokens"])
            self.prefix_prompt.labels(role).inc(int(usage.get("prompt_tokens") or 0))

    def observe_done(self, started: float, ended: float | None = None) -> None:
        """A request's answer was whole at `ended` (monotonic; now when None)."""
        self.e2e.observe((ended or time.monotonic()) - started)

    def observe_itl(self, first: float | None, tokens: int, ended: float | None = None) -> None:
        """A streamed request ended (at `ended`, or now): its first token came at `first`
        (monotonic) and it streamed `tokens` tokens (one gap fewer)."""
        if first is not None and tokens >= 2:
            self.itl.observe(((ended or time.monotonic()) - first) / (tokens - 1))

    def summed(self):
        """These metrics with every worker's counts (the dashboard's figures): self with one worker."""
        if self.scrape is self.registry:
            return self
        return _Summed(self, {family.name: family for family in self._summed.collect()})

    def render(self) -> bytes:
        return generate_latest(self.scrape)


class _AllWorkers:
    """Every worker's counters summed; the ones no worker has counted yet as this one describes them."""

    def __init__(self, summed, local: CollectorRegistry):
        self.summed, self.local = summed, local

    def collect(self):
        families = list(self.summed.collect())
        names = {family.name for family in families}
        yield from families
        yield from (family for family in self.local.collect() if family.name not in names)


class _Summed:
    """ProxyMetrics' attributes as the multiprocess files sum them: each has collect(), like a metric."""

    def __init__(self, metrics: ProxyMetrics, families: dict):
        self._metrics, self._families = metrics, families

    def __getattr__(self, attr: str):
        metric = getattr(self._metrics, attr)
        family = self._families.get(metric._name)  # noqa: SLF001 - prometheus_client keeps the name there
        return metric if family is None else _Family(family)  # never counted anywhere: its own zeros


class _Family:
    def __init__(self, family):
        self.family = family

    def collect(self) -> list:
        return [self.family]
