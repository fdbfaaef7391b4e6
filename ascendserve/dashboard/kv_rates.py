"""KV transfer throughput per instance, from the engines' own counters (connectors/kv/stats.py).

Our KV connectors count on each engine's /metrics (open, like every probe):
    ascendserve:kv_transfer_bytes_total     bytes moved (D: pulled; P in push mode: pushed)
    ascendserve:kv_transfer_seconds_sum     time spent moving them
Read only while a dashboard page is open (Hub.poll_every), two readings give
    gbps        bytes moved per second of wall clock between them (what the instance moves now)
    link_gbps   bytes per second of transfer time (how fast a transfer runs)
An engine that does not report them (the engine's own connectors, a plain vLLM, a stub) has none:
the page says "not reported".
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Awaitable, Callable

from ascendserve.web.upstream import UpstreamError

_SAMPLE = re.compile(rb"^ascendserve:kv_transfer_(bytes_total|seconds_sum)(?:\{[^}]*\})?\s+([0-9.eE+-]+)",
                     re.MULTILINE)


def parse(text: bytes) -> tuple[float, float] | None:
    """(bytes, seconds) summed over every engine/label set, or None when the instance reports neither."""
    found = {b"bytes_total": 0.0, b"seconds_sum": 0.0}
    seen = False
    for name, value in _SAMPLE.findall(text):
        try:
            found[name] += float(value)
            seen = True
        except ValueError:
            continue
    return (found[b"bytes_total"], found[b"seconds_sum"]) if seen else None


def metrics_reader(upstream) -> Callable[[str], Awaitable[bytes | None]]:
    """An engine's /metrics text through `upstream` (web/upstream.Upstream), None when it does not
    answer 200 within 2 s: what both dashboards poll."""
    async def read(url: str) -> bytes | None:
        try:
            status, raw = await upstream.get(url, 2.0, {"accept-encoding": "identity"})
        except UpstreamError:
            return None
        return raw if status == 200 else None

    return read


class KVRates:
    def __init__(self, get: Callable[[str], Awaitable[bytes | None]], clock: Callable[[], float] = time.monotonic):
        self.get, self.clock = get, clock
        self._last: dict[str, tuple[float, float, float]] = {}  # url -> (t, bytes, seconds)
        self.rates: dict[str, dict] = {}

    async def poll(self, urls: list[str]) -> None:
        texts = await asyncio.gather(*(self.get(u + "/metrics") for u in urls), return_exceptions=True)
        now = self.clock()
        for url, text in zip(urls, texts):
            reading = parse(text) if isinstance(text, bytes) else None
            if reading is None:
                self._last.pop(url, None)
                self.rates.pop(url, None)
                continue
            moved, seconds = reading
            before = self._last.get(url)
            self._last[url] = (now, moved, seconds)
            rate = {"bytes": moved, "gbps": None, "link_gbps": None}
            if before is not None and now > before[0] and moved >= before[1]:
                rate["gbps"] = round((moved - before[1]) / (now - before[0]) / 1e9, 4)
                spent = seconds - before[2]
                rate["link_gbps"] = round((moved - before[1]) / spent / 1e9, 4) if spent > 0 else None
            self.rates[url] = rate
        for url in set(self.rates) - set(urls):
            self.rates.pop(url, None)
            self._last.pop(url, None)

    def of(self, url: str) -> dict | None:
        return self.rates.get(url)
