"""EC hit/miss telemetry of our EC connectors, through vLLM's EC connector-stats path.

The consumer's scheduler counts, per multimodal item it needed: a hit (found
in the shm region or the store, loaded instead of encoded) or a miss (encoded
locally). On the instance's /metrics:

    ascendserve:ec_hits_total      items loaded from the EC region/store
    ascendserve:ec_misses_total    items this instance had to encode itself
    ascendserve:ec_hit_rate        hits / (hits + misses) since start
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorPromMetrics, ECConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine


@dataclass
class ECStats(ECConnectorStats):
    def __post_init__(self):
        self.data = {"hits": int(self.data.get("hits", 0)), "misses": int(self.data.get("misses", 0))}
        self._lock = threading.Lock()

    def hit(self) -> None:
        with self._lock:
            self.data["hits"] += 1

    def miss(self) -> None:
        with self._lock:
            self.data["misses"] += 1

    def take(self) -> "ECStats | None":
        with self._lock:
            if self.is_empty():
                return None
            out, self.data = ECStats(data=dict(self.data)), {"hits": 0, "misses": 0}
        return out

    def reset(self):
        self.data = {"hits": 0, "misses": 0}

    def aggregate(self, other: ECConnectorStats) -> ECConnectorStats:
        self.data["hits"] += int(other.data.get("hits", 0))
        self.data["misses"] += int(other.data.get("misses", 0))
        return self

    def reduce(self) -> dict[str, int | float]:
        n = self.data["hits"] + self.data["misses"]
        return {"EC hits": self.data["hits"], "EC misses": self.data["misses"],
                "EC hit rate": round(self.data["hits"] / n, 3) if n else 0.0}

    def is_empty(self) -> bool:
        return not self.data["hits"] and not self.data["misses"]


class ECProm(ECConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(cls, name, doc):
            return create_metric_per_engine(cls(name=name, documentation=doc, labelnames=labelnames),
                                            per_engine_labelvalues)

        self.hits = per_engine(self._counter_cls, "ascendserve:ec_hits", "Multimodal items loaded from the EC store.")
        self.misses = per_engine(self._counter_cls, "ascendserve:ec_misses",
                                 "Multimodal items this instance encoded itself (not in the EC store).")
        self.rate = per_engine(self._gauge_cls, "ascendserve:ec_hit_rate", "EC hits / (hits + misses) since start.")
        self._totals: dict[int, list[int]] = {}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        hits, misses = int(transfer_stats_data.get("hits", 0)), int(transfer_stats_data.get("misses", 0))
        if hits:
            self.hits[engine_idx].inc(hits)
        if misses:
            self.misses[engine_idx].inc(misses)
        total = self._totals.setdefault(engine_idx, [0, 0])
        total[0] += hits
        total[1] += misses
        if sum(total):
            self.rate[engine_idx].set(total[0] / sum(total))
