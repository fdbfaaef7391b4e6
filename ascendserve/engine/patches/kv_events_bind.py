"""vLLM's KV event publisher binds the address the role chose, not every interface.

vLLM 0.32's `ZmqEventPublisher` binds its PUB socket only when the endpoint holds a wildcard
(`tcp://*:port`, `::`) or is ipc/inproc, and connects to anything else
(`_is_bind_endpoint`). A wildcard would publish every cached prompt's token ids on every
interface of the host, without authentication. The engine role (engine/kv_events.py) sets
ASCENDSERVE_KV_EVENTS_BIND to the host it configured (127.0.0.1 by default); endpoints on that
host are then bound. An external data parallel rank of `launch` has a server and ports of its
own (ASCENDSERVE_KV_EVENTS_NO_OFFSET=1): vLLM's offset of its endpoints
(`offset_endpoint_port`, by an index that is not its rank in 0.32: rank 1's publisher landed on
rank 0's replay port) is left out for them. Feature-tested: installed only where the publisher
still decides with these static methods; otherwise apply() raises and vLLM is left as it is
(its publisher then connects, nobody receives the events, and the proxy routes by load).
"""

from __future__ import annotations

import os

ENV = "ASCENDSERVE_KV_EVENTS_BIND"
NO_OFFSET_ENV = "ASCENDSERVE_KV_EVENTS_NO_OFFSET"
PATCHED = "_ascendserve_kv_events_bind"


def apply(environ=os.environ) -> list[str]:
    host = environ.get(ENV, "").strip()
    if not host:
        return []
    from vllm.distributed.kv_events import ZmqEventPublisher

    prefix = f"tcp://{host}:"
    done = ["kv_events_bind"]
    _wrap(ZmqEventPublisher, "_is_bind_endpoint", lambda original: lambda endpoint: (
        endpoint.startswith(prefix) or original(endpoint)))
    if environ.get(NO_OFFSET_ENV) == "1":  # an external DP rank: its ports are its own already
        _wrap(ZmqEventPublisher, "offset_endpoint_port", lambda original: lambda endpoint, rank: (
            endpoint if endpoint and endpoint.startswith(prefix) else original(endpoint, rank)))
        done.append("kv_events_no_offset")
    return done


def _wrap(cls, name: str, make) -> None:
    """Replace the static method `name` of `cls` by make(original), once."""
    current = cls.__dict__.get(name)
    if not isinstance(current, staticmethod):
        raise TypeError(f"ZmqEventPublisher.{name} is no longer a staticmethod")
    original = current.__func__
    if getattr(original, PATCHED, False):
        return
    patched = make(original)
    setattr(patched, PATCHED, True)
    setattr(cls, name, staticmethod(patched))
