"""What the metaserver's dashboard shows: the whole registry.

With the embedded registry (registry.backend = "metaserver"): every registered instance with its
role, the load its heartbeat reports (running, waiting, KV cache usage), its KV connector, how
long it has been registered and how long since its last heartbeat ("late" past two heartbeat
intervals); events from the registry itself (metaserver/registry.py: joined, restarted, left,
expired). With etcd (registry.backend = "etcd"): the instances under the cluster's prefix, listed
every poll while a page is open (no watch: a page sees a change within `Hub.poll_every`
seconds), joined/left events from the difference between two listings.
Per-request figures (TTFT, errors, retries) live on each proxy's dashboard: the metaserver sees
no client request.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import msgspec

from ascendserve.dashboard.events import EventFeed
from ascendserve.dashboard.kv_rates import KVRates, metrics_reader
from ascendserve.dashboard.series import History, Reading, total
from ascendserve.discovery import etcd
from ascendserve.metaserver.registry import Registry
from ascendserve.protocol.registry import InstanceView, Registration
from ascendserve.web.upstream import Upstream

ROLE_ORDER = ("encoder", "prefill", "decode", "pd", "elastic-server")


class RegistrySource:
    kind = "metaserver"

    def __init__(self, name: str, registry: Registry, feed: EventFeed, upstream: Upstream,
                 heartbeat_interval_s: float, push_asks=None, etcd_settings: etcd.EtcdSettings | None = None,
                 clock: Callable[[], float] = time.time):
        self.name, self.registry, self.feed, self.upstream = name, registry, feed, upstream
        self.late_after_s = 2 * heartbeat_interval_s
        self.push_asks, self.etcd_settings, self.clock = push_asks, etcd_settings, clock
        self.started = clock()
        self.series = History()
        self.kv = KVRates(metrics_reader(upstream))
        self.listed: dict[str, Registration] | None = None  # etcd: the last listing
        self.etcd_error = ""
        registry.on_change = lambda kind, reg: feed.add(kind, reg.role, reg.url, "" if kind in ("left", "expired")
                                                        else "active", reg.instance_id)

    def views(self) -> list[InstanceView]:
        if self.etcd_settings is None:
            return self.registry.view().instances
        return [InstanceView(instance_id=r.instance_id, role=r.role, url=r.url, model=r.model, version=r.version,
                             load=r.load, age_s=0.0, seed=r.seed, seed_model=r.seed_model, kv=r.kv, cache=r.cache)
                for r in (self.listed or {}).values()]

    # ---- the charts -----------------------------------------------------------------------------
    def record(self) -> None:
        views = self.views()
        self.series.record(Reading(
            t=self.clock(), counters={"push_asks": total(self.push_asks)} if self.push_asks is not None else {},
            gauges={"running": float(sum(v.load.running for v in views)),
                    "waiting": float(sum(v.load.waiting for v in views)), "instances": float(len(views))}))

    def history(self) -> dict:
        return self.series.columns()

    # ---- the figures ----------------------------------------------------------------------------
    def snapshot(self) -> dict:
        silent = self.registry.silent_s() if self.etcd_settings is None else {}
        instances = []
        for v in sorted(self.views(), key=lambda v: (ROLE_ORDER.index(v.role) if v.role in ROLE_ORDER else 9, v.url)):
            quiet = silent.get(v.instance_id)
            instances.append({
                "url": v.url.rstrip("/"), "role": v.role, "state": "late" if quiet and quiet > self.late_after_s
                else "active", "source": "registry", "id": v.instance_id, "models": [v.model] if v.model else [],
                "in_flight": None, "others": None, "running": v.load.running, "waiting": v.load.waiting,
                "kv_usage": v.load.kv_usage, "active_kv": None, "active_tokens": None, "served": None,
                "failures": None, "last_error": "", "kv_connector": v.kv.connector if v.kv else "",
                "registered_s": v.age_s if self.etcd_settings is None else None,
                "silent_s": round(quiet, 1) if quiet is not None else None, "kv": self.kv.of(v.url.rstrip("/"))})
        rates = [r["gbps"] for i in instances if (r := i["kv"]) and r["gbps"] is not None]
        where = "etcd " + ", ".join(self.etcd_settings.endpoints) if self.etcd_settings else "in memory"
        return {"kind": self.kind, "name": self.name, "t": round(self.clock(), 3), "started": self.started,
                "topology": f"registry ({where})", "ready": not self.etcd_error, "missing":
                [self.etcd_error] if self.etcd_error else [], "instances": instances,
                "totals": {"running": sum(i["running"] for i in instances),
                           "waiting": sum(i["waiting"] for i in instances),
                           "push_asks": int(total(self.push_asks)) if self.push_asks is not None else None},
                "kv_gbps": round(sum(rates), 4) if rates else None, "point": self.series.point(),
                "not_measured": ["per-request latency, errors and retries: on each proxy's dashboard"]}

    # ---- slow extras, while pages are open --------------------------------------------------------
    async def poll(self) -> None:
        if self.etcd_settings is not None:
            await self._list_etcd()
        urls = [v.url.rstrip("/") for v in self.views() if v.role in ("prefill", "decode")]
        await self.kv.poll(urls)

    async def _list_etcd(self) -> None:
        try:
            entries = await asyncio.to_thread(etcd.instances, self.etcd_settings)
        except (etcd.EtcdError, OSError) as exc:
            self.etcd_error = f"etcd unreachable: {str(exc)[:200]}"
            return
        self.etcd_error = ""
        listed: dict[str, Registration] = {}
        for entry in entries:
            try:
                reg = msgspec.convert({k: v for k, v in entry.items() if k in Registration.__struct_fields__},
                                      Registration)
            except msgspec.ValidationError:
                continue
            if reg.check() is None:
                listed[reg.instance_id] = reg
        if self.listed is not None:
            for gone in set(self.listed) - set(listed):
                self.feed.add("left", self.listed[gone].role, self.listed[gone].url, "", "left etcd")
            for new in set(listed) - set(self.listed):
                self.feed.add("joined", listed[new].role, listed[new].url, "active", listed[new].instance_id)
        self.listed = listed
