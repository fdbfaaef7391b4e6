"""A ring buffer of what just happened to the cluster's instances, for the dashboard's feed.

Fed by whoever sees a change, on the event loop's thread:
    the proxy's HealthMonitor (its on_state hook, composed with the KV index's): admitted,
        ejected, re-admitted, active again after being suspect
    the proxy's registry watch (router/discovery.py): joined, suspect (left the registry),
        registered again, draining (silent too long), restarted (a new instance id at a URL)
    the proxy's admin routes: added, draining (removed)
    the metaserver's registry: joined, restarted (registered again while registered),
        left (deregistered), expired (missed its heartbeat deadline)
Listeners (the dashboard's hub) are called at once with each event; the last `size` events
are kept for a page that connects later.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from typing import Callable

import msgspec

# what a health state change is called in the feed: (before, after) -> kind
_STATE_KINDS = {("probing", "active"): "admitted", ("ejected", "active"): "readmitted",
                ("suspect", "active"): "active"}


class Event(msgspec.Struct, kw_only=True):
    seq: int
    t: float  # wall clock (time.time()), seconds
    kind: str  # joined, admitted, ejected, readmitted, suspect, active, draining, left, expired, restarted, added
    role: str = ""
    url: str = ""
    state: str = ""  # the instance's state after the event, where it has one
    detail: str = ""


class EventFeed:
    def __init__(self, size: int = 200, clock: Callable[[], float] = time.time):
        self._events: deque[Event] = deque(maxlen=size)
        self._seq = itertools.count(1)
        self._listeners: list[Callable[[Event], None]] = []
        self.clock = clock

    def add(self, kind: str, role: str = "", url: str = "", state: str = "", detail: str = "") -> Event:
        event = Event(seq=next(self._seq), t=self.clock(), kind=kind, role=role, url=url, state=state,
                      detail=detail[:300])
        self._events.append(event)
        for listener in self._listeners:
            listener(event)
        return event

    def recent(self, n: int | None = None) -> list[Event]:
        events = list(self._events)
        return events if n is None else events[-n:]

    def listen(self, listener: Callable[[Event], None]) -> None:
        self._listeners.append(listener)

    # ---- hooks ----------------------------------------------------------------------------------
    def on_state(self, inst, state: str, before: str) -> None:
        """HealthMonitor's on_state (compose it with the others: `compose(...)`)."""
        if state == before:
            return
        kind = _STATE_KINDS.get((before, state), state)
        detail = inst.last_error if state != "active" else ""
        self.add(kind, inst.role, inst.url, state, detail)

    def on_registry(self, kind: str, inst, detail: str = "") -> None:
        """The proxy's registry watch saw `inst` join, leave, come back or restart."""
        self.add(kind, inst.role, inst.url, inst.state, detail)


def compose(*hooks: Callable | None) -> Callable:
    """One callback that calls each of `hooks` (None skipped) in order, with the same arguments."""
    live = [h for h in hooks if h is not None]

    def both(*args) -> None:
        for hook in live:
            hook(*args)

    return both
