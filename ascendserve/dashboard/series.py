"""The last minutes of a process's counters, gauges and histograms, one sample a second.

`History.record` keeps cumulative readings (a counter's total, a histogram's cumulative bucket
counts, a gauge's value) with their time; a point of a chart is computed from two readings
`window_s` apart: a counter's rate, a histogram's quantiles over the observations in between
(interpolated inside the bucket, as Prometheus' histogram_quantile does), a gauge as read.
Reading a sample costs the metrics' own `collect()` (the readers below); nothing is done per request.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class Reading:
    t: float
    counters: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, list[float]] = field(default_factory=dict)  # cumulative counts per bucket (+Inf last)


def quantile(q: float, bounds: tuple[float, ...], counts: list[float]) -> float | None:
    """The q-quantile of observations whose cumulative counts per upper bound are `counts`
    (the last one for +Inf); None without observations. Linear inside a bucket; in +Inf, the
    largest finite bound."""
    total = counts[-1] if counts else 0
    if total <= 0:
        return None
    rank = q * total
    below, lower = 0.0, 0.0
    for i, c in enumerate(counts):
        if c >= rank:
            if i >= len(bounds):
                return bounds[-1]
            if c == below:
                return bounds[i]
            return lower + (bounds[i] - lower) * (rank - below) / (c - below)
        below = c
        lower = bounds[i] if i < len(bounds) else lower
    return bounds[-1]


def samples(metric) -> list:
    """A prometheus_client metric's samples, through its public collect()."""
    return [s for family in metric.collect() for s in family.samples]


def total(metric) -> float:
    """A counter's total over every label set."""
    return sum(s.value for s in samples(metric) if s.name.endswith("_total"))


def by_label(metric, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in samples(metric):
        if s.name.endswith("_total"):
            out[s.labels[label]] = out.get(s.labels[label], 0.0) + s.value
    return out


def buckets(histogram) -> list[float]:
    """A histogram's cumulative counts per bucket, +Inf last (prometheus_client lists them in bound order)."""
    return [s.value for s in samples(histogram) if s.name.endswith("_bucket")]


class History:
    """Readings of one second each, the last `keep`; points over a sliding `window_s`."""

    def __init__(self, bounds: dict[str, tuple[float, ...]] | None = None, keep: int = 600, window_s: float = 10.0,
                 quantiles: tuple[float, ...] = (0.5, 0.99)):
        self.bounds = bounds or {}
        self.readings: deque[Reading] = deque(maxlen=keep)
        self.window_s = window_s
        self.quantiles = quantiles

    def record(self, reading: Reading) -> None:
        self.readings.append(reading)

    def _base(self, i: int) -> Reading | None:
        """The reading `window_s` before reading i (the oldest one while fewer are kept)."""
        now = self.readings[i]
        base = None
        for j in range(i - 1, -1, -1):
            base = self.readings[j]
            if now.t - base.t >= self.window_s - 1e-6:
                break
        return base

    def point(self, i: int = -1) -> dict:
        """One chart point: t, `<counter>_rate` per second, `<histogram>_p50`.. in seconds, gauges."""
        if not self.readings:
            return {}
        i = i % len(self.readings)
        now, base = self.readings[i], self._base(i)
        out: dict[str, float | None] = {"t": round(now.t, 3)}
        span = (now.t - base.t) if base is not None else 0.0
        for name, value in now.counters.items():
            before = base.counters.get(name, 0.0) if base is not None else value
            out[f"{name}_rate"] = round(max(0.0, value - before) / span, 3) if span > 0 else 0.0
        for name, counts in now.histograms.items():
            before = base.histograms.get(name) if base is not None else None
            delta = [c - b for c, b in zip(counts, before)] if before and len(before) == len(counts) else \
                ([0.0] * len(counts) if base is None else counts)
            for q in self.quantiles:
                value = quantile(q, self.bounds.get(name, ()), delta)
                out[f"{name}_p{round(q * 100)}"] = None if value is None else round(value, 4)
        for name, value in now.gauges.items():
            out[name] = round(value, 4)
        return out

    def columns(self) -> dict[str, list]:
        """Every kept point, column by column (what a page draws its charts from when it connects)."""
        points = [self.point(i) for i in range(len(self.readings))]
        keys = list(points[-1]) if points else []
        return {k: [p.get(k) for p in points] for k in keys}
