"""Transfer telemetry of our KV connectors, through vLLM's connector-stats path.

Each worker returns a `KVTransferStats` per step (vLLM ships it to the API
server, aggregating TP ranks); `KVTransferProm` turns it into Prometheus
series on the instance's own /metrics:

    ascendserve:kv_transfer_seconds          histogram of one request's transfer time
    ascendserve:kv_transfer_bytes_total      bytes moved (D: pulled; P in push mode: pushed)
    ascendserve:kv_transfer_gbps             throughput of the last interval with transfers
    ascendserve:kv_transfer_failures_total   transfers that failed (recomputed or failed by policy)
    ascendserve:kv_holds_expired_total       P: holds freed at their deadline, never collected
    ascendserve:kv_blocks_held_remote        P: blocks held for remote peers right now
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine


def _empty() -> dict[str, Any]:
    return {"seconds": [], "bytes": [], "failures": 0, "expired": 0, "held_blocks": None}


@dataclass
class KVTransferStats(KVConnectorStats):
    def __post_init__(self):
        if not self.data:
            self.data = _empty()

    def reset(self):
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        o = other.data
        self.data["seconds"] = self.data["seconds"] + list(o.get("seconds", ()))
        self.data["bytes"] = self.data["bytes"] + list(o.get("bytes", ()))
        self.data["failures"] += o.get("failures", 0)
        self.data["expired"] += o.get("expired", 0)
        if o.get("held_blocks") is not None:  # a gauge: ranks add up
            self.data["held_blocks"] = (self.data["held_blocks"] or 0) + o["held_blocks"]
        return self

    def reduce(self) -> dict[str, int | float]:
        n, seconds, moved = len(self.data["seconds"]), sum(self.data["seconds"]), sum(self.data["bytes"])
        return {"Transfers": n, "Avg transfer (ms)": round(seconds / n * 1e3, 3) if n else 0,
                "Throughput (GB/s)": round(moved / seconds / 1e9, 3) if seconds else 0,
                "Failures": self.data["failures"], "Holds expired": self.data["expired"]}

    def is_empty(self) -> bool:
        d = self.data
        return not d["seconds"] and not d["failures"] and not d["expired"] and d["held_blocks"] is None


class StatsRecorder:
    """Worker side: thread-safe accumulation between two engine steps."""

    def __init__(self):
        self._lock = threading.Lock()
        self._data = _empty()
        self.total_bytes = 0
        self._last_held: int | None = None

    def transfer(self, moved: int, seconds: float) -> None:
        with self._lock:
            self._data["seconds"].append(seconds)
            self._data["bytes"].append(moved)
            self.total_bytes += moved

    def failure(self) -> None:
        with self._lock:
            self._data["failures"] += 1

    def expired(self) -> None:
        with self._lock:
            self._data["expired"] += 1

    def take(self, held_blocks: int | None) -> KVTransferStats | None:
        with self._lock:
            data, self._data = self._data, _empty()
            if held_blocks is not None and held_blocks != self._last_held:
                data["held_blocks"] = held_blocks  # only when the gauge moved
                self._last_held = held_blocks
        stats = KVTransferStats(data=data)
        return None if stats.is_empty() else stats


class KVTransferProm(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(cls, name, doc, **kw):
            return create_metric_per_engine(cls(name=name, documentation=doc, labelnames=labelnames, **kw),
                                            per_engine_labelvalues)

        self.seconds = per_engine(self._histogram_cls, "ascendserve:kv_transfer_seconds",
                                  "Time to move one request's KV between prefill and decode.",
                                  buckets=[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0])
        self.bytes = per_engine(self._counter_cls, "ascendserve:kv_transfer_bytes",
                                "KV bytes moved between prefill and decode.")
        self.gbps = per_engine(self._gauge_cls, "ascendserve:kv_transfer_gbps",
                               "KV transfer throughput (GB/s) over the last interval with transfers.")
        self.failures = per_engine(self._counter_cls, "ascendserve:kv_transfer_failures",
                                   "KV transfers that failed.")
        self.expired = per_engine(self._counter_cls, "ascendserve:kv_holds_expired",
                                  "KV holds freed at their deadline because no decode collected them.")
        self.held = per_engine(self._gauge_cls, "ascendserve:kv_blocks_held_remote",
                               "KV blocks held for remote decode instances.")

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        d = transfer_stats_data
        for s in d.get("seconds", ()):
            self.seconds[engine_idx].observe(s)
        moved, seconds = sum(d.get("bytes", ())), sum(d.get("seconds", ()))
        if moved:
            self.bytes[engine_idx].inc(moved)
        if seconds > 0:
            self.gbps[engine_idx].set(moved / seconds / 1e9)
        if d.get("failures"):
            self.failures[engine_idx].inc(d["failures"])
        if d.get("expired"):
            self.expired[engine_idx].inc(d["expired"])
        if d.get("held_blocks") is not None:
            self.held[engine_idx].set(d["held_blocks"])
