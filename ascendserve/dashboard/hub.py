"""Server-sent events to every open dashboard page: one snapshot a second, shared; events at once.

    Hub.run (a task of the app's lifespan), every `interval_s`:
        the source records a reading (History; also with no page open: the charts of a page
        opened later show the last minutes)
        with pages open: the snapshot is built and encoded once, and the same bytes are queued
        for every subscriber; every `poll_every` ticks the source's slow extras run in the
        background (the engines' KV transfer counters, an etcd listing)
    EventFeed -> Hub.on_event: the event is encoded once and queued for every subscriber at once.

A subscriber gets, on connecting: `retry`, the history (`event: history`), the recent events
(`event: events`) and the current snapshot; then `snapshot` and `event` frames. A subscriber
whose queue grows past `max_queued` frames (a page that stopped reading) is dropped; its
EventSource reconnects and starts over. Nothing here runs per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from typing import AsyncIterator, Protocol

import msgspec
import structlog

from ascendserve.dashboard.events import Event, EventFeed

log = structlog.get_logger("ascendserve.dashboard")


class Source(Protocol):
    """What a dashboard shows: the proxy's pools and metrics, or the metaserver's registry."""

    def record(self) -> None: ...  # one reading for the charts (History)

    def snapshot(self) -> dict: ...  # the figures of this second

    def history(self) -> dict: ...  # every kept chart point, by column

    async def poll(self) -> None: ...  # slow extras, while pages are open


def frame(event: str, data: bytes) -> bytes:
    """One SSE frame. `data` is one line of JSON (msgspec never writes a raw newline)."""
    return b"event: " + event.encode() + b"\ndata: " + data + b"\n\n"


class Subscriber:
    __slots__ = ("frames", "wake", "closed", "sent_bytes")

    def __init__(self):
        self.frames: deque[bytes] = deque()
        self.wake = asyncio.Event()
        self.closed = False
        self.sent_bytes = 0

    def push(self, data: bytes, max_queued: int) -> bool:
        if self.closed:
            return False
        if len(self.frames) >= max_queued:
            self.closed = True  # it stopped reading: drop it (its page reconnects)
            self.wake.set()
            return False
        self.frames.append(data)
        self.wake.set()
        return True


class Hub:
    def __init__(self, source: Source, feed: EventFeed, interval_s: float = 1.0, poll_every: int = 5,
                 max_queued: int = 120, retry_ms: int = 2000):
        self.source, self.feed = source, feed
        self.interval_s, self.poll_every, self.max_queued, self.retry_ms = interval_s, poll_every, max_queued, retry_ms
        self.subscribers: set[Subscriber] = set()
        self._snapshot: bytes = b""
        self._snapshot_at = float("-inf")
        self._ticks = 0
        self._polled_at = float("-inf")
        self._poll: asyncio.Task | None = None
        self.snapshots_built = 0
        self.cpu_s = 0.0  # CPU time of the ticks (readings, snapshots, fan-out), shown on the page
        self.stopping = False
        feed.listen(self.on_event)

    # ---- the tick -------------------------------------------------------------------------------
    async def run(self) -> None:
        next_at = time.monotonic()
        try:
            while True:
                # on a fixed schedule (a timer that fires a little early must not give two ticks)
                next_at = max(next_at + self.interval_s, time.monotonic())
                await asyncio.sleep(next_at - time.monotonic())
                self.tick()
        finally:
            if self._poll is not None:
                self._poll.cancel()
            for sub in list(self.subscribers):
                sub.closed = True
                sub.wake.set()

    def tick(self) -> None:
        started = time.thread_time()
        self._ticks += 1
        try:
            self.source.record()
            if not self.subscribers:
                return
            data = frame("snapshot", self.snapshot_json(fresh=True))
            for sub in list(self.subscribers):
                if not sub.push(data, self.max_queued):
                    self.subscribers.discard(sub)
            now = time.monotonic()
            if now - self._polled_at >= self.poll_every * self.interval_s and (self._poll is None or self._poll.done()):
                self._polled_at = now
                self._poll = asyncio.ensure_future(self._poll_source())
        except Exception:  # the dashboard must never take the process down
            log.exception("dashboard tick failed")
        finally:
            self.cpu_s += time.thread_time() - started  # the event loop's thread: this tick's own CPU

    async def _poll_source(self) -> None:
        try:
            await self.source.poll()
        except Exception:
            log.exception("dashboard poll failed")

    def snapshot_json(self, fresh: bool = False) -> bytes:
        """The snapshot, built at most once per `interval_s` (shared by every page and request)."""
        now = time.monotonic()
        if fresh or not self._snapshot or now - self._snapshot_at >= self.interval_s:
            cost = {"cpu_ms": round(self.cpu_s * 1000, 1), "pages": len(self.subscribers),
                    "snapshots": self.snapshots_built + 1}
            self._snapshot = msgspec.json.encode({**self.source.snapshot(), "dashboard": cost})
            self._snapshot_at = now
            self.snapshots_built += 1
        return self._snapshot

    # ---- events ---------------------------------------------------------------------------------
    def on_event(self, event: Event) -> None:
        if not self.subscribers:
            return
        data = frame("event", msgspec.json.encode(event))
        for sub in list(self.subscribers):
            if not sub.push(data, self.max_queued):
                self.subscribers.discard(sub)

    # ---- subscribers ----------------------------------------------------------------------------
    def stop(self) -> None:
        """End every page's stream and take no new one (the process is stopping: the server waits for
        open responses, and an event stream never ends by itself)."""
        self.stopping = True
        for sub in list(self.subscribers):
            sub.closed = True
            sub.wake.set()
        self.subscribers.clear()

    def subscribe(self) -> Subscriber:
        sub = Subscriber()
        sub.closed = self.stopping
        sub.frames.append(b"retry: " + str(self.retry_ms).encode() + b"\n\n")
        sub.frames.append(frame("history", msgspec.json.encode(self.source.history())))
        sub.frames.append(frame("events", msgspec.json.encode(self.feed.recent())))
        sub.frames.append(frame("snapshot", self.snapshot_json()))
        sub.wake.set()
        if not sub.closed:
            self.subscribers.add(sub)
        return sub

    async def stream(self, sub: Subscriber | None = None) -> AsyncIterator[bytes]:
        """The bytes of one page's event stream, until it goes away (or is dropped). Subscribes when
        first iterated, so that a response never started holds no subscription."""
        sub = sub or self.subscribe()
        try:
            while not sub.closed:
                if sub.frames:
                    data = b"".join(sub.frames)
                    sub.frames.clear()
                    sub.sent_bytes += len(data)
                    yield data
                    continue
                sub.wake.clear()
                await sub.wake.wait()
        finally:
            sub.closed = True
            self.subscribers.discard(sub)

    async def close(self) -> None:
        if self._poll is not None:
            self._poll.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._poll
