"""vLLM's KV event publisher binds the address the role chose, not every interface.

vLLM 0.32's `ZmqEventPublisher` binds its PUB socket only when the endpoint holds a wildcard
(`tcp://*:port`, `::`) or is ipc/inproc, and connects to anything else
(`_is_bind_endpoint`). A wildcard would publish every cached prompt's token ids on every
interface of the host, without authentication. The engine role (engine/kv_events.py) sets
ASCENDSERVE_KV_EVENTS_BIND to the host it configured (127.0.0.1 by default); endpoints on that
host are then bound. Feature-tested: installed only where the publisher still decides with a
static `_is_bind_endpoint(endpoint)`; otherwise apply() raises and vLLM is left as it is (its
publisher then connects, nobody receives the events, and the proxy routes by load).
"""

from __future__ import annotations

import os

ENV = "ASCENDSERVE_KV_EVENTS_BIND"
PATCHED = "_ascendserve_kv_events_bind"


def apply(environ=os.environ) -> list[str]:
    host = environ.get(ENV, "").strip()
    if not host:
        return []
    from vllm.distributed.kv_events import ZmqEventPublisher

    current = ZmqEventPublisher.__dict__.get("_is_bind_endpoint")
    if not isinstance(current, staticmethod):
        raise TypeError("ZmqEventPublisher._is_bind_endpoint is no longer a staticmethod")
    original = current.__func__
    if getattr(original, PATCHED, False):
        return ["kv_events_bind"]
    prefix = f"tcp://{host}:"

    def is_bind_endpoint(endpoint: str) -> bool:
        return endpoint.startswith(prefix) or original(endpoint)

    setattr(is_bind_endpoint, PATCHED, True)
    ZmqEventPublisher._is_bind_endpoint = staticmethod(is_bind_endpoint)
    return ["kv_events_bind"]
