"""Dashboard pages without a browser: N clients reading /dashboard/events, in a thread of their own.

For the load test and the benchmarks (bench/load.py --dashboard-pages, bench/dashboard.py): each
page reads the event stream as a browser's EventSource would and counts what it got (bytes,
snapshots, events); each pushed event is kept with the server's time of it and the time it
arrived here (one host, one clock), for the update latency.

    with Pages(proxy_url, 5) as pages:   # returns once every page has its first snapshot
        ... run the load ...
    pages.bytes, pages.snapshots, pages.arrivals, pages.errors

`PagesProcess` runs them in a process of their own (`python -m tests.dashboard_pages URL N`), as a
browser's pages are: a load generator in the same process would share its interpreter with them.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp


class Pages:
    def __init__(self, url: str, n: int, headers: dict | None = None, connect_timeout_s: float = 30.0):
        self.url, self.n, self.headers = url.rstrip("/") + "/dashboard/events", n, headers or {}
        self.connect_timeout_s = connect_timeout_s
        self.bytes = [0] * n
        self.snapshots = [0] * n
        self.arrivals: list[tuple[int, float, float, str, str]] = []  # (page, server t, arrival t, kind, url)
        self.errors: list[str] = []
        self.ended = 0  # streams the server closed while we read them
        self.started_at = self.stopped_at = 0.0
        self._connected = threading.Semaphore(0)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="dashboard-pages", daemon=True)

    def __enter__(self) -> "Pages":
        if self.n == 0:
            return self
        self._thread.start()
        deadline = time.monotonic() + self.connect_timeout_s
        for _ in range(self.n):
            if not self._connected.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"dashboard pages not all connected after {self.connect_timeout_s} s: "
                                   f"{self.errors[-3:]}")
        self.started_at = time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped_at = time.monotonic()
        if self.n and self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(30)

    @property
    def seconds(self) -> float:
        return max(1e-9, (self.stopped_at or time.monotonic()) - self.started_at)

    def bytes_per_second(self) -> float:
        """Per page, from the first snapshot on."""
        return sum(self.bytes) / max(1, self.n) / self.seconds

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        async with aiohttp.ClientSession(timeout=timeout, headers=self.headers) as session:
            tasks = [asyncio.ensure_future(self._page(session, i)) for i in range(self.n)]
            await self._stop.wait()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _page(self, session: aiohttp.ClientSession, i: int) -> None:
        connected = False
        try:
            async with session.get(self.url) as r:
                if r.status != 200:
                    self.errors.append(f"page {i}: HTTP {r.status}")
                    return
                held = b""
                async for chunk in r.content.iter_any():
                    now = time.time()
                    if connected:
                        self.bytes[i] += len(chunk)
                    held += chunk
                    *frames, held = held.split(b"\n\n")
                    for f in frames:
                        kind, data = _parse(f)
                        if kind == "snapshot":
                            self.snapshots[i] += connected
                            if not connected:
                                connected = True
                                self._connected.release()
                        elif kind == "event":
                            ev = json.loads(data)
                            self.arrivals.append((i, ev["t"], now, ev["kind"], ev["url"]))
                self.ended += 1
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 (counted, and said when the pages are checked)
            self.errors.append(f"page {i}: {exc!r}")


class PagesProcess:
    """Pages in a child process: connected on entering, their counts read back on leaving."""

    def __init__(self, url: str, n: int, connect_timeout_s: float = 30.0):
        self.url, self.n, self.connect_timeout_s = url, n, connect_timeout_s
        self.bytes, self.snapshots, self.arrivals, self.errors = [0] * n, [0] * n, [], []
        self.ended, self.seconds_open = 0, 0.0
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> "PagesProcess":
        if self.n == 0:
            return self
        repo = str(Path(__file__).resolve().parents[1])
        self._proc = subprocess.Popen([sys.executable, "-m", "tests.dashboard_pages", self.url, str(self.n),
                                       str(self.connect_timeout_s)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True, cwd=repo)
        line = self._proc.stdout.readline()
        if line.strip() != "connected":
            self._proc.kill()
            raise RuntimeError(f"dashboard pages did not connect: {line.strip()[:500]}")
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        out, _ = self._proc.communicate(timeout=60)  # closing stdin ends the pages
        stats = json.loads(out.strip().splitlines()[-1])
        for key, value in stats.items():
            setattr(self, key, value)

    @property
    def seconds(self) -> float:
        return max(1e-9, self.seconds_open)

    def bytes_per_second(self) -> float:
        return sum(self.bytes) / max(1, self.n) / self.seconds


def main() -> None:
    url, n = sys.argv[1], int(sys.argv[2])
    timeout = float(sys.argv[3]) if len(sys.argv) > 3 else 30.0
    try:
        pages = Pages(url, n, connect_timeout_s=timeout).__enter__()
    except TimeoutError as exc:
        print(f"not connected: {exc}", flush=True)
        return
    print("connected", flush=True)
    sys.stdin.read()  # until the parent closes it
    pages.__exit__(None, None, None)
    print(json.dumps({"bytes": pages.bytes, "snapshots": pages.snapshots, "arrivals": pages.arrivals,
                      "errors": pages.errors, "ended": pages.ended, "seconds_open": pages.seconds}), flush=True)


def hub_cpu_ms(url: str) -> float:
    """The CPU the dashboard's ticks have used in the process at `url` so far (its snapshot says; at
    most a second old)."""
    import httpx

    return float(httpx.get(url.rstrip("/") + "/dashboard/snapshot", timeout=10).json()["dashboard"]["cpu_ms"])


def _parse(frame: bytes) -> tuple[str, bytes]:
    kind, data = "", b""
    for line in frame.split(b"\n"):
        if line.startswith(b"event: "):
            kind = line[7:].decode()
        elif line.startswith(b"data: "):
            data = line[6:]
    return kind, data


if __name__ == "__main__":
    main()
