"""What the proxy's dashboard shows: its instances (router/pools.py) and its metrics (router/metrics.py).

Per instance: state, this proxy's requests in flight and the engine-reported others (running +
waiting beyond ours, from the registry), KV cache usage (registry), KV blocks held for decode
(prefill), requests served, failures, the last error, KV transfer GB/s (kv_rates.py).
Totals: requests, errors by kind, retries, encoder fallbacks and skips (the EC hit rate),
migrations, client disconnects. Charts: request and error rates, TTFT, inter-token latency
(router/metrics.py's per-request mean gap of streamed requests) and end-to-end percentiles over a
10 s window, requests in flight.
"""

from __future__ import annotations

import time

from ascendserve.dashboard.kv_rates import KVRates, metrics_reader
from ascendserve.dashboard.series import History, Reading, buckets, by_label, total
from ascendserve.router.metrics import ITL_BUCKETS, LATENCY_BUCKETS, ProxyMetrics
from ascendserve.router.pools import DRAINING, ROLES, Instance, Pools
from ascendserve.web.upstream import Upstream

MISSING: list[str] = []  # figures the page has a place for that this proxy cannot measure


def topology(pools: Pools, mode: str) -> str:
    known = {r for r in ROLES if pools[r].instances}
    flows = [f"P → D ({mode})"] if known & {"prefill", "decode"} else []
    flows += ["PD"] if "pd" in known else []
    text = " | ".join(flows)
    if "encoder" in known:
        text = "E → " + (f"({text})" if len(flows) > 1 else text or "?")
    return text or "no instances yet"


def _ints(counts: dict[str, float]) -> dict[str, int]:
    return {k: int(v) for k, v in counts.items()}


class ProxySource:
    kind = "proxy"

    def __init__(self, name: str, pools: Pools, metrics: ProxyMetrics, upstream: Upstream, mode: str = "pull",
                 encoders_required: bool = False, clock=time.time):
        self.name, self.pools, self.metrics, self.upstream = name, pools, metrics, upstream
        self.mode, self.encoders_required, self.clock = mode, encoders_required, clock
        self.started = clock()
        self.series = History({"ttft": LATENCY_BUCKETS, "itl": ITL_BUCKETS, "e2e": LATENCY_BUCKETS})
        self.kv = KVRates(metrics_reader(upstream))

    # ---- the charts -----------------------------------------------------------------------------
    def record(self) -> None:
        m = self.metrics.summed()
        self.series.record(Reading(
            t=self.clock(),
            counters={"requests": total(m.requests), "errors": total(m.errors), "retries": total(m.retries),
                      "migrations": total(m.migrations)},
            gauges={"in_flight": float(self.pools.in_flight())},
            histograms={"ttft": buckets(m.ttft), "itl": buckets(m.itl), "e2e": buckets(m.e2e)}))

    def history(self) -> dict:
        return self.series.columns()

    # ---- the figures ----------------------------------------------------------------------------
    def instance(self, inst: Instance) -> dict:
        registered = inst.source == "registry"
        _, tokens, kv = inst.peer_load()  # every proxy worker's
        return {"url": inst.url, "role": inst.role, "state": inst.state, "source": inst.source,
                "id": inst.instance_id, "models": list(inst.models),
                "in_flight": inst.total_requests, "others": inst.others if registered else None,
                "running": None, "waiting": None,
                "kv_usage": inst.kv_usage if registered else None,
                "active_kv": inst.active_kv + kv if inst.role == "prefill" else None,
                "active_tokens": inst.active_tokens + tokens, "served": inst.total_served, "failures": inst.failures,
                "last_error": inst.last_error, "kv_connector": inst.kv_connector, "kv": self.kv.of(inst.url)}

    def totals(self) -> dict:
        m = self.metrics.summed()
        statuses = by_label(m.requests, "status")
        skips, fallbacks = total(m.encoder_skips), total(m.fallbacks)
        encoder_calls = float(sum(i.total_served for i in self.pools["encoder"].instances.values()))
        ec_seen = skips + encoder_calls + fallbacks
        return {"requests": int(sum(statuses.values())), "ok": int(statuses.get("200", 0)),
                "failed": int(sum(v for k, v in statuses.items() if k != "200")),
                "errors": _ints(by_label(m.errors, "kind")), "retries": _ints(by_label(m.retries, "role")),
                "migrations": _ints(by_label(m.migrations, "reason")), "disconnects": int(total(m.cancelled)),
                "encoder_fallbacks": int(fallbacks), "encoder_skips": int(skips), "encoder_calls": int(encoder_calls),
                "ec_store_errors": int(total(m.ec_store_errors)),
                "ec_hit_rate": round(skips / ec_seen, 4) if ec_seen else None,
                "in_flight": self.pools.in_flight()}

    def snapshot(self) -> dict:
        ready = self.pools.readiness(encoders_required=self.encoders_required)
        instances = [self.instance(i) for r in ROLES for i in self.pools[r].instances.values()]
        rates = [r["gbps"] for i in instances if (r := i["kv"]) and r["gbps"] is not None]
        return {"kind": self.kind, "name": self.name, "t": round(self.clock(), 3), "started": self.started,
                "topology": topology(self.pools, self.mode), "ready": ready.ok, "missing": ready.missing,
                "instances": instances, "totals": self.totals(),
                "kv_gbps": round(sum(rates), 4) if rates else None, "point": self.series.point(),
                "not_measured": MISSING}

    # ---- slow extras, while pages are open --------------------------------------------------------
    async def poll(self) -> None:
        urls = [i.url for r in ("prefill", "decode") for i in self.pools[r].instances.values() if i.state != DRAINING]
        await self.kv.poll(urls)
