"""What `ascendserve status` knows about a cluster at one moment, whichever source it came from.

A `Snapshot` is one reading: its source (a proxy, a metaserver, etcd), whether the cluster can
serve, what is missing if not, the proxy's totals, and a `Row` per instance. Every row has every
field; a source that does not know one leaves it None, so `--json` has one shape for scripts.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

ROLE_ORDER = ("encoder", "prefill", "decode", "pd")  # E -> P -> D, then PD; anything else after
HEALTHY = ("active", "registered")  # a proxy's routable state; present in a registry


@dataclass
class Row:
    role: str
    url: str
    instance_id: str = ""
    state: str = ""  # proxy: probing | active | ejected | suspect | draining; registry: registered
    in_flight: int | None = None  # this proxy's requests on it
    others: int | None = None  # requests the engine reports beyond this proxy's (other proxies')
    kv_usage: float | None = None  # 0..1
    kv_held: int | None = None  # prefill: KV blocks held for decode
    served: int | None = None
    failures: int | None = None
    last_error: str = ""
    model: str = ""
    running: int | None = None  # registry: what its heartbeat reported
    waiting: int | None = None
    age_s: float | None = None  # metaserver: since it registered

    @property
    def healthy(self) -> bool:
        return self.state in HEALTHY

    def to_dict(self) -> dict:
        return {**asdict(self), "healthy": self.healthy}


@dataclass
class Snapshot:
    source: str  # proxy | metaserver | etcd
    where: str  # the URL (or etcd endpoints) asked
    ready: bool = False
    missing: list[str] = field(default_factory=list)  # why it cannot serve, in words
    error: str = ""  # the source could not be read at all
    rows: list[Row] = field(default_factory=list)
    totals: dict[str, float] = field(default_factory=dict)  # proxy: from /metrics
    push_pending: int | None = None  # metaserver: push-mode requests waiting for their decode callback
    time: float = field(default_factory=time.time)

    def sorted_rows(self) -> list[Row]:
        return sorted(self.rows, key=row_key)

    def to_dict(self) -> dict:
        return {"source": self.source, "where": self.where, "time": round(self.time, 3), "ready": self.ready,
                "missing": self.missing, "error": self.error or None, "totals": self.totals,
                "push_pending": self.push_pending, "instances": [r.to_dict() for r in self.sorted_rows()]}


def row_key(row: Row) -> tuple:
    order = ROLE_ORDER.index(row.role) if row.role in ROLE_ORDER else len(ROLE_ORDER)
    return order, row.role, row.url


def registry_missing(rows: list[Row]) -> list[str]:
    """What a registry's instances lack to serve, as the proxy judges it (router/pools.readiness):
    prefill and decode once either is there, pd when there; no engine at all is not servable."""
    roles = {r.role for r in rows}
    needed = [r for r in ("prefill", "decode") if roles & {"prefill", "decode"}] + (["pd"] if "pd" in roles else [])
    missing = [f"no {r} instance registered" for r in needed if r not in roles]
    if not needed:
        missing.append("no engine instance registered yet (need a pd instance, or prefill and decode instances)")
    return missing
